"""What a training run may do to --output_dir: hold it alone (a lock file naming its owner, stale locks recognised),
never write over the model it was started from, and have room for a checkpoint (a full disk named before training,
and in one line when a save finds it full)."""

from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path

from ..config.own_flags import CheckpointFlags, flags_of
from ..errors import UserError

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
    from ..environment.processes import same_process, this_process

    return same_process(record, this_process())  # host, pid and start time: a reused pid is not us


def _stale(output_dir, record: dict) -> bool:
    """A lock whose process is gone: on this host by its pid and start time; elsewhere when its heartbeat stopped."""
    from ..environment.processes import alive

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
        from ..environment.processes import this_process

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
            try:
                with os.fdopen(descriptor, "w") as stream:
                    json.dump(record, stream)
            except OSError as err:
                self.path.unlink(missing_ok=True)
                if err.errno in FULL:  # a full disk met at its first byte: said before the model is trained
                    raise OutputDirError(f"--output_dir {self.output_dir}: no space left on its disk (writing its "
                                         f"lock {LOCK} failed: {err.strerror}){room_text(self.output_dir)}; free "
                                         "space there, or give an --output_dir on a disk with room") from None
                raise
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
        atexit.unregister(self.release)  # released: the process's exit handlers as they were before the run
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
    """Before training: refuse an output_dir that is (or holds) the model being trained, or whose disk has no room
    for a checkpoint, then take its lock on the main process; every rank gets the same answer."""
    args = trainer.args
    model = trainer.user_model()
    source = getattr(getattr(model, "config", None), "_name_or_path", None) or getattr(model, "name_or_path", None)

    def decide():
        problem = model_in_output_dir(args.output_dir, source) or room_problem(args, model)
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


# -- room on the disk --------------------------------------------------------------------------------------------------
FULL = (errno.ENOSPC, errno.EDQUOT)  # no space left; a user's quota used up
FULL_TEXTS = ("No space left on device", "Disk quota exceeded", "StorageFull")  # safetensors' Rust error has no errno
MIB = 2 ** 20


def _mib(size: float) -> str:
    return f"{size / MIB:.1f} MiB" if size < 2 ** 30 else f"{size / 2 ** 30:.2f} GiB"


def checkpoint_bytes(model, args) -> tuple[int, int]:
    """(weights, optimizer state) bytes one checkpoint of `model` holds at least: the weights as saved (a peft model's
    adapters only), and AdamW's two fp32 moments per trainable parameter (other optimizers: not counted). A lower bound:
    DeepSpeed and FSDP also keep fp32 master weights, and the small files are not counted."""
    if model is None:
        return 0, 0
    parameters = list(model.parameters())
    trainable = [p for p in parameters if p.requires_grad]

    def size(p) -> int:
        return int(getattr(p, "ds_numel", p.numel())) * p.element_size()  # ZeRO-3 keeps the full count in ds_numel

    weights = sum(size(p) for p in (trainable if hasattr(model, "peft_config") else parameters))
    optim = args.optim  # transformers' OptimizerNames is a str: `in` reads its word
    moments = "adam" in optim and not any(bits in optim for bits in ("8bit", "4bit"))
    optimizer = 0 if args.save_only_model or not moments else 8 * sum(
        int(getattr(p, "ds_numel", p.numel())) for p in trainable)
    return weights, optimizer


def _disk(folder) -> tuple[Path, tuple] | None:
    """The mount point of the disk `folder` is (or will be) on, and that disk's usage; None if unknown."""
    path = Path(os.path.expanduser(str(folder))).absolute()
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    try:
        usage, device = shutil.disk_usage(existing), existing.stat().st_dev
        while existing.parent != existing and existing.parent.stat().st_dev == device:
            existing = existing.parent
        return existing, usage
    except (OSError, TypeError, AttributeError):
        return None


def _folder_bytes(folder: Path) -> int:
    total = 0
    for entry in folder.rglob("*") if folder.is_dir() else ():
        try:
            total += entry.stat().st_size if entry.is_file() else 0
        except OSError:
            pass
    return total


def room_text(folder) -> str:
    """" (N MiB free of M MiB on it)" for the disk of `folder`, or nothing when unknown."""
    disk = _disk(folder)
    return f" ({_mib(disk[1].free)} free of {_mib(disk[1].total)} on it)" if disk and disk[1].total else ""


def room_problem(args, model) -> str | None:
    """Before training: why the checkpoint folder's disk cannot hold one checkpoint of `model` (weights and optimizer
    state), or --output_dir's disk the final model, or None. The unfinished checkpoint of an earlier run (.staging) is
    named: it is removed only once the lock is written, which needs room too. A disk whose size is unknown (total 0:
    some network mounts) passes."""
    from .format import staging_dir
    from .policy import checkpoint_folder

    if model is None:  # model_init builds it inside train()
        return None
    weights, optimizer = checkpoint_bytes(model, args)
    saving = args.save_strategy != "no"
    folder = checkpoint_folder(args)
    flag = "--checkpoint_dir" if flags_of(CheckpointFlags, args).checkpoint_dir else "--output_dir"
    needs = [(folder, flag, weights + optimizer if saving else 0, "one checkpoint of this model needs at least "
              f"{_mib(weights + optimizer)} (weights {_mib(weights)} + optimizer state {_mib(optimizer)})")]
    if flag == "--checkpoint_dir" or not saving:
        needs.append((args.output_dir, "--output_dir", weights, f"the trained model needs at least {_mib(weights)}"))
    for where, name, needed, why in needs:
        disk = _disk(where)
        if not needed or disk is None or not disk[1].total:
            continue
        if disk[1].free < needed:
            unfinished = _folder_bytes(staging_dir(where))
            left = (f" ({staging_dir(where)} holds {_mib(unfinished)} of an unfinished checkpoint: delete it)"
                    if unfinished else "")
            return (f"{name} {where}: {_mib(disk[1].free)} free on its disk ({disk[0]}) and {why}: free space "
                    f"there{left}, or give {name} on a disk with room"
                    + (", or --save_strategy no" if saving and name == flag else ""))
    return None


def _chain(err: BaseException):
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _frames(err: BaseException):
    """Every traceback frame of `err` and the exceptions it came from, innermost last."""
    for link in reversed(list(_chain(err))):
        tb = link.__traceback__
        while tb is not None:
            yield tb.tb_frame
            tb = tb.tb_next


def _written(err: BaseException) -> str | None:
    """The file (or folder) a failed save was writing: torch.save's `f`, safetensors' `filename`, open()'s OSError
    filename, else the innermost `output_dir` of transformers' save methods."""
    for link in _chain(err):
        if isinstance(getattr(link, "filename", None), str):
            return link.filename
    found = None
    for frame in _frames(err):
        names, function = frame.f_locals, frame.f_code.co_name
        if function in ("write_bytes", "write_text") and isinstance(names.get("self"), Path):
            found = str(names["self"])
            continue
        for key in ("filename", "f", "json_file_path", "output_dir", "save_directory"):
            if isinstance(names.get(key), (str, os.PathLike)) and (key in ("output_dir", "save_directory")
                                                                   or "save" in function or "write" in function
                                                                   or "json" in function):
                found = str(names[key])
                break
    return found


def out_of_space(err: BaseException, args, model) -> OutputDirError | None:
    """The one line for a save that failed on a full disk (or a used-up quota): the folder, what was being written,
    the space one checkpoint needs; None for any other error. torch.save's error names no errno ("unexpected pos
    ..."), so a failed serialization on a disk with less room than a checkpoint counts too."""
    from .format import STAGING
    from .policy import checkpoint_folder

    if isinstance(err, UserError):
        return None
    said = any(getattr(link, "errno", None) in FULL or any(text in str(link) for text in FULL_TEXTS)
               for link in _chain(err))
    written = _written(err)
    folder = checkpoint_folder(args)
    weights, optimizer = checkpoint_bytes(model, args)
    if not said:
        serializing = any(part in frame.f_code.co_filename for frame in _frames(err)
                          for part in ("torch/serialization.py", "safetensors"))
        disk = _disk(written or folder)
        if not (serializing and isinstance(err, (RuntimeError, OSError)) and disk and disk[1].total
                and disk[1].free < weights + optimizer):
            return None
    where = Path(written) if written else Path(folder)
    given = flags_of(CheckpointFlags, args).checkpoint_dir
    flag = "--checkpoint_dir" if given and Path(folder) in (where, *where.parents) else "--output_dir"
    root = Path(folder) if flag == "--checkpoint_dir" else Path(args.output_dir)
    staged = next((part for part in where.parts if part.startswith("checkpoint-")), None) if STAGING in where.parts \
        else None
    what = f"{staged} ({where})" if staged else str(where)
    error = OutputDirError(f"{flag} {root}: no space left on its disk{room_text(root)} while writing {what}; one "
                           f"checkpoint of this model needs at least {_mib(weights + optimizer)} (weights "
                           f"{_mib(weights)} + optimizer state {_mib(optimizer)}): free space there, or give {flag} on "
                           "a disk with room")
    error.outcome = ("the steps since the last complete checkpoint (if any) are lost; once there is room, the same "
                     "command continues from it and removes the unfinished one" if staged else
                     "what this save was writing is incomplete")
    return error
