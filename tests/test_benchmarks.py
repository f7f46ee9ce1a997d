"""The benchmark's arithmetic and reports, CUDA columns included, checked without a GPU on synthetic runs."""

import importlib.util
import sys

import pytest

from conftest import REPO

spec = importlib.util.spec_from_file_location("backends", REPO / "benchmarks" / "backends.py")
backends = sys.modules["backends"] = importlib.util.module_from_spec(spec)  # dataclasses look the module up
spec.loader.exec_module(backends)

PSI = 22_713_986


def report(rank, step_seconds, moments=8 * PSI):
    ends = [10.0]
    for seconds in step_seconds:
        ends.append(ends[-1] + seconds)
    return {"rank": rank, "num_parameters": PSI, "params_bytes": 2 * PSI, "grads_bytes": 2 * PSI,
            "moments_bytes": moments, "master_bytes": 4 * PSI, "peak_rss_bytes": 2 ** 30,
            "peak_cuda_bytes": 3 * 2 ** 30, "losses": [0.7, 0.6, 0.5], "step_end_times": ends[1:]}


def test_samples_per_second_is_robust_to_one_slow_step():
    """A burst of load from elsewhere during one step must not move the figure."""
    steady = backends.samples_per_second(report(0, [0.5] * 10), warmup=3, global_batch=32)
    spiked = backends.samples_per_second(report(0, [0.5] * 6 + [5.0] + [0.5] * 3), warmup=3, global_batch=32)
    assert steady == spiked == pytest.approx(64.0)


def test_cuda_report_has_tokens_mfu_and_peak_memory(tmp_path):
    """On an H100 the tables add tokens/s, model FLOPs utilisation against bf16 peak, and peak CUDA memory."""
    device = "NVIDIA H100 80GB HBM3"
    runs = [{"reports": [report(0, [0.25] * 10), report(1, [0.25] * 10)], "wall_seconds": 9.0}]
    results = {("DDP, stock Trainer", "bf16"): runs, ("DDP, ExtTrainer", "bf16"): runs}
    rows = backends.summarise(results, ranks=2, steps=10, warmup=3, seq_length=64, device=device)
    row = rows[0]
    assert row["samples_per_second"] == pytest.approx(128.0)  # 32 samples every 0.25 s
    assert row["tokens_per_second"] == pytest.approx(128.0 * 64)
    flops_per_token = 6 * PSI + 12 * 6 * 384 * 64  # PaLM appendix B for MiniLM-L6 (6 layers, hidden 384)
    assert row["mfu"] == pytest.approx(flops_per_token * 128 * 64 / (989e12 * 2))
    meta = {"ranks": 2, "steps": 10, "repeats": 1, "warmup": 3, "seq_length": 64, "device": device, "cuda": True,
            "precisions": ["bf16"], "started": "today", "minutes": 1.0}
    backends.write_results(tmp_path / "backends.md", rows, meta)
    text = (tmp_path / "backends.md").read_text()
    assert "tokens/s | MFU |" in text and "peak CUDA |" in text and f"{row['mfu']:.1%}" in text
    assert (tmp_path / "backends.png").stat().st_size > 10_000
