"""Stale op-build locks: DeepSpeed JIT-builds its ops through torch's cpp_extension, which guards each op's build
folder with a `lock` file for the whole load. A job killed during that load (a spot reclaim, a Ctrl-C, a test
timeout) leaves the file behind, and every later run on the machine then waits on it forever, printing nothing.
The builder keeps the lock open while it works, so a lock that no process on this host holds open, and that is
older than a few seconds, is stale: we remove it and say so."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

MIN_AGE_S = 30.0  # a lock younger than this may belong to a builder we raced with in the /proc scan


def extensions_roots() -> list[Path]:
    """Folders torch builds JIT extensions in: $TORCH_EXTENSIONS_DIR, else torch's default build root."""
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured:
        return [Path(configured)]
    try:
        from torch.utils.cpp_extension import get_default_build_root
    except ImportError:
        return []
    return [Path(get_default_build_root())]


def lock_files(roots=None) -> list[Path]:
    """Every `lock` in an op's build folder: root/<op>/lock, and root/py311_cpu/<op>/lock under the default."""
    found = []
    for root in roots if roots is not None else extensions_roots():
        if root.is_dir():
            found += [*root.glob("*/lock"), *root.glob("*/*/lock")]
    return sorted(found)


def holders(path: Path) -> set[int] | None:
    """Process ids on this host with `path` open; None when some process's open files could not be read
    (another user's processes as non-root), so that nobody can be ruled out."""
    target = os.path.realpath(path)
    pids, unreadable = set(), False
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except FileNotFoundError:  # the process ended while we looked
            continue
        except PermissionError:
            unreadable = True
            continue
        for fd in fds:
            try:
                if os.readlink(fd) == target:
                    pids.add(int(entry.name))
            except OSError:
                continue
    return None if unreadable and not pids else pids


def clear_stale_build_locks(roots=None, min_age_s: float = MIN_AGE_S) -> list[Path]:
    """Remove op-build locks that no live process on this host holds and that are older than `min_age_s`;
    return the removed paths. A lock we cannot judge (unreadable /proc entries) is reported, not removed."""
    if not Path("/proc/self/fd").is_dir():  # no /proc (macOS): nothing can be proven, leave the locks alone
        return []
    removed = []
    for lock in lock_files(roots):
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:  # its builder finished meanwhile
            continue
        if age < min_age_s:
            continue
        held_by = holders(lock)
        if held_by:
            continue
        if held_by is None:
            logger.warning("op-build lock %s is %.0f s old and its holder cannot be checked: if no DeepSpeed job "
                           "is building ops on this machine, delete it, or this run waits on it forever", lock, age)
            continue
        try:
            lock.unlink()
        except FileNotFoundError:
            continue
        removed.append(lock)
        logger.warning("removed stale op-build lock %s (%.0f s old, held by no process: a job killed while "
                       "DeepSpeed built or loaded this op left it; this run would have waited on it forever)",
                       lock, age)
    return removed
