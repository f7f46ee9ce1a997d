"""The benchmark's arithmetic and reports, CUDA columns included, checked without a GPU on synthetic runs."""

import importlib.util
import sys
from types import SimpleNamespace

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


gpu_spec = importlib.util.spec_from_file_location("gpu", REPO / "benchmarks" / "gpu.py")
gpu = sys.modules["gpu"] = importlib.util.module_from_spec(gpu_spec)
gpu_spec.loader.exec_module(gpu)


def test_gpu_rows_have_mfu_from_the_model_shape_and_ratios_to_plain(tmp_path):
    """BERT-large on an H100: MFU from 24 layers x 1024 hidden x 384 tokens, ratios within the same precision."""
    args = SimpleNamespace(model_config="bert-large-qa", seq_length=384, batch_size=32,
                           warmup=3)
    plain = gpu.Config(gpu.BASELINE, "ext", "torchrun")
    zero2 = gpu.CONFIGS[1]
    psi = 334_094_338
    runs = {plain: [0.1] * 10, zero2: [0.2] * 10}
    rows = []
    for config, seconds in runs.items():
        reports = [dict(report(0, seconds), num_parameters=psi)]
        rows.append(gpu.summarise(config, "bf16", 1, {"reports": reports, "wall_seconds": 30.0}, args,
                                  "NVIDIA H100 80GB HBM3"))
    assert rows[0]["samples_per_second"] == pytest.approx(320.0)
    assert rows[0]["mfu"] == pytest.approx((6 * psi + 12 * 24 * 1024 * 384) * 320.0 * 384 / 989e12)
    meta = {"model_config": "bert-large-qa", "device": "1 × NVIDIA H100 80GB HBM3", "steps": 10, "warmup": 3,
            "seq_length": 384, "batch_size": 32, "started": "today", "minutes": 4.0, "prebuild": "DeepSpeed ops built",
            "results": str(tmp_path / "gpu.md"), "torch": "2.11", "transformers": "5.23", "deepspeed": "0.19.8",
            "fairscale": "0.4.13", "num_parameters_text": "BERT bert-large-qa (334.1M parameters)"}
    rows.append({"name": "zero_dp_2, ExtTrainer", "precision": "bf16", "ranks": 1, "status": "failed: TypeError x"})
    gpu.write_results(tmp_path / "gpu.md", rows, meta)
    text = (tmp_path / "gpu.md").read_text()
    assert "| ZeRO-2, ExtTrainer (zero2_minimal: our defaults) | bf16 | 160.0 | 61440 | 0.50 |" in text
    assert "| zero_dp_2, ExtTrainer | bf16 | failed: TypeError x |" in text
    assert (tmp_path / "gpu.png").stat().st_size > 10_000


@pytest.mark.fairscale
@pytest.mark.deepspeed
def test_gpu_benchmark_keeps_its_time_budget(tmp_path):
    """A row that would end after --budget_minutes is listed as not run: `make gpu-check` ends in time on any GPU."""
    assert gpu.main(["--allow_cpu", "--budget_minutes", "0", "--only", "plain", "simple", "--results",
                     str(tmp_path / "gpu.md")]) == 0
    text = (tmp_path / "gpu.md").read_text()
    assert text.count("not run: --budget_minutes 0 reached") == 7  # 3 plain rows in bf16, 2 in fp16, simple in both


@pytest.mark.deepspeed
def test_zero3_tuning_rows_are_configs_deepspeed_accepts(deepspeed_accepts):
    """The stage-3 settings a GPU session measures to choose the defaults: a row DeepSpeed (or our translator) rejects,
    or one that changes nothing, would waste the GPU's time and decide nothing."""
    import json

    from trainer_ext.deepspeed_config import resolve_deepspeed_config

    rows = [c for c in gpu.CONFIGS if c.name.startswith("ZeRO-3 tuning")]
    assert len(rows) == len(gpu.ZERO3_TUNING) >= 6 and all(c.precisions == ("bf16",) for c in rows)
    preset = deepspeed_accepts(resolve_deepspeed_config({"bf16": True}, "zero3", world_size=2, num_training_steps=20,
                                                        hidden_size=1024).config, 2).zero_config
    for row, changes in zip(rows, gpu.ZERO3_TUNING.values()):
        resolved = resolve_deepspeed_config({"bf16": True}, json.loads(row.flags[1]), world_size=2,
                                            num_training_steps=20, hidden_size=1024)
        zero = deepspeed_accepts(resolved.config, 2).zero_config
        assert zero.stage == 3 and zero != preset
        assert all(resolved.config["zero_optimization"][key] == value for key, value in changes.items())


def test_causal_lm_row_packs_samples_apart_and_counts_their_attention_flops():
    """The GPU causal-LM row's data and formula, by hand: rows of exactly seq_length real tokens whose positions
    restart at each sample with its first label -100; FLOPs per token 6·N' + 12·L·h·s_eff, s_eff = Σ len² / Σ len;
    the 1B shape gets 10 rows on an 80 GB GPU without checkpointing (the planner's bytes within 80%; ExtTrainer's
    chunked loss: 8 over the whole logits)."""
    train_spec = importlib.util.spec_from_file_location("bench_train", REPO / "benchmarks" / "train.py")
    train = importlib.util.module_from_spec(train_spec)
    train_spec.loader.exec_module(train)
    data = train.RandomPackedLM(4, 256, 100, (16, 128))
    for index in range(len(data)):
        row, lengths = data[index], data.lengths(index)
        assert sum(lengths) == 256 == row["input_ids"].numel()
        starts = (row["position_ids"] == 0).nonzero().flatten().tolist()
        assert len(starts) == len(lengths) and (row["labels"][starts] == -100).all()
        assert (row["labels"] != -100).sum().item() == 256 - len(lengths)
    assert gpu.causal_lm_flops_per_token(1000, 2, 64, 82.5) == 6 * 1000 + 12 * 2 * 64 * 82.5
    args = SimpleNamespace(clm_model_config="llama-1b", clm_seq_length=2048)
    batch, checkpointing, _ = gpu.causal_lm_batch(args, 80e9)
    assert (batch, checkpointing) == (10, False)


def test_step_overhead_counts_cuda_syncs_inside_the_counted_steps_only():
    """Fails when benchmarks/step_overhead.py's CUDA column (cudaStreamSynchronize per step that neither logs nor
    saves: what a GPU run reports) counts a sync outside the counted steps' profiler ranges (a logging step's reads,
    a window opened and then dropped), or is not written per step; synthetic profiler events, no GPU needed."""
    spec = importlib.util.spec_from_file_location("step_overhead", REPO / "benchmarks" / "step_overhead.py")
    step_overhead = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(step_overhead)

    def event(name, start, end=None):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end or start + 1))

    marker = step_overhead.MARKER
    events = [event(f"{marker} 4", 100, 200), event(f"{marker} 5", 200, 300), event(f"{marker} 7", 400, 500),
              event("cudaStreamSynchronize", 150), event("cudaStreamSynchronize", 250),  # 250: step 5, dropped
              event("cudaStreamSynchronize", 350), event("cudaEventSynchronize", 450), event("cudaLaunchKernel", 120)]
    waits = step_overhead.cuda_syncs_in_windows(SimpleNamespace(events=lambda: events), steps=[4, 7])
    assert waits == {"cudaStreamSynchronize": 1, "cudaEventSynchronize": 1}
    counted = {"steps": [4, 7], "per_step": [["sync", "_local_scalar_dense", "transformers/trainer.py", 2.0]],
               "cuda_per_step": {name: n / 2 for name, n in waits.items()}, "cuda": True}
    report = {"device": "cuda", "seconds_per_step": {"stock": [0.010], "ext": [0.0101]},
              "counts": {"stock": counted, "ext": {**counted, "cuda_per_step": {}}}}
    text = step_overhead.write_results({1: report}, SimpleNamespace(steps=200, repeats=1, ranks=[1]))
    assert "| 1 | stock | 2.0 | 0.0 | 2.0 | 0.0 | 0.0 | 0.0 | 0.5 |" in text
    assert "| 1 | ext | 2.0 | 0.0 | 2.0 | 0.0 | 0.0 | 0.0 | 0.0 |" in text
    assert "**1.010**" in text


def test_step_overhead_gives_each_count_to_its_package_wherever_it_is_installed(monkeypatch, tmp_path):
    """Fails when a count made in transformers installed outside a site-packages folder (`pip install --target`, a
    GPU machine's PYTHONPATH) is not given to the Trainer's column (the H200 run of 2026-11-28 gave stock's two reads
    in trainer.py to "other")."""
    spec = importlib.util.spec_from_file_location("step_overhead", REPO / "benchmarks" / "step_overhead.py")
    step_overhead = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(step_overhead)
    site = tmp_path / "gpu-site"
    monkeypatch.syspath_prepend(str(site))
    assert step_overhead.origin_of(str(site / "transformers" / "trainer.py")) == "transformers/trainer.py"
    assert step_overhead.owner(step_overhead.origin_of(str(site / "transformers" / "trainer.py"))) == "Trainer"
    assert step_overhead.origin_of(str(REPO / "trainer_ext" / "trainer.py")) == "trainer_ext/trainer.py"
