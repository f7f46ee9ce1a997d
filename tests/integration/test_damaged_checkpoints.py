"""A checkpoint damaged after its save finished (a disk or sync fault: truncated, or same size with other bytes) is
never resumed: its marker records every file's size and checksum, resume checks them, warns naming the file and
takes the newest intact checkpoint, which then continues exactly like an uninterrupted run. Each kind of file
(weights, optimizer, ZeRO shard, data_state.json) under each backend; remote downloads are checked the same way."""

import logging
import shutil

import pytest

from conftest import BIN, PYTHON, TINY_TRAIN, free_port, max_weight_difference, run, scratch
from trainer_ext.checkpoints.format import newest_valid_checkpoint

pytestmark = [pytest.mark.launch, pytest.mark.deepspeed]

LAUNCHERS = {
    "single": lambda: [PYTHON],
    "ddp": lambda: [BIN / "torchrun", "--nproc_per_node", 2, "--master_port", free_port()],
    # torchrun with --deepspeed: the checkpoint is the point, not the launcher (~3 s of CPU less per run)
    "zero2": lambda: [BIN / "torchrun", "--nproc_per_node", 2, "--master_port", free_port()],
    "simple": lambda: [PYTHON, "-m", "torch.distributed.launch", "--nproc_per_node", 2, "--master_port", free_port()],
}
BACKEND_FLAGS = {"single": [], "ddp": [], "zero2": ["--deepspeed", "zero2_minimal"], "simple": ["--sharded_ddp", "simple"]}
COMMON = ["--learning_rate", "1e-3", "--report_to", "none", "--disable_tqdm", "true", "--seed", 3,
          "--save_strategy", "steps", "--save_steps", 2, "--logging_steps", 1]
# The file of each kind in a checkpoint written by each backend.
FILES = {
    "single": {"weights": "model.safetensors", "optimizer": "optimizer.pt", "data_state": "data_state.json"},
    "ddp": {"weights": "model.safetensors", "optimizer": "optimizer.pt", "data_state": "data_state.json"},
    "simple": {"weights": "model.safetensors", "optimizer": "optimizer.pt", "data_state": "data_state.json"},
    "zero2": {"weights": "model.safetensors", "ZeRO shard": "global_step6/zero_pp_rank_1_mp_rank_00_optim_states.pt",
              "data_state": "data_state.json"},
}


def train(output_dir, backend, max_steps, *flags, check=True):
    per_device = 16 if backend == "single" else 8
    out = run([*LAUNCHERS[backend](), TINY_TRAIN, "--output_dir", output_dir, "--per_device_train_batch_size",
               per_device, "--max_steps", max_steps, *COMMON, *BACKEND_FLAGS[backend], *flags])
    if check:
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def uninterrupted(request):
    """6 steps per backend, checkpoints at 2, 4 and 6; the single process's also uploaded to root/remote."""
    root = scratch(request, "uninterrupted")
    for backend in FILES:
        train(root / backend, backend, 6, *(["--checkpoint_uri", root / "remote"] if backend == "single" else []))
    return root


def damage(path, how):
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(data[:len(data) // 2])
    else:  # same size, one byte changed in the middle: only a checksum sees it
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "same size"])
@pytest.mark.parametrize("backend,kind", [(b, k) for b, kinds in FILES.items() for k in kinds])
def test_each_damaged_file_is_found_and_the_previous_checkpoint_taken(uninterrupted, tmp_path, caplog, backend,
                                                                      kind, how):
    """Any damaged file (truncated or same size) under any backend must be named and the checkpoint before taken."""
    run_dir = tmp_path / backend
    shutil.copytree(uninterrupted / backend, run_dir)
    relative = FILES[backend][kind]
    assert (run_dir / "checkpoint-6" / relative).is_file(), sorted(p.name for p in (run_dir / "checkpoint-6").iterdir())
    damage(run_dir / "checkpoint-6" / relative, how)
    with caplog.at_level(logging.WARNING, logger="trainer_ext.checkpoints.format"):
        assert newest_valid_checkpoint(run_dir, checksums=True) == run_dir / "checkpoint-4"
    said = caplog.text
    assert f"skipping checkpoint {run_dir / 'checkpoint-6'}: {relative}" in said
    assert ("bytes but" if how == "truncated" else "does not match the checksum") in said


@pytest.mark.parametrize("backend,kind", [("ddp", "weights"), ("zero2", "ZeRO shard"), ("simple", "optimizer")])
def test_resume_skips_the_damaged_newest_checkpoint_and_ends_like_one_run(uninterrupted, tmp_path, backend, kind):
    """The reported crash: the newest checkpoint truncated, the same command resumes from the one before (warning
    naming the file) instead of dying in safetensors, and ends with the uninterrupted run's weights."""
    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted / backend, run_dir)
    shutil.rmtree(run_dir / "checkpoint-6")
    for name in ("model.safetensors", "config.json"):
        (run_dir / name).unlink()
    damage(run_dir / "checkpoint-4" / FILES[backend][kind].replace("global_step6", "global_step4"), "truncated")
    out = train(run_dir, backend, 6)
    said = out.stdout + out.stderr
    assert f"skipping checkpoint {run_dir / 'checkpoint-4'}: " in said
    assert f"resuming from {run_dir / 'checkpoint-2'}" in said
    assert max_weight_difference(uninterrupted / backend, run_dir) < 1e-5


def test_explicit_resume_from_a_damaged_checkpoint_is_refused(uninterrupted, tmp_path):
    """A damaged checkpoint the user names must be refused naming the file, not loaded or swapped for another."""
    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted / "single", run_dir)
    damage(run_dir / "checkpoint-6" / "optimizer.pt", "same size")
    out = train(run_dir, "single", 8, "--resume_from_checkpoint", run_dir / "checkpoint-6", check=False)
    assert out.returncode != 0
    assert f"--resume_from_checkpoint {run_dir / 'checkpoint-6'}: optimizer.pt does not match the checksum" in out.stderr


def test_a_damaged_remote_checkpoint_is_skipped_on_download(uninterrupted, tmp_path):
    """output_dir lost, the newest remote checkpoint damaged in storage: the one before is downloaded instead."""
    remote, run_dir = tmp_path / "remote", tmp_path / "run"
    shutil.copytree(uninterrupted / "remote", remote)
    damage(remote / "checkpoint-6" / "model.safetensors", "same size")
    out = train(run_dir, "single", 6, "--checkpoint_uri", remote)
    said = out.stdout + out.stderr
    assert f"skipping remote checkpoint {remote}/checkpoint-6: model.safetensors does not match the checksum" in said
    assert f"resuming from {run_dir / 'checkpoint-4'}" in said
    assert max_weight_difference(uninterrupted / "single", run_dir) < 1e-5
