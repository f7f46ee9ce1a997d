"""A ZeRO-2 checkpoint resumes on a different number of ranks (2 -> 1, 1 -> 2) with its optimizer state
re-partitioned (DeepSpeed's universal format), and with the same global batch continues the uninterrupted run."""

import pytest

from conftest import ACCUMULATE, assert_continues, copy_checkpoint, launch, logged

pytestmark = [pytest.mark.launch, pytest.mark.deepspeed, pytest.mark.model_package]

ZERO2 = ["--deepspeed", "zero2_minimal"]


def test_zero2_from_2_ranks_resumes_on_1_then_resumes_again(accumulate_runs, tmp_path):
    """Same global batch (8 x 2 accumulation on 1 rank = 4 x 2 x 2 ranks); a later ordinary resume still works."""
    uninterrupted = accumulate_runs / "zero2"
    resumed = copy_checkpoint(uninterrupted, 6, tmp_path / "one-rank")
    out = launch("deepspeed", resumed, *ACCUMULATE, "--per_device_train_batch_size", 8, *ZERO2, "--save_strategy",
                 "steps", "--save_steps", 6, ranks=1)
    assert "saved on 2 ranks, resuming on 1" in out.stdout + out.stderr
    assert (out.stdout + out.stderr).count("resuming a 2-rank ZeRO checkpoint on 1 ranks (universal)") == 1
    assert_continues(uninterrupted, resumed, 7)
    # The conversion is for that one load: continuing from the 1-rank checkpoint-12 is an ordinary resume.
    more = launch("deepspeed", resumed, *ACCUMULATE, "--per_device_train_batch_size", 8, *ZERO2,
                  "--save_strategy", "no", "--max_steps", 14, ranks=1)
    assert f"resuming from {resumed / 'checkpoint-12'}" in more.stdout + more.stderr
    assert "universal" not in more.stdout + more.stderr
    assert sorted(logged(resumed))[-1] == 14


def test_zero2_from_1_rank_resumes_on_2(tmp_path):
    """A ZeRO-2 checkpoint from 1 rank must resume on 2 and continue the uninterrupted run's losses and weights."""
    one_rank = tmp_path / "uninterrupted"
    launch("deepspeed", one_rank, *ACCUMULATE, "--per_device_train_batch_size", 8, *ZERO2, "--save_strategy",
           "steps", "--save_steps", 6, ranks=1)
    resumed = copy_checkpoint(one_rank, 6, tmp_path / "two-ranks")
    launch("deepspeed", resumed, *ACCUMULATE, "--per_device_train_batch_size", 4, *ZERO2, "--save_strategy", "no")
    assert_continues(one_rank, resumed, 7)
