"""Several workers on one study (each a `trainer-ext search` on its own machine, or its own study folder): who a worker
is, and the lock under which one worker at a time counts and asks a trial. Liveness is Optuna's: the heartbeats of
RDBStorage and fail_stale_trials (study.py)."""

from __future__ import annotations

import hashlib

from ..environment.processes import this_process


def this_worker(study_dir) -> dict:
    """A worker: its process and its study folder (where its trials' folders are)."""
    return {**this_process(), "study_dir": str(study_dir)}


class StudyLock:
    """One worker at a time counts and asks a trial (Optuna lacks an atomic "ask only while the study holds fewer than
    max_trials"), and creates the tables and the study. PostgreSQL and MySQL hold the lock for the worker's own
    connection, so a worker that dies (even kill -9) releases it with its connection; SQLite (one machine): a file
    lock beside the database file."""

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
