"""Mistakes in a user's input or environment end a run with one clear message and exit status 2, never a traceback;
internal bugs keep theirs. TRAINER_EXT_DEBUG=1 shows the traceback of a user error too (`--debug` is transformers'
own flag). Pure: no torch."""

from __future__ import annotations

import difflib
import functools
import os
import sys
from contextlib import contextmanager

DEBUG_ENV = "TRAINER_EXT_DEBUG"


class UserError(ValueError):
    """A flag, file, path, checkpoint or environment the user can fix; the message names it, its value and the fix."""


class ArgumentsError(UserError):
    """Flags that cannot work together, or a value a flag cannot take; raised before any training starts."""


def closest(word, choices, cutoff: float = 0.6) -> str | None:
    """The valid choice a mistyped word most likely meant (for "did you mean ...?"), or None."""
    hits = difflib.get_close_matches(str(word), [str(choice) for choice in choices], n=1, cutoff=cutoff)
    return hits[0] if hits else None


def debugging() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def main_process() -> bool:
    """Rank 0 of a launched job, or a plain process: the one that speaks for all (every rank meets the same error)."""
    return os.environ.get("RANK", "0").strip() in ("", "0")


def report(err: BaseException, prog: str | None = None) -> None:
    if main_process():
        prog = prog or os.path.basename(sys.argv[0] or "trainer_ext")
        outcome = getattr(err, "outcome", "nothing was trained or overwritten")  # a later error may have saved work
        print(f"{prog}: error: {err}\n({outcome}; {DEBUG_ENV}=1 shows where it was raised)", file=sys.stderr,
              flush=True)


@contextmanager
def user_errors(prog: str | None = None):
    """Turn a UserError raised inside into its message and exit status 2."""
    try:
        yield
    except UserError as err:
        if debugging():
            raise
        report(err, prog)
        raise SystemExit(2) from None


def exits_on_user_error(function):
    """The same, for a function or method: ExtTrainer's constructor and train(), so that a user's own script gets it."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with user_errors():
            return function(*args, **kwargs)
    return wrapper
