"""Mistakes in a user's input or environment are exceptions a script or notebook can catch (`UserError`, a
ValueError; the not-found kinds are FileNotFoundErrors too); uncaught, they end the process with their one-line message
and exit status 2 instead of a traceback, printed once on N ranks. Internal bugs keep their tracebacks.
TRAINER_EXT_DEBUG=1 shows the traceback of a user error too (`--debug` is transformers' own flag). Pure: no torch."""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import time
from contextlib import contextmanager

DEBUG_ENV = "TRAINER_EXT_DEBUG"
QUIET_RANKS_WAIT_S = 3.0  # ample for the main process to print one line, even on a loaded machine


class UserError(ValueError):
    """A flag, file, path, checkpoint or environment the user can fix; the message names it, its value and the fix."""


class ArgumentsError(UserError):
    """Flags that cannot work together, or a value a flag cannot take; raised before any training starts."""


class UserFileNotFoundError(UserError, FileNotFoundError):
    """A file or folder the user named (or asked us to find) is not there: `except FileNotFoundError` catches it too."""


class MissingLibraryError(UserError, ImportError):
    """An optional library a feature needs is not installed; the message gives the pip command (`except ImportError`
    catches it too)."""


def similarity(word, choice) -> float:
    """How likely `choice` is what a user meant by `word`, 0 to 1: difflib's ratio of the two, with dashes, underscores
    and case alike, raised where the word is the choice cut short or one letter longer (--onlyy,
    --gradient_accumulation, --lora_rank for --lora_r) or the choice's words with one left out or added
    (--per_device_batch_size: a plain ratio preferred --per_device_eval_batch_size)."""
    a, b = (str(text).lstrip("-").lower().replace("-", "_") for text in (word, choice))
    if not a or not b:
        return 0.0
    score = difflib.SequenceMatcher(None, a, b).ratio()
    short, long = sorted((a, b), key=len)
    if long.startswith(short) and len(short) >= 3:
        score = max(score, 0.8 + 0.2 * len(short) / len(long))
    words_a, words_b = set(filter(None, a.split("_"))), set(filter(None, b.split("_")))
    if len(words_a | words_b) > 1 and (words_a <= words_b or words_b <= words_a):
        score = max(score, 0.7 + 0.3 * len(words_a & words_b) / len(words_a | words_b))
    return score


def closest(word, choices, cutoff: float = 0.6) -> str | None:
    """The valid choice a mistyped word most likely meant (for "did you mean ...?"), or None: the one suggestion
    engine of every command, flag, key and value (the first of equally likely choices)."""
    scored = [(similarity(word, choice), -index, str(choice)) for index, choice in enumerate(choices)]
    best = max(scored, default=None)
    return best[2] if best is not None and best[0] >= cutoff else None


def unrecognized_arguments(words, valid) -> list[str]:
    """One message per word of a command line its parser does not take, with the closest valid flag: the flags
    among them (a flag's value is not named with it), else every word."""
    flags = [word.split("=")[0] for word in words if str(word).startswith("-")]
    return [f"unrecognized argument {word}" + (f" (did you mean {hint}?)" if (hint := closest(word, valid)) else "")
            for word in flags or words]


class CommandParser(argparse.ArgumentParser):
    """argparse for trainer-ext's subcommands, as ExtArgumentParser is for training flags: abbreviations refused
    (--only for --onlyy would be a silent guess), a flag it does not take named with the closest one before anything
    else is checked (argparse said "unrecognized arguments" bare, or first that a required flag was missing), and
    errors in one line, once on N ranks."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n(see {self.prog} --help for all flags)\n" if main_process()
                  else None)

    def unknown_flags(self, argv) -> list[str]:
        """The words of argv that look like a flag this parser does not take (before any "--")."""
        options = {option for action in self._actions for option in action.option_strings}
        unknown = []
        for word in argv:
            if word == "--":
                break
            if str(word).startswith("-") and not NUMBER.match(str(word)) and str(word).split("=")[0] not in options:
                unknown.append(str(word))
        return unknown

    def parse_args(self, args=None, namespace=None):
        argv = sys.argv[1:] if args is None else [str(word) for word in args]
        if unknown := self.unknown_flags(argv):
            self.error("; ".join(unrecognized_arguments(
                unknown, [option for action in self._actions for option in action.option_strings])))
        return super().parse_args(argv, namespace)


NUMBER = re.compile(r"^-\d|^-\.\d")  # a negative number is a value, not a flag


def debugging() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def main_process() -> bool:
    """Rank 0 of a launched job, or a plain process: the one that speaks for all (every rank meets the same error)."""
    return os.environ.get("RANK", "0").strip() in ("", "0")


def report(err: BaseException, prog: str | None = None, stream=None) -> None:
    """The error's one line, by the main process only; the other ranks, which meet the same error, wait a moment
    before exiting, so the launcher does not stop the main process (seeing a rank fail) before it said why."""
    if main_process():
        prog = prog or os.path.basename(sys.argv[0] or "trainer_ext")
        outcome = getattr(err, "outcome", "nothing was trained or overwritten")  # a later error may have saved work
        print(f"{prog}: error: {err}\n({outcome}; {DEBUG_ENV}=1 shows where it was raised)",
              file=stream or sys.stderr, flush=True)
    else:
        time.sleep(QUIET_RANKS_WAIT_S)


@contextmanager
def user_errors(prog: str | None = None):
    """The process boundary of our own commands (trainer-ext, the examples): a UserError raised inside becomes its
    message and exit status 2."""
    try:
        yield
    except UserError as err:
        if debugging():
            raise
        report(err, prog)
        raise SystemExit(2) from None


def one_line_errors() -> None:
    """For a user's own script (the CLI and the examples have `user_errors`): a UserError nobody caught prints its one
    line and exits with status 2 (after the exit handlers ran: the process group is released as at a normal exit),
    instead of a traceback on every rank. Other exceptions, and every exception in an interactive session (IPython
    shows its own), go to the hook that was there before. Idempotent. ExtTrainer never installs it itself: a library
    leaves the process's hooks as it found them; call it at the top of your script."""
    previous = sys.excepthook
    if getattr(previous, "trainer_ext", False):
        return

    def hook(kind, error, traceback):
        if not issubclass(kind, UserError) or debugging() or hasattr(sys, "ps1"):
            return previous(kind, error, traceback)
        # The real stderr: torch's process group wraps a hook installed before it in a sys.stderr buffer it writes out
        # only after the hook returns, which exit_process never does.
        report(error, stream=sys.__stderr__)
        exit_process(2)

    hook.trainer_ext = True
    sys.excepthook = hook


def exit_process(status: int = 0):
    """End this process with `status` as a normal exit would (threads joined, every exit handler run, so the process
    group is released), then skip interpreter finalization: torch 2.13's DDP keeps gloo's threads alive past
    destroy_process_group (measured: docs/operations.md), and the interpreter torn down under them can abort a rank
    that finished ("terminate called without an active exception", SIGABRT), so the launcher fails the whole job.
    For the process boundary only (our commands and examples, the end of a launched script); never returns."""
    import atexit
    import threading

    if threading.current_thread() is threading.main_thread():
        threading._shutdown()  # noqa: SLF001 (what a normal exit does first: executors' hooks, then non-daemon threads)
    atexit._run_exitfuncs()  # noqa: SLF001 (the handlers a normal exit runs; os._exit below skips them)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(int(status or 0))
