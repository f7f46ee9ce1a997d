"""Spot-instance safety: SIGTERM mid-run on one rank -> a complete checkpoint and exit 143; the same command
again continues exactly like an uninterrupted run. Damaged checkpoints are skipped, never resumed."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import (BIN, GLUE, GLUE_COMMON, PLAIN, PYTHON, REPO, STEPS, assert_same_training, clean_env,
                      free_port, signal_at_step)
from trainer_ext.checkpoints.format import MARKER, newest_valid_checkpoint
from trainer_ext.data.samplers import ResumableBatchSampler

# The choice of checkpoint and rotation in process: tests/unit/test_checkpoint_choice.py.
pytestmark = [pytest.mark.launch, pytest.mark.deepspeed, pytest.mark.model_package]

LAUNCHERS = {
    "ddp": lambda port: [BIN / "torchrun", "--nproc_per_node", 2, "--master_port", port, GLUE],
    "zero2": lambda port: [BIN / "deepspeed", "--num_gpus", 2, "--master_port", port, GLUE],
    "simple": lambda port: [PYTHON, "-m", "torch.distributed.launch", "--nproc_per_node", 2, "--master_port", port,
                            GLUE],
}
BACKEND_FLAGS = {"ddp": [], "zero2": ["--deepspeed", "zero2_minimal"], "simple": ["--sharded_ddp", "simple"]}


def command(backend, output_dir):
    flags = [*PLAIN, "--per_device_train_batch_size", 8, *BACKEND_FLAGS[backend]]
    flags = [f for f in flags if f not in ("--do_eval", "--do_predict")]
    return [str(c) for c in [*LAUNCHERS[backend](free_port()), "--output_dir", output_dir, *GLUE_COMMON,
                             *[str(f) for f in flags], "--disable_tqdm", "false"]]


@pytest.mark.parametrize("backend", ["ddp", "zero2", "simple"])
def test_sigterm_on_one_rank_then_rerun_equals_uninterrupted(plain_runs, tmp_path, backend):
    """Whichever rank gets SIGTERM, all save the same step; rerunning the same command finishes the same run. Rank 1
    signals itself at the end of step 5 (signal_at_step): the same step on every machine, never after the last."""
    output_dir = tmp_path / "run"
    env = clean_env()
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.run(command(backend, output_dir), stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                               env=signal_at_step(5, rank=1), timeout=600)
    text = (tmp_path / "first.log").read_text()
    assert first.returncode != 0, text[-3000:]
    assert "received SIGTERM" in text and "preempted: checkpoint" in text, text[-3000:]
    saved = newest_valid_checkpoint(output_dir)
    assert saved is not None, text[-3000:]
    assert saved.name == "checkpoint-5"  # every rank saves the step rank 1 was signalled at
    assert not (output_dir / "model.safetensors").exists()  # no final model from an interrupted run

    again = subprocess.run(command(backend, output_dir), capture_output=True, text=True, cwd=REPO, env=env,
                           timeout=900)
    assert again.returncode == 0, again.stderr[-4000:]
    assert f"resuming from {saved}" in again.stdout + again.stderr
    reference = {"ddp": "ddp", "zero2": "zero2", "simple": "ddp"}[backend]
    assert_same_training(plain_runs / reference, output_dir, STEPS)


def test_preempted_process_exits_with_143(tmp_path):
    """The documented status: 128 + SIGTERM, for job schedulers to tell preemption from failure."""
    cmd = [PYTHON, GLUE, "--output_dir", tmp_path / "run", *GLUE_COMMON, "--do_train", "--max_steps", 200,
           "--per_device_train_batch_size", 8, "--save_strategy", "no"]
    process = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               cwd=REPO, env=clean_env())
    lines = []
    for line in process.stdout:
        lines.append(line)
        if "'loss'" in line:
            process.send_signal(signal.SIGTERM)
            break
    lines += process.stdout.readlines()
    assert process.wait(timeout=300) == 143, "".join(lines[-50:])
    assert newest_valid_checkpoint(tmp_path / "run") is not None


def write_checkpoint(root, step, complete=True):
    path = Path(root) / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"weights")
    if complete:
        (path / MARKER).write_text(json.dumps({"step": step}))
    return path


def test_checkpoint_of_a_different_model_is_refused_before_training(tmp_path):
    """Resuming another model's checkpoint must fail clearly, and overwrite nothing."""
    run_dir = tmp_path / "run"
    checkpoint = write_checkpoint(run_dir, 5)
    (checkpoint / MARKER).write_text(json.dumps({"step": 5, "model": {"model_class": "GPT2LMHeadModel",
                                                                      "num_parameters": 124439808}}))
    before = sorted(p.name for p in checkpoint.iterdir())
    out = subprocess.run([str(c) for c in [PYTHON, GLUE, "--output_dir", run_dir, *GLUE_COMMON, "--do_train",
                                           "--max_steps", 3, "--save_strategy", "no"]],
                         capture_output=True, text=True, cwd=REPO, env=clean_env())
    assert out.returncode != 0
    assert "was written by a different model" in out.stderr and "GPT2LMHeadModel" in out.stderr
    assert "--fresh_start" in out.stderr
    assert sorted(p.name for p in checkpoint.iterdir()) == before
    fresh = subprocess.run([str(c) for c in [PYTHON, GLUE, "--output_dir", run_dir, *GLUE_COMMON, "--do_train",
                                             "--max_steps", 3, "--save_strategy", "no", "--fresh_start"]],
                           capture_output=True, text=True, cwd=REPO, env=clean_env())
    assert fresh.returncode == 0, fresh.stderr[-3000:]


def record_order_command(launcher, output_dir, *flags):
    from conftest import ORDER_COMMON, RECORD_ORDER

    starts = {"torchrun": [BIN / "torchrun", "--nproc_per_node", 2, "--master_port", free_port()],
              "deepspeed": [BIN / "deepspeed", "--num_gpus", 2, "--master_port", free_port()]}
    backend = ["--deepspeed", "zero2_minimal"] if launcher == "deepspeed" else []
    return [str(c) for c in [*starts[launcher], RECORD_ORDER, "--output_dir", output_dir, *ORDER_COMMON,
                             "--per_device_train_batch_size", 8, *backend, *flags]]


@pytest.mark.parametrize("launcher,target", [("torchrun", "launcher"), ("deepspeed", "process group")])
def test_sigterm_to_the_launcher_checkpoints_and_the_rerun_continues(uninterrupted, tmp_path, launcher, target):
    """What a scheduler does on preemption: SIGTERM to the launcher (torchrun forwards it to the ranks) or to the
    job's process group (the `deepspeed` runner does not forward it on one node); the ranks checkpoint, exit."""
    from conftest import loaded

    output_dir, records = tmp_path / "run", tmp_path / "first"
    env = {**clean_env(), "RECORD_DIR": str(records), "PYTHONUNBUFFERED": "1"}
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(record_order_command(launcher, output_dir, "--max_steps", 500, "--save_steps", 1000),
                                 stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
        deadline = time.time() + 600
        while time.time() < deadline and not ((records / "rank1.txt").is_file() and
                                              len((records / "rank1.txt").read_text().split()) >= 24):
            time.sleep(0.2)  # a few steps trained on both ranks (accelerate loads one batch ahead)
        if target == "launcher":
            first.send_signal(signal.SIGTERM)
        else:
            os.killpg(first.pid, signal.SIGTERM)
        first.wait(timeout=300)
        deadline = time.time() + 300
        while time.time() < deadline:  # the `deepspeed` runner exits at once; its ranks are still saving
            try:
                os.killpg(first.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.5)
    text = (tmp_path / "first.log").read_text()
    saved = newest_valid_checkpoint(output_dir)
    assert saved is not None and "preempted: checkpoint" in text, text[-4000:]
    step = int(saved.name.split("-")[1])
    assert 1 <= step < 500
    again = subprocess.run(record_order_command(launcher, output_dir, "--max_steps", step + 2),
                           capture_output=True, text=True, cwd=REPO, timeout=600,
                           env={**env, "RECORD_DIR": str(tmp_path / "second")})
    assert again.returncode == 0, again.stderr[-4000:]
    assert f"resuming from {saved}" in again.stdout + again.stderr
    # The order continues at the checkpoint's sample, whatever step the signal reached: the sampler's stream for
    # steps step+1, step+2 (tests/integration/test_resume_order.py checks that stream against uninterrupted runs).
    for rank in range(2):
        stream = ResumableBatchSampler(100, 8, rank=rank, world_size=2, seed=5)
        expected = [stream.micro_batch(s // stream.steps_per_epoch, s % stream.steps_per_epoch)
                    for s in (step, step + 1)]
        assert loaded(tmp_path / "second", rank)[:16] == expected[0] + expected[1]
        if step + 2 <= 14:  # and the uninterrupted run recorded the same samples
            assert expected[0] + expected[1] == loaded(uninterrupted / "indices", rank)[step * 8:][:16]
