"""Benchmark causal-LM fine-tuning (examples/run_clm.py: SFT of the shipped chat set, the recipe's tiny Llama) on one
process and on 2 CPU ranks under torchrun DDP, DeepSpeed ZeRO-2 and ZeRO-3, FSDP2 and `--sharded_ddp simple`, each
with padded batches and with --packing, interleaved in one run so that ratios hold on a noisy machine; writes
benchmarks/results/causal_lm.md and .json: real tokens/s side by side and each run's ratio to the 1-process run.

    python benchmarks/causal_lm.py            # 1536 samples, 2 repeats: ~6 min on 2 cores (estimated)
    python benchmarks/causal_lm.py --quick    # 1024 samples, 1 repeat: 2.6 min measured
    python benchmarks/causal_lm.py --only "1 process" DDP --repeats 1
    python benchmarks/causal_lm.py --loss     # the chunked loss against the whole logits: peak memory and step time

--loss trains a Llama of Llama 3's vocabulary (128,256 tokens; 2 layers of hidden 128) on sequences of 4,096 tokens,
one per step, on one process, with ExtTrainer's chunked loss and with --chunked_loss false, each in a fresh process,
alternating: the peak resident memory above the process's own before training (ru_maxrss, what the step adds) and the
median step time; results in benchmarks/results/causal_lm_loss.md and .json, beside the planner's loss term.

Real tokens are the samples' own tokens (chat template applied, no padding), counted from the data, not taken from
the Trainer: the benchmark tokenizes the training file as the recipe does (trainer_ext.tasks.chat_data.encode), packs
it as the recipe does (trainer_ext.data.packing.pack), and takes each optimizer step's samples from trainer_ext's
sampler, which trains the same global batches at every world size and backend. Each run checks that reconstruction
step by step against the Trainer's own count of non-padding tokens (--include_num_input_tokens_seen true, which
ExtTrainingArguments reads as non_padding); the same reconstruction gives the share of the computed tokens that was
padding. Time: the Trainer's elapsed time logged at each step (logging_steps 1; that flag is what logs it); tokens/s =
the median over steps warmup+1..last of each step's real tokens / its time (a median, so that a burst of load from
elsewhere on a shared machine moves it little; model set-up, the first steps and saving left out); the JSON also
keeps the steps' real tokens / their summed time."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from gpu import versions  # noqa: E402  (the library versions every report records)

BIN = Path(sys.executable).parent
RUN_CLM = REPO / "examples" / "run_clm.py"


@dataclass(frozen=True)
class Config:
    name: str
    ranks: int
    flags: tuple = ()
    notes: str = ""


# The baseline first. ZeRO-2 is our preset zero2_minimal: the preset named zero2 is the classic published file (fp16,
# optimizer offload, its own learning rate).
CONFIGS = [
    Config("1 process", 1, notes="no launcher; ExtTrainer gives it every core"),
    Config("DDP", 2),
    Config("ZeRO-2 (zero2_minimal)", 2, ("--deepspeed", "zero2_minimal")),
    Config("ZeRO-3 (zero3)", 2, ("--deepspeed", "zero3")),
    Config("FSDP2 (full_shard auto_wrap)", 2, ("--fsdp", "full_shard auto_wrap")),
    Config("simple (--sharded_ddp)", 2, ("--sharded_ddp", "simple")),
]
BASELINE = CONFIGS[0].name
LAYOUTS = ("padded", "packed")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def command(config: Config, layout: str, args, out: Path) -> list[str]:
    launcher = ([sys.executable] if config.ranks == 1 else
                [str(BIN / "torchrun"), "--nproc_per_node", str(config.ranks), "--master_port", str(free_port())])
    batch = args.packed_batch_size if layout == "packed" else args.padded_batch_size
    flags = ["--do_train", "--output_dir", str(out), "--max_train_samples", str(args.samples),
             "--max_seq_length", str(args.max_seq_length), "--per_device_train_batch_size", str(batch),
             "--num_train_epochs", "1", "--learning_rate", "1e-3", "--warmup_steps", "2", "--logging_steps", "1",
             "--include_num_input_tokens_seen", "true", "--save_strategy", "no", "--report_to", "none",
             "--disable_tqdm", "true", "--seed", "42", *args.model_flags, *config.flags]
    if layout == "packed":
        flags.append("--packing")
    return [*launcher, str(RUN_CLM), *flags]


def run_once(config: Config, layout: str, args, root: Path) -> dict:
    out = Path(tempfile.mkdtemp(prefix="run-", dir=root))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", OMP_WAIT_POLICY=env.get("OMP_WAIT_POLICY", "PASSIVE"),
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    started = time.perf_counter()
    done = subprocess.run(command(config, layout, args, out / "output"), capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=args.run_timeout)
    wall = time.perf_counter() - started
    state = out / "output" / "trainer_state.json"
    if done.returncode != 0 or not state.is_file():
        raise SystemExit(f"{config.name} ({layout}) failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    history = json.loads(state.read_text())["log_history"]
    shutil.rmtree(out, ignore_errors=True)
    steps = [row for row in history if "loss" in row and "train_runtime" in row]
    return {"wall_seconds": wall, "elapsed": [row["train_runtime"] for row in steps],
            "tokens_seen": [row["num_input_tokens_seen"] for row in steps], "losses": [row["loss"] for row in steps]}


# -- the data, counted as the recipe reads it ------------------------------------------------------------------------
def sample_lengths(args) -> list[int]:
    """Token count of each training sample the recipe keeps (its first --max_train_samples rows, chat template
    applied, cut to --max_seq_length), with the recipe's tokenizer."""
    from transformers import AutoTokenizer

    from trainer_ext.tasks.causal_lm import SHIPPED_DATA, default_model
    from trainer_ext.tasks.chat_data import DEFAULT_CHAT_TEMPLATE, encode, read_rows

    model = args.model_name_or_path or default_model()
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = read_rows(args.train_file or SHIPPED_DATA / "train.jsonl", "train")
    template = (tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE) if rows.kind == "messages" else None
    lengths = []
    for example in rows.rows[: args.samples]:
        ids, labels = encode(example, tokenizer, template, rows.kind != "text")
        if not any(label != -100 for label in labels[1: args.max_seq_length]):
            continue  # the recipe leaves out a sample whose every target token was cut
        lengths.append(min(len(ids), args.max_seq_length))
    return lengths


@dataclass(frozen=True)
class Layout:
    """What a dataset item of one layout holds: its real tokens and the length the collator pads it to."""
    real: list[int]  # per item
    padded_to: int | None  # packed rows: every row padded to --max_seq_length; padded batches: to their longest


def layouts(lengths: list[int], max_seq_length: int) -> dict[str, Layout]:
    from trainer_ext.data.packing import pack

    rows = pack(lengths, max_seq_length)
    return {"padded": Layout(lengths, None),
            "packed": Layout([sum(lengths[i] for i in row) for row in rows], max_seq_length)}


def step_tokens(layout: Layout, batch: int, ranks: int, steps: int, seed: int) -> tuple[list[int], list[int]]:
    """Per optimizer step: real tokens, and every token the ranks were given (padding included), from the sampler
    ExtTrainer trains with (each rank's micro-batch of the same global batch)."""
    from trainer_ext.data.samplers import ResumableBatchSampler

    samplers = [ResumableBatchSampler(len(layout.real), batch, rank, ranks, seed) for rank in range(ranks)]
    real, given = [], []
    for step in range(steps):
        epoch, index = divmod(step, samplers[0].steps_per_epoch)
        batches = [[layout.real[i] for i in sampler.micro_batch(epoch, index)] for sampler in samplers]
        real.append(sum(map(sum, batches)))
        given.append(sum(len(b) * (layout.padded_to or max(b)) for b in batches))
    return real, given


def measure(run: dict, layout: Layout, batch: int, ranks: int, warmup: int, seed: int) -> dict:
    steps = len(run["elapsed"])
    real, given = step_tokens(layout, batch, ranks, steps, seed)
    seen = [b - a for a, b in zip([0] + run["tokens_seen"], run["tokens_seen"])]
    mismatch = next((step + 1 for step, (a, b) in enumerate(zip(real, seen)) if a != b), None)
    if warmup >= steps:
        raise SystemExit(f"--warmup {warmup} leaves no timed step of {steps}: raise --samples or lower --warmup")
    durations = [b - a for a, b in zip([0.0] + run["elapsed"], run["elapsed"])][warmup:]
    rates = [tokens / seconds for tokens, seconds in zip(real[warmup:], durations)]
    return {"steps": steps, "tokens_per_second": statistics.median(rates),
            "mean_tokens_per_second": sum(real[warmup:]) / sum(durations), "step_seconds": durations,
            "real_tokens": sum(real),
            "given_tokens": sum(given), "check": "exact" if mismatch is None else f"differs at step {mismatch}",
            "final_loss": run["losses"][-1], "wall_seconds": run["wall_seconds"]}


# -- the report ------------------------------------------------------------------------------------------------------
def summarise(results: dict) -> list[dict]:
    rows = []
    for (name, layout), runs in results.items():
        speeds = [run["tokens_per_second"] for run in runs]
        rows.append({"name": name, "layout": layout, "tokens_per_second": statistics.median(speeds),
                     "all_tokens_per_second": speeds,
                     "all_mean_tokens_per_second": [run["mean_tokens_per_second"] for run in runs],
                     "step_seconds": [run["step_seconds"] for run in runs], **{k: runs[0][k] for k in (
                         "steps", "real_tokens", "given_tokens", "final_loss")},
                     "check": "; ".join(sorted({run["check"] for run in runs}))})
    return rows


def write_markdown(path: Path, rows: list[dict], meta: dict) -> None:
    by = {(row["name"], row["layout"]): row for row in rows}
    base = {layout: by.get((BASELINE, layout)) for layout in LAYOUTS}
    names = [c.name for c in CONFIGS if any((c.name, layout) in by for layout in LAYOUTS)]
    lines = [f"# Causal LM: real tokens/s on {meta['device']}", "",
             f"Made by `{meta['command']}` ({meta['started']}, {meta['minutes']:.1f} min; torch {meta['torch']}, "
             f"transformers {meta['transformers']}, deepspeed {meta['deepspeed']}, fairscale {meta['fairscale']}). "
             f"examples/run_clm.py, {meta['model']}, fp32; the first {meta['samples']} samples of "
             f"{meta['train_file']} ({meta['real_tokens']:,} real tokens), one epoch, --max_seq_length "
             f"{meta['max_seq_length']}; padded: {meta['padded_batch_size']} samples per rank padded to their "
             f"longest; packed: --packing, {meta['packed_batch_size']} rows of {meta['max_seq_length']} per rank "
             f"({meta['packed_rows']} rows). The {len(names)} configurations × 2 layouts run one after another in "
             f"each of {meta['repeats']} repeat(s), order reversed on odd repeats; the median over repeats.", "",
             "**tokens/s counts real tokens**: the samples' own tokens, counted from the data (the recipe's "
             "tokenization and packing, each step's samples from trainer_ext's sampler), padding excluded, over "
             f"steps {meta['warmup'] + 1}-last, each step's real tokens by its time (the Trainer's elapsed time at "
             "each step), the median over steps, then over repeats. `check`: that "
             "count against the Trainer's own non-padding count, step by step; `padding`: the share of the tokens "
             "computed (the collator's padded batches or rows) that were padding; `final loss`: the last step's, "
             "equal across the 2-rank backends when they train the same numbers.", "",
             "| configuration | ranks | padded tokens/s | × 1 process | packed tokens/s | × 1 process | "
             "packed / padded | padding (padded / packed) | steps (padded / packed) | final loss (padded / packed) | "
             "check |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in names:
        config = next(c for c in CONFIGS if c.name == name)
        cells = []
        for layout in LAYOUTS:
            row = by.get((name, layout))
            ratio = (f"{row['tokens_per_second'] / base[layout]['tokens_per_second']:.2f}"
                     if row and base[layout] else "")
            cells += [f"{row['tokens_per_second']:.0f}" if row else "", ratio]
        padded, packed = by.get((name, "padded")), by.get((name, "packed"))
        both = padded and packed
        gain = f"{packed['tokens_per_second'] / padded['tokens_per_second']:.2f}" if both else ""
        padding = " / ".join(f"{1 - r['real_tokens'] / r['given_tokens']:.0%}" if r else "–"
                             for r in (padded, packed))
        steps = " / ".join(str(r["steps"]) if r else "–" for r in (padded, packed))
        losses = " / ".join(f"{r['final_loss']:.4f}" if r else "–" for r in (padded, packed))
        checks = "; ".join(sorted({r["check"] for r in (padded, packed) if r}))
        lines.append(f"| {name} | {config.ranks} | {' | '.join(cells)} | {gain} | {padding} | {steps} | {losses} | "
                     f"{checks} |")
    lines += ["", "Each repeat (tokens/s): " + "; ".join(
        f"{row['name']} {row['layout']} {', '.join(f'{s:.0f}' for s in row['all_tokens_per_second'])}"
        for row in rows), ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


# -- the chunked loss against the whole logits -------------------------------------------------------------------------
LOSS_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)


def loss_child(args) -> None:
    """One variant in this process: ExtTrainer trains the large-vocabulary Llama for --loss_steps steps of one
    sequence; writes {peak_above_start_bytes, step_seconds, losses} to --loss_out."""
    import resource

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

    from trainer_ext import ExtTrainer, ExtTrainingArguments

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, max_position_embeddings=args.seq, tie_word_embeddings=False,
                         **LOSS_SHAPE)
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(args.loss_steps):
        ids = torch.randint(0, args.vocab, (args.seq,), generator=generator)
        labels = ids.clone()
        labels[: args.seq // 10] = -100  # a prompt without labels: completion-only
        rows.append({"input_ids": ids, "labels": labels})
    times, started = [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            started.append(time.perf_counter())

        def on_step_end(self, *_, **__):
            times.append(time.perf_counter() - started[-1])

    out = Path(tempfile.mkdtemp(prefix="loss-"))
    training = ExtTrainingArguments(output_dir=str(out), use_cpu=True, per_device_train_batch_size=1,
                                    max_steps=args.loss_steps, learning_rate=1e-4, logging_steps=1,
                                    save_strategy="no", report_to="none", disable_tqdm=True,
                                    chunked_loss=args.loss_child == "chunked")
    trainer = ExtTrainer(model=model, args=training, train_dataset=rows, callbacks=[Clock()])
    start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    trainer.train()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    shutil.rmtree(out, ignore_errors=True)
    Path(args.loss_out).write_text(json.dumps({"peak_above_start_bytes": peak - start, "step_seconds": times,
                                               "losses": losses}))


def loss_benchmark(args) -> int:
    """--chunked_loss on and off, alternating, each in a fresh process; the markdown and JSON report."""
    from trainer_ext.planner import DecoderShape, decoder_activation_bytes

    results = {"chunked": [], "full": []}
    root = Path(tempfile.mkdtemp(prefix="trainer-ext-loss-bench-"))
    clock = time.perf_counter()
    for repeat in range(args.repeats or 2):
        for variant in (("full", "chunked") if repeat % 2 == 0 else ("chunked", "full")):
            out = root / f"{variant}-{repeat}.json"
            done = subprocess.run([sys.executable, __file__, "--loss_child", variant, "--vocab", str(args.vocab),
                                   "--seq", str(args.seq), "--loss_steps", str(args.loss_steps), "--loss_out",
                                   str(out)], capture_output=True, text=True, cwd=REPO, timeout=args.run_timeout,
                                  env={**os.environ, "PYTHONPATH": str(REPO)})
            if done.returncode != 0:
                raise SystemExit(f"{variant} failed:\n{done.stderr[-5000:]}")
            results[variant].append(json.loads(out.read_text()))
            row = results[variant][-1]
            print(f"repeat {repeat + 1} {variant}: peak +{row['peak_above_start_bytes'] / 2 ** 30:.2f} GiB, "
                  f"median step {statistics.median(row['step_seconds'][1:]):.2f} s", flush=True)
    shape = DecoderShape("llama", LOSS_SHAPE["hidden_size"], 2, 4, 2, 32, LOSS_SHAPE["intermediate_size"], args.vocab,
                         False)
    planned = {variant: decoder_activation_bytes(shape, 1, args.seq, 4, chunked_loss=variant == "chunked").loss
               for variant in results}
    rows = {variant: {"peak_above_start_gib": statistics.median(r["peak_above_start_bytes"] for r in runs) / 2 ** 30,
                      "median_step_seconds": statistics.median(t for r in runs for t in r["step_seconds"][1:]),
                      "planned_loss_gib": planned[variant] / 2 ** 30, "losses": runs[0]["losses"]}
            for variant, runs in results.items()}
    meta = {"device": f"{os.cpu_count()} shared CPU cores, one process", "started": time.strftime("%Y-%m-%d"),
            "minutes": (time.perf_counter() - clock) / 60, **versions(), "vocab": args.vocab, "seq": args.seq,
            "steps": args.loss_steps, "repeats": len(results["full"]),
            "model": f"LlamaForCausalLM {LOSS_SHAPE}, fp32, one sequence a step, 10% of it prompt (no labels)",
            "command": shlex.join(["python", "benchmarks/causal_lm.py", *(args.argv or [])])}
    path = REPO / "benchmarks" / "results" / "causal_lm_loss.md"
    path.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    full, chunked = rows["full"], rows["chunked"]
    path.write_text("\n".join([
        "# The chunked loss against the whole logits (benchmarks/causal_lm.py --loss)", "",
        f"{meta['model']}; vocabulary {args.vocab:,}, {args.seq:,} tokens a step; {meta['device']}; "
        f"{meta['repeats']} runs each, alternating, {args.loss_steps} steps a run (the first left out of the time); "
        f"torch {meta.get('torch')}, transformers {meta.get('transformers')}. `{meta['command']}`", "",
        "| loss | peak memory a step adds | median step | the planner's loss term |", "|---|---|---|---|",
        *(f"| {name} | {row['peak_above_start_gib']:.2f} GiB | {row['median_step_seconds']:.2f} s | "
          f"{row['planned_loss_gib']:.2f} GiB |" for name, row in (("whole logits (--chunked_loss false)", full),
                                                                  ("chunked (default)", chunked))), "",
        f"The chunked loss: {chunked['peak_above_start_gib'] / full['peak_above_start_gib']:.2f}x the peak, "
        f"{chunked['median_step_seconds'] / full['median_step_seconds']:.2f}x the step time (each chunk's logits are "
        "computed twice: in the forward and again in backward). Losses: "
        + ", ".join(f"{a:.6f}/{b:.6f}" for a, b in zip(full["losses"], chunked["losses"])) + " (whole/chunked).",
        ""]))
    shutil.rmtree(root, ignore_errors=True)
    print(f"wrote {path} and {path.with_suffix('.json')}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loss", action="store_true", help="the chunked loss against the whole logits (see above)")
    parser.add_argument("--vocab", type=int, default=128256, help="--loss: vocabulary size")
    parser.add_argument("--seq", type=int, default=4096, help="--loss: tokens a step")
    parser.add_argument("--loss_steps", type=int, default=4, help="--loss: steps a run")
    parser.add_argument("--loss_child", choices=("chunked", "full"), help=argparse.SUPPRESS)
    parser.add_argument("--loss_out", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="1024 samples and 1 repeat (unless given)")
    parser.add_argument("--samples", type=int, help="--max_train_samples (default 1536; --quick 1024)")
    parser.add_argument("--repeats", type=int, help="default 2; --quick 1")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of tokens/s")
    parser.add_argument("--max_seq_length", type=int, default=512)
    parser.add_argument("--padded_batch_size", type=int, default=16, help="samples per rank, padded")
    parser.add_argument("--packed_batch_size", type=int, default=4, help="packed rows per rank")
    parser.add_argument("--model_name_or_path", help="default: the recipe's tiny Llama")
    parser.add_argument("--train_file", help="default: the shipped data/causal_lm/train.jsonl")
    parser.add_argument("--only", nargs="*", help="configuration names to run, whole or in part (the 1-process run "
                                                  "is always kept: the ratios' baseline)")
    parser.add_argument("--layouts", nargs="*", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--run_timeout", type=float, default=600, help="seconds before one run is given up")
    parser.add_argument("--results", default=str(REPO / "benchmarks" / "results" / "causal_lm.md"))
    parser.add_argument("--report_only", action="store_true", help="rewrite the .md from the saved .json")
    args = parser.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    if args.loss_child:
        loss_child(args)
        return 0
    if args.loss:
        return loss_benchmark(args)
    if args.report_only:
        saved = json.loads(Path(args.results).with_suffix(".json").read_text())
        write_markdown(Path(args.results), saved["rows"], saved["meta"])
        return 0
    args.samples = args.samples or (1024 if args.quick else 1536)
    args.repeats = args.repeats or (1 if args.quick else 2)
    args.model_flags = [*(["--model_name_or_path", args.model_name_or_path] if args.model_name_or_path else []),
                        *(["--train_file", args.train_file] if args.train_file else [])]
    if not RUN_CLM.is_file():
        print(f"benchmarks/causal_lm.py: error: {RUN_CLM.relative_to(REPO)} is missing", file=sys.stderr)
        return 2
    configs = [c for c in CONFIGS if c.name == BASELINE or not args.only or any(s in c.name for s in args.only)]
    lengths = sample_lengths(args)
    shapes = layouts(lengths, args.max_seq_length)
    batches = {"padded": args.padded_batch_size, "packed": args.packed_batch_size}
    import torch

    threads = torch.get_num_threads()
    root = Path(tempfile.mkdtemp(prefix="trainer-ext-clm-bench-"))
    results: dict = {}
    started, clock = time.strftime("%Y-%m-%d"), time.perf_counter()
    print(f"{len(lengths)} samples, {sum(lengths):,} real tokens; packed into {len(shapes['packed'].real)} rows of "
          f"{args.max_seq_length}", flush=True)
    for repeat in range(args.repeats):
        order = configs if repeat % 2 == 0 else configs[::-1]
        for config in order:
            for layout in (args.layouts if repeat % 2 == 0 else args.layouts[::-1]):
                run = run_once(config, layout, args, root)
                row = measure(run, shapes[layout], batches[layout], config.ranks, args.warmup, 42)
                results.setdefault((config.name, layout), []).append(row)
                print(f"repeat {repeat + 1}/{args.repeats} {config.name} {layout}: {row['tokens_per_second']:.0f} "
                      f"real tokens/s ({row['steps']} steps, check {row['check']}, {row['wall_seconds']:.0f} s)",
                      flush=True)
        meta = {"device": f"{os.cpu_count()} shared CPU cores (gloo; the 1-process run uses {threads} threads)",
                "command": shlex.join(["python", "benchmarks/causal_lm.py",
                                       *(argv if argv is not None else sys.argv[1:])]),
                "started": started, "minutes": (time.perf_counter() - clock) / 60, **versions(),
                "model": (args.model_name_or_path or "the recipe's tiny Llama (2 layers, hidden 64, byte tokenizer)"),
                "samples": len(lengths), "train_file": args.train_file or "data/causal_lm/train.jsonl",
                "real_tokens": sum(lengths), "max_seq_length": args.max_seq_length,
                "padded_batch_size": args.padded_batch_size, "packed_batch_size": args.packed_batch_size,
                "packed_rows": len(shapes["packed"].real), "repeats": repeat + 1, "warmup": args.warmup}
        rows = summarise(results)  # written after every repeat: a run cut short still leaves complete tables
        path = Path(args.results)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        write_markdown(path, rows, meta)
    shutil.rmtree(root, ignore_errors=True)
    print(f"wrote {args.results} and {Path(args.results).with_suffix('.json')} in {meta['minutes']:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
