"""The `search` section of an experiment file read whole: the space (float, log_float, int or categorical ranges over
any flag of `trainer-ext train`, or <flag>.<path> inside a backend's config: deepspeed.zero_optimization.stage), the
metric and its direction, how many trials and how many at a time, the sampler, the pruner and where the study lives;
each problem is one line with the closest valid key. Pure apart from Optuna, which names the sampler's and pruner's
own options."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from typing import Any, Collection

from ..backends import backend_classes
from ..backends.spec import ConfigKeys
from ..experiment import OPTIMIZER_FIELDS, SCHEDULER_FIELDS, check_keys, as_mapping
from ..config.values import WrongType, did_you_mean, read_as

KEYS = ("space", "metric", "direction", "max_trials", "parallel_trials", "sampler", "pruner", "storage", "study_name",
        "study_dir", "heartbeat_interval", "grace_period")
TYPES = {"float": ("low", "high", "step"), "log_float": ("low", "high"), "int": ("low", "high", "step"),
         "categorical": ("choices",)}
KEYS_OF_A_PARAM = ("type", "low", "high", "step", "choices")
DIRECTIONS = ("maximize", "minimize")
# The search gives each trial these itself, or they would start an interrupted trial over.
NOT_SEARCHED = {"output_dir": "each trial trains in <study_dir>/trial-N",
                "fresh_start": "an interrupted trial must resume from its checkpoint",
                "resume_from_checkpoint": "an interrupted trial resumes from its own newest checkpoint",
                "checkpoint_uri": "each trial copies its checkpoints to <checkpoint_uri>/trial-N"}
# The optimizer/scheduler sections' names (lr, warmup_steps) -> the flag a trial is given.
ALIASES = {**{key: field for key, field in OPTIMIZER_FIELDS.items() if isinstance(field, str)},
           **{key: field for key, field in SCHEDULER_FIELDS.items() if key != "type"}}


@dataclasses.dataclass
class Param:
    """One dimension of the space."""

    type: str
    low: float | None = None
    high: float | None = None
    step: float | None = None
    choices: list | None = None

    def values_to_check(self) -> list:
        """The values a trial could be given that are most likely to be refused: both ends, every choice."""
        return list(self.choices) if self.type == "categorical" else [self.low, self.high]

    def distribution(self):
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        if self.type == "categorical":
            return CategoricalDistribution(self.choices)
        if self.type == "int":
            return IntDistribution(int(self.low), int(self.high), step=int(self.step or 1))
        return FloatDistribution(self.low, self.high, log=self.type == "log_float", step=self.step)


@dataclasses.dataclass
class SearchSettings:
    """A validated `search` section."""

    space: dict[str, Param]
    metric: str  # as the evaluation reports it: eval_accuracy
    direction: str
    study_name: str
    study_dir: str
    max_trials: int = 10
    parallel_trials: int = 1
    sampler: dict = dataclasses.field(default_factory=lambda: {"type": "tpe"})
    pruner: dict = dataclasses.field(default_factory=lambda: {"type": "none"})
    storage: str | None = None  # any SQLAlchemy URL; None: SQLite in study_dir
    heartbeat_interval: int = 10  # seconds between Optuna's heartbeats on the trials a worker runs (whole seconds)
    grace_period: int = 60  # a trial whose heartbeat is older than this is failed and retried by another worker

    @property
    def storage_url(self) -> str:
        return self.storage or f"sqlite:///{self.study_dir}/study.db"

    def to_dict(self) -> dict:
        values = dataclasses.asdict(self)
        values["space"] = {name: {key: value for key, value in param.items() if value is not None}
                           for name, param in values["space"].items()}
        return values

    @classmethod
    def from_dict(cls, values: dict) -> SearchSettings:
        return cls(**{**values, "space": {name: Param(**param) for name, param in values["space"].items()}})


def searchable_configs() -> dict[str, ConfigKeys]:
    """{selecting flag: its config's keys} of the backends whose config a search space reaches into (`<flag>.<path>`:
    deepspeed.zero_optimization.stage)."""
    return {cls.flag: cls.config_keys for cls in backend_classes() if cls.config_keys is not None}


def inside_config(name: str) -> tuple[str, str] | None:
    """`deepspeed.zero_optimization.stage` -> ("deepspeed", "zero_optimization.stage"): a key inside the config of the
    backend whose flag the name starts with; None for any other name."""
    flag, dot, path = name.partition(".")
    return (flag, path) if dot and flag in searchable_configs() else None


def read_search(section, where: str, types: dict, *, metrics=None, configs: Collection[str] = (),
                study_name: str = "search", study_dir: str = "search", folder=None,
                problems: list[str]) -> SearchSettings:
    """`section` -> SearchSettings, adding one line per problem to `problems` (the settings then hold what could be
    read, for the checks that look at the rest of the file).

    types: field -> (type, choices) of every flag a trial can be given; metrics: the task's evaluation metrics
    (None: any name); configs: the backend flags whose config the experiment gives (its deepspeed section or
    --deepspeed), which <flag>.<path> keys need; study_dir: the default, used when the section names none (relative
    to `folder` when it does)."""
    start = len(problems)
    section = as_mapping(section, where, problems)
    check_keys(section, KEYS, where, problems)
    space = {name: param for name, value in as_mapping(section.get("space"), f"{where}.space", problems).items()
             if (param := _param(name, value, f"{where}.space: {name}", types, problems)) is not None}
    if "space" in section and not space and len(problems) == start:
        problems.append(f"{where}.space: empty: give at least one hyperparameter to search")
    elif "space" not in section:
        problems.append(f"{where}: no space: give the hyperparameters to search, e.g. "
                        "space: {learning_rate: {type: log_float, low: 1.0e-5, high: 1.0e-3}}")
    for flag in sorted({inside[0] for name in space if (inside := inside_config(name)) is not None}):
        if flag not in configs and flag not in space:
            first = min(name for name in space if name.startswith(f"{flag}."))
            problems.append(f"{where}.space: {first}: the experiment has no {flag} backend (add a {flag} section, "
                            f"pass --{flag}, or search `{flag}` itself)")
    metric = _metric(section.get("metric", "loss"), metrics, f"{where}: metric", problems)
    direction = section.get("direction", "minimize" if metric.endswith("loss") else "maximize")
    if direction not in DIRECTIONS:
        problems.append(f"{where}: direction: expected one of {', '.join(DIRECTIONS)}, got {direction!r}"
                        + did_you_mean(direction, DIRECTIONS))
    counts = {key: _positive(section.get(key, default), int, f"{where}: {key}", problems)
              for key, default in (("max_trials", 10), ("parallel_trials", 1))}
    timing = {key: _positive(section.get(key, default), int, f"{where}: {key}", problems)  # Optuna takes integers
              for key, default in (("heartbeat_interval", 10), ("grace_period", 60))}
    if timing["grace_period"] <= timing["heartbeat_interval"]:
        problems.append(f"{where}: grace_period {timing['grace_period']:g} must exceed heartbeat_interval "
                        f"{timing['heartbeat_interval']:g} (a few heartbeats, e.g. 6x), or live workers look dead")
    sampler = _registered(section.get("sampler", "tpe"), "sampler", f"{where}: sampler", problems)
    pruner = _registered(section.get("pruner", "none"), "pruner", f"{where}: pruner", problems)
    texts = {key: section.get(key) for key in ("storage", "study_name", "study_dir")}
    for key, value in texts.items():
        if value is not None and not (isinstance(value, str) and value.strip()):
            problems.append(f"{where}: {key}: expected a string, got {value!r}")
            texts[key] = None
    if isinstance(texts["storage"], str) and "://" not in texts["storage"]:
        problems.append(f"{where}: storage: {texts['storage']!r} is not an SQLAlchemy URL (e.g. "
                        "postgresql://user@host/db, sqlite:////abs/path/study.db); leave it out for SQLite in "
                        "study_dir")
    if texts["study_dir"] and folder is not None:
        import os

        texts["study_dir"] = os.path.normpath(os.path.join(folder, os.path.expanduser(texts["study_dir"])))
    return SearchSettings(space=space, metric=metric, direction=direction,
                          study_name=texts["study_name"] or study_name, study_dir=texts["study_dir"] or study_dir,
                          storage=texts["storage"], sampler=sampler, pruner=pruner, **counts, **timing)


def trial_flags(params: dict[str, Any], configs: dict | None = None) -> list[str]:
    """A trial's values -> the flags `trainer-ext train` takes; <flag>.<path> values are set inside the experiment's
    config for that backend flag (`configs`: flag -> its value in the experiment; or the searched flag itself), given
    whole as inline JSON (deepspeed.zero_optimization.stage -> --deepspeed '{"zero_optimization": {"stage": 3},
    ...}')."""
    inside: dict[str, dict[str, Any]] = {}
    for name, value in params.items():
        if (key := inside_config(name)) is not None:
            inside.setdefault(key[0], {})[key[1]] = value
    flags: list[str] = []
    for name, value in params.items():
        if inside_config(name) is None and name not in inside:
            flags += [f"--{name}", flag_word(value)]
    keys = searchable_configs()
    for flag, values in inside.items():
        config = keys[flag].load(params.get(flag, (configs or {}).get(flag)))
        for path, value in values.items():
            *parents, last = path.split(".")
            node = config
            for key in parents:
                node = node.setdefault(key, {})
            node[last] = value
        flags += [f"--{flag}", json.dumps(config)]
    return flags


def flag_word(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


# -- helpers ---------------------------------------------------------------------------------------------
def _param(name: str, value, where: str, types: dict, problems: list[str]) -> Param | None:
    start = len(problems)
    if name in NOT_SEARCHED:
        problems.append(f"{where}: not searchable: {NOT_SEARCHED[name]}")
    elif (inside := inside_config(name)) is not None:
        problems += [f"{where}: {line}" for line in searchable_configs()[inside[0]].problems(inside[1])]
    elif name not in types:
        alias = ALIASES.get(name.rsplit(".", 1)[-1])
        problems.append(f"{where}: not a flag of the task's model, data or training arguments"
                        + (f" (did you mean {alias!r}?)" if alias else
                           did_you_mean(name, [*types, *(f"{flag}." for flag in searchable_configs())])))
    if isinstance(value, list):  # [8, 16, 32]: the short form of a categorical
        value = {"type": "categorical", "choices": value}
    value = as_mapping(value, where, problems)
    kind = value.get("type")
    if kind not in TYPES:
        check_keys(value, KEYS_OF_A_PARAM, where, problems)
        problems.append(f"{where}: type: expected one of {', '.join(TYPES)}, got {kind!r}" + did_you_mean(kind, TYPES)
                        if "type" in value else f"{where}: no type (one of {', '.join(TYPES)})")
        return None
    for key in value:
        if key not in KEYS_OF_A_PARAM:
            problems.append(f"{where}: unknown key {key!r}" + did_you_mean(key, KEYS_OF_A_PARAM))
        elif key != "type" and key not in TYPES[kind]:
            problems.append(f"{where}: {key!r} does not apply to type {kind} (it takes {', '.join(TYPES[kind])})")
    hint = types.get(name) if inside_config(name) is None else None
    param = _categorical(value, where, hint, problems) if kind == "categorical" else \
        _range(kind, value, where, hint, problems)
    return param if len(problems) == start else None


def _range(kind: str, value: dict, where: str, hint, problems: list[str]) -> Param | None:
    number = int if kind == "int" else float
    bounds = {}
    for key in TYPES[kind]:
        if key not in value:
            if key != "step":
                problems.append(f"{where}: type {kind} needs {key}")
            continue
        try:
            bounds[key] = read_as(value[key], number)
        except WrongType as err:
            problems.append(f"{where}: {key}: {err}")
    low, high, step = bounds.get("low"), bounds.get("high"), bounds.get("step")
    if low is not None and high is not None and not low < high:
        problems.append(f"{where}: low {low} must be below high {high}")
    if kind == "log_float" and low is not None and low <= 0:
        problems.append(f"{where}: low {low}: a log_float range starts above 0")
    if step is not None and step <= 0:
        problems.append(f"{where}: step {step} must be above 0")
    if hint is not None:
        sample = 1 if kind == "int" else 0.5  # a float range gives fractions: the field must take them
        try:
            read_as(sample, *hint)
        except WrongType:
            problems.append(f"{where}: type {kind}, but the flag takes {_taking(hint)}"
                            + ("; use type int" if kind != "int" and _takes(hint, 1) else
                               "; use type categorical with its choices" if not _takes(hint, 1) else ""))
    return Param(kind, low, high, step) if None not in (low, high) else None


def _categorical(value: dict, where: str, hint, problems: list[str]) -> Param | None:
    choices = value.get("choices")
    if not isinstance(choices, list) or not choices:
        problems.append(f"{where}: choices: expected a non-empty list, got {choices!r}")
        return None
    kept = []
    for choice in choices:
        if choice is None or isinstance(choice, (dict, list)):
            problems.append(f"{where}: choices: {choice!r}: a choice is a number, a string or true/false"
                            + (" (leave the key out of the space to keep the file's value)" if choice is None else ""))
            continue
        if hint is not None:
            try:
                read_as(choice, *hint)
            except WrongType as err:
                problems.append(f"{where}: choices: {err}")
        kept.append(choice)
    if len(set(map(repr, kept))) < len(kept):
        problems.append(f"{where}: choices: {choices!r} repeats a value")
    return Param("categorical", choices=kept)


def _takes(hint, value) -> bool:
    try:
        read_as(value, *hint)
        return True
    except WrongType:
        return False


def _taking(hint) -> str:
    from ..config.values import describe

    return describe(hint[0]) if hint[1] is None else f"one of {', '.join(map(str, hint[1]))}"


def _metric(value, metrics, where: str, problems: list[str]) -> str:
    if not isinstance(value, str) or not value.strip():
        problems.append(f"{where}: expected a metric name such as accuracy or eval_loss, got {value!r}")
        return "eval_loss"
    name = value if value.startswith("eval_") else f"eval_{value}"
    if metrics is not None and name[len("eval_"):] not in metrics:
        problems.append(f"{where}: {value!r} is not a metric the task evaluates ({', '.join(metrics)})"
                        + did_you_mean(name[len("eval_"):], metrics))
    return name


def _positive(value, kind: type, where: str, problems: list[str]):
    """A count (int, at least 1) or seconds (float, above 0); 1 when it is not one."""
    try:
        number = read_as(value, kind)
    except WrongType as err:
        problems.append(f"{where}: {err}")
        return kind(1)
    if number < 1 if kind is int else not number > 0:
        problems.append(f"{where}: {number:g} must be " + ("at least 1" if kind is int else "above 0 (seconds)"))
        return kind(1)
    return number


def _registered(value, kind: str, where: str, problems: list[str]) -> dict:
    """`tpe` or {type: tpe, seed: 0, ...}: a registered name and the options its Optuna class takes."""
    from .study import REGISTRIES, OptionError, build

    spec = {"type": value} if isinstance(value, str) else copy.deepcopy(as_mapping(value, where, problems))
    names = REGISTRIES[kind]
    if spec.get("type") not in names:
        problems.append(f"{where}: type: expected one of {', '.join(names)}, got {spec.get('type')!r}"
                        + did_you_mean(spec.get("type"), names))
        return spec
    for key, number in list(spec.items()):
        if isinstance(number, str) and key != "type" and _is_number(number):
            spec[key] = float(number)  # YAML reads 1e-3 without a dot as a string
    try:
        build(kind, spec)
    except OptionError as err:
        problems += [f"{where}: {line}" for line in str(err).splitlines()]
    except (TypeError, ValueError) as err:
        problems.append(f"{where}: {spec['type']}: {err}")
    return spec


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False
