"""Per-step host cost of ExtTrainer against the stock transformers Trainer where Python dominates: a tiny Llama on
padded batches of 8 with an attention mask, fp32, on 1 process and on 2 ranks (DDP under torchrun, a GPU each on CUDA).
The two trainers run the same 200 steps in one process, each in a thread of its own taking optimizer steps in turn, so
whatever else the machine does meets both alike; reported: each one's CPU time per step (its thread's) over the steps
after the 10th that neither log nor save, and ExtTrainer / stock (the median over repeats). Then, from a shorter run
of each, the host syncs (`aten::_local_scalar_dense`, the op behind `.item()`, `bool(tensor)` and `if tensor:`; and
the ops whose result's size or value the host needs: a boolean mask's index, nonzero, equal) and the collectives (c10d ops) per step that neither logs nor saves, by the code that made them, and on CUDA the
`cudaStreamSynchronize` (device and event synchronisations too) inside those steps, from torch.profiler. Writes
benchmarks/results/step_overhead.md and .json.

    python benchmarks/step_overhead.py [--steps 200 --repeats 10 --ranks 1 2] [--profile cprofile]

`--profile cprofile` adds, from the last repeat's cProfile of each thread (rank 0, CPU time), the functions whose own
time differs most between the two. A worker is one launched process: `--worker --report_dir DIR` plus any
TrainingArguments flags (`--deepspeed FILE`, `--fsdp ...`) trains `--trainers stock,ext` (stock needs a backend
transformers runs on this machine: FSDP is accelerate's on GPUs only) and writes DIR/rank<R>.json;
tests/integration/test_host_syncs.py launches it with `--timed_repeats 0` (the default) for the counts alone."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
BIN = Path(sys.executable).parent
RESULTS = REPO / "benchmarks" / "results"

VOCAB, PAD, EOS = 96, 0, 1
LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=PAD,
             eos_token_id=EOS, bos_token_id=EOS)
# Where a counted op came from: the innermost frame outside these (torch's own machinery, the counter itself).
PASS_THROUGH = (os.sep + "torch" + os.sep, "contextlib.py", "functools.py", "typing_extensions.py", "step_overhead.py")
# ...unless the op runs inside a distributed wrapper's forward (DDP broadcasting its buffers at every forward): the
# engine's, whichever code called the model (the stock loop, or ExtTrainer's chunked loss).
WRAPPERS = (os.sep.join(("torch", "nn", "parallel", "distributed.py")), os.sep.join(("torch", "distributed", "fsdp", "")))
# What the counts are split by: ExtTrainer's own code (trainer_ext, its backends apart), transformers' Trainer.
MARKER = "trainer_ext.counted_step"  # torch.profiler's range around each counted step (on CUDA)
OWNERS = {"trainer_ext": f"trainer_ext{os.sep}", "Trainer": f"transformers{os.sep}trainer"}


# -- the run --------------------------------------------------------------------------------------------------------
def samples(count: int, seed: int = 1) -> list[dict]:
    """Seeded token ids of 10-49 tokens ending in EOS, the first 2-8 without a label (a prompt)."""
    import torch

    generator, rows = torch.Generator().manual_seed(seed), []
    for _ in range(count):
        length = int(torch.randint(10, 50, (1,), generator=generator))
        ids = torch.randint(2, VOCAB, (length,), generator=generator)
        ids[-1] = EOS
        prompt = int(torch.randint(2, 9, (1,), generator=generator))
        rows.append({"input_ids": ids.tolist(), "labels": [-100] * prompt + ids.tolist()[prompt:]})
    return rows


def pad_batch(features: list[dict]) -> dict:
    """Right-padded to the batch's longest sample, with an attention mask (what the model's mask check reads)."""
    import torch
    from torch.nn.utils.rnn import pad_sequence

    ids = [torch.tensor(f["input_ids"]) for f in features]
    return {"input_ids": pad_sequence(ids, batch_first=True, padding_value=PAD),
            "attention_mask": pad_sequence([torch.ones_like(i) for i in ids], batch_first=True),
            "labels": pad_sequence([torch.tensor(f["labels"]) for f in features], batch_first=True, padding_value=-100)}


def build_trainer(kind: str, flags: list[str], output_dir: Path, train: list, steps: int, callbacks=()):
    """The stock Trainer (`stock`) or ExtTrainer (`ext`) on the same seeded model, data and flags."""
    import torch
    from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from trainer_ext import ExtArgumentParser, ExtTrainer, ExtTrainingArguments

    common = ["--output_dir", str(output_dir), "--max_steps", str(steps), "--per_device_train_batch_size", "8",
              "--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no", "--seed", "7"]
    if not torch.cuda.is_available():
        common += ["--use_cpu", "true"]  # stock arguments on CPU ranks form a process group only so
    if kind == "stock":
        (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses([*common, *flags])
        trainer_class = Trainer
    else:
        (args,) = ExtArgumentParser(ExtTrainingArguments).parse_args_into_dataclasses([*common, *flags,
                                                                                      "--fresh_start", "true"])
        trainer_class = ExtTrainer
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    trainer = trainer_class(model=model, args=args, train_dataset=train, data_collator=pad_batch)
    for callback in callbacks:
        trainer.add_callback(callback)  # last: their on_step_end comes after every other callback's
    return trainer


# -- the counters ---------------------------------------------------------------------------------------------------
def origin(frame) -> str:
    """The file (from its package root) of the innermost frame outside torch: the code that asked for the op."""
    while frame is not None:
        path = frame.f_code.co_filename
        if any(part in path for part in WRAPPERS) or not any(part in path for part in PASS_THROUGH):
            return origin_of(path)
        frame = frame.f_back
    return "?"


def owner(path: str) -> str:
    """Who a count belongs to: trainer_ext (outside its backends, whose engines' collectives are stock's own),
    transformers' Trainer, or the rest (the model, accelerate, the engine)."""
    if path.startswith(OWNERS["trainer_ext"]) and not path.startswith(f"trainer_ext{os.sep}backends"):
        return "trainer_ext"
    if path.startswith(OWNERS["Trainer"]):
        return "Trainer"
    return "other"


def sync_counter():
    """A TorchDispatchMode counting host syncs and collectives by (kind, op, origin)."""
    import sys as _sys

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    scalar_read = torch.ops.aten._local_scalar_dense.default
    aten = torch.ops.aten
    # Ops whose result's size or value the host must have, so on a GPU they wait for it too (cudaStreamSynchronize)
    # though no .item() is called: a boolean mask's index, nonzero, equal.
    shape_reads = {aten.nonzero.default, aten.equal.default, aten.masked_select.default, aten.is_nonzero.default}

    def masked_index(func, args) -> bool:
        return func is aten.index.Tensor and any(torch.is_tensor(index) and index.dtype == torch.bool
                                                 for index in args[1])

    class SyncCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            namespace = func.namespace
            if func is scalar_read:
                self.counts[("sync", "_local_scalar_dense", origin(_sys._getframe(1)))] += 1
            elif func in shape_reads or masked_index(func, args):
                name = "index (boolean mask)" if func is aten.index.Tensor else func.__name__.split(".")[0]
                self.counts[("sync", name, origin(_sys._getframe(1)))] += 1
            elif namespace in ("c10d", "_c10d_functional") and "wait" not in func.__name__:
                self.counts[("collective", func.__name__.split(".")[0], origin(_sys._getframe(1)))] += 1
            return func(*args, **(kwargs or {}))

    return SyncCounter()


def step_windows(first: int, count_ops: bool, cuda_profile: bool, clock=time.process_time):
    """A callback (added last) that times every optimizer step by `clock` from the previous step's end to its own, and counts
    the steps from `first` on that neither log, evaluate nor save, nor follow one that did (whose work falls after
    its on_step_end): their host syncs and collectives (count_ops), and on CUDA their cudaStreamSynchronize."""
    from transformers import TrainerCallback

    class StepWindows(TrainerCallback):
        def __init__(self):
            self.times, self.counted, self.counts, self.profiled = [], [], Counter(), Counter()
            self.mode = self.marker = self.profiler = None
            self.last, self.quiet = 0.0, False

        def on_train_begin(self, args, state, control, **kwargs):
            if cuda_profile:
                import torch

                activities = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                self.profiler = torch.profiler.profile(activities=activities)
                self.profiler.__enter__()
            self.last, self.quiet = clock(), True

        def on_step_end(self, args, state, control, **kwargs):
            now = clock()
            quiet = not (control.should_log or control.should_evaluate or control.should_save or control.should_training_stop)
            if self.mode is not None or self.marker is not None:
                self._close(state.global_step, keep=quiet)
            self.times.append((state.global_step, now - self.last, quiet and self.quiet))
            self.quiet = quiet
            if quiet and state.global_step + 1 >= first:
                self._open(state.global_step + 1)
            self.last = clock()

        def on_train_end(self, args, state, control, **kwargs):
            if self.mode is not None or self.marker is not None:
                self._close(state.global_step, keep=False)
            if self.profiler is not None:
                import torch

                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.profiler.__exit__(None, None, None)
                self.profiled = cuda_syncs_in_windows(self.profiler, self.counted)
                self.profiler = None

        def _open(self, step):
            if cuda_profile:
                import torch

                self.marker = torch.profiler.record_function(f"{MARKER} {step}")
                self.marker.__enter__()
            if count_ops:
                self.mode = sync_counter()
                self.mode.__enter__()

        def _close(self, step, keep):
            if self.mode is not None:
                self.mode.__exit__(None, None, None)
                if keep:
                    self.counts.update(self.mode.counts)
                self.mode = None
            if self.marker is not None:
                self.marker.__exit__(None, None, None)
                self.marker = None
            if keep:
                self.counted.append(step)

    return StepWindows()


def cuda_syncs_in_windows(profiler, steps: list[int]) -> Counter:
    """CUDA runtime calls that make the host wait for the device, made inside the counted steps' markers."""
    events = profiler.events()
    names = {f"{MARKER} {step}" for step in steps}
    windows = [(e.time_range.start, e.time_range.end) for e in events if e.name in names]
    waits = Counter()
    for event in events:
        if event.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize") and any(
                start <= event.time_range.start <= end for start, end in windows):
            waits[event.name] += 1
    return waits


# -- a worker: one launched process ---------------------------------------------------------------------------------
def worker(options, flags: list[str]) -> dict:
    import torch

    rank = int(os.environ.get("RANK", "0"))
    report_dir = Path(options.report_dir)
    kinds = options.trainers.split(",")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    train = samples(8 * world * max(options.steps, options.count_steps) + 64)
    timings = {kind: [] for kind in kinds}
    for repeat in range(options.timed_repeats):
        order = kinds if repeat % 2 == 0 else kinds[::-1]  # which one steps first, alternating
        trainers = {kind: build_trainer(kind, ["--logging_steps", "50", *flags], report_dir / f"{kind}-timed", train,
                                        options.steps) for kind in order}
        profile = report_dir if options.profile == "cprofile" and repeat == options.timed_repeats - 1 and rank == 0 \
            else None
        for kind, seconds in lockstep(trainers, profile).items():
            timings[kind].append(seconds)
        for trainer in trainers.values():
            release(trainer)
    counts = {}
    for kind in sorted(kinds, key=lambda kind: kind != "ext") if options.count_steps else ():  # Ext first: stock_flags
        windows = step_windows(first=4, count_ops=True, cuda_profile=torch.cuda.is_available())
        trainer = build_trainer(kind, ["--logging_steps", "5", *stock_flags(kind, flags, report_dir / "ext-counted")],
                                report_dir / f"{kind}-counted", train, options.count_steps, [windows])
        if kind == "ext":  # agreeing only where a step waits anyway: the counts hold no agreement of its schedule
            trainer.preemption.agree_every_s = float("inf")
        trainer.train()
        steps = max(len(windows.counted), 1)
        counts[kind] = {"steps": windows.counted,
                        "per_step": [[*key, n / steps] for key, n in sorted(windows.counts.items())],
                        "cuda_per_step": {name: n / steps for name, n in windows.profiled.items()},
                        "cuda": torch.cuda.is_available()}
        release(trainer)
    return {"rank": rank, "world_size": world, "device": "cuda" if torch.cuda.is_available() else "cpu",
            "seconds_per_step": timings, "counts": counts}


def stock_flags(kind: str, flags: list[str], ext_output: Path) -> list[str]:
    """The stock Trainer trains the DeepSpeed config ExtTrainer resolved from the same flags (transformers refuses a
    file of only a zero_optimization section, as the presets are): the same engine, settings and optimizer."""
    if kind != "stock" or "--deepspeed" not in flags:
        return flags
    flags = list(flags)
    flags[flags.index("--deepspeed") + 1] = str(ext_output / "ds_config.resolved.json")
    return flags


def lockstep(trainers: dict, profile_dir: Path | None = None) -> dict:
    """Train each trainer in a thread of its own, one optimizer step at a time in turn, so that whatever else the
    machine does meets both alike; each one's CPU seconds per step (its own thread's: the forward, backward and
    optimizer run there) over the steps after the 10th that neither log nor save, nor follow one that did. With
    `profile_dir`, each thread's cProfile (CPU time) is written there as <kind>.prof."""
    import threading

    from transformers import TrainerCallback

    kinds = list(trainers)
    turns = {kind: threading.Semaphore(0) for kind in kinds}
    windows, failed = {}, []

    class Turn(TrainerCallback):
        def __init__(self, kind):
            self.mine, self.next = turns[kind], turns[kinds[(kinds.index(kind) + 1) % len(kinds)]]

        def on_step_end(self, args, state, control, **kwargs):
            self.next.release()
            self.mine.acquire()

        def on_train_end(self, args, state, control, **kwargs):
            self.next.release()  # the other trains on alone

    def run(kind):
        trainer = trainers[kind]
        try:
            if kind != kinds[0]:
                turns[kind].acquire()
            if profile_dir is not None:
                import cProfile

                profile = cProfile.Profile(time.thread_time)
                profile.enable()
            trainer.train()
            if profile_dir is not None:
                profile.disable()
                profile.dump_stats(profile_dir / f"{kind}.prof")
        except BaseException as error:  # noqa: BLE001 - re-raised in the main thread
            failed.append(error)
            for turn in turns.values():
                turn.release()

    for kind, trainer in trainers.items():
        windows[kind] = step_windows(first=11, count_ops=False, cuda_profile=False, clock=time.thread_time)
        trainer.add_callback(windows[kind])
        trainer.add_callback(Turn(kind))
    threads = [threading.Thread(target=run, args=(kind,)) for kind in kinds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failed:
        raise failed[0]
    return {kind: statistics.fmean(cpu for step, cpu, kept in windows[kind].times if step > 10 and kept)
            for kind in kinds}


def release(trainer) -> None:
    """The trainer's engine and model given back before the next one is built in this process."""
    import gc

    trainer.accelerator.free_memory()
    del trainer
    gc.collect()


# -- the report -----------------------------------------------------------------------------------------------------
def summary(report: dict) -> dict:
    """Per trainer and rank count: syncs and collectives per counted step, split by owner."""
    rows = {}
    for kind, counted in report["counts"].items():
        split = Counter()
        for what, op, where, per_step in counted["per_step"]:
            split[(what, owner(where))] += per_step
            split[(what, "all")] += per_step
        rows[kind] = split
    return rows


def write_results(reports: dict, options) -> str:
    lines = ["# Per-step host cost: ExtTrainer against the stock Trainer", "",
             f"`python benchmarks/step_overhead.py --steps {options.steps} --repeats {options.repeats} --ranks "
             f"{' '.join(map(str, options.ranks))}` ({time.strftime('%Y-%m-%d')}, {reports[options.ranks[0]]['device']}"
             f"); a tiny Llama (2 layers, hidden 32) on padded batches of 8 with an attention mask, fp32; the steps "
             "that neither log nor save.", "",
             "| ranks | stock, CPU per step | ExtTrainer, CPU per step | ExtTrainer / stock (median of repeats) | "
             "each repeat |", "|---|---|---|---|---|"]
    for ranks, report in reports.items():
        stock, ext = report["seconds_per_step"]["stock"], report["seconds_per_step"]["ext"]
        ratios = [e / s for e, s in zip(ext, stock)]
        lines.append(f"| {ranks} | {statistics.median(stock) * 1e3:.2f} ms | {statistics.median(ext) * 1e3:.2f} ms | "
                     f"**{statistics.median(ratios):.3f}** | {', '.join(f'{r:.3f}' for r in ratios)} |")
    lines += ["", "Per counted step (steps 4-13 of 14 that neither log nor follow a log, `--logging_steps 5`), rank 0:",
              "", "| ranks | trainer | host syncs: all | from trainer_ext | from the Trainer | collectives: all | "
              "from trainer_ext | from the Trainer | cudaStreamSynchronize |", "|---|---|---|---|---|---|---|---|---|"]
    for ranks, report in reports.items():
        for kind, split in summary(report).items():
            cuda = report["counts"][kind]["cuda_per_step"].get("cudaStreamSynchronize", 0.0) \
                if report["counts"][kind]["cuda"] else "n/a (CPU)"
            lines.append(f"| {ranks} | {kind} | {split['sync', 'all']:.1f} | {split['sync', 'trainer_ext']:.1f} | "
                         f"{split['sync', 'Trainer']:.1f} | {split['collective', 'all']:.1f} | "
                         f"{split['collective', 'trainer_ext']:.1f} | {split['collective', 'Trainer']:.1f} | {cuda} |")
    lines += ["", "Where each count came from (op, the innermost frame outside torch, per counted step):", ""]
    for ranks, report in reports.items():
        for kind, counted in report["counts"].items():
            lines.append(f"- {ranks} rank(s), {kind}: " + "; ".join(
                f"{op} {where} {per_step:g}" for what, op, where, per_step in counted["per_step"]))
    return "\n".join(lines) + "\n"


def profile_difference(folder: Path, steps: int, rows: int = 12) -> list[str]:
    """Where ExtTrainer's CPU time differs from stock's: the functions whose own time grew or shrank most, per
    step (a markdown table from the two cProfile files of one lockstep repeat)."""
    import pstats

    def own_times(kind):
        times = Counter()
        for (path, _, name), (_, _, own, _, _) in pstats.Stats(str(folder / f"{kind}.prof")).stats.items():
            times[f"{origin_of(path)}:{name}"] += own
        return times

    stock, ext = own_times("stock"), own_times("ext")
    change = sorted(((ext[key] - stock[key], key) for key in set(stock) | set(ext)), reverse=True)
    lines = [f"total per step: stock {sum(stock.values()) / steps * 1e3:.2f} ms, ExtTrainer "
             f"{sum(ext.values()) / steps * 1e3:.2f} ms (profiled: a function call costs more than unprofiled)", "",
             "| function (own time) | ExtTrainer - stock, per step |", "|---|---|"]
    for delta, key in change[:rows] + change[-3:]:
        lines.append(f"| `{key}` | {delta / steps * 1e6:+.1f} µs |")
    return lines


def origin_of(path: str) -> str:
    """`path` from the root it is imported from: the longest sys.path entry (or the repository) holding it, so
    transformers installed by `pip --target` or on PYTHONPATH is still transformers/trainer.py."""
    roots = {os.path.join(os.path.abspath(entry), "") for entry in (*sys.path, str(REPO))}
    for root in sorted(roots, key=len, reverse=True):
        if path.startswith(root):
            return path[len(root):]
    return path


def launch_worker(ranks: int, options, report_dir: Path) -> dict:
    own = [__file__, "--worker", "--report_dir", str(report_dir), "--steps", str(options.steps),
           "--timed_repeats", str(options.repeats), *(["--profile", options.profile] if options.profile else [])]
    if ranks == 1:
        command = [sys.executable, *own]
    else:
        command = [str(BIN / "torchrun"), "--nproc_per_node", str(ranks), "--master_port", str(free_port()), *own]
    # One thread per process: the model is too small for intra-op threads to matter, and idle ones would spin.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    subprocess.run(command, check=True, cwd=REPO, env=env)
    return json.loads((report_dir / "rank0.json").read_text())


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--profile", choices=["cprofile"], default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--report_dir", help=argparse.SUPPRESS)
    parser.add_argument("--trainers", default="stock,ext", help=argparse.SUPPRESS)
    parser.add_argument("--timed_repeats", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--count_steps", type=int, default=14, help=argparse.SUPPRESS)
    options, flags = parser.parse_known_args(argv)
    if options.worker:
        report = worker(options, flags)
        Path(options.report_dir).mkdir(parents=True, exist_ok=True)
        (Path(options.report_dir) / f"rank{report['rank']}.json").write_text(json.dumps(report, indent=1))
        return 0
    import tempfile

    import torch

    if torch.cuda.is_available():  # a rank per GPU
        options.ranks = [ranks for ranks in options.ranks if ranks <= torch.cuda.device_count()]
    reports, profiles = {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        for ranks in options.ranks:
            reports[ranks] = launch_worker(ranks, options, Path(scratch) / f"ranks{ranks}")
            if options.profile:
                profiles[ranks] = profile_difference(Path(scratch) / f"ranks{ranks}", options.steps)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "step_overhead.json").write_text(json.dumps(reports, indent=1))
    text = write_results(reports, options)
    for ranks, lines in profiles.items():
        text += f"\n{ranks} rank(s), rank 0, the last repeat under cProfile (its thread's CPU time):\n\n" + "\n".join(lines) + "\n"
    (RESULTS / "step_overhead.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
