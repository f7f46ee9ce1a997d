"""What a search leaves: a table of its trials (values, metric, state, steps, time) printed and written to
search_results.md, plots of its history and of each value's importance as PNG, and the best trial's model (best/ links
to its folder) with the other finished trials' checkpoints and weights removed unless asked to keep them."""

from __future__ import annotations

import json
import math
import os
import shutil
import warnings
from pathlib import Path

from . import PRUNED_ATTR

RESULTS = "search_results.md"
PLOTS = {"optimization_history.png": "plot_optimization_history", "param_importances.png": "plot_param_importances",
         "intermediate_values.png": "plot_intermediate_values"}
WEIGHTS = ("model*.safetensors", "model*.safetensors.index.json", "pytorch_model*.bin", "checkpoint-*", ".staging*")


def trial_outcome(trial_dir: Path, metric: str) -> tuple[float | None, int | None, str | None]:
    """A finished trial's (metric after training, steps trained, error): from eval_results.json, else the last
    evaluation the trainer logged."""
    steps, history = None, []
    state = trial_dir / "trainer_state.json"
    if state.is_file():
        recorded = json.loads(state.read_text())
        steps, history = recorded.get("global_step"), recorded.get("log_history", [])
    results = trial_dir / "eval_results.json"
    metrics = json.loads(results.read_text()) if results.is_file() else \
        next((row for row in reversed(history) if metric in row), {})
    value = metrics.get(metric)
    if value is None:
        found = sorted(key for key in metrics if key.startswith("eval_")) or ["no evaluation"]
        return None, steps, f"the trial reported no {metric} ({', '.join(found)})"
    if not math.isfinite(value):
        return None, steps, f"{metric} is {value}"
    return float(value), steps, None


def table(study, metric: str) -> str:
    """The trials as a markdown table, one row each: readable in a terminal too."""
    trials = study.get_trials(deepcopy=False)
    names = list(dict.fromkeys(name for trial in trials for name in trial.params))  # the space's order
    best = _best(study)
    header = ["trial", "state", metric, *names, "steps", "time", "runs"]
    rows = []
    for trial in trials:
        attrs = trial.user_attrs
        state = trial.state.name + (" (best)" if best is not None and trial.number == best.number else "")
        value = trial.value if trial.state.name == "COMPLETE" else trial.intermediate_values.get(trial.last_step)
        steps = attrs.get("steps", attrs.get(PRUNED_ATTR, trial.last_step))
        rows.append([str(trial.number), state, "" if value is None else short(value),
                     *[short(trial.params[name]) if name in trial.params else "" for name in names],
                     "" if steps is None else str(steps), _duration(attrs.get("seconds")), str(attrs.get("runs", 0))])
    widths = [max(len(row[column]) for row in [header, *rows]) for column in range(len(header))]

    def line(cells):
        return "| " + " | ".join(cell.ljust(width) for cell, width in zip(cells, widths)) + " |"

    rule = "|" + "|".join("-" * (width + 2) for width in widths) + "|"
    return "\n".join([line(header), rule, *map(line, rows)])


def write(study, settings, study_dir: Path, plots: bool) -> str:
    """search_results.md (and the PNGs when `plots`); returns the text for the terminal."""
    best = _best(study)
    trials = study.get_trials(deepcopy=False)
    counts = {}
    for trial in trials:
        counts[trial.state.name] = counts.get(trial.state.name, 0) + 1
    summary = [f"study {settings.study_name!r} in {settings.storage_url}: {len(trials)} of {settings.max_trials} "
               f"trials ({', '.join(f'{count} {state.lower()}' for state, count in sorted(counts.items()))}); "
               f"{settings.metric}, {settings.direction}"]
    if best is not None:
        values = ", ".join(f"{name}={short(value)}" for name, value in best.params.items())
        summary.append(f"best: trial {best.number}, {settings.metric} {short(best.value)} with {values}; its model: "
                       f"{study_dir / 'best'} -> trial-{best.number}")
    drawn = draw(study, study_dir) if plots else [name for name in PLOTS if (study_dir / name).is_file()]
    text = "\n".join(summary) + "\n\n" + table(study, settings.metric) + "\n"
    images = "".join(f"\n![{name[:-4].replace('_', ' ')}]({name})\n" for name in drawn)
    (study_dir / RESULTS).write_text(f"# Search `{settings.study_name}`\n\n" + "\n\n".join(summary) + "\n\n"
                                     + table(study, settings.metric) + "\n" + images)
    return text


def draw(study, study_dir: Path) -> list[str]:
    """The plots that the trials so far can show; each PNG beside search_results.md."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import optuna
        from optuna.importance import PedAnovaImportanceEvaluator
        from optuna.visualization import matplotlib as plots
    except ImportError:
        return []
    complete = [trial for trial in study.get_trials(deepcopy=False) if trial.state.name == "COMPLETE"]
    wanted = {"optimization_history.png": bool(complete),
              "param_importances.png": len(complete) >= 2 and len({n for t in complete for n in t.params}) >= 2,
              "intermediate_values.png": any(t.intermediate_values for t in study.get_trials(deepcopy=False))}
    drawn = []
    for name, function in PLOTS.items():
        if not wanted[name]:
            continue
        options = {"evaluator": PedAnovaImportanceEvaluator()} if name == "param_importances.png" else {}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                axes = getattr(plots, function)(study, **options)
            axes.figure.savefig(study_dir / name, dpi=120, bbox_inches="tight")
            plt.close(axes.figure)
            drawn.append(name)
        except (ValueError, RuntimeError, ZeroDivisionError) as err:  # too few trials for a statistic
            print(f"trainer-ext search: no {name}: {err}")
    return drawn


def keep_best(study, study_dir: Path, keep_checkpoints: bool) -> None:
    """best/ -> the best trial's folder; the other finished trials' checkpoints and weights removed (they are never
    run again) unless `keep_checkpoints`."""
    best = _best(study)
    if best is not None:
        link, temporary = study_dir / "best", study_dir / ".best"
        if not link.is_symlink() or os.readlink(link) != f"trial-{best.number}":
            temporary.unlink(missing_ok=True)
            temporary.symlink_to(f"trial-{best.number}", target_is_directory=True)
            os.replace(temporary, link)
    if keep_checkpoints:
        return
    for trial in study.get_trials(deepcopy=False):
        if trial.state.is_finished() and (best is None or trial.number != best.number):
            for pattern in WEIGHTS:
                for path in (study_dir / f"trial-{trial.number}").glob(pattern):
                    shutil.rmtree(path) if path.is_dir() else path.unlink()


def _best(study):
    try:
        return study.best_trial
    except ValueError:  # no trial complete yet
        return None


def short(value) -> str:
    """A value as the table shows it: 4 significant digits."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _duration(seconds) -> str:
    if seconds is None:
        return ""
    minutes, seconds = divmod(int(round(seconds)), 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"
