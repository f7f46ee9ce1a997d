"""A `compute_metrics` whose answer is not a dict of metric names to numbers stops the run with one line naming the
function, after the training done so far is saved as a checkpoint (the same command then continues from it)."""

from __future__ import annotations

import functools
import inspect
import numbers
from pathlib import Path

from ..errors import UserError
from ..integrations import internals


class MetricsError(UserError):
    """compute_metrics returned something the Trainer cannot log or compare."""

    outcome = "nothing was trained or overwritten"  # replaced when the training so far was saved first


def metrics_problem(metrics) -> str | None:
    """What is wrong with compute_metrics' answer, in a phrase; None for a dict of names to numbers."""
    if not isinstance(metrics, dict):
        return f"a {type(metrics).__name__} ({_short(metrics)})"
    for key, value in metrics.items():
        if not isinstance(key, str):
            return f"a dict with the key {key!r} ({type(key).__name__}, not a metric name)"
        if not _number(value):
            return f"a dict whose {key!r} is a {type(value).__name__} ({_short(value)})"
    return None


def _number(value) -> bool:
    if isinstance(value, numbers.Number) and not isinstance(value, complex):
        return True
    # numpy scalars and one-element arrays/tensors: the Trainer turns them into Python numbers itself
    size = getattr(value, "size", None)
    size = size() if callable(size) else size
    return size == 1 and hasattr(value, "item") and isinstance(value.item(), numbers.Real)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def describe(function) -> str:
    """`module.name (file:line)` of a function, a functools.partial's function or a callable object's class."""
    while isinstance(function, functools.partial):
        function = function.func
    target = function if inspect.isfunction(function) or inspect.ismethod(function) else type(function)
    name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"
    try:
        return f"{name} ({inspect.getsourcefile(target)}:{inspect.getsourcelines(target)[1]})"
    except (OSError, TypeError):
        return name


def checked_compute_metrics(trainer):
    """trainer.compute_metrics wrapped so that a wrong answer is a MetricsError; None stays None."""
    function = trainer.compute_metrics
    if function is None or getattr(function, "checked_by_trainer_ext", False):
        return function

    def checked(*args, **kwargs):
        metrics = function(*args, **kwargs)
        if kwargs.get("compute_result") is False:  # --batch_eval_metrics: a batch's call only accumulates
            return metrics
        problem = metrics_problem(metrics)
        if problem is None:
            return metrics
        error = MetricsError(f"compute_metrics {describe(function)} returned {problem}: it must return a dict of "
                             "metric names to numbers, e.g. {\"accuracy\": 0.83}")
        saved = save_training_so_far(trainer)
        if saved:
            error.outcome = (f"the training so far is saved in {saved}: once compute_metrics is fixed, the same "
                             "command continues from it")
        elif trainer.state.global_step > 0 and any(Path(trainer.args.output_dir).glob("model*.safetensors")):
            error.outcome = f"the trained model in {trainer.args.output_dir} is kept"  # evaluating after training
        raise error

    checked.checked_by_trainer_ext = True
    checked.__wrapped__ = function
    return checked


def save_training_so_far(trainer) -> str | None:
    """Inside train(): write a checkpoint at the current step (every rank takes part); its folder, or None."""
    if not getattr(trainer, "is_in_train", False) or trainer.state.global_step <= 0:
        return None
    folder = Path(trainer.args.output_dir) / f"checkpoint-{trainer.state.global_step}"
    if not folder.is_dir():  # as transformers saves at a step: the checkpoint, then on_save (which publishes it)
        internals.save_checkpoint(trainer)
        trainer.control = trainer.callback_handler.on_save(trainer.args, trainer.state, trainer.control)
    return str(folder)
