"""Hyperparameter search over full training runs (`trainer-ext search experiment.yaml`): each trial is the experiment
trained by its own launcher and backend in <study_dir>/trial-N, the study is an Optuna database, and a search killed
at any moment continues where it stopped.

space.py     the experiment file's `search` section, validated whole
check.py     a child process validates the experiment with every range end and choice (no torch in the search)
launch.py    a trial's command line under each launcher, its environment, its process group
guard.py     a trial's first process: the trial checkpoints and stops when the search dies
callback.py  inside a trial: reports evaluations (at training samples) to the study, stops a pruned trial after a
             checkpoint
study.py     the Optuna side: storage and its driver, heartbeats and retries, sampler and pruner registries
workers.py   several workers on one study: the lock for asking (liveness: Optuna's heartbeats and retries)
copies.py    a trial's checkpoints and model across machines: fetched for a takeover, the best copied, the rest removed
runner.py    the loop: start, take over, record; signals
report.py    the table of trials, plots, the best trial's model kept
"""

INSTALL = "pip install 'trainer_ext[search]'"


def require_optuna() -> None:
    """Optuna is an extra: without it, one line with the install command (exit 2 through UserError)."""
    import importlib.util

    from ..errors import UserError

    if importlib.util.find_spec("optuna") is None:
        raise UserError(f"trainer-ext search needs Optuna, which is not installed: {INSTALL}")

# Between the search and its trials' processes.
TRIAL_ENV = "TRAINER_EXT_SEARCH_TRIAL"  # JSON: storage, study_name, trial (storage id), number, metric, pruner
PRUNED_ATTR = "pruned_at_step"  # set on the trial by its rank 0 when the pruner stops it
PRUNED_STATUS = 3  # a pruned trial's exit status in one process (launchers turn any failing rank into 1)
