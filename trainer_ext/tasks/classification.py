"""Sequence classification: JSON lines/CSV (or a `datasets` dataset) of text and label -> a fine-tuned classifier,
accuracy on validation, predictions on test."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ArgumentsError
from .common import (REPO, ModelArguments, first, load_config, load_tokenizer, shipped_model, train_and_save,
                     with_channels)

SHIPPED_DATA = REPO / "data" / "classification"
EVAL_METRICS = ("loss", "accuracy")  # what evaluation reports (eval_*): `trainer-ext search` checks its metric
SPLITS = ("train", "validation", "test")

__all__ = ["ModelArguments", "DataArguments", "run"]


@dataclass
class DataArguments:
    dataset_name: str | None = field(default=None, metadata={
        "help": "A `datasets.load_dataset` name or a local folder of train/validation/test files (datasets 4+ no "
                "longer runs dataset scripts)."})
    dataset_config_name: str | None = field(default=None)
    train_file: str | None = field(default=None, metadata={"help": "JSON lines/CSV with text, label."})
    validation_file: str | None = field(default=None)
    test_file: str | None = field(default=None)
    text_column: str = field(default="sentence")
    label_column: str = field(default="label")
    max_seq_length: int = field(default=128)
    max_train_samples: int | None = field(default=None)
    max_eval_samples: int | None = field(default=None)
    max_predict_samples: int | None = field(default=None)
    preprocessing_num_workers: int | None = field(default=None)
    overwrite_cache: bool = field(default=False, metadata={"help": "Tokenize again instead of using the cache."})
    evaluate_before_training: bool = field(default=False, metadata={"help": "Report validation metrics first."})

    def __post_init__(self):
        if self.dataset_name is None:
            missing = [f"--{split}_file {path}" for split, path in self.data_files().items()
                       if not Path(path).is_file()]
            if missing:
                raise ArgumentsError(f"no such data file: {', '.join(missing)}")
        if self.max_seq_length < 1:
            raise ArgumentsError(f"--max_seq_length {self.max_seq_length} must be at least 1")

    def data_files(self) -> dict[str, str]:
        given = with_channels({"train": self.train_file, "validation": self.validation_file, "test": self.test_file},
                              (".jsonl", ".json", ".csv"))
        return {split: str(path or SHIPPED_DATA / f"{split}.jsonl") for split, path in given.items()}


def load_raw(data_args: DataArguments):
    import datasets

    from .common import reading

    if data_args.dataset_name is not None:
        with reading("--dataset_name", data_args.dataset_name, "dataset"):
            return datasets.load_dataset(data_args.dataset_name, data_args.dataset_config_name)
    files = data_args.data_files()
    kind = "csv" if files["train"].endswith(".csv") else "json"
    return datasets.load_dataset(kind, data_files=files)


def tokenize(batch, tokenizer, text_column, label_column, labels, max_length):
    """Top level with plain arguments: `datasets` can fingerprint it, so a second run reuses the cache."""
    encoded = tokenizer(batch[text_column], truncation=True, max_length=max_length)
    encoded["labels"] = [labels.index(label) for label in batch[label_column]]
    return encoded


def accuracy(prediction) -> dict:
    predictions = np.argmax(prediction.predictions, axis=-1)
    return {"accuracy": float((predictions == prediction.label_ids).mean())}


def run(model_args: ModelArguments, data_args: DataArguments, training_args) -> dict:
    """Fine-tune and/or evaluate a classifier with ExtTrainer; returns the metrics.

    Writes {train,eval,eval_before,predict}_results.json and, with --do_predict, predictions.json to output_dir."""
    import transformers
    from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding, set_seed

    from ..backends.deepspeed import sharded_loading
    from ..trainer import ExtTrainer

    raw = load_raw(data_args)
    for split in ("train",) + (("validation",) if training_args.do_eval or data_args.evaluate_before_training
                               else ()) + (("test",) if training_args.do_predict else ()):
        if split not in raw:
            raise ArgumentsError(f"the data has no {split!r} split (it has {sorted(raw)})")
    for column in (data_args.text_column, data_args.label_column):
        if column not in raw["train"].column_names:
            flag = "--text_column" if column == data_args.text_column else "--label_column"
            raise ArgumentsError(f"{flag} {column!r}: the training data has columns {raw['train'].column_names}")
    labels = sorted(set(raw["train"][data_args.label_column]))
    weights = getattr(training_args, "class_weights", None)
    if weights and len(weights) != len(labels):  # before the model is loaded
        raise ArgumentsError(f"--class_weights has {len(weights)} values but the training data has {len(labels)} "
                             f"labels ({', '.join(map(str, labels))}): give one weight per label, in that order")
    model_path = model_args.model_name_or_path or shipped_model()
    set_seed(training_args.seed)  # the new classifier head is initialised identically on every backend
    config = load_config(model_path, model_args, num_labels=len(labels))
    tokenizer = load_tokenizer(model_path, model_args)
    with sharded_loading(training_args):  # ZeRO-3: built and loaded partitioned, never whole on a rank
        model = AutoModelForSequenceClassification.from_pretrained(model_path, config=config,
                                                                   **model_args.model_kwargs)
    transformers.utils.logging.set_verbosity_warning()

    arguments = dict(tokenizer=tokenizer, text_column=data_args.text_column, label_column=data_args.label_column,
                     labels=labels, max_length=data_args.max_seq_length)
    with training_args.main_process_first(desc="tokenize"):  # the other ranks then read rank 0's cache
        tokenized = raw.map(tokenize, batched=True, fn_kwargs=arguments, remove_columns=raw["train"].column_names,
                            num_proc=data_args.preprocessing_num_workers,
                            load_from_cache_file=not data_args.overwrite_cache)
    limits = {"train": data_args.max_train_samples, "validation": data_args.max_eval_samples,
              "test": data_args.max_predict_samples}
    for split, limit in limits.items():
        if split in tokenized:
            tokenized[split] = first(tokenized[split], limit)

    trainer = ExtTrainer(model=model, args=training_args, train_dataset=tokenized["train"],
                         eval_dataset=tokenized.get("validation"), processing_class=tokenizer,
                         data_collator=DataCollatorWithPadding(tokenizer), compute_metrics=accuracy)
    main_process = trainer.is_world_process_zero()
    results = {}
    if data_args.evaluate_before_training:
        before = trainer.evaluate(metric_key_prefix="eval_before")
        trainer.save_metrics("eval_before", before)
        results.update(before)
        if main_process:
            print(f"validation accuracy before training: {before['eval_before_accuracy']:.4f}", flush=True)
    if training_args.do_train:
        results.update(train_and_save(trainer, training_args, len(tokenized["train"])))
    if training_args.do_eval:
        metrics = trainer.evaluate()
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        results.update(metrics)
        if main_process:
            print(f"validation accuracy after training: {metrics['eval_accuracy']:.4f}", flush=True)
    if training_args.do_predict:
        output = trainer.predict(tokenized["test"], metric_key_prefix="predict")
        trainer.save_metrics("predict", output.metrics)
        results.update(output.metrics)
        if main_process:
            predictions = np.argmax(output.predictions, axis=-1).tolist()
            path = Path(training_args.output_dir) / "predictions.json"
            path.write_text(json.dumps({"predictions": predictions, "logits": output.predictions.tolist()}))
    if main_process and training_args.do_train:
        print(f"model saved to {Path(training_args.output_dir).resolve()}", flush=True)
    return results
