"""Find where a ZeRO-2 step loses time to DDP on small models: time forward, backward (with gradient reduction)
and optimizer step separately for DDP and for DeepSpeed engines that differ only in `zero_optimization` settings,
interleaved in one run, and check that every variant trains the same numbers.

    deepspeed --num_gpus 2 benchmarks/profile_zero2.py [--steps 5 --repeats 3] [--variants ...] [--torch_profile]

Each engine gets the config ExtTrainer would hand DeepSpeed (the translator's, from `zero2_minimal` and the flags of
the benchmark: MiniLM, seq 64, 16 per rank, fp32, AdamW 5e-5, linear schedule). Rank 0 prints one table and writes
benchmarks/results/profile_zero2.json."""

from __future__ import annotations

import argparse
import json
import os
import gc
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from sharded_ddp import model_and_batches  # noqa: E402

CLASSIC = {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 5e8, "overlap_comm": True,
           "reduce_scatter": True, "reduce_bucket_size": 5e8, "contiguous_gradients": True}
# Each variant changes one thing (or the winning combination) relative to the classic published section.
VARIANTS = {
    "classic": {},
    "no_overlap_comm": {"overlap_comm": False},
    "no_reduce_scatter": {"reduce_scatter": False},
    "no_contiguous_gradients": {"contiguous_gradients": False},
    "buckets_hidden2": {"reduce_bucket_size": 384 * 384, "allgather_bucket_size": 384 * 384},
    "no_overlap_no_reduce_scatter": {"overlap_comm": False, "reduce_scatter": False},
    "no_overlap_no_reduce_scatter_no_contiguous": {"overlap_comm": False, "reduce_scatter": False,
                                                   "contiguous_gradients": False},
    # --bf16 only: DeepSpeed's per-parameter overflow scan replaced by the gradient-norm test (ExtTrainer's default)
    "no_overlap_no_reduce_scatter_norm_overflow": {"overlap_comm": False, "reduce_scatter": False,
                                                   "norm_overflow": True},
    # DeepSpeed's `torch_adam` option: torch's AdamW (here fused, as the Trainer's default) on each partition
    # instead of DeepSpeed's own CPU Adam op.
    "torch_fused_adamw": {"overlap_comm": False, "reduce_scatter": False, "optimizer": {"torch_adam": True,
                                                                                       "fused": True}},
}


def engine_for(build, zero, steps, bf16=False):
    zero = dict(zero)
    optimizer_params = zero.pop("optimizer", {})
    norm_overflow = zero.pop("norm_overflow", False)
    import deepspeed

    from trainer_ext.backends.deepspeed.backend import check_overflow_by_norm
    from trainer_ext.deepspeed_config import build_deepspeed_config

    flags = {"per_device_train_batch_size": 16, "learning_rate": 5e-5, "max_grad_norm": 1.0, "bf16": bf16}
    config = build_deepspeed_config(flags, world_size=dist.get_world_size(), num_training_steps=steps,
                                    config={"zero_optimization": zero}, cpu_ranks=True)
    config["zero_optimization"].update(zero)  # exactly the variant's values, whatever the defaults
    config["optimizer"]["params"].update(optimizer_params)
    engine, *_ = deepspeed.initialize(model=build(), model_parameters=None, config=config)
    if norm_overflow:
        check_overflow_by_norm(engine.optimizer)
    return engine


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=0)
    parser.add_argument("--variants", nargs="*", choices=list(VARIANTS), help="default: all")
    parser.add_argument("--torch_profile", action="store_true", help="also print torch.profiler's top ops per variant")
    parser.add_argument("--bf16", action="store_true", help="DeepSpeed bf16 (no DDP row: it would run fp32)")
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "profile_zero2.json"))
    args = parser.parse_args()

    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    build, batches = model_and_batches(world_size, rank, 16, 64, args.steps + 1)
    names = [*([] if args.bf16 else ["ddp"]), *(args.variants or VARIANTS)]
    phases = {name: {"forward": [], "backward": [], "step": []} for name in names}
    losses = {name: [] for name in names}

    def make(name):
        if name == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(build())
            return model, torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.0, fused=True)  # the Trainer's default
        return engine_for(build, {**CLASSIC, **VARIANTS[name]}, args.steps + 1, args.bf16), None

    def step(model, optimizer, batch, name, timed):
        marks = [time.perf_counter()]
        loss = model(**batch).loss
        marks.append(time.perf_counter())
        if optimizer is not None:  # DDP
            loss.backward()
            marks.append(time.perf_counter())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        else:
            model.backward(loss)
            marks.append(time.perf_counter())
            model.step()
        marks.append(time.perf_counter())
        if timed:
            losses[name].append(loss.item())
            for phase, start, end in zip(("forward", "backward", "step"), marks, marks[1:]):
                phases[name][phase].append(end - start)

    # One model at a time (memory), rebuilt from the same weights in every repeat; the order alternates so that
    # load from other work on the machine hits every variant alike.
    for repeat in range(args.repeats):
        for name in (names if repeat % 2 == 0 else names[::-1]):
            model, optimizer = make(name)
            step(model, optimizer, batches[0], name, timed=False)  # allocates the optimizer state
            dist.barrier()
            for batch in batches[1:]:
                step(model, optimizer, batch, name, timed=True)
            if args.torch_profile and repeat == args.repeats - 1:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    step(model, optimizer, batches[-1], name, timed=False)
                if rank == 0:
                    print(f"== {name}\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15),
                          flush=True)
            del model, optimizer
            gc.collect()

    if rank == 0:
        result = {name: {phase: statistics.median(times) for phase, times in by_phase.items()}
                  for name, by_phase in phases.items()}
        for name in result:
            result[name]["total"] = sum(result[name].values())
            result[name]["ratio_to_ddp_samples_per_s"] = result[names[0]]["total"] / result[name]["total"]
            result[name]["max_loss_difference_to_first"] = max(
                (abs(a - b) for a, b in zip(losses[name], losses[names[0]])), default=float("nan"))
        print(f"{'variant':34s} {'forward':>8s} {'backward':>9s} {'step':>8s} {'total':>8s} {'x ' + names[0]:>6s} "
              f"{'dloss':>8s}")
        for name, row in result.items():
            print(f"{name:34s} {row['forward']:8.3f} {row['backward']:9.3f} {row['step']:8.3f} {row['total']:8.3f} "
                  f"{row['ratio_to_ddp_samples_per_s']:6.3f} {row['max_loss_difference_to_first']:8.1e}", flush=True)
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({"steps": args.steps, "repeats": args.repeats, "seconds_per_step":
                                                 result}, indent=2) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
