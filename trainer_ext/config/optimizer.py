"""Optimizer and scheduler settings as small dataclasses, filled from TrainingArguments (or built by the user), and the
warmup rules every backend follows. Pure: no torch."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..errors import ArgumentsError


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

    def warmup_for(self, num_training_steps: int) -> int:
        return warmup_steps(self.warmup_steps, num_training_steps)
