"""Several workers on one study (each a `trainer-ext search` on its own machine, or its own study folder): who a worker
is, the lock under which one worker at a time asks a trial or takes one over, the heartbeat each worker keeps on the
trials it runs, and how another worker decides that a trial's worker is gone."""

from __future__ import annotations

import hashlib
import threading
import time

from ..integrations import internals
from ..environment.processes import alive, same_process, this_process

STOPPED = "stopped"  # the heartbeat of a trial whose worker stopped cleanly (SIGTERM): others may continue it at once


def this_worker(study_dir) -> dict:
    """A worker: its process and its study folder (where its trials' folders are)."""
    return {**this_process(), "study_dir": str(study_dir)}


class StudyLock:
    """One worker at a time counts and asks a trial, or takes one over. PostgreSQL and MySQL hold the lock for the
    worker's own connection, so a worker that dies (even kill -9) releases it with its connection; SQLite (one
    machine): a file lock beside the database file."""

    def __init__(self, url: str, study_name: str):
        from sqlalchemy.engine import make_url

        self.url, self.parsed = url, make_url(url)
        self.backend = self.parsed.get_backend_name()
        self.name = f"trainer_ext.search:{study_name}"
        self.key = int.from_bytes(hashlib.sha1(self.name.encode()).digest()[:8], "big", signed=True)
        self._engine = self._held = None

    def __enter__(self):
        if self.backend == "sqlite":
            import fcntl

            database = self.parsed.database
            if database and database != ":memory:":
                self._held = open(f"{database}.lock", "a")
                fcntl.flock(self._held, fcntl.LOCK_EX)
        elif self.backend in ("postgresql", "mysql", "mariadb"):
            from sqlalchemy import text

            self._held = self._connection()
            if self.backend == "postgresql":
                self._held.execute(text("SELECT pg_advisory_lock(:key)"), {"key": self.key})
            else:  # MySQL's lock names are at most 64 characters
                self._held.execute(text("SELECT GET_LOCK(:name, -1)"), {"name": f"trainer_ext.search:{self.key}"})
        return self

    def __exit__(self, *exc) -> None:
        held, self._held = self._held, None
        if held is not None:
            held.close()  # the lock ends with its connection (a file lock with its file)

    def _connection(self):
        if self._engine is None:
            from sqlalchemy import create_engine
            from sqlalchemy.pool import NullPool

            self._engine = create_engine(self.url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
        return self._engine.connect()


def supports_workers(url: str) -> bool:
    """Whether StudyLock can keep several workers on this database from asking the same trial twice."""
    from sqlalchemy.engine import make_url

    return make_url(url).get_backend_name() in ("sqlite", "postgresql", "mysql", "mariadb")


class Heartbeat(threading.Thread):
    """This worker's pulse on each trial it owns: the trial's `heartbeat` attribute counts up every `interval` seconds
    (a counter, not a time: machines' clocks need not agree). It also notices when another worker took one of them
    over (this worker looked dead to it): the search then stops that run without recording it."""

    def __init__(self, database, me: dict, interval: float):
        super().__init__(name="search-heartbeat", daemon=True)
        self.database, self.me, self.interval = database, me, interval
        self.lost: set[int] = set()  # trial ids another worker owns now
        self._owned: dict[int, int] = {}
        self._guard = threading.Lock()
        self._stopping = threading.Event()
        self._said = False

    def own(self, trial_id: int, beats) -> None:
        """Start beating for a trial (`beats`: its heartbeat so far; the count goes on from there)."""
        with self._guard:
            self._owned[trial_id] = beats if isinstance(beats, int) else 0
        self._beat(trial_id)

    def drop(self, trial_id: int) -> None:
        with self._guard:
            self._owned.pop(trial_id, None)

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        while not self._stopping.wait(self.interval):
            with self._guard:
                owned = list(self._owned)
            for trial_id in owned:
                self._beat(trial_id)

    def _beat(self, trial_id: int) -> None:
        from optuna.exceptions import UpdateFinishedTrialError

        try:
            frozen = self.database.get_trial(trial_id)
            if frozen.state.is_finished():
                self.drop(trial_id)
                return
            if not same_process(frozen.user_attrs.get("owner"), self.me):
                self.drop(trial_id)
                self.lost.add(trial_id)
                return
            with self._guard:
                if trial_id not in self._owned:
                    return
                self._owned[trial_id] += 1
                beats = self._owned[trial_id]
            self.database.set_trial_user_attr(trial_id, "heartbeat", beats)
        except UpdateFinishedTrialError:  # recorded between the look and the beat
            self.drop(trial_id)
        except Exception as err:  # noqa: BLE001 - the database may be out of reach for a while; beat again later
            if not self._said:
                print(f"trainer-ext search: heartbeat not recorded ({type(err).__name__}: {err}); trying again every "
                      f"{self.interval:g} s", flush=True)
                self._said = True


class Watch:
    """Whether the worker of a trial that another worker runs is gone: on this machine, its process is checked;
    elsewhere, its heartbeat must move at least once every `grace_period` seconds of this worker's clock."""

    def __init__(self, me: dict, grace_period: float):
        self.me, self.grace_period = me, grace_period
        self._seen: dict[int, tuple] = {}  # trial id -> (owner pid, heartbeat, since)

    def gone(self, frozen) -> str | None:
        """Why the trial's worker is gone, or None while it may be alive."""
        owner, beat = frozen.user_attrs.get("owner"), frozen.user_attrs.get("heartbeat")
        if not owner:
            return "no worker recorded"
        if same_process(owner, self.me):
            return None
        where = f"{owner.get('host')} (pid {owner.get('pid')})"
        if beat == STOPPED:
            return f"its worker on {where} stopped"
        if owner.get("host") == self.me["host"]:
            return None if alive(owner) else f"its worker on {where} is gone"
        now = time.monotonic()
        seen = (owner.get("pid"), owner.get("started"), beat)
        last = self._seen.get(internals.optuna_trial_id(frozen))
        if last is None or last[0] != seen:
            self._seen[internals.optuna_trial_id(frozen)] = (seen, now)
            return None
        if now - last[1] >= self.grace_period:
            return f"no heartbeat from its worker on {where} for {now - last[1]:.0f} s"
        return None

