"""Experiment files: one reviewed YAML (task, hyperparameters, data, backend) validated whole, then trained with the
task's recipe and ExtTrainer — `trainer-ext train experiment.yaml` or `run_experiment(path)`."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any, Literal, Sequence

from .backends import backend_flags, owned_flags
from .errors import ArgumentsError
from .config.optimizer import OptimizerSettings, SchedulerSettings
from .tasks import TASKS
from .tasks.driver import argument_classes, run_task
from .config.values import WrongType, did_you_mean, field_types, read_as

BACKENDS = set(backend_flags())  # a top-level section each: `deepspeed: zero2_minimal`, `sharded_ddp: simple`
SECTIONS = ("task", "description", "hyperparameters", "data", *sorted(BACKENDS), "search")  # search: trainer-ext search
MODEL_KWARGS = {"config": "config_kwargs", "tokenizer": "tokenizer_kwargs", "model": "model_kwargs"}
# optimizer / scheduler sections -> the TrainingArguments fields ExtTrainer builds them from
OPTIMIZER_FIELDS = {"lr": "learning_rate", "betas": ("adam_beta1", "adam_beta2"), "eps": "adam_epsilon",
                    "weight_decay": "weight_decay"}
SCHEDULER_FIELDS = {"type": "lr_scheduler_type", "warmup_steps": "warmup_steps", "kwargs": "lr_scheduler_kwargs"}
# Fields typed str for the command line (JSON, comma lists) that also take YAML's structured values.
TYPES = {"config_kwargs": dict | str | None, "tokenizer_kwargs": dict | str | None, "model_kwargs": dict | str | None,
         "checkpoint_storage_options": dict | str | None, "class_weights": list[float] | str | None,
         "resume_from_checkpoint": str | Literal[True] | None, "lora_target_modules": list[str] | str | None,
         "dataset_columns": dict | str | None}
# Fields that hold a path: a relative one is relative to the experiment file's folder (cache_dir: in the
# config/tokenizer/model keyword arguments; logging_dir: transformers 4).
PATH_FIELDS = ("train_file", "validation_file", "test_file", "chat_template", "output_dir", "logging_dir",
               "resume_from_checkpoint", "checkpoint_uri", "checkpoint_dir", "fsdp_config", "accelerator_config", "cache_dir")
# Fields that hold a name (Hub model or dataset, DeepSpeed preset) or a path: the path beside the file when there is
# one there (or the value starts with ./ or ../), else the name as written.
NAME_OR_PATH_FIELDS = ("model_name_or_path", "tokenizer_name", "dataset_name", "deepspeed", "generation_config")


class ExperimentError(ArgumentsError):
    pass


@dataclasses.dataclass
class Experiment:
    """A validated experiment: the task recipe, its three argument objects, and the fields the file and flags set."""

    task: str
    model_args: Any
    data_args: Any
    training_args: Any
    given: dict = dataclasses.field(default_factory=dict)

    def run(self, callbacks: Sequence = ()) -> dict:
        return run_task(self.task, self.model_args, self.data_args, self.training_args, callbacks)

    def resolved(self) -> dict:
        """What would run (`--check`): every model and data field, each training field the file or flags set."""
        training = {key: self.given[key] if key == "deepspeed" else getattr(self.training_args, key)
                    for key in self.given if key in _field_names(type(self.training_args))}
        return {"task": self.task, "model": dataclasses.asdict(self.model_args),
                "data": dataclasses.asdict(self.data_args), "training": training}


def read(source, folder=None) -> tuple[dict, str, Path | None]:
    """A path to a YAML file, or a mapping (from Python) -> (mapping, name used in messages, folder of its paths)."""
    if isinstance(source, dict):
        return source, "experiment", None if folder is None else Path(os.path.abspath(folder))
    path = Path(source)
    if not path.is_file():
        raise ExperimentError(f"{path}: no such experiment file")
    import yaml

    try:
        values = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ExperimentError(yaml_problem(path, err)) from None
    if not isinstance(values, dict):
        raise ExperimentError(f"{path}: expected a mapping with sections {', '.join(SECTIONS)}")
    return values, str(path), Path(os.path.abspath(path)).parent


def load_experiment(source, argv: Sequence[str] = (), folder=None) -> Experiment:
    """Validate everything (keys, value types, data files, backend config, command-line flags `argv` that override
    the file's values) before anything is built or trained. Relative paths in a file are relative to its folder (in
    a mapping: to `folder`, default the current directory); in `argv`, to the current directory."""
    values, name, folder = read(source, folder)
    problems: list[str] = []
    check_keys(values, SECTIONS, name, problems)
    task = values.get("task")
    if not isinstance(task, str) or task not in TASKS:
        problems.append(f"{name}: task: {task!r} is not one of {', '.join(TASKS)}" + did_you_mean(task, TASKS))
        raise ExperimentError("\n".join(problems))
    classes = argument_classes(task)
    types = flag_types(classes)
    given = with_paths(_file_values(values, name, classes, types, problems), folder)  # field -> typed value
    flags = _flags(classes, argv, problems)
    if BACKENDS & flags.keys():  # a backend flag replaces the file's backend, with the flags that backend reads
        owned = {flag for flags_of_one in owned_flags().values() for flag in flags_of_one}
        given = {key: value for key, value in given.items() if key not in owned}
    for key, value in flags.items():
        _put(given, key, value, types[key], f"--{key}", problems)
    if problems:
        raise ExperimentError("\n".join(problems))
    arguments = [_build(cls, {key: value for key, value in given.items() if key in _field_names(cls)},
                        f"{name}: {section}", problems)
                 for cls, section in zip(classes, ("hyperparameters", "data", "hyperparameters"))]
    if problems:
        raise ExperimentError("\n".join(problems))
    return Experiment(task, *arguments, given=given)


def flag_types(classes) -> dict:
    """Field of the task's argument classes -> (the type an experiment file's value is read as, its choices)."""
    types = {key: hint for cls in classes for key, hint in field_types(cls).items()}
    types.update((key, (hint, None)) for key, hint in TYPES.items())
    return types


def run_experiment(source, argv: Sequence[str] = ()) -> dict:
    """Validate, then train and evaluate; returns the task's metrics."""
    return load_experiment(source, argv).run()


# -- helpers ---------------------------------------------------------------------------------------------
def yaml_problem(path, err) -> str:
    """PyYAML's error in one line: where (line, column), what, and for a tab the fix (YAML indents with spaces only)."""
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    what = " ".join(str(getattr(err, "problem", None) or err).split())
    hint = ": YAML indents with spaces only, replace the tab" if "'\\t'" in what else ""
    return f"{path}: not valid YAML{where}: {what}{hint}"


def _field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.init}


def check_keys(values: dict, valid, where: str, problems: list[str], flags: bool = False) -> None:
    """Unknown keys, each with the closest valid one; `flags`: the keys are flags' fields, so one transformers 5
    removed (or another tool's spelling) gets what to write instead."""
    from .config.removed import advice

    for key in values:
        if key not in valid:
            instead = advice(key) if flags else None
            problems.append(f"{where}: unknown key {key!r}" + (f": {instead}" if instead else did_you_mean(key, valid)))


def _file_values(values: dict, name: str, classes, types: dict, problems: list[str]) -> dict:
    """The file's sections -> {field of the model/data/training arguments: value read as the field's type}."""
    model_fields, data_fields, training_fields = (_field_names(cls) for cls in classes)
    where = f"{name}: hyperparameters"
    hyper = dict(as_mapping(values.get("hyperparameters") or {}, where, problems))
    data = dict(as_mapping(values.get("data") or {}, f"{name}: data", problems))
    check_keys(hyper, sorted({*MODEL_KWARGS, "optimizer", "scheduler", *model_fields, *training_fields}), where,
                problems, flags=True)
    check_keys(data, sorted(data_fields), f"{name}: data", problems, flags=True)
    given: dict[str, Any] = {}
    for key, value in hyper.items():
        if key in model_fields | training_fields:
            _put(given, key, value, types[key], f"{where}: {key}", problems)
        elif key in MODEL_KWARGS:
            given[MODEL_KWARGS[key]] = as_mapping(value, f"{where}.{key}", problems)
    _section(hyper.get("optimizer"), OptimizerSettings, OPTIMIZER_FIELDS, f"{where}.optimizer", types, given, problems)
    _section(hyper.get("scheduler"), SchedulerSettings, SCHEDULER_FIELDS, f"{where}.scheduler", types, given, problems)
    for key, value in data.items():
        if key in data_fields:
            _put(given, key, value, types[key], f"{name}: data: {key}", problems)
    for backend in sorted(BACKENDS):
        if values.get(backend) is not None:
            _put(given, backend, values[backend], types[backend], f"{name}: {backend}", problems)
    return given


def as_mapping(value, where: str, problems: list[str]) -> dict:
    if not isinstance(value, dict):
        problems.append(f"{where}: expected a mapping, got {value!r}")
        return {}
    return value


def _put(given: dict, field: str, value, type_and_choices, where: str, problems: list[str]) -> None:
    try:
        given[field] = read_as(value, *type_and_choices)
    except WrongType as err:
        problems.append(f"{where}: {err}")


def _section(section, settings, fields: dict, where: str, types: dict, given: dict, problems: list[str]) -> None:
    """An optimizer/scheduler section (keys of the `settings` dataclass) -> the training fields it stands for."""
    if section is None:
        return
    section = as_mapping(section, where, problems)
    check_keys(section, [f.name for f in dataclasses.fields(settings)], where, problems)
    for key, value in section.items():
        target = fields.get(key)
        if isinstance(target, tuple):  # betas -> adam_beta1, adam_beta2
            parts: dict = {}
            _put(parts, key, value, (tuple[tuple(types[field][0] for field in target)], None), f"{where}: {key}",
                 problems)
            given.update(zip(target, parts.get(key, ())))
        elif target:
            _put(given, target, value, types[target], f"{where}: {key}", problems)


def with_paths(values: dict, folder: Path | None) -> dict:
    """Relative paths made relative to `folder` (the experiment file's): see PATH_FIELDS and NAME_OR_PATH_FIELDS."""
    if folder is None:
        return values
    resolved = {}
    for key, value in values.items():
        if isinstance(value, dict) and key in MODEL_KWARGS.values():
            value = with_paths(value, folder)
        elif isinstance(value, dict) and key == "deepspeed":
            value = deepspeed_paths(value, folder)
        elif isinstance(value, str) and _is_path(key, value):
            beside = os.path.normpath(folder / os.path.expanduser(value))
            if key in PATH_FIELDS or os.path.exists(beside) or value.startswith(("./", "../")):
                value = beside
        resolved[key] = value
    return resolved


# Folders a DeepSpeed section names (ZeRO-Infinity's NVMe swap): relative to the experiment file, like its other paths.
DEEPSPEED_PATHS = (("zero_optimization", "offload_optimizer", "nvme_path"),
                   ("zero_optimization", "offload_param", "nvme_path"))


def deepspeed_paths(section: dict, folder: Path) -> dict:
    """A copy of a deepspeed section written in the file, its relative nvme_path(s) made relative to `folder`."""
    import copy

    section = copy.deepcopy(section)
    for *parents, key in DEEPSPEED_PATHS:
        block = section
        for parent in parents:
            block = block.get(parent) if isinstance(block, dict) else None
        if isinstance(block, dict) and isinstance(block.get(key), str) and block[key] != "auto":
            block[key] = os.path.normpath(folder / os.path.expanduser(block[key]))
    return section


def _is_path(key: str, value: str) -> bool:
    """Not inline JSON, an fsspec URL, or resume_from_checkpoint's auto / true / false."""
    if key not in PATH_FIELDS + NAME_OR_PATH_FIELDS or not value or value.lstrip().startswith("{") or "://" in value:
        return False
    from .checkpoints.format import PATH, resume_request

    return not (key == "resume_from_checkpoint" and resume_request(value) != PATH)


def _flags(classes, argv: Sequence[str], problems: list[str]) -> dict:
    """Command-line flags -> {field: value as given}; typed with the file's values, so every problem shows at once."""
    if not argv:
        return {}
    from .args import ExtArgumentParser

    parser = ExtArgumentParser(classes, prog="trainer-ext train")
    for action in parser._actions:  # keep the words as given and only the flags given
        action.type, action.choices, action.default, action.required = None, None, argparse.SUPPRESS, False
    problems += parser.unrecognized(argv)
    return vars(parser.parse_known_args(list(argv))[0])


def _build(cls, values: dict, where: str, problems: list[str]):
    from .deepspeed_config import DeepSpeedConfigError

    try:
        return cls(**values)
    except DeepSpeedConfigError as err:  # from the file's deepspeed section (or --deepspeed), not its hyperparameters
        file = where.rsplit(": ", 1)[0]
        problems.append(f"{file}: deepspeed: {str(err).replace('DeepSpeed config (given as a dict): ', '', 1)}")
        return None
    except (ArgumentsError, ValueError, TypeError) as err:
        problems.append(f"{where}: {err}")
        return None
