"""Fine-tune a causal LM (SFT) with ExtTrainer: chat `messages` (or ShareGPT, Alpaca), `prompt`/`completion` or plain
`text` JSON lines of any size (tokenized once per machine, or --streaming); full or LoRA (--lora_r); --packing; one process, torchrun DDP, deepspeed ZeRO-2/3, FSDP2 (--fsdp) or --sharded_ddp
simple, unchanged.

With no --model_name_or_path it builds a tiny Llama from a config with a byte-level tokenizer (offline); with no data
files, the chat set shipped in data/causal_lm/. The recipe itself is trainer_ext.tasks.causal_lm (also behind
`trainer-ext train experiments/causal_lm.yaml`)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a source checkout without installing

# Hub access is left as the user set it: a Hub name works online; the default model and data are local (offline,
# HF_HUB_OFFLINE=1 makes a Hub name fail at once instead of after the network's time-outs).
from trainer_ext import ExtArgumentParser, ExtTrainingArguments  # noqa: E402
from trainer_ext.errors import exit_process, user_errors  # noqa: E402
from trainer_ext.tasks.causal_lm import DataArguments, ModelArguments, run  # noqa: E402


def main(argv=None):
    parser = ExtArgumentParser((ModelArguments, DataArguments, ExtTrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    with user_errors(parser.prog):  # a bad flag, path or file found once data or model are read: one line, exit 2
        return run(model_args, data_args, training_args)


if __name__ == "__main__":
    main()
    exit_process(0)  # a finished rank ends without interpreter teardown, where gloo's threads can abort it
