"""Every recipe's sequence, run by one driver, and the example scripts' one entry.

A recipe (a module under tasks/, a line in TASKS) declares its flags (ModelArguments, DataArguments), what its
evaluation reports (EVAL_METRICS), the steps it acts on (STEPS), and `setup(model_args, data_args, training_args) ->
Prepared`: its data, model and trainer; optionally `check` (its refusals before anything loads), `model_path` (the
model it starts from when none is given) and `report` (what its example prints). `run_task` runs the same sequence for
all: the checks, the process set-up, the recipe's setup, then evaluate before training, train and save, evaluate,
predict, as the flags ask. examples/run_<task>.py is its docstring and `main = script("<task>", __name__)`.

Hub access is left as the user set it: a Hub name works online; the default models and data are local (offline,
HF_HUB_OFFLINE=1 makes a Hub name fail at once instead of after the network's time-outs)."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from importlib import import_module
from typing import Any, Callable, Sequence

from . import TASKS, TRAINING_ARGUMENTS

STEPS = ("do_train", "do_eval", "do_predict")  # the TrainingArguments steps a recipe acts on, unless it says fewer


@dataclass
class Prepared:
    """What a recipe's setup hands the driver: its trainer, the training set's size (None: a stream), and where the
    recipe evaluates or predicts its own way (each returns its metrics, logged and saved)."""

    trainer: Any
    train_samples: int | None = None
    evaluate: Callable[[str], dict] | None = None  # the metric prefix (eval_before, eval) -> metrics
    predict: Callable[[], dict] | None = None  # --do_predict
    more_metrics: Callable[[str, dict], dict] | None = None  # added to each default evaluation's (perplexity)


def argument_classes(task: str) -> tuple:
    """The task's ModelArguments, DataArguments and training arguments dataclasses."""
    recipe = import_module(TASKS[task])
    module, name = TRAINING_ARGUMENTS.get(task, ("trainer_ext.args", "ExtTrainingArguments"))
    return recipe.ModelArguments, recipe.DataArguments, getattr(import_module(module), name)


def run_task(task: str, model_args, data_args, training_args, callbacks: Sequence = ()) -> dict:
    """The recipe's sequence: its checks before anything loads (the output folder, the steps asked for, the metric for
    the best model), the process set up, its data, model and trainer (given `callbacks` too, last: a search trial's),
    then --evaluate_before_training, --do_train (train and save), --do_eval, --do_predict. Returns every metric."""
    from ..training.prepare import prepare_process
    from .common import check_best_metric, check_output_dir, check_something_to_do, train_and_save

    recipe = import_module(TASKS[task])
    if hasattr(recipe, "check"):
        recipe.check(model_args, data_args, training_args)
    model_path = recipe.model_path(model_args) if hasattr(recipe, "model_path") else model_args.model_name_or_path
    check_output_dir(training_args, model_path)
    check_something_to_do(training_args, data_args, steps=getattr(recipe, "STEPS", STEPS))
    check_best_metric(training_args, recipe.EVAL_METRICS)
    prepare_process(training_args)  # before the data and model load (--checkpoint_uri checked, threads per rank)
    prepared = recipe.setup(model_args, data_args, training_args)
    trainer, results = prepared.trainer, {}
    for callback in callbacks:
        trainer.add_callback(callback)

    def evaluate(prefix: str) -> dict:
        if prepared.evaluate is not None:
            return prepared.evaluate(prefix)
        metrics = trainer.evaluate(metric_key_prefix=prefix)
        metrics.update(prepared.more_metrics(prefix, metrics) if prepared.more_metrics else {})
        trainer.log_metrics(prefix, metrics)
        trainer.save_metrics(prefix, metrics)
        return metrics

    if getattr(data_args, "evaluate_before_training", False):
        results.update(evaluate("eval_before"))
    if training_args.do_train:
        results.update(train_and_save(trainer, training_args, prepared.train_samples))
    if training_args.do_eval:
        results.update(evaluate("eval"))
    if training_args.do_predict and prepared.predict is not None:
        results.update(prepared.predict())
    return results


def main(task: str, argv: Sequence[str] | None = None) -> dict:
    """Parse `argv` (default: the command line) with the task's flags and run its recipe; returns its metrics. A bad
    flag, path or file found once the data or model are read is one line and exit status 2, as a parsing error is."""
    from ..args import ExtArgumentParser
    from ..errors import user_errors

    parser = ExtArgumentParser(argument_classes(task))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    with user_errors(parser.prog):
        results = run_task(task, model_args, data_args, training_args)
    report(task, results, training_args)
    return results


def report(task: str, results: dict, training_args) -> None:
    """What the recipe says last on the main process (where the model went, its scores), if it says anything: the
    example scripts and `trainer-ext train` alike, never a call from Python (run_task prints nothing of it)."""
    said = getattr(import_module(TASKS[task]), "report", None)
    if said is not None and training_args.process_index == 0:
        said(results, training_args)


def script(task: str, module_name: str) -> Callable[..., dict]:
    """examples/run_<task>.py's `main(argv=None)`. When the script itself runs (`module_name` is "__main__": python,
    torchrun, deepspeed, a SageMaker entry point), it runs at once, and the finished rank then ends without the
    interpreter's teardown, where gloo's threads can abort it."""
    entry = functools.partial(main, task)
    if module_name == "__main__":
        from ..errors import exit_process

        entry()
        exit_process(0)
    return entry
