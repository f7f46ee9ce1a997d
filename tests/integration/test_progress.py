"""Progress and logs on a real 2-rank run: one progress bar with samples/s (main process only), the resolved backend
settings printed once, and `--report_to tensorboard` writing event files."""

import pytest

from conftest import launch, scratch

pytestmark = [pytest.mark.launch, pytest.mark.model_package, pytest.mark.deepspeed]  # every test reads the ZeRO-2 run

STEPS = 4


@pytest.fixture(scope="module")
def zero2_run(request):
    root = scratch(request, "progress")
    out = launch("deepspeed", root / "out", "--do_train", "--max_steps", STEPS, "--per_device_train_batch_size", 4,
                 "--deepspeed", "zero2_minimal", "--save_strategy", "no", "--report_to", "tensorboard",
                 "--disable_tqdm", "false")  # transformers 5 writes events under output_dir/runs/
    return root, out.stdout + out.stderr


def test_progress_bar_with_samples_per_second_on_main_process_only(zero2_run):
    """Each rank would draw its own bar (N interleaved bars), or the bar would lack samples/s."""
    _, output = zero2_run
    assert output.count(f" 0/{STEPS} [") == 1, output[-3000:]  # tqdm draws a new bar's empty state once
    assert f"{STEPS}/{STEPS} [" in output and "samples/s=" in output


def test_resolved_settings_printed_once(zero2_run):
    """The resolved backend settings would be missing at start, or printed by every rank."""
    _, output = zero2_run
    assert output.count("trainer_ext: backend deepspeed ZeRO-2 on 2 rank(s)") == 1, output[-3000:]
    assert "4 per device x 1 accumulation x 2 ranks = 8 per step" in output
    assert '"overlap_comm"' in output.split("trainer_ext: backend", 1)[1]


def test_report_to_tensorboard_writes_event_files(zero2_run):
    """`--report_to tensorboard` would write nothing (or no training loss) on a multi-rank run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, _ = zero2_run
    events = list((root / "out").rglob("events.out.tfevents.*"))
    assert len(events) == 1, events  # the main process only
    accumulator = EventAccumulator(str(events[0].parent))
    accumulator.Reload()
    losses = accumulator.Scalars("train/loss")
    assert [event.step for event in losses] == list(range(1, STEPS + 1))
