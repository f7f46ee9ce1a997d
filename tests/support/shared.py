"""What is session-wide across the pytest-xdist workers (`make test` runs two test files at a time): the session's
shared folder, created by the controller before its workers start and removed at its end, a file lock that lets the
first worker do a piece of work once while the others wait for it, and the lines a worker leaves for the session's
summary, which the controller prints."""

import fcntl
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

SHARED_ENV = "TRAINER_EXT_TEST_SHARED"


def shared_dir() -> Path:
    """This session's folder shared by every pytest-xdist worker (`make test` runs two test files at a time): the
    session-wide reference runs, the op build's lock and what each worker launched live there, so each is done once."""
    return Path(os.environ[SHARED_ENV])


def create_shared_dir(config) -> None:
    """The controller (or a session without workers), before its workers: a new shared folder, in the environment
    the workers inherit."""
    if not hasattr(config, "workerinput") and SHARED_ENV not in os.environ:
        os.environ[SHARED_ENV] = config._shared_created = tempfile.mkdtemp(prefix="trainer-ext-tests-")


def remove_shared_dir(config) -> None:
    created = getattr(config, "_shared_created", None)
    if created:
        shutil.rmtree(created, ignore_errors=True)
        del os.environ[SHARED_ENV]


@contextmanager
def shared_once(name):
    """Exclusive access to `shared_dir()/name` across workers (a file lock): the first worker to come does the work,
    the others wait for it and read the result."""
    with open(shared_dir() / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield shared_dir() / name
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def say(line: str) -> None:
    """A line for the session's summary: written to the shared folder, where the controller of the workers reads it."""
    with open(shared_dir() / f"said-{os.getpid()}.txt", "a") as said:
        said.write(line + "\n")


def said() -> list[str]:
    """Every worker's lines for the summary (see say)."""
    return [line for path in sorted(shared_dir().glob("said-*.txt")) for line in path.read_text().splitlines()]
