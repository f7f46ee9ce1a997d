"""What a killed DeepSpeed job leaves behind (an op-build lock, a shared-memory buffer) must not hang or fill later runs."""

import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import REPO, launch
from trainer_ext.backends.deepspeed.leftovers import clear_stale_build_locks

HOUR_AGO = time.time() - 3600


def make_lock(root, op, age_s=3600.0):
    lock = root / "py311_cpu" / op / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock


def test_only_old_unheld_locks_are_removed(tmp_path):
    """A stale lock is removed; a young one (a builder we may have raced) and a held one are kept."""
    stale, young = make_lock(tmp_path, "fused_adam"), make_lock(tmp_path, "cpu_adam", age_s=1)
    held = make_lock(tmp_path, "deepspeed_shm_comm")
    # Another process holds it the way torch's FileBaton does: the descriptor stays open for the whole build.
    holder = subprocess.Popen([sys.executable, "-c", f"import os, time; fd = os.open({str(held)!r}, os.O_RDONLY); "
                               "print('open', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        assert clear_stale_build_locks([tmp_path]) == [stale]
        assert not stale.exists() and young.exists() and held.exists()
    finally:
        holder.kill()
        holder.wait()
    assert clear_stale_build_locks([tmp_path]) == [held]  # its holder is gone now


@pytest.mark.model_package
@pytest.mark.deepspeed
@pytest.mark.launch
def test_a_deepspeed_run_proceeds_past_a_stale_lock(tmp_path):
    """Without the clean-up, DeepSpeed waits forever on a lock a killed run left in its op folders."""
    built = tmp_path / "torch_extensions"
    shutil.copytree(os.environ["TORCH_EXTENSIONS_DIR"], built)  # the ops conftest built, with their mtimes
    locks = [built / op / "lock" for op in ("deepspeed_shm_comm", "fused_adam") if (built / op).is_dir()]
    for lock in locks:
        lock.touch()
        os.utime(lock, (HOUR_AGO, HOUR_AGO))
    out = launch("torchrun", tmp_path / "out", "--deepspeed", REPO / "ds_configs" / "zero2_minimal.json",
                 "--do_train", "--max_steps", "2", "--per_device_train_batch_size", "4", "--save_strategy", "no",
                 env={"TORCH_EXTENSIONS_DIR": str(built)}, timeout=400)
    assert locks and "removed stale op-build lock" in out.stdout + out.stderr
    assert not any(lock.exists() for lock in locks)


def test_unmapped_shm_buffers_are_removed_and_mapped_ones_kept(tmp_path):
    """A killed rank's all-reduce buffer (~66 MB of RAM) is freed; a live rank's mapping is never touched."""
    from trainer_ext.backends.deepspeed.leftovers import clear_stale_shm_buffers

    def buffer(port):
        path = tmp_path / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_0"
        path.write_bytes(b"\0" * 4096)
        os.utime(path, (HOUR_AGO, HOUR_AGO))
        return path

    orphan, mapped = buffer(1111), buffer(2222)
    # A live rank maps its buffer and closes the descriptor, as shm.cpp does.
    holder = subprocess.Popen([sys.executable, "-c", "import mmap, os, time\n"
                               f"fd = os.open({str(mapped)!r}, os.O_RDWR); m = mmap.mmap(fd, 4096); os.close(fd)\n"
                               "print('mapped', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "mapped"
        assert clear_stale_shm_buffers(tmp_path) == [orphan]
        assert mapped.exists()
    finally:
        holder.kill()
        holder.wait()
