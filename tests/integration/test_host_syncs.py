"""A training step that neither logs nor saves gives the GPU nothing of ExtTrainer's to wait for: no host sync
(`aten::_local_scalar_dense`, the op behind .item() and bool(tensor)) and no collective beyond the stock Trainer's
and the backend engine's, one read (the chunked loss's target positions, before the forward is queued), two syncs
fewer than stock (the logged loss's NaN/Inf filter runs on the device); counted
by benchmarks/step_overhead.py's dispatch mode on 1 process (here) and 2 ranks (DDP, ZeRO-2, FSDP2), stock and
ExtTrainer in one launched process per backend. The ranks agree on a preemption's stop step without a per-step
collective (tests/scripts/stop_agreement.py, in the DDP launch)."""

import json
import sys
from argparse import Namespace
from collections import Counter

import pytest

from conftest import REPO, free_port, launcher, run, scratch

sys.path.insert(0, str(REPO / "benchmarks"))
from step_overhead import owner  # noqa: E402

BACKENDS = {
    "ddp": [],  # launched with the stop agreement's cases (ddp_launch)
    "zero2": ["--deepspeed", "zero2_minimal"],
    "fsdp2": ["--fsdp", "full_shard auto_wrap", "--fsdp_config", '{"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}'],
}


def per_step(report: dict, kind: str) -> Counter:
    """A trainer's counts per counted step by (syncs, reads or collectives, owner), and collectives by op ("op",
    name). A read: an op whose result's size or value the host needs (nonzero, a boolean mask's index, equal); by file
    ("read at", path) too."""
    counts = Counter()
    for what, op, where, n in report["counts"][kind]["per_step"]:
        if what == "sync" and op != "_local_scalar_dense":
            what = "read"
            counts["read at", where] += n
        counts[what, owner(where)] += n
        if what == "collective":
            counts["op", op] += n
    return counts


def check(report: dict) -> None:
    """What every backend and rank count must show (stock's counts where stock ran the same engine)."""
    ext = per_step(report, "ext")
    assert len(report["counts"]["ext"]["steps"]) >= 5
    assert ext["sync", "trainer_ext"] == 0 and ext["collective", "trainer_ext"] == 0, report["counts"]["ext"]
    # one read of ours: where the chunked loss's target tokens are, taken before the model's forward is queued (a
    # boolean-mask selection after it, and a torch.equal on the returned loss, waited for the whole forward)
    ours = {key[1]: n for key, n in ext.items() if key[0] == "read at" and owner(key[1]) == "trainer_ext"}
    assert ours == {"trainer_ext/training/chunked_loss.py": 1.0}, report["counts"]["ext"]
    if "stock" not in report["counts"]:  # FSDP2 on CPU ranks (accelerate's is for GPUs): no stock run to compare
        assert ext["sync", "Trainer"] == 0, report["counts"]["ext"]
        return
    stock = per_step(report, "stock")
    assert report["counts"]["ext"]["steps"] == report["counts"]["stock"]["steps"]
    assert stock["sync", "Trainer"] >= 2  # the stock loop's NaN/Inf filter: isnan, then isinf, read on the host
    assert ext["sync", "trainer_ext"] + ext["sync", "Trainer"] <= stock["sync", "trainer_ext"] \
        + stock["sync", "Trainer"] - 2, (report["counts"]["ext"], report["counts"]["stock"])
    collectives = {key: n for key, n in ext.items() if key[0] == "op"}
    assert collectives == {key: n for key, n in stock.items() if key[0] == "op"}, (ext, stock)


def test_one_process_step_has_no_sync_of_ext_trainers(tmp_path):
    """Fails when ExtTrainer reads a device value on the host at a step that neither logs nor saves (a `.item()`, a
    `bool(tensor)`), or no longer keeps the stock loop's two NaN/Inf-filter reads away, in one process."""
    from step_overhead import worker

    options = Namespace(report_dir=str(tmp_path), trainers="stock,ext", steps=0, count_steps=14, timed_repeats=0,
                        profile=None)
    check(worker(options, []))


@pytest.fixture(scope="module")
def ddp_launch(request):
    """One torchrun launch of tests/scripts/stop_agreement.py --train: DDP's step counts, the stop agreement's cases
    and a preempted ExtTrainer run."""
    folder = scratch(request, "ddp")
    done = run([*launcher("torchrun"), "--nproc_per_node", 2, "--master_port", free_port(),
                REPO / "tests" / "scripts" / "stop_agreement.py", folder, "--train"], timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return folder


@pytest.mark.launch
@pytest.mark.parametrize("backend", [pytest.param(name, marks=[pytest.mark.deepspeed] if name == "zero2" else [])
                                     for name in BACKENDS])
def test_two_ranks_step_adds_no_sync_or_collective(request, tmp_path, backend):
    """Fails when ExtTrainer adds a collective or a host sync to a step of 2 ranks that neither logs nor saves (the
    preemption agreement's blocking all-reduce and .item() every step did), under DDP, ZeRO-2 and FSDP2."""
    if backend == "ddp":
        folder = request.getfixturevalue("ddp_launch")
    else:
        folder = tmp_path
        done = run([*launcher("torchrun"), "--nproc_per_node", 2, "--master_port", free_port(),
                    REPO / "benchmarks" / "step_overhead.py", "--worker", "--report_dir", folder,
                    "--trainers", "ext" if backend == "fsdp2" else "stock,ext", *BACKENDS[backend]], timeout=900)
        assert done.returncode == 0, done.stderr[-4000:]
    for rank in range(2):
        check(json.loads((folder / f"rank{rank}.json").read_text()))


@pytest.mark.launch
def test_ranks_agree_on_the_stop_step_without_a_collective_per_step(ddp_launch):
    """Fails when a SIGTERM on one rank makes the ranks stop after different steps (a deadlock, or checkpoints of two
    steps), when a signal is acted on later than the next agreement, or when the agreement costs a collective at
    steps its schedule leaves alone: one asynchronous all-reduce started at a step is read at the next one's end."""
    seen = {name: [json.loads((ddp_launch / f"{name}-rank{rank}.json").read_text()) for rank in range(2)]
            for name in ("every_step", "logs_only", "timed", "before_a_log")}
    for name, ranks in seen.items():
        assert ranks[0] == ranks[1], name  # the same stop step and the same collectives on both ranks
        assert ranks[0]["signum"] == 15, name
    assert seen["every_step"][0]["stopped"] == 5  # signalled at 4: agreed at 4's end, read at 5's
    assert seen["every_step"][0]["collectives"] == [1, 1, 1, 1, 0]
    assert seen["logs_only"][0]["stopped"] == 10  # the next step that logs agrees at once
    assert seen["logs_only"][0]["collectives"] == [1] + [0] * 8 + [1]
    assert seen["before_a_log"][0]["stopped"] == 10
    timed = seen["timed"][0]
    assert 7 < timed["stopped"] <= 7 + 10 + 1  # K at most 0.2 s / 0.02 s
    assert sum(timed["collectives"]) <= len(timed["collectives"]) / 2


@pytest.mark.launch
def test_a_sigterm_between_logging_steps_checkpoints_the_next_step_on_every_rank(ddp_launch):
    """Fails when a real DDP run (--logging_steps 50, an asynchronous agreement every step) signalled on rank 1 during
    step 6 does not stop every rank after step 7 with that step's complete checkpoint and exit status 143."""
    from trainer_ext.checkpoints.format import newest_valid_checkpoint

    for rank in range(2):
        assert json.loads((ddp_launch / f"preempted-rank{rank}.json").read_text()) == \
            {"preempted": 143, "checkpoint": "checkpoint-7", "step": 7}
    assert newest_valid_checkpoint(ddp_launch / "preempted").name == "checkpoint-7"
