"""After a resume each rank trains on exactly the samples an uninterrupted run would have, from the saved position
on (also on another world size, or with another global batch), and skipped samples are never loaded."""

import shutil

import pytest

from conftest import loaded, train

pytestmark = [pytest.mark.launch, pytest.mark.deepspeed]


def global_steps(record_dir, batch_size, ranks):
    """Sorted samples of each optimizer step, all ranks together (accumulation 1: one micro-batch per step)."""
    per_rank = [loaded(record_dir, r) for r in range(ranks)]
    count = len(per_rank[0]) // batch_size
    assert all(len(indices) == count * batch_size for indices in per_rank)
    return [sorted(i for indices in per_rank for i in indices[k * batch_size:(k + 1) * batch_size])
            for k in range(count)]


def resume_from(uninterrupted, step, tmp_path):
    output_dir = tmp_path / "run"
    output_dir.mkdir()
    shutil.copytree(uninterrupted / "run" / f"checkpoint-{step}", output_dir / f"checkpoint-{step}")
    return output_dir


@pytest.mark.oldest
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
    """A 2-rank run resumed on 1 rank (same global batch) must train each step on the uninterrupted run's samples."""
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
