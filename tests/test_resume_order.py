"""After a resume each rank trains on exactly the samples an uninterrupted run would have, from the saved position
on (also on another world size, or with another global batch), and skipped samples are never loaded."""

import shutil

import pytest

from conftest import BIN, PYTHON, REPO, free_port, run

SCRIPT = REPO / "tests" / "scripts" / "record_order.py"
COMMON = ["--report_to", "none", "--disable_tqdm", "true", "--seed", "5", "--logging_steps", "1",
          "--learning_rate", "1e-3", "--save_strategy", "steps", "--save_steps", 4]


def train(output_dir, record_dir, batch_size, ranks=1, *flags):
    launcher = [PYTHON] if ranks == 1 else [BIN / "torchrun", "--nproc_per_node", ranks, "--master_port", free_port()]
    out = run([*launcher, SCRIPT, "--output_dir", output_dir, *COMMON, "--per_device_train_batch_size", batch_size,
               *flags], env={"RECORD_DIR": str(record_dir)})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out


def loaded(record_dir, rank):
    return [int(line) for line in (record_dir / f"rank{rank}.txt").read_text().split()]


def global_steps(record_dir, batch_size, ranks):
    """Sorted samples of each optimizer step, all ranks together (accumulation 1: one micro-batch per step)."""
    per_rank = [loaded(record_dir, r) for r in range(ranks)]
    count = len(per_rank[0]) // batch_size
    assert all(len(indices) == count * batch_size for indices in per_rank)
    return [sorted(i for indices in per_rank for i in indices[k * batch_size:(k + 1) * batch_size])
            for k in range(count)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """2 ranks x 8 = 16 per step, 14 steps over a 100-sample set: 7 steps per epoch, checkpoints every 4 steps."""
    root = tmp_path_factory.mktemp("order")
    train(root / "run", root / "indices", 8, 2, "--max_steps", 14)
    return root


def resume_from(uninterrupted, step, tmp_path):
    output_dir = tmp_path / "run"
    output_dir.mkdir()
    shutil.copytree(uninterrupted / "run" / f"checkpoint-{step}", output_dir / f"checkpoint-{step}")
    return output_dir


def test_resume_in_the_second_epoch_trains_the_same_samples_on_each_rank(uninterrupted, tmp_path):
    """Checkpoint 8 lies in epoch 2; each rank's loaded indices continue its uninterrupted sequence exactly."""
    output_dir = resume_from(uninterrupted, 8, tmp_path)
    out = train(output_dir, tmp_path / "indices", 8, 2, "--max_steps", 14)
    assert f"resuming from {output_dir / 'checkpoint-8'}" in out.stdout + out.stderr
    for rank in range(2):
        # nothing before step 9 is loaded: the skip works on indices only
        assert loaded(tmp_path / "indices", rank) == loaded(uninterrupted / "indices", rank)[8 * 8:]


@pytest.mark.parametrize("batch_size,ranks", [(16, 1)])
def test_resume_on_one_rank_with_the_same_global_batch(uninterrupted, tmp_path, batch_size, ranks):
    output_dir = resume_from(uninterrupted, 4, tmp_path)
    train(output_dir, tmp_path / "indices", batch_size, ranks, "--max_steps", 14)
    assert global_steps(tmp_path / "indices", batch_size, ranks) == global_steps(uninterrupted / "indices", 8, 2)[4:]


def test_a_changed_global_batch_warns_and_repeats_or_drops_nothing(uninterrupted, tmp_path):
    """Resume step 4 (64 samples) with 2 x 16 = 32 per step: the next 160 samples are the next 160 of the stream."""
    output_dir = resume_from(uninterrupted, 4, tmp_path)
    out = train(output_dir, tmp_path / "indices", 16, 2, "--max_steps", 9)
    assert "the global batch changed from 16 to 32" in out.stdout + out.stderr
    old = [i for step in global_steps(uninterrupted / "indices", 8, 2) for i in step]  # 14 x 16 = 224 samples
    new = global_steps(tmp_path / "indices", 16, 2)[:5]  # steps 5..9 (accelerate loads one batch ahead)
    position = 4 * 16
    for step in new:
        assert step == sorted(old[position:position + 32])  # = old steps k and k+1 together
        position += 32
    assert position == len(old)
