"""What a search leaves: a table of its trials (values, metric, state, steps, time, the hosts that ran them and how
often they were taken over) printed and written to search_results.md, plots of its history, of each value's importance
and of which worker ran what as PNG, and the best trial's model (best/ links to its folder here, or holds a copy from
the remote when another worker ran it) with the other finished trials' checkpoints and weights removed, here and in the
remote copy, unless asked to keep them."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

from ..checkpoints.format import newest_valid_checkpoint
from . import PRUNED_ATTR
from .copies import copied_trial, download_model, remove_remote, replace
from .study import experimental, folder_number, retried, shown

RESULTS = "search_results.md"
PLOTS = {"optimization_history.png": "plot_optimization_history", "param_importances.png": "plot_param_importances",
         "intermediate_values.png": "plot_intermediate_values"}
WORKERS_PLOT = "workers.png"  # which host ran each trial when, drawn when more than one worker took part
WEIGHTS = ("model*.safetensors", "model*.safetensors.index.json", "pytorch_model*.bin", "checkpoint-*", ".staging*")


def trial_outcome(trial_dir: Path, metric: str) -> tuple[float | None, int | None, str | None]:
    """A finished trial's (metric after training, steps trained, error): from eval_results.json, else the last
    evaluation the trainer logged."""
    steps, history = None, []
    state = trial_dir / "trainer_state.json"
    if not state.is_file() and newest_valid_checkpoint(trial_dir) is not None:  # a re-run found training complete
        state = newest_valid_checkpoint(trial_dir) / "trainer_state.json"
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
    header = ["trial", "state", metric, *names, "steps", "time", "runs", "hosts", "takeovers"]
    rows = []
    again = retried(trials)
    for trial in trials:
        attrs = trial.user_attrs
        state = trial.state.name + (" (best)" if best is not None and trial.number == best.number else "") + \
            (" (retried)" if trial.number in again else "")
        value = trial.value if trial.state.name == "COMPLETE" else trial.intermediate_values.get(trial.last_step)
        steps = attrs.get("steps", attrs.get(PRUNED_ATTR))  # optimizer steps (intermediate values are at samples)
        rows.append([str(trial.number), state, "" if value is None else short(value),
                     *[short(trial.params[name]) if name in trial.params else "" for name in names],
                     "" if steps is None else str(steps), _duration(attrs.get("seconds")), str(attrs.get("runs", 0)),
                     ", ".join(hosts(trial)), str(attrs.get("takeovers", 0))])
    widths = [max(len(row[column]) for row in [header, *rows]) for column in range(len(header))]

    def line(cells):
        return "| " + " | ".join(cell.ljust(width) for cell, width in zip(cells, widths)) + " |"

    rule = "|" + "|".join("-" * (width + 2) for width in widths) + "|"
    return "\n".join([line(header), rule, *map(line, rows)])


def write(study, settings, study_dir: Path, me: dict, plots: bool) -> str:
    """search_results.md (and the PNGs when `plots`); returns the text for the terminal."""
    best = _best(study)
    trials = study.get_trials(deepcopy=False)
    counts = {}
    for trial in trials:
        counts[trial.state.name] = counts.get(trial.state.name, 0) + 1
    again = retried(trials)
    states = ", ".join(f"{count} {state.lower()}" for state, count in sorted(counts.items()))
    summary = [f"study {settings.study_name!r} in {shown(settings.storage_url)}: {len(trials) - len(again)} of "
               f"{settings.max_trials} trials ({states}" + (f", of which {len(again)} retried" if again else "")
               + f"); {settings.metric}, {settings.direction}"]
    runs = {}
    for trial in trials:
        for host in hosts(trial, every_run=True) if trial.number not in again else ():  # its retry holds its runs
            runs[host] = runs.get(host, 0) + 1
    moved = [trial.number for trial in trials if trial.user_attrs.get("takeovers")]
    if len(runs) > 1 or moved:
        summary.append("runs by host: " + ", ".join(f"{host} {count}" for host, count in runs.items())
                       + (f"; taken over from a gone worker: trial {', '.join(map(str, moved))}" if moved else ""))
    if best is not None:
        values = ", ".join(f"{name}={short(value)}" for name, value in best.params.items())
        summary.append(f"best: trial {best.number}, {settings.metric} {short(best.value)} with {values}; its model: "
                       + best_model_text(best, study_dir, me))
    drawn = draw(study, study_dir) if plots else [name for name in [*PLOTS, WORKERS_PLOT]
                                                   if (study_dir / name).is_file()]
    text = "\n".join(summary) + "\n\n" + table(study, settings.metric) + "\n"
    images = "".join(f"\n![{name[:-4].replace('_', ' ')}]({name})\n" for name in drawn)
    (study_dir / RESULTS).write_text(f"# Search `{settings.study_name}`\n\n" + "\n\n".join(summary) + "\n\n"
                                     + table(study, settings.metric) + "\n" + images)
    return text


def hosts(trial, every_run: bool = False) -> list[str]:
    """The hosts that ran the trial, in order (each run with `every_run`, else each change of host)."""
    ran = [run[0] for run in trial.user_attrs.get("history") or []]
    if not ran and trial.user_attrs.get("owner"):  # a study from before the history was kept
        ran = [trial.user_attrs["owner"]["host"]]
    return ran if every_run else [host for index, host in enumerate(ran) if index == 0 or ran[index - 1] != host]


def draw(study, study_dir: Path) -> list[str]:
    """The plots that the trials so far can show; each PNG beside search_results.md."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from optuna.importance import PedAnovaImportanceEvaluator
        from optuna.visualization import matplotlib as plots
    except ImportError:
        return []
    complete = [trial for trial in study.get_trials(deepcopy=False) if trial.state.name == "COMPLETE"]
    wanted = {"optimization_history.png": bool(complete),
              "param_importances.png": len(complete) >= 2 and len({n for t in complete for n in t.params}) >= 2,
              "intermediate_values.png": any(t.intermediate_values for t in study.get_trials(deepcopy=False))}
    drawn = [WORKERS_PLOT] if draw_workers(study, study_dir / WORKERS_PLOT) else []
    for name, function in PLOTS.items():
        if not wanted[name]:
            continue
        options = {"evaluator": PedAnovaImportanceEvaluator()} if name == "param_importances.png" else {}
        try:
            with experimental():
                axes = getattr(plots, function)(study, **options)
            if name == "intermediate_values.png":
                axes.set_xlabel("training samples")  # the step the callback reports
            axes.figure.savefig(study_dir / name, dpi=120, bbox_inches="tight")
            plt.close(axes.figure)
            drawn.append(name)
        except (ValueError, RuntimeError, ZeroDivisionError) as err:  # too few trials for a statistic
            print(f"trainer-ext search: no {name}: {err}")
    return drawn


def draw_workers(study, path: Path) -> bool:
    """One bar per run of each trial from its start to its end, coloured by the host that ran it (hatched: a run
    whose worker died, until the trial was taken over): where each trial ran and which ones moved. Only when more
    than one worker took part."""
    import time

    every = study.get_trials(deepcopy=False)
    again = retried(every)  # a retried trial's runs are in its retry's history too
    trials = [trial for trial in every if trial.user_attrs.get("history") and trial.number not in again]
    workers = {(trial.user_attrs.get("owner") or {}).get("study_dir") for trial in trials}
    names = list(dict.fromkeys(host for trial in trials for host in hosts(trial, every_run=True)))
    if len(names) < 2 and len(workers) < 2:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colours = {host: plt.get_cmap("tab10")(index % 10) for index, host in enumerate(names)}
    origin = min(run[1] for trial in trials for run in trial.user_attrs["history"])
    figure, axes = plt.subplots(figsize=(8, 0.4 * len(trials) + 1.5))
    died = False
    for trial in trials:
        runs = trial.user_attrs["history"]
        for index, (host, started, ended) in enumerate(runs):
            lost = ended is None and index + 1 < len(runs)  # its worker died: hatched, until the next run began
            died = died or lost
            if ended is None:
                ended = runs[index + 1][1] if lost else (
                    trial.datetime_complete.timestamp() if trial.datetime_complete else time.time())
            axes.barh(trial.number, (ended - started) / 60, left=(started - origin) / 60, color=colours[host],
                      edgecolor="black", linewidth=0.5, hatch="//" if lost else None)
        taken = trial.user_attrs.get("takeovers", 0)
        if taken:
            axes.annotate(f" taken over {taken}x", ((runs[-1][1] - origin) / 60, trial.number), va="center",
                          fontsize=8)
    keys = [Patch(facecolor=colours[host], edgecolor="black", label=host) for host in names]
    if died:
        keys.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="its worker died"))
    axes.legend(handles=keys, title="host", loc="best", fontsize=8)
    axes.set_yticks([trial.number for trial in trials])
    axes.set_xlabel("minutes since the first trial started")
    axes.set_ylabel("trial")
    axes.invert_yaxis()
    axes.set_title("runs of each trial by host")
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return True


def here(trial, study_dir: Path, me: dict) -> bool:
    """The trial finished in this worker's folder on this machine (its model is there)."""
    owner, folder = trial.user_attrs.get("owner") or {}, trial.user_attrs.get("trial_dir")
    local = study_dir / f"trial-{folder_number(trial)}"
    if folder is None:  # a study from before workers were recorded
        return local.is_dir()
    return Path(folder) == local and owner.get("host") == me["host"] and local.is_dir()


def best_model_text(best, study_dir: Path, me: dict) -> str:
    """Where the best trial's model is, as the report says it."""
    link = study_dir / "best"
    if here(best, study_dir, me):
        return f"{link} -> trial-{folder_number(best)}"
    copied = copied_trial(link)
    if copied and copied.get("trial") == best.number:
        return f"{link} (copied from {copied['from']})"
    owner = best.user_attrs.get("owner") or {}
    return (f"on {owner.get('host')}:{best.user_attrs.get('trial_dir')} (run by another worker, with no remote copy: "
            "give --checkpoint_uri to have it copied here)")


def keep_best(study, study_dir: Path, me: dict, keep_checkpoints: bool, storage_options: dict | None = None,
              removed: set | None = None) -> None:
    """best/ -> the best trial's folder when it ran here, else a copy of its model from the remote; the other finished
    trials' checkpoints and weights removed here and in the remote copy (they are never run again) unless
    `keep_checkpoints`. `removed`: the remote copies removed so far (each is looked for once)."""
    removed = set() if removed is None else removed
    best = _best(study)
    if best is not None:
        link, temporary = study_dir / "best", study_dir / ".best"
        copied = copied_trial(link)
        if here(best, study_dir, me):
            if not link.is_symlink() or os.readlink(link) != f"trial-{folder_number(best)}":
                temporary.unlink(missing_ok=True)
                temporary.symlink_to(f"trial-{folder_number(best)}", target_is_directory=True)
                replace(link, temporary)
        elif best.user_attrs.get("model_uri") and (copied or {}).get("trial") != best.number:
            try:
                download_model(best.user_attrs["model_uri"], storage_options, link,
                               {"trial": best.number, "from": best.user_attrs["model_uri"]})
            except Exception as err:  # noqa: BLE001 - gone or incomplete: the report names where the model is
                print(f"trainer-ext search: best/ not copied from {best.user_attrs['model_uri']} ({err})", flush=True)
        elif link.is_symlink() or (copied or {}).get("trial", best.number) != best.number:
            link.unlink() if link.is_symlink() else shutil.rmtree(link)  # it would name a trial that is not the best
    if keep_checkpoints:
        return
    trials = study.get_trials(deepcopy=False)
    again = retried(trials)
    # A retry continues its original's folder; a trial just found stale (FAIL without an error) is about to have one.
    live = {folder_number(trial) for trial in trials if not trial.state.is_finished() or (
        trial.state.name == "FAIL" and "error" not in trial.user_attrs and trial.number not in again)}
    if best is not None:
        live.add(folder_number(best))
    for trial in trials:
        if trial.state.is_finished() and folder_number(trial) not in live:
            for pattern in WEIGHTS:
                for path in (study_dir / f"trial-{folder_number(trial)}").glob(pattern):
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
            uri = trial.user_attrs.get("checkpoint_uri")
            if uri and uri not in removed:
                try:
                    remove_remote(uri, storage_options)
                    removed.add(uri)
                except Exception as err:  # noqa: BLE001 - tried again after the next trial
                    print(f"trainer-ext search: could not remove {uri} ({err})", flush=True)


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
