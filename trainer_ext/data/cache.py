"""The tokenized-data cache: one folder per key (everything that decides what it holds), built once per machine by
the local main process while the run's other ranks wait for it on a process group of their own (a day's timeout, not
the training's --ddp_timeout), then memory-mapped by every rank, and by later runs, resumes and search trials, after
its checksums say it is the one written. A damaged folder is rebuilt with one warning. Builds are staged and renamed
into place under a file lock, so two machines sharing the folder (or two jobs) build it once."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from ..errors import UserError

LAYOUT = 1  # what a build writes, and how: part of every key (raise it when that changes)
MANIFEST = "manifest.json"
WAIT = timedelta(hours=24)  # the other ranks' wait for a build; training's collectives keep --ddp_timeout
CHUNK = 1 << 24


@dataclass(frozen=True)
class Entry:
    """A verified cache folder: what its manifest says, and whether this run reused it or built it."""

    folder: Path
    manifest: dict
    reused: bool


def checksum(path: Path, algorithm: str = "xxh3_64") -> str:
    import xxhash

    digest = getattr(xxhash, algorithm)()
    with open(path, "rb") as stream:
        while chunk := stream.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_fingerprint(path) -> dict:
    """What a data file holds, for a key: its size and a 128-bit hash of its bytes (not its name or time)."""
    return {"bytes": Path(path).stat().st_size, "xxh3_128": checksum(Path(path), "xxh3_128")}


def folder_name(key: dict) -> str:
    """Named by the key alone: the same content under another name or path (a copy on local scratch, a SageMaker
    channel) finds the same folder."""
    return hashlib.sha256(json.dumps({"layout": LAYOUT, **key}, sort_keys=True, default=str).encode()).hexdigest()[:24]


def damage(folder: Path, key: dict) -> str | None:
    """Why a cache folder is not the complete one written for `key` (said in a phrase), or None."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        return f"its {MANIFEST} cannot be read ({getattr(err, 'strerror', None) or err})"
    if not isinstance(manifest, dict) or manifest.get("key") != json.loads(json.dumps(key, default=str)):
        return f"its {MANIFEST} was written for other data or settings"
    for name, (size, digest) in sorted(manifest.get("files", {}).items()):
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} is {path.stat().st_size:,} bytes, {size:,} were written"
        if checksum(path) != digest:
            return f"{name} does not match the checksum recorded when it was written"
    return None


def local_entry(root: Path, key: dict, build, overwrite: bool = False, say=print) -> Entry:
    """The folder for `key` under `root`, built by `build(staging folder) -> dict` (what the manifest records beside
    the key and the files' checksums) unless a complete one is there; `overwrite` builds it again. Problems writing
    the folder are one UserError naming it and the fix."""
    root = Path(root)
    folder = root / folder_name(key)
    try:
        root.mkdir(parents=True, exist_ok=True)
        with _Lock(root / f".{folder.name}.lock", say):
            if folder.exists() and not overwrite:
                problem = damage(folder, key)
                if problem is None:
                    return Entry(folder, json.loads((folder / MANIFEST).read_text()), True)
                say(f"warning: the tokenized data cache {folder} is damaged ({problem}): building it again")
            for leftover in root.glob(f".{folder.name}.*.tmp"):  # a build that was stopped (we hold the lock)
                shutil.rmtree(leftover, ignore_errors=True)
            staging = root / f".{folder.name}.{socket.gethostname()}.{os.getpid()}.tmp"
            staging.mkdir()
            try:
                started = time.time()
                content = build(staging)
                files = {path.name: [path.stat().st_size, checksum(path)] for path in sorted(staging.iterdir())}
                manifest = {"key": json.loads(json.dumps(key, default=str)), "files": files, **content,
                            "built": time.strftime("%Y-%m-%d %H:%M:%S"), "host": socket.gethostname(),
                            "build_seconds": round(time.time() - started, 2)}
                (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
                if folder.exists():  # damaged, or --overwrite_cache: out of the way first, then gone
                    old = folder.with_name(f".{folder.name}.{os.getpid()}.old.tmp")
                    os.rename(folder, old)
                    shutil.rmtree(old, ignore_errors=True)
                os.rename(staging, folder)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            return Entry(folder, manifest, False)
    except OSError as err:
        raise _cache_error(root, err) from None


def _cache_error(root: Path, err: OSError) -> UserError:
    if err.errno == errno.ENOSPC:
        return UserError(f"no space left on the device of the tokenized data cache {root}: free some, or set "
                         "TRAINER_EXT_CACHE to a folder on a larger disk")
    return UserError(f"the tokenized data cache {root} cannot be written ({err.strerror or err}: "
                     f"{err.filename or root}): set TRAINER_EXT_CACHE to a writable folder")


class _Lock:
    """An exclusive lock file (flock: released when its process dies, also over NFS); says once whom it waits for."""

    def __init__(self, path: Path, say):
        self.path, self.say = path, say

    def __enter__(self):
        try:
            self.stream = open(self.path, "a+")
        except OSError as err:
            if err.errno not in (errno.EROFS, errno.EACCES):
                raise
            self.stream = None  # a read-only cache someone built: reading it needs no lock (building it fails)
            return self
        try:
            fcntl.flock(self.stream, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.stream.seek(0)
            holder = self.stream.read().strip() or "another process"
            self.say(f"waiting for {holder}, which builds the same tokenized data ({self.path.parent})")
            fcntl.flock(self.stream, fcntl.LOCK_EX)
        self.stream.seek(0)
        self.stream.truncate()
        self.stream.write(f"process {os.getpid()} on {socket.gethostname()}")
        self.stream.flush()
        return self

    def __exit__(self, *exc):
        if self.stream is None:
            return
        fcntl.flock(self.stream, fcntl.LOCK_UN)
        self.stream.close()


def on_each_machine(args, work, waiting: str):
    """`work()` run by each machine's local main process while the run's other ranks wait, then its result (or the
    UserError it raised) on every rank of that machine. The wait is a barrier on a gloo group of its own whose timeout
    is WAIT, so a long build never trips the training group's --ddp_timeout; a rank still waiting after a few seconds
    says so once (local rank 1, for the others)."""
    import torch.distributed as dist

    if args.world_size <= 1 or not dist.is_initialized():  # args.world_size forms the process group, as the Trainer
        return work()
    group = dist.new_group(backend="gloo", timeout=WAIT)
    outcome, failure = None, None
    try:
        if args.local_process_index == 0:
            try:
                outcome = ("done", work())
            except UserError as err:
                outcome = ("refused", err)
            except BaseException as err:  # a bug, or an interrupt: the others must not wait for a day
                outcome, failure = ("failed", f"{type(err).__name__}: {err}"), err
            dist.barrier(group=group)
        else:
            _wait(dist.barrier(group=group, async_op=True), args.local_process_index, waiting)
        outcomes = [None] * args.world_size
        dist.all_gather_object(outcomes, (socket.gethostname(), outcome), group=group)
    finally:
        dist.destroy_process_group(group)
    if failure is not None:
        raise failure
    for host, (kind, value) in ((host, outcome) for host, outcome in outcomes if outcome is not None):
        if kind == "refused":
            raise value  # every rank ends with the same line
        if kind == "failed":
            raise RuntimeError(f"the main process of {host} failed while preparing the data: {value}")
    # A machine's ranks are numbered one after the other (torchrun, deepspeed): its main is this rank's first.
    mine = outcomes[dist.get_rank() - args.local_process_index]
    if mine[0] != socket.gethostname() or mine[1] is None:  # another numbering: any main of this host
        mine = next(item for item in outcomes if item[0] == socket.gethostname() and item[1] is not None)
    return mine[1][1]


def _wait(work, local_rank: int, waiting: str, after_s: float = 3.0) -> None:
    started = time.monotonic()
    said = local_rank != 1
    while not work.is_completed():
        if not said and time.monotonic() - started > after_s:
            print(f"trainer_ext: the other ranks of this machine wait while its main process {waiting}", flush=True,
                  file=sys.stdout)
            said = True
        time.sleep(0.05)
    work.wait()
