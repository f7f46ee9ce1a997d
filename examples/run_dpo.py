"""Preference-tune a causal LM (DPO) with ExtTrainer and TRL's DPOTrainer (trainer_ext.trl.ExtDPOTrainer): JSON lines
of {"prompt", "chosen", "rejected"}; full (the reference a copy of the starting model, or --precompute_ref_log_probs
true) or LoRA (--lora_r: the reference the adapter-disabled base); one process, torchrun DDP, deepspeed ZeRO-2/3,
FSDP2 (--fsdp) or --sharded_ddp simple, unchanged. Every DPOConfig flag works (--beta, --loss_type, --max_length, ...).

Start from the SFT recipe's output (examples/run_clm.py; a LoRA one folded first with `trainer-ext merge`):
    python examples/run_dpo.py --model_name_or_path out/chat --output_dir out/dpo --do_train --do_eval
With no --model_name_or_path: the causal-LM recipe's tiny Llama; with no data files, the pairs shipped in
data/preference/. The recipe itself is trainer_ext.tasks.dpo (also behind `trainer-ext train experiments/dpo.yaml`)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a source checkout without installing

from trainer_ext import ExtArgumentParser  # noqa: E402
from trainer_ext.errors import exit_process, user_errors  # noqa: E402
from trainer_ext.tasks.dpo import DataArguments, ModelArguments, run  # noqa: E402
from trainer_ext.trl import ExtDPOConfig  # noqa: E402


def main(argv=None):
    parser = ExtArgumentParser((ModelArguments, DataArguments, ExtDPOConfig))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    with user_errors(parser.prog):  # a bad flag, path or file found once data or model are read: one line, exit 2
        return run(model_args, data_args, training_args)


if __name__ == "__main__":
    main()
    exit_process(0)  # a finished rank ends without interpreter teardown, where gloo's threads can abort it
