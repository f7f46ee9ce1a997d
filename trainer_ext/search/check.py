"""Everything wrong with an experiment file and its search, found before anything trains: the file and flags as
`trainer-ext train` reads them, the `search` section, and the experiment built with each end of every range and every
choice (a ZeRO stage or batch size training would refuse). Runs as a child of the search (`python -m
trainer_ext.search.check request.json result.json`), so that the long-lived search never imports torch nor holds a
GPU or a process group."""

from __future__ import annotations

import json
import os
import sys
from importlib import import_module
from pathlib import Path

from ..config.own_flags import CheckpointFlags, flags_of
from .space import SearchSettings, flag_word, inside_config, read_search, searchable_configs, trial_flags


def check(experiment_path: str, flags: list[str], overrides: dict) -> dict:
    """-> {"problems": [...], "warnings": [...], "settings": SearchSettings as a dict or None, "configs": the
    experiment's backend configs as given ({"deepspeed": its value}), "checkpoint_uri" and "storage_options": the
    experiment's}."""
    from ..experiment import ExperimentError, argument_classes, flag_types, load_experiment, read
    from ..tasks import TASKS

    problems: list[str] = []
    result = {"problems": problems, "warnings": [], "settings": None, "configs": {}, "checkpoint_uri": None,
              "storage_options": None}
    experiment = None
    try:
        experiment = load_experiment(experiment_path, flags)
    except ExperimentError as err:
        problems += str(err).splitlines()
        try:
            experiment = load_experiment(experiment_path) if flags else None  # the search checked against the file
        except ExperimentError:
            pass
    try:
        values, name, folder = read(experiment_path)
    except ExperimentError:
        return result  # no file: already said
    if values.get("task") not in TASKS:
        return result
    if values.get("search") is None:
        problems.append(f"{name}: no search section: add one, e.g. search: {{metric: accuracy, max_trials: 8, "
                        "space: {learning_rate: {type: log_float, low: 1.0e-5, high: 1.0e-3}}}")
        return result
    given = experiment.given if experiment else {}
    keys = searchable_configs()
    configs = {flag: (given if experiment else values).get(flag) for flag in keys}
    output_dir = experiment.training_args.output_dir if experiment else "."
    settings = read_search(values["search"], f"{name}: search", flag_types(argument_classes(values["task"])),
                           metrics=getattr(import_module(TASKS[values["task"]]), "EVAL_METRICS", None),
                           configs=[flag for flag, value in configs.items() if value],
                           study_name=Path(name).stem, study_dir=os.path.join(output_dir, "search"), folder=folder,
                           problems=problems)
    if experiment is None:
        return result
    for key, value in overrides.items():
        if value is not None:
            setattr(settings, key, value)
    settings.study_dir = os.path.abspath(settings.study_dir)  # trials and the SQLite URL do not depend on a folder
    _resolve_paths(settings, folder)
    problems += _requirements(settings, experiment, flags, f"{name}: ", result["warnings"])
    database = _database(settings, f"{name}: ", result["warnings"])  # said last, after the values' problems
    stored = flags_of(CheckpointFlags, experiment.training_args).checkpoint_storage_options
    result.update(configs={flag: value for flag, value in configs.items() if value},
                  checkpoint_uri=given.get("checkpoint_uri"), storage_options=stored or None)
    if problems:
        problems += database
        return result
    for key, param in settings.space.items():
        for value in param.values_to_check():
            params = {key: value}
            if (inside := inside_config(key)) is not None and inside[0] in settings.space:
                params[inside[0]] = settings.space[inside[0]].choices[0]
            try:
                argv = [*flags, "--output_dir", os.path.join(settings.study_dir, "trial-0"),
                        *trial_flags(params, result["configs"])]
                load_experiment(experiment_path, argv)
            except (ExperimentError, *(config.error for config in keys.values())) as err:
                problems += [f"{name}: search.space: {key} = {flag_word(value)}: {line}" for line in _lines(err, name)]
    problems += database
    result["settings"] = settings.to_dict()
    return result


def _lines(err: Exception, name: str) -> list[str]:
    """The problems of an experiment built with one searched value, without the file's name and section (said once
    already) and without the DeepSpeed translator's 'N problems:' heading."""
    lines = []
    for line in str(err).splitlines():
        for prefix in (f"{name}: hyperparameters: ", f"{name}: data: "):
            line = line[len(prefix):] if line.startswith(prefix) else line
        if not line.rstrip().endswith("problems:"):
            lines.append(line.strip().removeprefix("- "))
    return lines


def _resolve_paths(settings: SearchSettings, folder) -> None:
    """Choices of a path flag (deepspeed: ../ds_configs/x.json) are relative to the file, as its other values are."""
    from ..experiment import NAME_OR_PATH_FIELDS, PATH_FIELDS, with_paths

    for key, param in settings.space.items():
        if key in PATH_FIELDS + NAME_OR_PATH_FIELDS and param.choices:
            param.choices = [with_paths({key: choice}, folder)[key] if isinstance(choice, str) else choice
                             for choice in param.choices]


def _database(settings: SearchSettings, name: str, warnings: list[str]) -> list[str]:
    """A storage URL this machine can open (its driver installed), and one that keeps workers apart."""
    if not settings.storage:
        return []
    from .study import driver_problem, shown
    from .workers import supports_workers

    problem = driver_problem(settings.storage)
    if problem:
        return [f"{name}search: storage: {shown(settings.storage)}: {problem}"]
    if not supports_workers(settings.storage):
        warnings.append(f"search.storage: {shown(settings.storage)}: trainer-ext search keeps several workers apart "
                        "on PostgreSQL, MySQL and SQLite only: run one worker on this study")
    return []


def _requirements(settings: SearchSettings, experiment, flags: list[str], name: str, warnings: list[str]) -> list[str]:
    """What the rest of the file and the flags must allow: an evaluation to score, evaluations during training to
    prune on, a flag not both searched and fixed, resuming left on."""
    args, problems = experiment.training_args, []
    if not args.do_eval:
        problems.append(f"{name}search: metric: {settings.metric} needs an evaluation after training: set "
                        "hyperparameters.do_eval: true")
    if settings.pruner.get("type", "none") != "none" and args.eval_strategy == "no":  # enums of transformers: str
        problems.append(f"{name}search: pruner: {settings.pruner.get('type')} stops weak trials on evaluations during "
                        "training, and hyperparameters.eval_strategy is no: set eval_strategy: steps and eval_steps "
                        "(or epoch)")
    for key in settings.space:
        flag = f"--{key}"
        if inside_config(key) is None and any(word == flag or word.startswith(flag + "=") for word in flags):
            problems.append(f"{name}search.space: {key}: searched, and also given as {flag} on the command line: "
                            "drop one")
    if flags_of(CheckpointFlags, args).fresh_start:
        problems.append(f"{name}hyperparameters: fresh_start: true would start interrupted trials over: remove it")
    resume = args.resume_from_checkpoint
    if isinstance(resume, str) and resume not in ("auto", "True", "true"):
        problems.append(f"{name}hyperparameters: resume_from_checkpoint: {resume}: every trial would resume from it, "
                        "an interrupted one too: remove it (each trial resumes from its own newest checkpoint)")
    if args.save_strategy == "no":
        warnings.append("hyperparameters.save_strategy is no: a trial that is interrupted starts over")
    return problems


def validate(experiment_path: str, flags: list[str], overrides: dict) -> dict:
    """check() in a child process (the search's side): its result, or RuntimeError with the child's output."""
    import subprocess
    import tempfile

    from .launch import DISTRIBUTED_ENV

    with tempfile.TemporaryDirectory(prefix="trainer-ext-search-") as folder:
        request, result = Path(folder) / "request.json", Path(folder) / "result.json"
        request.write_text(json.dumps({"experiment": experiment_path, "flags": flags, "overrides": overrides}))
        env = {key: value for key, value in os.environ.items() if key not in DISTRIBUTED_ENV}
        out = subprocess.run([sys.executable, "-m", "trainer_ext.search.check", str(request), str(result)],
                             capture_output=True, text=True, env=env)
        if not result.is_file():
            raise RuntimeError(f"checking {experiment_path} failed (exit status {out.returncode}):\n"
                               f"{(out.stdout + out.stderr)[-4000:]}")
        return json.loads(result.read_text())


def main(argv: list[str]) -> None:
    request = json.loads(Path(argv[0]).read_text())
    result = check(request["experiment"], request["flags"], request["overrides"])
    Path(argv[1]).write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # DeepSpeed's checks may have started a process group; its teardown has nothing to add


if __name__ == "__main__":
    main(sys.argv[1:])
