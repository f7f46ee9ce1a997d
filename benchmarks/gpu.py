"""The GPU benchmark of `make gpu-check`: every backend on a BERT-large extractive-QA model built from a config (334M
parameters, seeded random token ids, 384 tokens, 32 per GPU), fp16 and bf16, on one GPU and, where there are several,
on all of them; writes benchmarks/results/gpu.{md,json,png} with samples/s, tokens/s, model FLOPs utilisation, peak
CUDA memory and the ratio of each configuration to plain ExtTrainer in the same precision on the same GPUs.

The causal-LM row is its own workload: a ~1B Llama built from a config (llama-1b: 1,104,218,112 parameters) in bf16 on
seeded random samples of 64-1024 tokens packed into rows of 2048 (positions restart per sample, no attention mask),
plain ExtTrainer with fused AdamW, flash_attention_2 where flash-attn is installed, else sdpa; the batch per GPU is
the largest the memory planner fits in 80% of the GPU (gradient checkpointing only if fewer than 4 rows fit without);
reported as tokens/s and MFU in a section of its own (see causal_lm_flops_per_token).

    python benchmarks/gpu.py                       # all rows that fit --budget_minutes (default 9)
    python benchmarks/gpu.py --only simple ZeRO-2  # rows whose name holds one of these (a whole name: that row)
    python benchmarks/gpu.py --only "causal LM"    # the causal-LM row alone (about a minute on one H100)
    python benchmarks/gpu.py --profile "simple"    # one row with torch.profiler tables of steps 8-10

No model package and no network: everything is built from a config. Needs deepspeed and fairscale for their rows (a
row whose package is missing is reported, not run). Rows run in priority order and a row that would not finish
inside the budget is listed as not run, so the command ends in time on any GPU."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from backends import PEAK_FLOPS, free_port, model_flops_per_token, samples_per_second  # noqa: E402
from train import CAUSAL_LM_SHAPES, SHAPES  # noqa: E402

GIB = 2 ** 30
BASELINE = "plain, ExtTrainer"
CAUSAL_LM = "causal LM: Llama from a config, packed rows, ExtTrainer"


@dataclass(frozen=True)
class Config:
    name: str
    trainer: str  # stock | ext
    launcher: str  # torchrun | deepspeed
    flags: tuple = ()
    precisions: tuple = ("bf16", "fp16")
    needs: str = ""  # the package the row needs
    notes: str = ""
    task: str = "qa"  # qa: the BERT QA shape of --model_config; causal_lm: the --clm_* workload, reported apart


# In priority order: the rows that decide the issue's targets first; the budget cuts from the end.
CONFIGS = [
    Config(BASELINE, "ext", "torchrun"),
    Config("ZeRO-2, ExtTrainer (zero2_minimal: our defaults)", "ext", "deepspeed", ("--deepspeed", "zero2_minimal"),
           needs="deepspeed"),
    # The causal-LM target: MFU >= 0.40 on one H100/H200 for SFT of a ~1B Llama, packed, on the best backend (on one GPU
    # plain data parallelism: every other backend adds bookkeeping there, see docs/gpus.md).
    Config(CAUSAL_LM, "ext", "torchrun", ("--optim", "adamw_torch_fused"), precisions=("bf16",), task="causal_lm"),
    Config("plain, stock Trainer", "stock", "torchrun"),
    Config("simple, ExtTrainer", "ext", "torchrun", ("--sharded_ddp", "simple"), needs="fairscale"),
    Config("zero_dp_2, ExtTrainer", "ext", "torchrun", ("--sharded_ddp", "zero_dp_2"), needs="fairscale"),
    Config("zero_dp_3, ExtTrainer", "ext", "torchrun", ("--sharded_ddp", "zero_dp_3"), needs="fairscale"),
    Config("ZeRO-2, stock Trainer (zero2_auto.json: the anchor)", "stock", "deepspeed",
           ("--deepspeed", "ds_configs/zero2_auto.json"), needs="deepspeed"),
    Config("recipe: plain, ExtTrainer --torch_compile", "ext", "torchrun", ("--torch_compile", "true"),
           precisions=("bf16",), notes="the docs/gpus.md recipe for the highest MFU"),
    Config("ZeRO-2 + optimizer offload, ExtTrainer (zero2_offload)", "ext", "deepspeed",
           ("--deepspeed", "zero2_offload"), needs="deepspeed"),
    Config("zero_dp_2 offload, ExtTrainer", "ext", "torchrun", ("--sharded_ddp", "zero_dp_2 offload"),
           needs="fairscale"),
    # Issue 14's target: ZeRO-3 >= 0.7x plain where the model would fit anyway (H200: 0.19x at DeepSpeed's defaults;
    # the 0.62-0.66x once measured with module granularity h² was a whole-model leaf that learnt nothing).
    Config("ZeRO-3, ExtTrainer (zero3)", "ext", "deepspeed", ("--deepspeed", "zero3"), needs="deepspeed"),
    # Issue 22: PyTorch FSDP2 beside ZeRO-3 (the same memory: parameters, gradients and Adam sharded), bf16.
    Config("FSDP2 full_shard, ExtTrainer (--fsdp full_shard auto_wrap)", "ext", "torchrun",
           ("--fsdp", "full_shard auto_wrap", "--fsdp_config", '{"transformer_layer_cls_to_wrap": ["BertLayer"]}'),
           precisions=("bf16",)),
    Config("ZeRO-3 + offload, ExtTrainer (zero3_offload)", "ext", "deepspeed", ("--deepspeed", "zero3_offload"),
           needs="deepspeed"),
]


def zero3_variant(**changes) -> tuple:
    """The zero3 preset with some zero_optimization fields changed, as an inline --deepspeed config."""
    config = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    config["zero_optimization"].update(changes)
    return ("--deepspeed", json.dumps(config))


# The stage-3 settings the defaults are chosen from (issue 25, one H200, bf16): one change each from the resolved
# preset, then the four others together; bf16 only, lowest priority: `--only "ZeRO-3 tuning"` runs them alone. The
# preset resolves stage3_module_granularity_threshold to DeepSpeed's 0 (h² made BERT-large one leaf that learnt
# nothing); the first row measures the largest value backends/deepspeed/leaves.py allows for BERT-large: 897,059, its
# 24 attention blocks as leaves. BERT-large: attention matrices h^2 = 1.05M parameters, feed-forward 4.2M; the preset
# sizes the rest from h = 1024.
ZERO3_TUNING = {
    "module granularity 897059 (BERT-large's attention blocks fetched whole)":
        {"stage3_module_granularity_threshold": 897059},
    "persistence 2e6 (attention matrices stay whole)": {"stage3_param_persistence_threshold": 2e6},
    "prefetch 5e8, live 3e9": {"stage3_prefetch_bucket_size": 5e8, "stage3_max_live_parameters": 3e9},
    "overlap_comm off": {"overlap_comm": False},
    "contiguous_gradients off": {"contiguous_gradients": False},
}
ZERO3_TUNING["the four others together"] = {k: v for name, changes in ZERO3_TUNING.items()
                                            if not name.startswith("module") for k, v in changes.items()}
CONFIGS += [Config(f"ZeRO-3 tuning: {name}", "ext", "deepspeed", zero3_variant(**changes), precisions=("bf16",),
                   needs="deepspeed") for name, changes in ZERO3_TUNING.items()]


def causal_lm_flops_per_token(matmul_parameters: int, layers: int, hidden: int, effective_length: float) -> float:
    """Training FLOPs per token of a decoder on packed samples: 6·N for the matmuls with weights (N: the parameters
    in matmuls, all but the input embedding, a lookup; the untied lm_head counts, as in Megatron-LM's formula) plus
    12·L·h·len for attention, where a token of a sample of `len` tokens attends over that sample only (PaLM
    appendix B's 12·L·h·s with s the sample's own length, causal masking not halved, as there). Averaged over a
    run's tokens that is 12·L·h·s_eff with s_eff = Σ len² / Σ len over its samples."""
    return 6 * matmul_parameters + 12 * layers * hidden * effective_length


def peak_flops(device: str, precision: str, peak_tflops: float | None = None) -> tuple[float | None, str]:
    """Dense peak FLOP/s of one device for the precision, and which entry gave it (--peak_tflops: the one given)."""
    if peak_tflops:
        return peak_tflops * 1e12, f"--peak_tflops {peak_tflops:g}"
    key = next((k for k in PEAK_FLOPS if k in device), None)
    return (PEAK_FLOPS[key].get(precision), f"{key} dense {precision}") if key else (None, "unknown device")


def causal_lm_shape(name: str):
    """The planner's view of a CAUSAL_LM_SHAPES entry (untied embeddings)."""
    from trainer_ext.planner import DecoderShape, ModelSize

    c = CAUSAL_LM_SHAPES[name]
    heads = c["num_attention_heads"]
    shape = DecoderShape("llama", c["hidden_size"], c["num_hidden_layers"], heads, c["num_key_value_heads"],
                         c["hidden_size"] // heads, c["intermediate_size"], c["vocab_size"], tied_embeddings=False)
    return ModelSize(sum(shape.parameter_tensors()), "llama formula", c["hidden_size"], c["num_hidden_layers"], heads,
                     dropout=False, attention_dropout=False, decoder=shape)


CAUSAL_LM_BATCHES = (16, 12, 10, 8, 6, 4, 3, 2, 1)


def causal_lm_batch(args, device_memory: float) -> tuple[int, bool, str]:
    """The causal-LM row's rows per GPU and whether it checkpoints: the largest batch (at most 16) whose bytes by
    trainer_ext.planner (plain data parallelism under autocast) stay within 80% of the GPU's memory (the rest: CUDA's
    context, the allocator's slack, the packed attention mask), without checkpointing if 4 rows fit so, else with."""
    from trainer_ext.planner import plan

    size = causal_lm_shape(args.clm_model_config)

    def planned(batch: int, checkpointing: bool) -> float:
        estimates = plan(size, 1, "bf16", batch_size=batch, seq_length=args.clm_seq_length,
                         gradient_checkpointing=checkpointing).estimates
        return next(e for e in estimates if e.backend == "ddp").device_total

    for checkpointing, smallest in ((False, 4), (True, 1)):
        batch = next((b for b in CAUSAL_LM_BATCHES if b >= smallest and planned(b, checkpointing)
                      <= 0.8 * device_memory), None)
        if batch:
            return batch, checkpointing, (f"planned {planned(batch, checkpointing) / GIB:.1f} GiB of "
                                          f"{device_memory / GIB:.1f}")
    return 1, True, f"planned {planned(1, True) / GIB:.1f} GiB of {device_memory / GIB:.1f}: may not fit"


def command(config: Config, precision: str, ranks: int, args, out: Path, profile: str | None = None) -> list[str]:
    bin_dir = Path(sys.executable).parent
    port = str(free_port())
    launcher = {
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
                     port],
        "deepspeed": [shutil.which("deepspeed", path=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
                      or "deepspeed", "--num_gpus", str(ranks), "--master_port", port],
    }[config.launcher]
    if config.task == "causal_lm":
        workload = ["--model_config", args.clm_model_config, "--max_seq_length", str(args.clm_seq_length),
                    "--sample_lengths", *map(str, args.clm_sample_lengths),
                    "--per_device_train_batch_size", str(args.clm_batch_size)]
        workload += ["--gradient_checkpointing", "true"] if args.clm_gradient_checkpointing else []
        workload += ["--attn_implementation", args.clm_attention] if args.clm_attention else []
    else:
        workload = ["--model_config", args.model_config, "--max_seq_length", str(args.seq_length),
                    "--per_device_train_batch_size", str(args.batch_size)]
    flags = ["--trainer", config.trainer, *workload, "--report_dir", str(out / "report"), "--output_dir",
             str(out / "output"), "--max_steps", str(args.steps),
             "--learning_rate", "5e-5", "--warmup_steps", "2", "--logging_steps", "1", "--save_strategy", "no",
             "--report_to", "none", "--disable_tqdm", "true", "--seed", "42", f"--{precision}", *config.flags]
    if config.trainer == "stock":  # a classifier's loss is not multiplied by the world size (see backends.py)
        flags += ["--average_tokens_across_devices", "false"]
    if args.allow_cpu:
        flags.append("--use_cpu")
    if profile:
        flags += ["--profile_steps", profile]
    return [*launcher, str(HERE / "train.py"), *flags]


def run_once(config: Config, precision: str, ranks: int, args, root: Path, profile: str | None = None) -> dict:
    out = Path(tempfile.mkdtemp(prefix="run-", dir=root))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")])))
    started = time.perf_counter()
    done = subprocess.run(command(config, precision, ranks, args, out, profile), capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=max(60.0, args.run_timeout))
    result = {"wall_seconds": time.perf_counter() - started}
    reports = [out / "report" / f"rank{r}.json" for r in range(ranks)]
    if done.returncode != 0 or not all(path.is_file() for path in reports):
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        # the rank's own message, not the launcher's summary of it
        errors = ([line for line in lines if "error:" in line] or
                  [line for line in lines if "Error" in line and "elastic" not in line and "ChildFailed" not in line])
        result["failed"] = (errors or lines or ["no output"])[-1].strip()[:300]
        result["log"] = (done.stdout[-3000:] + "\n" + done.stderr[-6000:])
    else:
        result["reports"] = [json.loads(path.read_text()) for path in reports]
        for path in sorted((out / "report").glob("profile_rank*.txt")):
            result.setdefault("profiles", {})[path.name] = path.read_text()
    shutil.rmtree(out, ignore_errors=True)
    return result


def summarise(config: Config, precision: str, ranks: int, run: dict, args, device: str) -> dict:
    row = {"name": config.name, "precision": precision, "ranks": ranks, "wall_seconds": run["wall_seconds"]}
    if config.task != "qa":
        row["task"] = config.task
    if "failed" in run:
        return {**row, "status": f"failed: {run['failed']}"}
    if config.task == "causal_lm":
        return summarise_causal_lm(row, run, args, device)
    first = run["reports"][0]
    shape = SHAPES[args.model_config]
    speed = samples_per_second(first, args.warmup, args.batch_size * ranks)
    row.update(status="ok", samples_per_second=speed, tokens_per_second=speed * args.seq_length,
               num_parameters=first["num_parameters"], losses=first["losses"],
               peak_cuda_bytes=max(report.get("peak_cuda_bytes") or 0 for report in run["reports"]))
    peak = next((v.get(precision) for k, v in PEAK_FLOPS.items() if k in device), None)
    if peak:
        flops = model_flops_per_token(first["num_parameters"], shape["num_hidden_layers"], shape["hidden_size"],
                                      args.seq_length)
        row["mfu"] = flops * row["tokens_per_second"] / (peak * ranks)
    return row


def summarise_causal_lm(row: dict, run: dict, args, device: str) -> dict:
    """tokens/s (every position of a packed row is a sample's token) and MFU by causal_lm_flops_per_token, with s_eff
    over every row the run trained (the ranks' datasets together hold exactly the rows of its steps)."""
    first = run["reports"][0]
    shape = CAUSAL_LM_SHAPES[args.clm_model_config]
    ranks, batch = row["ranks"], args.clm_batch_size
    rows_per_second = samples_per_second(first, args.warmup, batch * ranks)
    packed = first["packed"]
    effective = packed["squared"] / packed["tokens"]
    matmul_parameters = first["num_parameters"] - shape["vocab_size"] * shape["hidden_size"]
    flops = causal_lm_flops_per_token(matmul_parameters, shape["num_hidden_layers"], shape["hidden_size"], effective)
    row.update(status="ok", model_config=args.clm_model_config, samples_per_second=rows_per_second,
               tokens_per_second=rows_per_second * args.clm_seq_length, seq_length=args.clm_seq_length,
               batch_size=batch, gradient_checkpointing=args.clm_gradient_checkpointing,
               attn_implementation=first.get("attn_implementation"), num_parameters=first["num_parameters"],
               matmul_parameters=matmul_parameters, layers=shape["num_hidden_layers"], hidden=shape["hidden_size"],
               effective_length=effective, packed_samples=packed["samples"], flops_per_token=flops,
               losses=first["losses"], peak_cuda_bytes=max(report.get("peak_cuda_bytes") or 0
                                                           for report in run["reports"]))
    peak, source = peak_flops(device, row["precision"], args.peak_tflops)
    row["peak_flops_source"] = source
    if peak:
        row.update(peak_flops=peak, mfu=flops * row["tokens_per_second"] / (peak * ranks),
                   mfu_all_parameters=(flops + 6 * shape["vocab_size"] * shape["hidden_size"])
                   * row["tokens_per_second"] / (peak * ranks))
    return row


def causal_lm_line(row: dict) -> str:
    """The row's figures and the formula they came from, in words (the console and the report)."""
    text = (f"{row['tokens_per_second']:.0f} tokens/s ({row['batch_size']} rows × {row['seq_length']} tokens per "
            f"GPU, {row['attn_implementation']}{', gradient checkpointing' if row['gradient_checkpointing'] else ''})"
            f"; N = {row['num_parameters']:,} parameters, {row['matmul_parameters']:,} in matmuls; FLOPs per token "
            f"= 6·{row['matmul_parameters']:,} + 12·{row['layers']}·{row['hidden']}·{row['effective_length']:.1f} "
            f"(s_eff = Σ len² / Σ len over {row['packed_samples']:,} packed samples) = "
            f"{row['flops_per_token'] / 1e9:.4g} GFLOP")
    if "mfu" in row:
        return (text + f"; MFU = tokens/s × FLOPs per token / ({row['peak_flops'] / 1e12:g} TFLOP/s "
                f"[{row['peak_flops_source']}] × {row['ranks']}) = {row['mfu']:.3f} (counting every parameter in "
                f"6·N: {row['mfu_all_parameters']:.3f})")
    return text + f"; MFU: no peak known for this device ({row['peak_flops_source']}; give --peak_tflops)"


def plan_runs(configs: list[Config], rank_counts: list[int]) -> list[tuple[Config, str, int]]:
    """bf16 before fp16, one GPU before all of them, each in the configs' priority order."""
    runs = []
    for ranks in rank_counts:
        for precision in ("bf16", "fp16"):
            runs += [(config, precision, ranks) for config in configs if precision in config.precisions]
    return runs


def missing_package(config: Config) -> str | None:
    return config.needs if config.needs and importlib.util.find_spec(config.needs) is None else None


def prebuild_deepspeed_ops() -> str:
    """Build DeepSpeed's FusedAdam and CPUAdam once, before the clock of any row (a first build takes minutes)."""
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed not installed"
    from trainer_ext.backends.deepspeed.cuda_arch import prepare_for_deepspeed

    prepare_for_deepspeed()  # TORCH_CUDA_ARCH_LIST=9.0a would stop the build
    code = ("from deepspeed.accelerator import get_accelerator\n"
            "for name in ('FusedAdamBuilder', 'CPUAdamBuilder'):\n"
            "    builder = get_accelerator().create_op_builder(name)\n"
            "    if builder is not None and builder.is_compatible(verbose=False): builder.load(verbose=False)\n")
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    status = "built" if done.returncode == 0 else f"build failed: {done.stderr.strip().splitlines()[-1:]}"
    return f"DeepSpeed ops {status} in {time.perf_counter() - started:.0f} s"


def write_results(path: Path, rows: list[dict], meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    path.write_text(markdown(rows, meta))
    write_figure(path.with_suffix(".png"), rows, meta)


def baseline_of(rows: list[dict], row: dict) -> dict | None:
    if row.get("task", "qa") != "qa":  # another workload: no ratio to the QA rows
        return None
    return next((r for r in rows if r["name"] == BASELINE and r["precision"] == row["precision"]
                 and r["ranks"] == row["ranks"] and r["status"] == "ok"), None)


def markdown(rows: list[dict], meta: dict) -> str:
    causal_lm = [row for row in rows if row.get("task") == "causal_lm"]
    rows = [row for row in rows if row.get("task", "qa") == "qa"]
    qa = (f"{meta['num_parameters_text']}, seeded random token ids, {meta['seq_length']} tokens, "
          f"{meta['batch_size']} per GPU, AdamW 5e-5, dropout off. " if rows else "")
    title = f"{meta['model_config']} on {meta['device']}" if rows else f"causal LM on {meta['device']}"
    lines = [f"# GPU benchmark: {title}", "",
             f"Made by `python benchmarks/gpu.py --steps {meta['steps']} --warmup {meta['warmup']}"
             f"{' --only ' + ' '.join(repr(o) for o in meta['only']) if meta.get('only') else ''}` "
             f"({meta['started']}, {meta['minutes']:.1f} min; torch {meta['torch']}, transformers "
             f"{meta['transformers']}, deepspeed {meta['deepspeed']}, fairscale {meta['fairscale']}). "
             f"{qa}samples/s = global batch / median time between "
             f"step ends over steps {meta['warmup'] + 1}-{meta['steps']}. MFU: (6·N + 12·L·h·s) FLOPs per token "
             "against the GPU's dense peak for the precision. × plain: against plain ExtTrainer in the same precision "
             "on the same GPUs.", "", f"{meta['prebuild']}.", ""]
    for ranks in sorted({row["ranks"] for row in rows}):
        lines += [f"## {ranks} GPU{'s' if ranks > 1 else ''}", "",
                  "| configuration | precision | samples/s | tokens/s | × plain | MFU | peak CUDA GiB | final loss | "
                  "max loss difference to plain |", "|---|---|---|---|---|---|---|---|---|"]
        for row in (r for r in rows if r["ranks"] == ranks):
            if row["status"] != "ok":
                lines.append(f"| {row['name']} | {row['precision']} | {row['status']} | | | | | | |")
                continue
            base = baseline_of(rows, row)
            ratio = f"{row['samples_per_second'] / base['samples_per_second']:.2f}" if base else ""
            difference = (f"{max(abs(a - b) for a, b in zip(row['losses'], base['losses'])):.1e}" if base else "")
            mfu = f"{row['mfu']:.1%}" if "mfu" in row else ""
            lines.append(f"| {row['name']} | {row['precision']} | {row['samples_per_second']:.1f} | "
                         f"{row['tokens_per_second']:.0f} | {ratio} | {mfu} | {row['peak_cuda_bytes'] / GIB:.1f} | "
                         f"{row['losses'][-1]:.4f} | {difference} |")
        lines.append("")
    if causal_lm:
        lines += causal_lm_markdown(causal_lm)
    lines += [f"![throughput ratio and peak memory]({Path(meta['results']).with_suffix('.png').name})", ""]
    return "\n".join(lines)


def causal_lm_markdown(rows: list[dict]) -> list[str]:
    done = [row for row in rows if row["status"] == "ok"]
    shape = next((f"{row['model_config']} ({row['num_parameters']:,} parameters)" for row in done), "")
    lines = [f"## Causal LM: {shape} built from a config, packed rows, bf16", "",
             "Seeded random samples packed into rows (positions restart at each sample, no attention mask: each sample "
             "attends to itself only), plain ExtTrainer, fused AdamW; tokens/s = rows/s × row length (every position "
             "is a sample's token). MFU = tokens/s × (6·N + 12·L·h·s_eff) / (peak × GPUs): N the parameters in "
             "matmuls (all but the input embedding, a lookup), s_eff = Σ len² / Σ len over the packed samples (a "
             "token attends over its own sample's len tokens: 12·L·h·len FLOPs). The last MFU column counts every "
             "parameter in 6·N, as the QA rows do.", "",
             "| GPUs | rows × tokens per GPU | attention | checkpointing | tokens/s | MFU | MFU (6·N all "
             "parameters) | peak CUDA GiB | final loss | status |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if row["status"] != "ok":
            lines.append(f"| {row['ranks']} | | | | | | | | | {row['status']} |")
            continue
        mfu = (f"**{row['mfu']:.3f}**", f"{row['mfu_all_parameters']:.3f}") if "mfu" in row else ("", "")
        lines.append(f"| {row['ranks']} | {row['batch_size']} × {row['seq_length']} | "
                     f"{row['attn_implementation']} | {'yes' if row['gradient_checkpointing'] else 'no'} | "
                     f"{row['tokens_per_second']:.0f} | {mfu[0]} | "
                     f"{mfu[1]} | {row['peak_cuda_bytes'] / GIB:.1f} | {row['losses'][-1]:.4f} | "
                     f"{row.get('note', 'ok')} |")
    lines += [""] + [f"- {row['ranks']} GPU{'s' if row['ranks'] > 1 else ''}: {causal_lm_line(row)}" for row in done]
    return lines + [""]


def write_figure(path: Path, rows: list[dict], meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [row for row in rows if row["status"] == "ok" and baseline_of(rows, row)]
    if not done:
        return
    labels = [f"{row['name']} ({row['precision']}, {row['ranks']} GPU)" for row in done]
    figure, (speed, memory) = plt.subplots(1, 2, figsize=(15, 0.38 * len(done) + 2.2), sharey=True)
    positions = range(len(done))
    colors = ["#4c72b0" if row["precision"] == "bf16" else "#dd8452" for row in done]
    speed.barh(positions, [row["samples_per_second"] / baseline_of(rows, row)["samples_per_second"] for row in done],
               color=colors)
    speed.axvline(1.0, color="black", linewidth=0.8)
    speed.axvline(0.9, color="grey", linewidth=0.8, linestyle=":")
    speed.set(xlabel="samples/s × plain ExtTrainer (same precision, same GPUs)", title="Throughput")
    memory.barh(positions, [row["peak_cuda_bytes"] / GIB for row in done], color=colors)
    memory.set(xlabel="peak CUDA memory allocated, GiB (most loaded rank)", title="Memory")
    speed.set_yticks(list(positions), labels, fontsize=8)
    speed.invert_yaxis()
    figure.suptitle(f"{meta['model_config']}, {meta['seq_length']} tokens × {meta['batch_size']} per GPU on "
                    f"{meta['device']} (blue bf16, orange fp16)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def versions() -> dict:
    import importlib.metadata as metadata

    found = {}
    for name in ("torch", "transformers", "deepspeed", "fairscale"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def run_timed(config: Config, precision: str, ranks: int, args, root: Path) -> dict:
    try:
        return run_once(config, precision, ranks, args, root)
    except subprocess.TimeoutExpired:
        return {"failed": f"no result within --run_timeout {args.run_timeout:g} s", "wall_seconds": args.run_timeout}


def out_of_memory(run: dict) -> bool:
    return "failed" in run and "out of memory" in (run.get("log", "") + run["failed"]).lower()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_config", choices=sorted(SHAPES), default="bert-large-qa")
    parser.add_argument("--seq_length", type=int, default=384)
    parser.add_argument("--batch_size", type=int, default=32, help="per GPU")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=6, help="steps left out of samples/s (compilation, first "
                                                              "allocations)")
    parser.add_argument("--budget_minutes", type=float, default=9.0, help="rows that would end later are not run")
    parser.add_argument("--run_timeout", type=float, default=300, help="seconds before one row is given up")
    parser.add_argument("--ranks", type=int, nargs="*", help="GPU counts to run on (default: 1 and all GPUs)")
    parser.add_argument("--only", nargs="*", help="configuration names to run, whole or in part (default: all)")
    parser.add_argument("--precision", choices=("bf16", "fp16"), nargs="*", help="default: both")
    parser.add_argument("--profile", metavar="NAME", help="run the first row whose name holds NAME with "
                                                          "torch.profiler over 3 steps; print its tables")
    parser.add_argument("--results", default=str(HERE / "results" / "gpu.md"))
    parser.add_argument("--clm_model_config", choices=sorted(CAUSAL_LM_SHAPES), default="llama-1b",
                        help="the causal-LM row's Llama shape")
    parser.add_argument("--clm_seq_length", type=int, default=2048, help="the causal-LM row's packed row length")
    parser.add_argument("--clm_sample_lengths", type=int, nargs=2, default=(64, 1024), metavar=("MIN", "MAX"),
                        help="the causal-LM row's sample lengths, drawn from MIN..MAX (seeded)")
    parser.add_argument("--clm_batch_size", type=int, help="rows per GPU (default: the largest the memory planner "
                                                           "fits in 80%% of the GPU; on CPU 2)")
    parser.add_argument("--clm_gradient_checkpointing", action="store_true",
                        help="checkpoint (default: only where the planner fits fewer than 4 rows without)")
    parser.add_argument("--clm_attention", help="attn_implementation (default: flash_attention_2 where flash-attn is "
                                                "installed, else sdpa)")
    parser.add_argument("--peak_tflops", type=float, help="the device's dense peak for the precision, for MFU "
                                                          "(default: from the device's name, see backends.PEAK_FLOPS)")
    parser.add_argument("--allow_cpu", action="store_true", help=argparse.SUPPRESS)  # the CPU test of this script
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print("benchmarks/gpu.py: error: no CUDA GPU on this machine (torch.cuda.is_available() is False); run it "
              "on a GPU machine with a CUDA build of torch", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 1
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    rank_counts = args.ranks or sorted({1, gpus})
    names = {c.name for c in CONFIGS}  # a row's whole name picks that row alone; other words, every row holding them
    configs = [c for c in CONFIGS
               if not args.only or any(s == c.name if s in names else s in c.name for s in args.only)]
    runs = [(c, p, r) for c, p, r in plan_runs(configs, rank_counts) if not args.precision or p in args.precision]
    if any(c.task == "causal_lm" for c, _, _ in runs):
        if args.clm_batch_size is None and torch.cuda.is_available():
            memory = torch.cuda.get_device_properties(0).total_memory
            args.clm_batch_size, checkpointing, why = causal_lm_batch(args, memory)
            args.clm_gradient_checkpointing = args.clm_gradient_checkpointing or checkpointing
            print(f"causal LM: {args.clm_batch_size} rows of {args.clm_seq_length} tokens per GPU, gradient "
                  f"checkpointing {'on' if args.clm_gradient_checkpointing else 'off'} ({why})", flush=True)
        args.clm_batch_size = args.clm_batch_size or 2

    if args.profile:
        config, precision, ranks = next(((c, p, r) for c, p, r in runs if args.profile in c.name), (None, None, None))
        if config is None:
            print(f"benchmarks/gpu.py: error: --profile {args.profile!r} names no row; rows: "
                  f"{', '.join(c.name for c in CONFIGS)}", file=sys.stderr)
            return 2
        root = Path(tempfile.mkdtemp(prefix="trainer-ext-gpu-"))
        run = run_once(config, precision, ranks, args, root, profile=f"{args.steps - 2}-{args.steps}")
        print(run.get("log", "") if "failed" in run else "\n".join(run.get("profiles", {}).values()))
        return 1 if "failed" in run else 0

    clock, started = time.perf_counter(), time.strftime("%Y-%m-%d %H:%M")
    prebuild = prebuild_deepspeed_ops() if any(c.needs == "deepspeed" for c, _, _ in runs) else "no DeepSpeed rows"
    print(prebuild, flush=True)
    root = Path(tempfile.mkdtemp(prefix="trainer-ext-gpu-"))
    meta = {"model_config": args.model_config, "device": f"{gpus} × {device}", "steps": args.steps,
            "warmup": args.warmup, "seq_length": args.seq_length, "batch_size": args.batch_size,
            "started": started, "prebuild": prebuild, "results": args.results, **versions(),
            "num_parameters_text": f"BERT {args.model_config}", "only": args.only}
    rows, walls = [], []
    for config, precision, ranks in runs:
        row = {"name": config.name, "precision": precision, "ranks": ranks}
        elapsed = time.perf_counter() - clock
        estimate = statistics.median(walls) if walls else 60.0
        if missing_package(config):
            row["status"] = f"not run: {missing_package(config)} is not installed"
        elif elapsed + estimate > args.budget_minutes * 60:
            row["status"] = f"not run: --budget_minutes {args.budget_minutes:g} reached"
        else:
            run = run_timed(config, precision, ranks, args, root)
            walls.append(run["wall_seconds"])
            note = None
            if config.task == "causal_lm" and out_of_memory(run) and args.clm_batch_size > 1 and (
                    time.perf_counter() - clock + run["wall_seconds"] < args.budget_minutes * 60):
                note = f"batch halved from {args.clm_batch_size}: out of CUDA memory"
                print(f"{config.name}: {note}", flush=True)
                args.clm_batch_size //= 2
                run = run_timed(config, precision, ranks, args, root)
                walls.append(run["wall_seconds"])
            row = summarise(config, precision, ranks, run, args, device)
            if note:
                row["note"] = note
            if "log" in run:
                print(run["log"], file=sys.stderr)
        rows.append(row)
        shown = f"{row['samples_per_second']:.1f} samples/s" if row.get("status") == "ok" else row["status"]
        if row.get("status") == "ok" and config.task == "causal_lm":
            shown = causal_lm_line(row)
        print(f"{config.name} ({precision}, {ranks} GPU): {shown}", flush=True)
        if "num_parameters" in row and config.task == "qa":
            meta["num_parameters_text"] = f"BERT {args.model_config} ({row['num_parameters'] / 1e6:.1f}M parameters)"
        meta["minutes"] = (time.perf_counter() - clock) / 60
        write_results(Path(args.results), rows, meta)  # after every row: a cut-short run still leaves its tables
    shutil.rmtree(root, ignore_errors=True)
    print(f"wrote {args.results} and {Path(args.results).with_suffix('.png')} in {meta['minutes']:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
