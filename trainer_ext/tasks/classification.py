"""Sequence classification: JSON lines/CSV (or a `datasets` dataset) of text and label -> a fine-tuned classifier,
accuracy on validation, predictions on test."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..config.own_flags import LossFlags, flags_of
from ..errors import ArgumentsError, closest
from .common import (REPO, ModelArguments, check_sample_limits, first, load_config, load_tokenizer, nearby,
                     needed_splits, say_model_saved, shipped_model, with_channels)
from .driver import run_task

SHIPPED_DATA = REPO / "data" / "classification"
EVAL_METRICS = ("loss", "accuracy")  # what evaluation reports (eval_*): `trainer-ext search` checks its metric
SPLITS = ("train", "validation", "test")
FORMATS = (".jsonl", ".json", ".csv", ".tsv")

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
        check_sample_limits(self)
        if self.dataset_name is None:
            folders = [f"--{split}_file {path}" for split, path in self.data_files().items() if Path(path).is_dir()]
            if folders:
                raise ArgumentsError(f"{', '.join(folders)}: a folder, not a file (give the file itself, or the "
                                     "folder as --dataset_name)")
            missing = [f"--{split}_file {path}{nearby(path)}" for split, path in self.data_files().items()
                       if not Path(path).is_file()]
            if missing:
                raise ArgumentsError(f"no such data file: {', '.join(missing)}")
        if self.max_seq_length < 1:
            raise ArgumentsError(f"--max_seq_length {self.max_seq_length} must be at least 1")

    def uses_shipped_data(self) -> bool:
        return self.dataset_name is None and not any(self._given().values())

    def data_files(self) -> dict[str, str]:
        """The files given (a SageMaker job's channels fill splits no flag names); all three shipped ones when none
        is (never a shipped file beside a file of the user's)."""
        if self.uses_shipped_data():
            return {split: str(SHIPPED_DATA / f"{split}.jsonl") for split in SPLITS}
        return {split: str(path) for split, path in self._given().items() if path}

    def _given(self) -> dict:
        return with_channels({"train": self.train_file, "validation": self.validation_file, "test": self.test_file},
                             (".jsonl", ".json", ".csv"))


def load_raw(data_args: DataArguments, training_args=None):
    import datasets

    from .common import check_needed_splits, reading, shipped_data_note
    from .data_checks import check_datasets_cache, load_files

    if data_args.dataset_name is not None:
        check_datasets_cache()
        with reading("--dataset_name", data_args.dataset_name, "dataset"):
            return datasets.load_dataset(data_args.dataset_name, data_args.dataset_config_name)
    files = data_args.data_files()
    if training_args is not None:
        check_needed_splits(needed_splits(data_args, training_args), files)
    if data_args.uses_shipped_data():
        shipped_data_note(SHIPPED_DATA)
    for split, path in files.items():
        if not path.lower().endswith(FORMATS):
            raise ArgumentsError(f"--{split}_file {path}: give JSON lines (.jsonl or .json, one object per line) or "
                                 "CSV (.csv, .tsv) with a header line")
    kinds = {"csv" if path.lower().endswith((".csv", ".tsv")) else "json" for path in files.values()}
    if len(kinds) > 1:
        raise ArgumentsError(f"the data files mix CSV and JSON lines ({', '.join(files.values())}): give them all in "
                             "one format")
    kind = kinds.pop()
    return load_files(kind, files, **({"delimiter": "\t"} if kind == "csv" and any(
        path.endswith(".tsv") for path in files.values()) else {}))


def checked_labels(raw, data_args: DataArguments, config=None) -> tuple[list[str], set[str]]:
    """The class names in the order of the classifier's outputs (from the training data, or evaluating only, the
    model's own label names), with every split's texts and labels checked; and the splits without labels (a test
    file without the column, or GLUE's -1 everywhere)."""
    from .data_checks import (check_known_labels, check_rows, check_texts, label_name, label_order, training_labels,
                              unlabelled)

    files = {} if data_args.dataset_name is not None else data_args.data_files()
    where = {split: files.get(split, f"--dataset_name {data_args.dataset_name} [{split}]") for split in raw}
    column = data_args.label_column
    for split in raw:
        check_rows(raw[split], where[split], split)
        check_texts(raw[split], data_args.text_column, where[split], "--text_column")
    if "train" in raw:
        names = training_labels(raw["train"], column, where["train"])
    else:
        names = model_label_names(config)
        if names is None:  # a model without label names: the classes of the data evaluated, sorted as training does
            names = sorted({label_name(v) for split in raw if column in raw[split].column_names
                            for v in raw[split][column] if v is not None}, key=label_order)
    without = set()
    for split in raw:
        if split == "train":
            continue
        if column not in raw[split].column_names or (split == "test" and unlabelled(raw[split][column], names)):
            if split == "validation":
                raise ArgumentsError(f"--label_column {column!r}: {where[split]} has no labels to evaluate against "
                                     f"(columns: {raw[split].column_names})")
            if column in raw[split].column_names:
                without.add(split)
            continue
        check_known_labels(raw[split], column, where[split], names, split)
    return names, without


def model_label_names(config) -> list[str] | None:
    """The label names a fine-tuned classifier carries (id2label), None for transformers' LABEL_0... defaults."""
    id2label = getattr(config, "id2label", None) or {}
    names = [str(id2label[i]) for i in sorted(id2label, key=int)]
    return None if not names or names == [f"LABEL_{i}" for i in range(len(names))] else names


def tokenize(batch, tokenizer, text_column, label_column, labels, max_length):
    """Top level with plain arguments: `datasets` can fingerprint it, so a second run reuses the cache. `labels`: the
    class names in output order; a split without labels gets none."""
    from .data_checks import label_name

    encoded = tokenizer(batch[text_column], truncation=True, max_length=max_length)
    if label_column in batch:
        index = {name: i for i, name in enumerate(labels)}
        encoded["labels"] = [index[label_name(label)] for label in batch[label_column]]
    return encoded


def accuracy(prediction) -> dict:
    predictions = np.argmax(prediction.predictions, axis=-1)
    return {"accuracy": float((predictions == prediction.label_ids).mean())}


def same_order_as_model(labels: list[str], config) -> list[str]:
    """A fine-tuned classifier's own label order when the data has the same labels: its head's rows keep their
    meaning (sorting the names could swap them)."""
    from .data_checks import say_once

    own = model_label_names(config)
    if own is not None and sorted(own) == sorted(labels):
        return own
    if own is not None and len(own) == len(labels):
        say_once(f"the model's labels ({', '.join(own)}) are not the data's ({', '.join(labels)}): its classifier "
                 f"rows now stand for {', '.join(labels)}, in that order")
    return labels


def check_head(config, labels: list[str], model_path, model_args) -> None:
    """A model that already has a classifier head for another number of classes: transformers stops with a traceback
    about mismatched sizes; one line instead, and the flag that starts a new head."""
    own = model_label_names(config)
    trained = any(name.endswith("ForSequenceClassification") for name in getattr(config, "architectures", None) or [])
    if not trained or config.num_labels == len(labels) or model_args.model_kwargs.get("ignore_mismatched_sizes"):
        return
    what = f" ({', '.join(own)})" if own else ""
    raise ArgumentsError(f"--model_name_or_path {model_path} is a classifier for {config.num_labels} classes{what} but "
                         f"the data has {len(labels)} ({', '.join(labels)}): to train a new head for them pass "
                         "--model_kwargs '{\"ignore_mismatched_sizes\": true}', or check --label_column")


def likely_column(dataset, flag: str) -> str | None:
    """The one column that looks like the text (strings) or the labels (a usual name, else the one column of whole
    numbers) when the named one is missing and no name is close: a file written with "text"/"labels"."""
    from ..data.loader import text_columns

    names = dataset.column_names
    if flag == "--text_column":
        found = text_columns(dataset)
    else:
        found = [name for name in names if name.lower() in ("label", "labels", "target", "class", "category", "y")]
        found = found or [name for name, feature in dataset.features.items()
                          if str(getattr(feature, "dtype", "")).startswith(("int", "uint")) or
                          type(feature).__name__ == "ClassLabel"]
    return found[0] if len(found) == 1 else None


def model_path(model_args: ModelArguments) -> str:
    return model_args.model_name_or_path or shipped_model()


def setup(model_args: ModelArguments, data_args: DataArguments, training_args):
    """A classifier fine-tuned and/or evaluated with ExtTrainer (trainer_ext.tasks.driver runs the steps). Writes
    {train,eval,eval_before,predict}_results.json and, with --do_predict, predictions.json to output_dir."""
    import datasets
    import transformers
    from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding, set_seed

    from ..training.prepare import sharded_loading
    from ..trainer import ExtTrainer

    from .common import check_sequence_length, reading
    from .driver import Prepared

    source = model_path(model_args)  # the model given, or the shipped one
    original = load_config(source, model_args)  # --config_overrides checked before the data and weights load
    raw = load_raw(data_args, training_args)
    for split in (split for split, flag in needed_splits(data_args, training_args).items() if flag):
        if split not in raw:
            raise ArgumentsError(f"the data has no {split!r} split (it has {sorted(raw)})")
    if "train" in raw:
        problems = []
        for column in (data_args.text_column, data_args.label_column):
            if column not in raw["train"].column_names:
                flag = "--text_column" if column == data_args.text_column else "--label_column"
                hint = closest(column, raw["train"].column_names) or likely_column(raw["train"], flag)
                problems.append(f"{flag} {column!r}: the training data has columns {raw['train'].column_names}"
                                + (f" (did you mean {flag} {hint}?)" if hint else ""))
        if problems:
            raise ArgumentsError("\n".join(problems))
    labels, unlabelled = checked_labels(raw, data_args, original)
    raw = datasets.DatasetDict({split: dataset.remove_columns(data_args.label_column) if split in unlabelled
                                else dataset for split, dataset in raw.items()})
    if "train" in raw:
        labels = same_order_as_model(labels, original)
    weights = flags_of(LossFlags, training_args).class_weights
    if weights and len(weights) != len(labels):  # before the model is loaded
        raise ArgumentsError(f"--class_weights has {len(weights)} values but the training data has {len(labels)} "
                             f"labels ({', '.join(map(str, labels))}): give one weight per label, in that order")
    check_head(original, labels, source, model_args)
    set_seed(training_args.seed)  # the new classifier head is initialised identically on every backend
    config = load_config(source, model_args, num_labels=len(labels),
                         id2label=dict(enumerate(labels)), label2id={name: i for i, name in enumerate(labels)})
    tokenizer = load_tokenizer(source, model_args)
    check_sequence_length("--max_seq_length", data_args.max_seq_length, config, tokenizer)
    with sharded_loading(training_args), reading("--model_name_or_path", source, "model"):
        model = AutoModelForSequenceClassification.from_pretrained(source, config=config,
                                                                   **model_args.model_kwargs)
    transformers.utils.logging.set_verbosity_warning()

    arguments = dict(tokenizer=tokenizer, text_column=data_args.text_column, label_column=data_args.label_column,
                     labels=labels, max_length=data_args.max_seq_length)
    with training_args.main_process_first(desc="tokenize"):  # the other ranks then read rank 0's cache
        tokenized = datasets.DatasetDict({
            split: dataset.map(tokenize, batched=True, fn_kwargs=arguments, remove_columns=dataset.column_names,
                               num_proc=data_args.preprocessing_num_workers,
                               load_from_cache_file=not data_args.overwrite_cache)
            for split, dataset in raw.items()})
    limits = {"train": data_args.max_train_samples, "validation": data_args.max_eval_samples,
              "test": data_args.max_predict_samples}
    for split, limit in limits.items():
        if split in tokenized:
            tokenized[split] = first(tokenized[split], limit)

    trainer = ExtTrainer(model=model, args=training_args, train_dataset=tokenized.get("train"),
                         eval_dataset=tokenized.get("validation"), processing_class=tokenizer,
                         data_collator=DataCollatorWithPadding(tokenizer), compute_metrics=accuracy)
    main_process = trainer.is_world_process_zero()
    said = {"eval_before": "validation accuracy before training", "eval": "validation accuracy after training"}

    def evaluate(prefix: str) -> dict:
        metrics = trainer.evaluate(metric_key_prefix=prefix)
        trainer.log_metrics(prefix, metrics)
        trainer.save_metrics(prefix, metrics)
        if main_process:
            print(f"{said[prefix]}: {metrics[f'{prefix}_accuracy']:.4f}", flush=True)
        return metrics

    def predict() -> dict:
        output = trainer.predict(tokenized["test"], metric_key_prefix="predict")
        trainer.save_metrics("predict", output.metrics)
        if main_process:
            predictions = np.argmax(output.predictions, axis=-1).tolist()
            path = Path(training_args.output_dir) / "predictions.json"
            path.write_text(json.dumps({"predictions": predictions, "labels": [labels[i] for i in predictions],
                                        "logits": output.predictions.tolist()}))
        return output.metrics

    return Prepared(trainer, len(tokenized["train"]) if "train" in tokenized else None, evaluate, predict)


def report(results: dict, training_args) -> None:
    """What the example prints last on the main process: where the model went."""
    say_model_saved(training_args)


# The whole recipe, as the examples and experiment files run it (run(model_args, data_args, training_args) -> metrics).
run = functools.partial(run_task, "classification")
