"""Experiment files: one reviewed YAML (task, hyperparameters, data, backend) validated whole, then trained with the
task's recipe and ExtTrainer — `trainer-ext train experiment.yaml` or `run_experiment(path)`."""

from __future__ import annotations

import dataclasses
import difflib
from importlib import import_module
from pathlib import Path
from typing import Any

from .options import ArgumentsError

TASKS = {
    "classification": "trainer_ext.tasks.classification",
    "qa": "trainer_ext.tasks.qa",
    "translation": "trainer_ext.tasks.translation",
}
# Tasks whose recipe needs more than ExtTrainingArguments (generation settings).
TRAINING_ARGUMENTS = {"translation": ("trainer_ext.seq2seq", "ExtSeq2SeqTrainingArguments")}
SECTIONS = ("task", "description", "hyperparameters", "data", "deepspeed", "sharded_ddp")
MODEL_KWARGS = {"config": "config_kwargs", "tokenizer": "tokenizer_kwargs", "model": "model_kwargs"}
# optimizer / scheduler sections -> the TrainingArguments fields ExtTrainer builds them from
OPTIMIZER_FIELDS = {"lr": "learning_rate", "eps": "adam_epsilon", "weight_decay": "weight_decay"}
SCHEDULER_FIELDS = {"type": "lr_scheduler_type", "warmup_steps": "warmup_steps", "kwargs": "lr_scheduler_kwargs"}


class ExperimentError(ArgumentsError):
    pass


@dataclasses.dataclass
class Experiment:
    """A validated experiment: the task recipe and its three argument objects."""

    task: str
    model_args: Any
    data_args: Any
    training_args: Any

    def run(self) -> dict:
        return import_module(TASKS[self.task]).run(self.model_args, self.data_args, self.training_args)


def read(source) -> tuple[dict, str]:
    """A path to a YAML file, or a mapping (from Python) -> (mapping, name used in messages)."""
    if isinstance(source, dict):
        return source, "experiment"
    path = Path(source)
    if not path.is_file():
        raise ExperimentError(f"{path}: no such experiment file")
    import yaml

    try:
        values = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ExperimentError(f"{path}: not valid YAML ({err})") from None
    if not isinstance(values, dict):
        raise ExperimentError(f"{path}: expected a mapping with sections {', '.join(SECTIONS)}")
    return values, str(path)


def load_experiment(source) -> Experiment:
    """Validate everything (keys, values, data files, backend config) before anything is built or trained."""
    values, name = read(source)
    problems: list[str] = []
    _check_keys(values, SECTIONS, name, problems)
    task = values.get("task")
    if task not in TASKS:
        hint = _closest(str(task), TASKS)
        problems.append(f"{name}: task: {task!r} is not one of {', '.join(TASKS)}" + hint)
        raise ExperimentError("\n".join(problems))
    recipe = import_module(TASKS[task])
    module, name_in_module = TRAINING_ARGUMENTS.get(task, ("trainer_ext.args", "ExtTrainingArguments"))
    training_class = getattr(import_module(module), name_in_module)

    hyper = dict(values.get("hyperparameters") or {})
    data = dict(values.get("data") or {})
    model_fields = _field_names(recipe.ModelArguments)
    training_fields = _field_names(training_class)
    _check_keys(hyper, sorted({*MODEL_KWARGS, "optimizer", "scheduler", *model_fields, *training_fields}),
                f"{name}: hyperparameters", problems)
    _check_keys(data, sorted(_field_names(recipe.DataArguments)), f"{name}: data", problems)

    model_values = {key: hyper.pop(key) for key in list(hyper) if key in model_fields}
    for section, field in MODEL_KWARGS.items():
        if section in hyper:
            model_values[field] = _mapping(hyper.pop(section), f"{name}: hyperparameters.{section}", problems)
    training_values = {key: value for key, value in hyper.items() if key in training_fields}
    training_values.update(_optimizer(hyper.get("optimizer"), f"{name}: hyperparameters.optimizer", problems))
    training_values.update(_scheduler(hyper.get("scheduler"), f"{name}: hyperparameters.scheduler", problems))
    for backend in ("deepspeed", "sharded_ddp"):
        if values.get(backend) is not None:
            training_values[backend] = _backend_value(backend, values[backend], name)
    if problems:
        raise ExperimentError("\n".join(problems))

    model_args = _build(recipe.ModelArguments, model_values, f"{name}: hyperparameters", problems)
    data_args = _build(recipe.DataArguments, data, f"{name}: data", problems)
    training_args = _build(training_class, training_values, f"{name}: hyperparameters", problems)
    if problems:
        raise ExperimentError("\n".join(problems))
    return Experiment(task, model_args, data_args, training_args)


def run_experiment(source) -> dict:
    """Validate, then train and evaluate; returns the task's metrics."""
    return load_experiment(source).run()


# -- helpers ---------------------------------------------------------------------------------------------
def _field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.init}


def _closest(word: str, valid) -> str:
    match = difflib.get_close_matches(word, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _check_keys(values: dict, valid, where: str, problems: list[str]) -> None:
    for key in values:
        if key not in valid:
            problems.append(f"{where}: unknown key {key!r}" + _closest(str(key), valid))


def _mapping(value, where: str, problems: list[str]) -> dict:
    if not isinstance(value, dict):
        problems.append(f"{where}: expected a mapping of keyword arguments, got {value!r}")
        return {}
    return value


def _settings_section(section, settings, fields: dict, where: str, problems: list[str]) -> dict:
    """A settings section (keys of the `settings` dataclass) -> the TrainingArguments fields it stands for."""
    if section is None:
        return {}
    section = _mapping(section, where, problems)
    _check_keys(section, [f.name for f in dataclasses.fields(settings)], where, problems)
    return {fields[key]: value for key, value in section.items() if key in fields}


def _optimizer(section, where: str, problems: list[str]) -> dict:
    from .settings import OptimizerSettings

    values = _settings_section(section, OptimizerSettings, OPTIMIZER_FIELDS, where, problems)
    betas = (section or {}).get("betas") if isinstance(section, dict) else None
    if betas is not None:
        if not (isinstance(betas, (list, tuple)) and len(betas) == 2):
            problems.append(f"{where}: betas: expected two numbers, e.g. [0.9, 0.999], got {betas!r}")
        else:
            values["adam_beta1"], values["adam_beta2"] = (float(b) for b in betas)
    return values


def _scheduler(section, where: str, problems: list[str]) -> dict:
    from .settings import SchedulerSettings

    return _settings_section(section, SchedulerSettings, SCHEDULER_FIELDS, where, problems)


def _backend_value(backend: str, value, name: str):
    if backend == "sharded_ddp":
        return value.split() if isinstance(value, str) else list(value)
    if isinstance(value, str) and not Path(value).is_file() and name != "experiment":
        beside = Path(name).parent / value  # a config next to the experiment file
        if beside.is_file():
            return str(beside)
    return value


def _build(cls, values: dict, where: str, problems: list[str]):
    try:
        return cls(**values)
    except (ArgumentsError, ValueError, TypeError) as err:
        problems.append(f"{where}: {err}")
        return None
