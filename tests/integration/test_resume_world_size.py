"""A ZeRO-2 checkpoint resumes on a different number of ranks (2 -> 1, 1 -> 2) with its optimizer state
re-partitioned (DeepSpeed's universal format), and with the same global batch continues the uninterrupted run.
The resumes run under torchrun (the world size is the point here, not the launcher: a deepspeed launcher costs ~3 s
of CPU more per run); the checkpoint is the deepspeed launcher's, and test_trainer_distributed.py resumes under it."""

import pytest

from conftest import ACCUMULATE, assert_continues, copy_checkpoint, launch, logged, scratch

pytestmark = [pytest.mark.launch, pytest.mark.deepspeed, pytest.mark.model_package]

ZERO2 = ["--deepspeed", "zero2_minimal"]


@pytest.fixture(scope="module")
def on_one_rank(request, accumulate_runs):
    """The 2-rank run's checkpoint-6 resumed on 1 rank to step 12 (8 x 2 accumulation on 1 rank = 4 x 2 x 2 ranks),
    saving 1-rank checkpoints at 9 and 12 (the checkpoint's save_steps); returns its output_dir and log."""
    resumed = copy_checkpoint(accumulate_runs / "zero2", 6, scratch(request, "world-size") / "one-rank")
    out = launch("torchrun", resumed, *ACCUMULATE, "--per_device_train_batch_size", 8, *ZERO2, "--save_strategy",
                 "steps", "--save_steps", 3, ranks=1)
    assert sorted(p.name for p in resumed.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-6", "checkpoint-9"]
    return resumed, out.stdout + out.stderr


def test_zero2_from_2_ranks_resumes_on_1_then_resumes_again(accumulate_runs, on_one_rank):
    """Same global batch on 1 rank continues the 2-rank run; a later ordinary resume still works."""
    resumed, said = on_one_rank
    assert "saved on 2 ranks, resuming on 1" in said
    assert said.count("resuming a 2-rank ZeRO checkpoint on 1 ranks (universal)") == 1
    assert_continues(accumulate_runs / "zero2", resumed, 7)
    # The conversion is for that one load: continuing from the 1-rank checkpoint-12 is an ordinary resume.
    more = launch("torchrun", resumed, *ACCUMULATE, "--per_device_train_batch_size", 8, *ZERO2,
                  "--save_strategy", "no", "--max_steps", 14, ranks=1)
    assert f"resuming from {resumed / 'checkpoint-12'}" in more.stdout + more.stderr
    assert "universal" not in more.stdout + more.stderr
    assert sorted(logged(resumed))[-1] == 14


def test_zero2_from_1_rank_resumes_on_2(accumulate_runs, on_one_rank, tmp_path):
    """A ZeRO-2 checkpoint saved by 1 rank (checkpoint-9 above) must resume on 2 and continue the uninterrupted run's
    losses and weights (one 1-rank run fewer than training a 1-rank reference from step 0: the 2-rank run is it)."""
    resumed = copy_checkpoint(on_one_rank[0], 9, tmp_path / "two-ranks")
    out = launch("torchrun", resumed, *ACCUMULATE, "--per_device_train_batch_size", 4, *ZERO2, "--save_strategy",
                 "no")
    assert (out.stdout + out.stderr).count("resuming a 1-rank ZeRO checkpoint on 2 ranks (universal)") == 1
    assert_continues(accumulate_runs / "zero2", resumed, 10)
