"""Parse ExtTrainingArguments from the command line and print what the run would use, as JSON (one line per rank)."""

import json
import os
from pathlib import Path

import torch

from trainer_ext import ExtArgumentParser, ExtTrainingArguments, prepare_process


def main():
    (args,) = ExtArgumentParser(ExtTrainingArguments).parse_args_into_dataclasses()
    prepare_process(args)  # the process set up, as ExtTrainer does first (CPU threads per rank)
    device = str(args.device)  # the process group, as the Trainer sets it up
    values = {
        "device": device,
        "rank": int(os.environ.get("RANK", 0)),
        "local_rank": args.local_rank,
        "world_size": args.world_size,
        "sharded_ddp": args.sharded_ddp,
        "fp16": args.fp16,
        "learning_rate": args.learning_rate,
        "adam_beta1": args.adam_beta1,
        "weight_decay": args.weight_decay,
        "warmup_steps": args.warmup_steps,
        "deepspeed": args.deepspeed,
        "threads": torch.get_num_threads(),
    }
    # One file per rank: lines printed by two ranks at once can interleave.
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.output_dir) / f"args_rank{values['rank']}.json").write_text(json.dumps(values))
    print("ARGS " + json.dumps(values), flush=True)


if __name__ == "__main__":
    main()
