"""Optimizer and scheduler settings as small dataclasses, filled from TrainingArguments or a config dict/file, and the
warmup rules every backend follows. Pure: no torch."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..errors import ArgumentsError, UserError


def warmup_steps(warmup: float, num_training_steps: int | None) -> int | None:
    """A warmup of >= 1 is a step count, of < 1 a ratio of the total (None while the total is unknown)."""
    if warmup >= 1:
        return int(warmup)
    if warmup == 0:
        return 0
    if num_training_steps is None:
        return None
    return math.ceil(num_training_steps * warmup)


def merge_warmup_ratio(steps: float, warmup_ratio: float) -> float:
    """The v4 spelling --warmup_ratio R becomes transformers 5's --warmup_steps R (a float < 1 is a ratio)."""
    if warmup_ratio is None or warmup_ratio == 0:
        return steps
    if not 0 <= warmup_ratio < 1:
        raise ArgumentsError(f"--warmup_ratio {warmup_ratio}: a ratio must be in [0, 1)")
    if steps:
        raise ArgumentsError(f"--warmup_ratio {warmup_ratio:g} and --warmup_steps {steps:g} both set "
                             "the warmup: give only one")
    return warmup_ratio


def _from_mapping(cls, values: dict):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise UserError(f"{cls.__name__}: unknown keys {unknown}; valid: {sorted(known)}")
    return cls(**values)


@dataclass
class OptimizerSettings:
    """AdamW, as the Trainer builds it: no weight decay on biases and LayerNorm weights."""

    lr: float = 5e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    @classmethod
    def from_args(cls, args) -> "OptimizerSettings":
        return cls(args.learning_rate, (args.adam_beta1, args.adam_beta2), args.adam_epsilon, args.weight_decay)

    @classmethod
    def from_dict(cls, values: dict) -> "OptimizerSettings":
        values = dict(values)
        if "betas" in values:
            values["betas"] = tuple(values["betas"])
        return _from_mapping(cls, values)

    @classmethod
    def from_file(cls, path) -> "OptimizerSettings":
        return cls.from_dict(json.loads(Path(path).read_text()))


@dataclass
class SchedulerSettings:
    """A transformers scheduler type and its warmup (steps, or a ratio of the training steps when < 1)."""

    type: str = "linear"
    warmup_steps: float = 0
    kwargs: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def from_args(cls, args) -> "SchedulerSettings":
        kind = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
        return cls(kind, args.warmup_steps, dict(args.lr_scheduler_kwargs or {}))

    @classmethod
    def from_dict(cls, values: dict) -> "SchedulerSettings":
        return _from_mapping(cls, dict(values))

    @classmethod
    def from_file(cls, path) -> "SchedulerSettings":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def warmup_for(self, num_training_steps: int) -> int:
        return warmup_steps(self.warmup_steps, num_training_steps)
