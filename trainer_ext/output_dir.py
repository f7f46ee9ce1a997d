"""What a training run may do to --output_dir: hold it alone (a lock file naming its owner, stale locks recognised) and
never write over the model it was started from."""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

from .errors import UserError

logger = logging.getLogger(__name__)

LOCK = ".trainer_ext.lock"
HEARTBEAT_S = 30.0  # the owner touches its lock this often
STALE_AFTER_S = 600.0  # a lock from another host untouched this long belongs to a run that is gone
MODEL_FILES = ("config.json", "model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
               "pytorch_model.bin.index.json")


class OutputDirError(UserError):
    """--output_dir cannot be written by this run: another run holds it, or it holds the model this run reads."""


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def model_in_output_dir(output_dir, model_path) -> str | None:
    """Why training into `output_dir` would overwrite or delete the model read from `model_path` (a local folder or
    file), or None. Saving writes config.json and model weights into output_dir, and checkpoint rotation deletes
    checkpoint-N folders in it."""
    if not model_path or not output_dir:
        return None
    model = Path(os.path.expanduser(str(model_path)))
    if not model.exists():
        return None  # a Hub name, or nothing: nothing of the user's on disk
    model, output = model.resolve(), Path(os.path.expanduser(str(output_dir))).resolve()
    if not _inside(model, output):
        return None
    if model == output:
        return (f"--output_dir {output_dir} is the folder of the model this run starts from (--model_name_or_path "
                f"{model_path}): training would overwrite its {', '.join(sorted(_model_files(model))) or 'files'}; "
                "give another --output_dir")
    return (f"--output_dir {output_dir} holds the model this run starts from ({model_path}): saving and checkpoint "
            "rotation there could overwrite or delete it; give another --output_dir, or copy the model out of it first")


def _model_files(folder: Path) -> list[str]:
    return [name for name in MODEL_FILES if (folder / name).is_file()]


def check_not_the_model(output_dir, model_path) -> None:
    problem = model_in_output_dir(output_dir, model_path)
    if problem:
        raise OutputDirError(problem)


# -- the lock ----------------------------------------------------------------------------------------------------------
def _owner_text(record: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("locked_at", 0)))
    command = record.get("command")
    return (f"pid {record.get('pid')} on host {record.get('host')}, since {since}"
            + (f" ({command})" if command else ""))


def read_lock(output_dir) -> dict | None:
    path = Path(output_dir) / LOCK
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # half written or damaged: treated as stale below


def holder_problem(output_dir) -> str | None:
    """Why another live run holds `output_dir` (one line naming it and the fix), or None: free, ours, or stale."""
    record = read_lock(output_dir)
    if record is None or not record or _ours(record) or _stale(output_dir, record):
        return None
    return (f"--output_dir {output_dir} is being written by another run: {_owner_text(record)}. Wait for it to finish "
            f"or stop it, or give another --output_dir (if no such run exists, delete {Path(output_dir) / LOCK})")


def _ours(record: dict) -> bool:
    from .processes import same_process, this_process

    return same_process(record, this_process())  # host, pid and start time: a reused pid is not us


def _stale(output_dir, record: dict) -> bool:
    """A lock whose process is gone: on this host by its pid and start time; elsewhere when its heartbeat stopped."""
    from .processes import alive

    if not record or "pid" not in record:
        return True
    running = alive(record)
    if running is not None:
        return not running
    try:
        age = time.time() - (Path(output_dir) / LOCK).stat().st_mtime
    except OSError:
        return True
    return age > STALE_AFTER_S


class OutputDirLock:
    """The lock this process holds on one output_dir: taken by the main process before training, touched every
    HEARTBEAT_S, removed when train() ends and at exit (with the folder, when the run created it and left nothing
    in it)."""

    _held: dict[Path, "OutputDirLock"] = {}

    def __init__(self, output_dir):
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / LOCK
        self.created_folder = False
        self._stop = threading.Event()

    @classmethod
    def acquire(cls, output_dir) -> "OutputDirLock":
        """Take the lock (again, if this process holds it already); OutputDirError names the live owner."""
        key = Path(output_dir).resolve()
        if key in cls._held:
            return cls._held[key]
        lock = cls(output_dir)
        lock._take()
        cls._held[key] = lock
        return lock

    def _take(self) -> None:
        from .processes import this_process

        self.created_folder = not self.output_dir.exists()
        self.output_dir.mkdir(parents=True, exist_ok=True)
        record = {**this_process(), "locked_at": time.time(), "command": " ".join(sys.argv)[:300]}
        for _ in range(3):
            try:
                descriptor = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                problem = holder_problem(self.output_dir)
                if problem:
                    raise OutputDirError(problem) from None
                previous = read_lock(self.output_dir) or {}
                self._remove_stale()
                if previous:
                    logger.warning("--output_dir %s: taking over the lock of a run that is gone (%s)", self.output_dir,
                                   _owner_text(previous))
                continue
            with os.fdopen(descriptor, "w") as stream:
                json.dump(record, stream)
            break
        else:
            raise OutputDirError(f"--output_dir {self.output_dir}: cannot take its lock {self.path} (another run "
                                 "keeps replacing it); give another --output_dir")
        atexit.register(self.release)
        threading.Thread(target=self._heartbeat, daemon=True, name="output-dir-lock").start()

    def _remove_stale(self) -> None:
        # Renamed aside first: of two runs taking over the same stale lock, only one rename succeeds.
        aside = self.path.with_name(f"{LOCK}.stale-{os.getpid()}")
        try:
            self.path.rename(aside)
            aside.unlink()
        except FileNotFoundError:
            pass

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        self._stop.set()
        self._held.pop(self.output_dir.resolve(), None)
        record = read_lock(self.output_dir)
        if record and _ours(record):
            self.path.unlink(missing_ok=True)
        if self.created_folder:
            try:
                self.output_dir.rmdir()  # only when empty: a run refused before it wrote anything leaves no folder
            except OSError:
                pass


def hold_output_dir(trainer) -> None:
    """Before training: refuse an output_dir that is (or holds) the model being trained, then take its lock on the
    main process; every rank gets the same answer."""
    args = trainer.args
    model = trainer.backend.unwrap(trainer.accelerator.unwrap_model(trainer.model)) if trainer.model is not None else None
    source = getattr(getattr(model, "config", None), "_name_or_path", None) or getattr(model, "name_or_path", None)

    def decide():
        problem = model_in_output_dir(args.output_dir, source)
        if problem:
            return problem
        try:
            OutputDirLock.acquire(args.output_dir)
        except OutputDirError as err:
            return str(err)
        return None

    problem = trainer.checkpoints.decided_by_main_process(decide)
    if problem:
        raise OutputDirError(problem)


def release_output_dir(trainer) -> None:
    """Give up this process's lock on the trainer's output_dir: train() returned or failed."""
    lock = OutputDirLock._held.get(Path(trainer.args.output_dir).resolve())
    if lock is not None:
        lock.release()
