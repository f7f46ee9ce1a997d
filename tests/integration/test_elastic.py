"""Elastic training on torchrun's rendezvous: two agents on this machine (`--nnodes 1:2 --rdzv-backend c10d`, one CPU
rank each) stand for two nodes. One node leaves at step 6 (lost: its agent and worker killed; or stopped: its agent
gets a scheduler's SIGTERM), the other continues alone from the newest checkpoint with the same global batch, then a
new agent for the node joins and the group grows back at a preemption checkpoint; every step's loss and the final
weights equal one uninterrupted process's over the same global batches, and each restart says which checkpoint it
continued from and how many steps it redid. The steps are those of tests/scripts/hooks, not timings."""

import re

import pytest

from conftest import BIN, TINY, TINY_COMMON, TINY_TRAIN, free_port, logged, max_weight_difference, signal_at_step
from support.processes import Started

pytestmark = [pytest.mark.launch]

# The torchrun command of every node (docs/operations.md's, with a shorter last call: once one node is in, the
# rendezvous waits this long for others before it closes; both first nodes join within it, and a node left alone
# waits it out before it restarts).
ELASTIC = ["--nnodes", "1:2", "--nproc_per_node", 1, "--rdzv-backend", "c10d", "--rdzv-id", "elastic",
           "--max-restarts", 3, "--monitor-interval", "0.1"]
RENDEZVOUS = "last_call_timeout=10,join_timeout=120"
# 12 steps of 16 samples: 8 per rank on 2 ranks, 8 x 2 accumulated on 1 (the run's global batch kept), checkpoints
# every 4 steps; tiny_runs' single process trains the same global batches.
FLAGS = [*TINY_COMMON, *TINY, "--per_device_train_batch_size", 8, "--save_strategy", "steps", "--save_steps", 4]
HOLD = 9  # the step at which the lone node waits for the returning one (then stops on its agent's SIGTERM)


def elastic_run(folder, leave: str, *flags):
    """Nodes A (hosting the rendezvous store) and B start together; B's worker acts on `leave` at step 6; A, alone
    after its restart, holds at step HOLD until node B's new agent joins. Returns the output folder and the nodes'
    logs."""
    port, output = free_port(), folder / "run"
    held = output.with_name(f"{output.name}.held-{HOLD}")
    with Started(folder) as nodes:
        def node(name, host, spec=None):
            env = {**(signal_at_step(0, 0) if spec else {}), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
            if spec:
                env["TRAINER_EXT_TEST_SIGNAL"] = spec
            return nodes.start(name, [BIN / "torchrun", *ELASTIC, "--rdzv-endpoint", f"127.0.0.1:{port}",
                                      "--rdzv-conf", f"is_host={int(host)},{RENDEZVOUS}", TINY_TRAIN, "--output_dir",
                                      output, *FLAGS, *flags], env)

        a = node("A", True, f"{HOLD}:*:SIGTERM:hold:1")
        node("B", False, f"6:*:{leave}:0")  # at once: its agent retries until A's store is up, joins in the last call
        assert wait_for(held.exists, a), "node A ended before it trained alone:\n" + "\n".join(
            f"--- {name}\n{nodes.log(name)[-4000:]}" for name in "AB")
        node("B2", False)  # node B back, once A trains alone
        status = nodes.wait(timeout=900)
        logs = {name: nodes.log(name) for name in ("A", "B", "B2")}
    assert status["A"] == status["B2"] == 0, "\n".join(f"--- {name} ({status[name]})\n{log[-4000:]}"
                                                       for name, log in logs.items())
    return output, logs


def wait_for(condition, node, timeout=900) -> bool:
    """Until `condition()` holds; False when `node` ended first or the time is up."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline or node.poll() is not None:
            return False
        time.sleep(0.05)
    return True


def continued(log: str) -> list[str]:
    """Each restart's line (the main process's), without the restart's measured seconds and the error's own words
    (which collective saw the peer go first decides them)."""
    return [re.sub(r"; the restart took .*", "", re.sub(r"then failed: [^)]*\)", "then failed)", line))
            for line in re.findall(r"trainer_ext: (continuing on .*)", log)]


def assert_uninterrupted(tiny_runs, output):
    """Every step's loss and the final weights as one process training the same global batches (1e-5)."""
    ours, theirs = logged(tiny_runs / "single"), logged(output)
    assert sorted(theirs) == list(range(1, 13))
    assert max(abs(ours[step] - theirs[step]) for step in ours) < 1e-5
    assert max_weight_difference(tiny_runs / "single", output) < 1e-5


def test_ddp_node_lost_then_back_trains_as_one_uninterrupted_process(tiny_runs, tmp_path):
    """Fails when a lost node hangs or ends the survivor, the survivor does not continue from the newest complete
    checkpoint on the global batch the run began with, the returning node does not join at the next restart, a
    restart's line misstates its checkpoint or redone steps, or any step differs from an uninterrupted run."""
    output, logs = elastic_run(tmp_path, "SIGKILL:node")
    assert continued(logs["A"]) == [
        "continuing on 1 rank (was 2) from checkpoint-4, written every --save_steps 4: 2 steps redone (it reached "
        "step 6, then failed); global batch 16 (the run's, from checkpoint-4) on 1 rank(s): 8 per device "
        "x 2 accumulation (the command gives 8 x 1)",
        f"continuing on 2 ranks (was 1) from checkpoint-{HOLD}, written for SIGTERM: no step redone (it reached step "
        f"{HOLD}, then stopped on SIGTERM)"]
    assert_uninterrupted(tiny_runs, output)


@pytest.mark.deepspeed
def test_zero3_node_stopped_by_its_scheduler_then_back_trains_as_one_uninterrupted_process(tiny_runs, tmp_path):
    """Fails when a node's agent stopped by SIGTERM does not checkpoint the whole group at that step, ZeRO-3's
    partitions do not continue on 1 rank and then on 2 (DeepSpeed's universal checkpoints), or any step differs from
    an uninterrupted run."""
    output, logs = elastic_run(tmp_path, "SIGTERM:agent", "--deepspeed", "zero3")
    assert continued(logs["A"]) == [
        "continuing on 1 rank (was 2) from checkpoint-6, written for SIGTERM: no step redone (it reached step 6, then "
        "stopped on SIGTERM); global batch 16 (the run's, from checkpoint-6) on 1 rank(s): 8 per device x 2 "
        "accumulation (the command gives 8 x 1)",
        f"continuing on 2 ranks (was 1) from checkpoint-{HOLD}, written for SIGTERM: no step redone (it reached step "
        f"{HOLD}, then stopped on SIGTERM)"]
    assert_uninterrupted(tiny_runs, output)
