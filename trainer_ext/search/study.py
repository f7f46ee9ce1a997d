"""The Optuna side of a search: the storage (SQLite by default, any SQLAlchemy URL) and its database driver, samplers
and pruners by name, the study with its space recorded."""

from __future__ import annotations

import inspect
import os
import warnings
from contextlib import contextmanager

from ..config.values import did_you_mean
from ..errors import UserError
from ..integrations import internals

SAMPLERS = {"tpe": "TPESampler", "random": "RandomSampler"}
PRUNERS = {"none": "NopPruner", "median": "MedianPruner", "percentile": "PercentilePruner",
           "successive_halving": "SuccessiveHalvingPruner", "hyperband": "HyperbandPruner",
           "threshold": "ThresholdPruner"}
REGISTRIES = {"sampler": SAMPLERS, "pruner": PRUNERS}
SQLITE_WAIT_S = 60  # trials and the search write to one SQLite file; a writer waits for the lock this long


class OptionError(ValueError):
    """Options the sampler's or pruner's class does not take, one line each."""


def build(kind: str, spec: dict, **extra):
    """A sampler or pruner from {type: name, option: value, ...}; `extra` are options the search adds (seed)."""
    import optuna

    cls = getattr(optuna.samplers if kind == "sampler" else optuna.pruners, REGISTRIES[kind][spec["type"]])
    options = {key: value for key, value in spec.items() if key != "type"}
    valid = [name for name in inspect.signature(cls).parameters if name not in ("self", "args", "kwargs")]
    unknown = [f"{spec['type']}: unknown key {key!r}" + did_you_mean(key, valid) for key in options if key not in valid]
    if unknown:
        raise OptionError("\n".join(unknown))
    with experimental():
        return cls(**{**options, **extra})


def sampler(spec: dict, trials_so_far: int, parallel_trials: int):
    """A sampler seeded for the next trial: a resumed search draws what an uninterrupted one would, not the first
    trial's values again; several trials at a time make TPE assume the running ones' results (constant liar)."""
    extra = {}
    if "seed" in spec:
        extra["seed"] = int(spec["seed"]) + trials_so_far
    if spec["type"] == "tpe" and parallel_trials > 1 and "constant_liar" not in spec:
        extra["constant_liar"] = True
    return build("sampler", spec, **extra)


# SQLAlchemy's driver name -> the package that brings it (SQLAlchemy 2.1 reads postgresql:// with psycopg 3).
DRIVERS = {"psycopg": "psycopg[binary]", "psycopg2": "psycopg2-binary", "pg8000": "pg8000", "asyncpg": "asyncpg",
           "mysqldb": "mysqlclient", "pymysql": "PyMySQL", "mysqlconnector": "mysql-connector-python",
           "mariadbconnector": "mariadb", "oracledb": "oracledb", "pyodbc": "pyodbc"}
EXTRA_FOR = {"psycopg": "trainer_ext[search-postgres]"}


def shown(url: str) -> str:
    """A storage URL as printed and written to the report: without its password."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


def driver_problem(url: str) -> str | None:
    """What keeps SQLAlchemy from opening `url` on this machine (an unknown dialect, a driver not installed), with the
    package to install; None when its driver imports."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        parsed = make_url(url)
        dialect = parsed.get_dialect()
    except NoSuchModuleError:  # an ArgumentError too
        return f"SQLAlchemy knows no database {parsed.drivername!r} (e.g. postgresql://, mysql+pymysql://, sqlite:///)"
    except ArgumentError as err:
        return f"not an SQLAlchemy URL ({err})"
    try:
        dialect.import_dbapi()
    except ImportError:
        driver, scheme = dialect.driver, parsed.drivername
        package = DRIVERS.get(driver, driver)
        extra = f" (or pip install '{EXTRA_FOR[driver]}')" if driver in EXTRA_FOR else ""
        other = "; postgresql+psycopg2:// selects psycopg2" if scheme == "postgresql" else ""
        return (f"{scheme}:// needs the {driver} driver, which is not installed: pip install '{package}'{extra}{other}")
    return None


def storage(url: str, heartbeat_interval: int | None = None, grace_period: int | None = None):
    """The study's RDBStorage. A worker's gives `heartbeat_interval`: Optuna then stamps a heartbeat on each trial the
    worker runs with the database server's clock (SQLite's file too), and `fail_stale_trials` marks a RUNNING trial
    whose heartbeat is older than `grace_period` FAIL and queues a WAITING retry of it with the same values."""
    import optuna

    if url.startswith("sqlite:///"):
        os.makedirs(os.path.dirname(url[len("sqlite:///"):]) or ".", exist_ok=True)
    kwargs = {"connect_args": {"timeout": SQLITE_WAIT_S}} if url.startswith("sqlite") else {}
    if heartbeat_interval is None:
        return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
    with experimental():
        retry = optuna.storages.RetryHeartbeatStaleTrialCallback(inherit_intermediate_values=True)
        return optuna.storages.RDBStorage(url, engine_kwargs=kwargs, heartbeat_interval=heartbeat_interval,
                                          grace_period=grace_period, heartbeat_stale_trial_callback=retry)


def fail_stale_trials(study) -> None:
    """Optuna's check of the other workers: their RUNNING trials with a stale heartbeat become FAIL + a WAITING retry
    (exactly once: the worker whose update wins queues it)."""
    import optuna

    with experimental():
        optuna.storages.fail_stale_trials(study)


def hand_on(study, database, frozen) -> None:
    """A trial this worker leaves RUNNING when it stops cleanly: FAIL + a WAITING retry now, as Optuna's stale check
    would do after the grace period, so another worker (or the next run) continues it at once."""
    from optuna.trial import TrialState

    from optuna.exceptions import UpdateFinishedTrialError

    try:
        failed = database.set_trial_state_values(trial_id(frozen), state=TrialState.FAIL)
    except UpdateFinishedTrialError:  # another worker found it stale first and queued the retry
        return
    if failed:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Warning)
            database.get_heartbeat_stale_trial_callback()(study, database.get_trial(trial_id(frozen)))


def retried_from(frozen) -> int | None:
    """The number of the trial this one retries (the first of the series), None for a trial of its own."""
    import optuna

    with experimental():
        return optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number(frozen)


def folder_number(frozen) -> int:
    """N of the trial's folder trial-N (and remote copy): a retry keeps its original's, to continue from its
    checkpoints."""
    original = retried_from(frozen)
    return frozen.number if original is None else original


def retried(trials) -> set[int]:
    """The numbers of the trials that a later trial retries (FAIL, continued by their retry)."""
    import optuna

    with experimental():
        return {number for trial in trials
                for number in optuna.storages.RetryHeartbeatStaleTrialCallback.retry_history(trial)}


@contextmanager
def experimental():
    """Optuna's experimental API (heartbeat retries, their history) called without its warning on every call."""
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield


def quiet_optuna() -> None:
    """Optuna logs each trial at INFO; the search prints its own lines."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)


def open_study(settings, database):
    """Create the study, or continue it when it exists and searches the same space for the same metric."""
    import optuna

    quiet_optuna()
    study = optuna.create_study(storage=database, study_name=settings.study_name, direction=settings.direction,
                                load_if_exists=True, pruner=build("pruner", settings.pruner),
                                sampler=sampler(settings.sampler, 0, settings.parallel_trials))
    recorded = {"space": settings.to_dict()["space"], "metric": settings.metric, "direction": settings.direction}
    for key, value in recorded.items():
        before = study.user_attrs.get(key)
        if before is None:
            study.set_user_attr(key, value)
        elif before != value:
            raise UserError(f"search: the study {settings.study_name!r} in {settings.storage_url} was made with "
                            f"{key} {before}, and the file now says {value}: give a new study_name (or study_dir) to "
                            "start another study, or restore the section to continue this one")
    return study


def with_sampler(database, settings, trials_so_far: int):
    """The study, asking with a sampler seeded for its next trial (the pruner too: TPE samples within a Hyperband
    bracket)."""
    import optuna

    return optuna.load_study(study_name=settings.study_name, storage=database, pruner=build("pruner", settings.pruner),
                             sampler=sampler(settings.sampler, trials_so_far, settings.parallel_trials))


def trial_id(frozen) -> int:
    """Optuna keeps a trial's storage id private; the trial's process and the search address it by that id."""
    return internals.optuna_trial_id(frozen)


def running_trial(url: str, study_name: str, trial: int, pruner: dict):
    """Inside a trial's process: its Optuna trial (by storage id), to report evaluations and ask the pruner."""
    import optuna

    quiet_optuna()
    study = optuna.load_study(study_name=study_name, storage=storage(url), pruner=build("pruner", pruner),
                              sampler=optuna.samplers.RandomSampler())
    return optuna.trial.Trial(study, trial)

