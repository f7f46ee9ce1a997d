"""benchmarks/gpu.py itself, run end to end on a CPU rank (tests/unit/test_benchmarks.py checks its arithmetic and
reports on synthetic runs)."""

import pytest

from conftest import PYTHON, REPO, run


@pytest.mark.launch
def test_gpu_benchmark_runs_and_reports_a_failing_row(tmp_path):
    """The script itself, end to end on CPU ranks with a tiny model: rows that train are measured, a row that cannot
    run here (FSDP needs CUDA) is reported with the rank's own error line, and the tables and figure are written."""
    out = run([PYTHON, REPO / "benchmarks" / "gpu.py", "--allow_cpu", "--model_config", "tiny-qa", "--seq_length", 32,
               "--batch_size", 4, "--steps", 5, "--warmup", 2, "--ranks", 1, "--precision", "bf16", "--only",
               "plain, ExtTrainer", "simple", "zero_dp_2,", "--results", tmp_path / "gpu.md"], timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    text = (tmp_path / "gpu.md").read_text()
    assert "| plain, ExtTrainer | bf16 |" in text and "| simple, ExtTrainer | bf16 |" in text
    assert "| zero_dp_2, ExtTrainer | bf16 | failed: train.py: error: --sharded_ddp zero_dp_2: FairScale's" in text
    assert (tmp_path / "gpu.png").is_file()
