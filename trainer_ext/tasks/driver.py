"""The one entry of the example scripts: a task's flags parsed with its argument classes, its recipe run, its report
printed on the main process. examples/run_<task>.py is its docstring and `main = script("<task>", __name__)`; a new
recipe is its module under tasks/ (ModelArguments, DataArguments, run, optionally report) and a line in TASKS.

Hub access is left as the user set it: a Hub name works online; the default models and data are local (offline,
HF_HUB_OFFLINE=1 makes a Hub name fail at once instead of after the network's time-outs)."""

from __future__ import annotations

import functools
import logging
from importlib import import_module
from typing import Callable, Sequence

from . import TASKS, TRAINING_ARGUMENTS


def argument_classes(task: str) -> tuple:
    """The task's ModelArguments, DataArguments and training arguments dataclasses."""
    recipe = import_module(TASKS[task])
    module, name = TRAINING_ARGUMENTS.get(task, ("trainer_ext.config.flags", "ExtTrainingArguments"))
    return recipe.ModelArguments, recipe.DataArguments, getattr(import_module(module), name)


def main(task: str, argv: Sequence[str] | None = None) -> dict:
    """Parse `argv` (default: the command line) with the task's flags and run its recipe; returns its metrics. A bad
    flag, path or file found once the data or model are read is one line and exit status 2, as a parsing error is."""
    from ..config.flags import ExtArgumentParser
    from ..errors import user_errors

    parser = ExtArgumentParser(argument_classes(task))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    recipe = import_module(TASKS[task])
    with user_errors(parser.prog):
        results = recipe.run(model_args, data_args, training_args)
    report = getattr(recipe, "report", None)
    if report is not None and training_args.process_index == 0:
        report(results, training_args)
    return results


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
