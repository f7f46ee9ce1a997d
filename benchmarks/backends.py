"""Benchmark every backend on one fine-tune, interleaved in one run so that ratios hold on a noisy machine: the stock
transformers Trainer and ExtTrainer with DDP, with DeepSpeed ZeRO-2, and ExtTrainer with `--sharded_ddp simple`,
ZeRO-3 and FSDP2 (`--fsdp full_shard`);
writes benchmarks/results/backends.md (ratios to DDP, per-rank model-state bytes against the planner's formulas,
losses) and benchmarks/results/backends.png (loss curves and memory bars).

    python benchmarks/backends.py [--steps 30 --repeats 3 --ranks 2]

Each run is benchmarks/train.py (MiniLM classifier, shipped set, sequences padded to 64, 16 per rank, fp32, dropout
off); on CUDA every configuration also runs in fp16 and bf16 and the report adds tokens/s, model FLOPs utilisation
and peak CUDA memory."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
BIN = Path(sys.executable).parent
MIB = 2 ** 20

from trainer_ext.planner import ModelSize, plan  # noqa: E402


@dataclass(frozen=True)
class Config:
    name: str
    trainer: str  # stock | ext
    launcher: str  # torchrun | deepspeed | launch
    backend: str  # the planner's name for the formula to compare with
    flags: tuple = ()
    notes: str = ""
    env: tuple = ()  # (name, value) pairs for the launcher's environment
    stock: str = ""  # for an ExtTrainer row: the stock-Trainer row that runs the same thing (overhead column)


def zero2_json(**change) -> str:
    """ds_configs/zero2_minimal.json with some zero_optimization fields changed, as inline JSON."""
    config = json.loads((REPO / "ds_configs" / "zero2_minimal.json").read_text())
    config["zero_optimization"].update(change)
    return json.dumps(config)


CONFIGS = [
    Config("DDP, stock Trainer", "stock", "torchrun", "ddp"),
    Config("DDP, ExtTrainer", "ext", "torchrun", "ddp", stock="DDP, stock Trainer"),
    # The same DeepSpeed file for both trainers. The deepspeed launcher sets no OMP_NUM_THREADS (torchrun sets 1), so
    # stock CPU ranks each run one thread per core; ExtTrainer gives each rank its share. The OMP_NUM_THREADS=1 row
    # runs stock with ExtTrainer's threads, so that the overhead column compares the Trainers alone.
    Config("ZeRO-2, stock Trainer (zero2_auto.json)", "stock", "deepspeed", "zero2",
           ("--deepspeed", "ds_configs/zero2_auto.json")),
    Config("ZeRO-2, stock Trainer (zero2_auto.json, OMP_NUM_THREADS=1)", "stock", "deepspeed", "zero2",
           ("--deepspeed", "ds_configs/zero2_auto.json"), env=(("OMP_NUM_THREADS", "1"),)),
    Config("ZeRO-2, ExtTrainer (zero2_auto.json)", "ext", "deepspeed", "zero2",
           ("--deepspeed", "ds_configs/zero2_auto.json"),
           stock="ZeRO-2, stock Trainer (zero2_auto.json, OMP_NUM_THREADS=1)"),
    Config("ZeRO-2, ExtTrainer (zero2_minimal: our defaults)", "ext", "deepspeed", "zero2",
           ("--deepspeed", "zero2_minimal")),
    # The classic published values; our defaults turn both off on CPU ranks (no side streams to overlap with), the
    # same numbers trained.
    Config("ZeRO-2, ExtTrainer (overlap_comm, reduce_scatter on: classic values)", "ext", "deepspeed", "zero2",
           ("--deepspeed", zero2_json(overlap_comm=True, reduce_scatter=True))),
    Config("simple, ExtTrainer", "ext", "launch", "simple", ("--sharded_ddp", "simple")),
    # Parameters partitioned too: every layer gathered for its forward and backward (the presets' stage-3 fields).
    Config("ZeRO-3, ExtTrainer (zero3)", "ext", "deepspeed", "zero3", ("--deepspeed", "zero3")),
    # torch's FSDP2: each BertLayer (then the rest) a group gathered for its forward and backward, as ZeRO-3 does.
    Config("FSDP2, ExtTrainer (--fsdp full_shard)", "ext", "torchrun", "fsdp",
           ("--fsdp", "full_shard auto_wrap", "--fsdp_config", '{"transformer_layer_cls_to_wrap": ["BertLayer"]}')),
    # Parameters kept gathered from forward to backward: one all-gather fewer per layer, ZeRO-2's communication.
    Config("FSDP2, ExtTrainer (--fsdp shard_grad_op)", "ext", "torchrun", "fsdp_shard_grad_op",
           ("--fsdp", "shard_grad_op auto_wrap", "--fsdp_config", '{"transformer_layer_cls_to_wrap": ["BertLayer"]}')),
]
BASELINE = {"stock": "DDP, stock Trainer", "ext": "DDP, ExtTrainer"}

# Dense peak FLOP/s by device name and precision (vendor data sheets), for model FLOPs utilisation.
PEAK_FLOPS = {  # the first key the device's name holds is taken: the PCIe and NVL cards before the SXM ones
    "GH200": {"fp32": 67e12, "fp16": 989e12, "bf16": 989e12},
    "H100 PCIe": {"fp32": 51e12, "fp16": 756e12, "bf16": 756e12},
    "H100 NVL": {"fp32": 60e12, "fp16": 835e12, "bf16": 835e12},
    "H100": {"fp32": 67e12, "fp16": 989e12, "bf16": 989e12},
    "H200 NVL": {"fp32": 60e12, "fp16": 835e12, "bf16": 835e12},
    "H200": {"fp32": 67e12, "fp16": 989e12, "bf16": 989e12},
    "A100": {"fp32": 19.5e12, "fp16": 312e12, "bf16": 312e12},
    "L4": {"fp32": 30.3e12, "fp16": 121e12, "bf16": 121e12},
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def command(config: Config, ranks: int, precision: str, steps: int, out: Path, cuda: bool) -> list[str]:
    port = str(free_port())
    launcher = {
        "torchrun": [str(BIN / "torchrun"), "--nproc_per_node", str(ranks), "--master_port", port],
        "deepspeed": [str(BIN / "deepspeed"), "--num_gpus", str(ranks), "--master_port", port],
        "launch": [sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node", str(ranks),
                   "--master_port", port],
    }[config.launcher]
    flags = ["--trainer", config.trainer, "--report_dir", str(out / "report"), "--output_dir", str(out / "output"),
             "--max_steps", str(steps), "--per_device_train_batch_size", "16", "--learning_rate", "5e-5",
             "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true",
             "--seed", "42", *config.flags]
    if precision != "fp32":
        flags.append(f"--{precision}")
    if config.trainer == "stock":
        # Stock transformers 5 runs CPU ranks as separate jobs without --use_cpu, and multiplies a classifier's
        # loss by the world size unless told not to; both would make the comparison meaningless.
        flags += ["--average_tokens_across_devices", "false"] + ([] if cuda else ["--use_cpu"])
    return [*launcher, str(REPO / "benchmarks" / "train.py"), *flags]


def run_once(config, ranks, precision, steps, root: Path, cuda: bool) -> dict:
    out = Path(tempfile.mkdtemp(prefix="run-", dir=root))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(config.env)
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(
        [str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    started = time.perf_counter()
    done = subprocess.run(command(config, ranks, precision, steps, out, cuda), capture_output=True, text=True,
                          env=env, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"{config.name} ({precision}) failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    reports = [json.loads((out / "report" / f"rank{r}.json").read_text()) for r in range(ranks)]
    shutil.rmtree(out, ignore_errors=True)
    return {"reports": reports, "wall_seconds": time.perf_counter() - started}


def samples_per_second(report: dict, warmup: int, global_batch: int) -> float:
    """Steady state: the global batch over the median time between step ends after step `warmup` (data loading and
    logging included); a median, so that a burst of load from elsewhere on a shared machine moves it little."""
    ends = report["step_end_times"][warmup - 1:]
    return global_batch / statistics.median(b - a for a, b in zip(ends, ends[1:]))


def model_flops_per_token(num_parameters: int, layers: int, hidden: int, seq_length: int) -> float:
    """Training FLOPs per token: 6Ψ for the matmuls with weights plus 12·L·h·s for attention (PaLM, appendix B)."""
    return 6 * num_parameters + 12 * layers * hidden * seq_length


def predicted_model_states(row: dict, ranks: int) -> float:
    """The planner's per-rank model-state bytes for this row's backend, parameter count and precision."""
    estimates = plan(ModelSize(row["num_parameters"], "run"), ranks, row["precision"]).estimates
    return next(e for e in estimates if e.backend == row["backend"]).model_states


def summarise(results: dict, ranks: int, steps: int, warmup: int, seq_length: int, device: str) -> list[dict]:
    rows = []
    for (name, precision), runs in results.items():
        config = next(c for c in CONFIGS if c.name == name)
        speeds = [samples_per_second(run["reports"][0], warmup, 16 * ranks) for run in runs]
        first = runs[0]["reports"]
        psi = first[0]["num_parameters"]
        per_rank = []
        for report in first:
            states = sum(report.get(k, 0) for k in ("params_bytes", "grads_bytes", "moments_bytes", "master_bytes"))
            per_rank.append({"rank": report["rank"], "params": report["params_bytes"], "grads": report["grads_bytes"],
                             "moments": report["moments_bytes"], "master": report["master_bytes"],
                             "model_states": states,
                             "peak_rss": report["peak_rss_bytes"], "peak_cuda": report.get("peak_cuda_bytes")})
        row = {"name": name, "trainer": config.trainer, "backend": config.backend, "precision": precision,
               "samples_per_second": statistics.median(speeds), "all_samples_per_second": speeds,
               "tokens_per_second": statistics.median(speeds) * seq_length, "per_rank": per_rank,
               "losses": first[0]["losses"], "num_parameters": psi}
        peak = next((v.get(precision) for k, v in PEAK_FLOPS.items() if k in device), None)
        if peak:
            flops = model_flops_per_token(psi, 6, 384, seq_length) * row["tokens_per_second"]
            row["mfu"] = flops / (peak * ranks)
        rows.append(row)
    return rows


def measured(by_name: dict, precision: str):
    """(configuration, its row, the row of DDP on its Trainer) for each configuration this run measured."""
    for config in CONFIGS:
        row = by_name.get((config.name, precision))
        if row is not None:
            yield config, row, by_name[(BASELINE[config.trainer], precision)]


def write_markdown(path: Path, rows: list[dict], meta: dict) -> None:
    by_name = {(r["name"], r["precision"]): r for r in rows}
    lines = [f"# Backends on {meta['ranks']} ranks: throughput, per-rank memory, losses", "",
             f"Made by `python benchmarks/backends.py --steps {meta['steps']} --warmup {meta['warmup']} --repeats "
             f"{meta['repeats']}{' --only ' + ' '.join(repr(o) for o in meta['only']) if meta.get('only') else ''}` on "
             f"{meta['device']} ({meta['started']}, {meta['minutes']:.0f} min). MiniLM-L6 classifier "
             f"({rows[0]['num_parameters']:,} parameters), shipped classification set padded to "
             f"{meta['seq_length']} tokens, 16 per rank, AdamW 5e-5, dropout off. The {meta.get('configs', len(CONFIGS))} "
             "configurations "
             f"run one after another in each repeat (order reversed on odd repeats), so load from other work on this "
             f"shared machine hits them alike; samples/s = global batch / median time between step ends over steps "
             f"{meta['warmup'] + 1}-{meta['steps']} (data loading and logging included), then the median over "
             "repeats.", ""]
    for precision in meta["precisions"]:
        cuda = precision != "fp32" or meta["cuda"]
        lines += [f"## Throughput ({precision})", "",
                  "| configuration | samples/s | each repeat | × DDP (same Trainer) | ExtTrainer / stock |"
                  + (" tokens/s | MFU |" if cuda else ""),
                  "|---|---|---|---|---|" + ("---|---|" if cuda else "")]
        for config, row, baseline in measured(by_name, precision):
            ddp = baseline["samples_per_second"]
            stock = by_name.get((config.stock, precision))
            overhead = (f"{row['samples_per_second'] / stock['samples_per_second']:.3f}"
                        if config.trainer == "ext" and stock else "")
            line = (f"| {config.name} | {row['samples_per_second']:.2f} | "
                    f"{', '.join(f'{s:.1f}' for s in row['all_samples_per_second'])} | "
                    f"{row['samples_per_second'] / ddp:.3f} | {overhead} |")
            if cuda:
                line += f" {row['tokens_per_second']:.0f} | {row.get('mfu', float('nan')):.1%} |"
            lines.append(line)
        lines += ["", f"## Per-rank model states ({precision}, MiB; measured in the run, formula from "
                  "`trainer_ext.planner`)", "",
                  "| configuration | rank | params | grads | Adam moments | fp32 master | model states | formula | "
                  "measured / formula | moments / DDP's | peak RSS |" + (" peak CUDA |" if cuda else ""),
                  "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if cuda else "")]
        for config, row, baseline in measured(by_name, precision):
            ddp_rows = baseline["per_rank"]
            formula = predicted_model_states(row, meta["ranks"])
            for rank, ddp in zip(row["per_rank"], ddp_rows):
                line = (f"| {config.name} | {rank['rank']} | {rank['params'] / MIB:.2f} | {rank['grads'] / MIB:.2f} | "
                        f"{rank['moments'] / MIB:.2f} | {rank['master'] / MIB:.2f} | "
                        f"{rank['model_states'] / MIB:.2f} | {formula / MIB:.2f} | "
                        f"{rank['model_states'] / formula:.4f} | {rank['moments'] / ddp['moments']:.4f} | "
                        f"{rank['peak_rss'] / MIB:.0f} |")
                if cuda:
                    line += f" {(rank['peak_cuda'] or 0) / MIB:.0f} |"
                lines.append(line)
        lines += ["", f"## Losses ({precision})", "", "| configuration | first | final | max difference to DDP "
                  "(same Trainer) |", "|---|---|---|---|"]
        for config, row, baseline in measured(by_name, precision):
            ddp = baseline["losses"]
            difference = max(abs(a - b) for a, b in zip(row["losses"], ddp))
            lines.append(f"| {config.name} | {row['losses'][0]:.6f} | {row['losses'][-1]:.6f} | {difference:.1e} |")
        lines.append("")
    notes = path.with_name(path.stem + "_notes.md")
    if notes.is_file():  # the analysis written by hand after reading the figures
        lines += [notes.read_text().rstrip(), ""]
    lines += [f"![loss curves and per-rank memory]({path.with_suffix('.png').name})", ""]
    path.write_text("\n".join(lines))


def write_figure(path: Path, rows: list[dict], precision: str, ranks: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["precision"] == precision]
    figure, (curves, bars) = plt.subplots(1, 2, figsize=(16, 6.5))
    for number, (row, style) in enumerate(zip(rows, itertools.cycle(["-", "--", ":", "-."])), 1):
        curves.plot(range(1, len(row["losses"]) + 1), row["losses"], style, label=f"{number}: {row['name']}",
                    linewidth=1.4)
    curves.set(xlabel="step", ylabel="training loss (rank 0)", title=f"Loss curves ({precision})")
    curves.legend(fontsize=7)
    labels, bottoms = [], []
    parts = [("params", "#4c72b0"), ("grads", "#dd8452"), ("moments", "#55a868"), ("master", "#c44e52")]
    position = 0
    for number, row in enumerate(rows, 1):
        for rank in row["per_rank"]:
            bottom = 0.0
            for part, color in parts:
                value = rank[part] / MIB
                bars.bar(position, value, bottom=bottom, color=color, label=part if position == 0 else None)
                bottom += value
            bars.plot([position - 0.4, position + 0.4], [predicted_model_states(row, ranks) / MIB] * 2, color="black", linewidth=1,
                      label="planner formula" if position == 0 else None)
            labels.append(f"{number}\nr{rank['rank']}")  # the configuration's number in the loss legend
            bottoms.append(position)
            position += 1
        position += 0.5
    bars.set_ylim(0, bars.get_ylim()[1] * 1.08)  # room above the tallest bar for its planner line
    bars.set_xticks(bottoms, labels, fontsize=8)
    bars.set(ylabel="MiB per rank", xlabel="configuration (numbered as in the loss legend), rank",
             title="Per-rank model states (measured; line: planner)")
    bars.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of samples/s")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--only", nargs="*", help="substrings of configuration names to run (default: all)")
    parser.add_argument("--results", default=str(REPO / "benchmarks" / "results" / "backends.md"))
    parser.add_argument("--report_only", action="store_true", help="rewrite the .md and .png from the saved .json")
    args = parser.parse_args()
    if args.report_only:
        saved = json.loads(Path(args.results).with_suffix(".json").read_text())
        write_results(Path(args.results), saved["rows"], saved["meta"])
        return

    import torch

    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else f"{os.cpu_count()} shared CPU cores (gloo)"
    precisions = ["fp32", "fp16", "bf16"] if cuda else ["fp32"]
    configs = [c for c in CONFIGS if not args.only or any(s in c.name for s in args.only)]
    root = Path(tempfile.mkdtemp(prefix="trainer-ext-bench-"))
    results: dict = {}
    started, clock = time.strftime("%Y-%m-%d"), time.perf_counter()
    for repeat in range(args.repeats):
        order = configs if repeat % 2 == 0 else configs[::-1]
        for precision in precisions:
            for config in order:
                run = run_once(config, args.ranks, precision, args.steps, root, cuda)
                results.setdefault((config.name, precision), []).append(run)
                print(f"repeat {repeat + 1}/{args.repeats} {precision} {config.name}: "
                      f"{samples_per_second(run['reports'][0], args.warmup, 16 * args.ranks):.2f} samples/s "
                      f"({run['wall_seconds']:.0f} s)", flush=True)
        # Written after every repeat: a run cut short on a busy machine still leaves complete tables.
        meta = {"only": args.only, "configs": len(configs), "ranks": args.ranks, "steps": args.steps, "repeats": repeat + 1, "warmup": args.warmup,
                "seq_length": 64, "device": device, "cuda": cuda, "precisions": precisions, "started": started,
                "minutes": (time.perf_counter() - clock) / 60}
        write_results(Path(args.results), summarise(results, args.ranks, args.steps, args.warmup, 64, device), meta)
    shutil.rmtree(root, ignore_errors=True)


def write_results(results_path: Path, rows: list[dict], meta: dict) -> None:
    results_path.parent.mkdir(parents=True, exist_ok=True)
    results_path.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    write_markdown(results_path, rows, meta)
    write_figure(results_path.with_suffix(".png"), rows, meta["precisions"][0], meta["ranks"])
    print(f"wrote {results_path} and {results_path.with_suffix('.png')}", flush=True)


if __name__ == "__main__":
    main()
