"""What a killed DeepSpeed job leaves on a machine, found and removed before the next run starts.

Stale op-build locks: DeepSpeed JIT-builds its ops through torch's cpp_extension, which guards each op's build
folder with a `lock` file for the whole load. A job killed during that load (a spot reclaim, a Ctrl-C, a test
timeout) leaves the file behind, and every later run on the machine then waits on it forever, printing nothing.
The builder keeps the lock open while it works, so a lock that no process on this host holds open, and that is
older than a few seconds, is stale: we remove it and say so.

Stale shared-memory buffers: DeepSpeed's CPU all-reduce maps /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_
<rank> (~66 MB of RAM each) and never unlinks it. A finished rank removes its own (ExtTrainer's exit hook); a killed
one cannot, so a buffer that no process maps is removed at the next start."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

MIN_AGE_S = 30.0  # a lock younger than this may belong to a builder we raced with in the /proc scan


def extensions_roots() -> list[Path]:
    """Folders torch builds JIT extensions in: $TORCH_EXTENSIONS_DIR, else this environment's own folder (ops.py) and
    torch's default build root (where earlier releases built them)."""
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured:
        return [Path(configured)]
    try:
        from torch.utils.cpp_extension import get_default_build_root
    except ImportError:
        return []
    from .ops import environment_folder

    return [environment_folder(), Path(get_default_build_root())]


def lock_files(roots=None) -> list[Path]:
    """Every `lock` in an op's build folder: root/<op>/lock, and root/py311_cpu/<op>/lock under the default."""
    found = []
    for root in roots if roots is not None else extensions_roots():
        if root.is_dir():
            found += [*root.glob("*/lock"), *root.glob("*/*/lock")]
    return sorted(found)


def holders(path: Path) -> set[int] | None:
    """Process ids on this host with `path` open or mapped; None when one of the file owner's processes could not
    be read, so that nobody can be ruled out. Other users' processes are skipped: the files are the owner's only
    (0600 buffers, a per-user cache)."""
    target = os.path.realpath(path)
    owner = path.stat().st_uid
    pids, unreadable = set(), False
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if owner != 0 and entry.stat().st_uid != owner:
                continue
            fds = list((entry / "fd").iterdir())
            maps = (entry / "maps").read_text()
        except (FileNotFoundError, ProcessLookupError):  # the process ended while we looked
            continue
        except PermissionError:
            unreadable = unreadable or _may_be_python(entry)
            continue
        if any(line.endswith(" " + target) for line in maps.splitlines()):
            pids.add(int(entry.name))
            continue
        for fd in fds:
            try:
                if os.readlink(fd) == target:
                    pids.add(int(entry.name))
                    break
            except OSError:
                continue
    return None if unreadable and not pids else pids


def _may_be_python(process: Path) -> bool:
    """Whether an unreadable process could be a DeepSpeed rank or builder (all of them are Python processes); a
    sandbox's init, say, lets its command line be read but not its memory map."""
    try:
        program = (process / "cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return True
    return b"python" in Path(program.decode(errors="replace")).name.encode()


def _remove_if_unused(path: Path, min_age_s: float, what: str, why: str) -> bool:
    """Remove `path` when it is older than `min_age_s` and no process on this host holds it; log either way."""
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:  # its owner finished meanwhile
        return False
    if age < min_age_s:
        return False
    try:
        held_by = holders(path)
    except FileNotFoundError:
        return False
    if held_by:
        return False
    if held_by is None:
        logger.warning("%s %s is %.0f s old and its holder cannot be checked: if no DeepSpeed job is running on "
                       "this machine, delete it (%s)", what, path, age, why)
        return False
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    logger.warning("removed stale %s %s (%.0f s old, held by no process: left by a killed job; %s)", what, path,
                   age, why)
    return True


def clear_stale_build_locks(roots=None, min_age_s: float = MIN_AGE_S) -> list[Path]:
    """Remove op-build locks that no live process on this host holds and that are older than `min_age_s`;
    return the removed paths. A lock we cannot judge (unreadable /proc entries) is reported, not removed."""
    if not Path("/proc/self/fd").is_dir():  # no /proc (macOS): nothing can be proven, leave the locks alone
        return []
    why = "this run would have waited on it forever"
    return [lock for lock in lock_files(roots) if _remove_if_unused(lock, min_age_s, "op-build lock", why)]


def clear_stale_shm_buffers(shm=Path("/dev/shm"), min_age_s: float = MIN_AGE_S) -> list[Path]:
    """Remove this user's DeepSpeed all-reduce buffers that no process maps; return the removed paths."""
    if not Path("/proc/self/maps").is_file() or not shm.is_dir():
        return []
    why = "it held RAM until the next reboot"
    buffers = sorted(shm.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*"))
    return [path for path in buffers if _remove_if_unused(path, min_age_s, "shared-memory buffer", why)]


def clear_leftovers() -> None:
    """Both of the above, before DeepSpeed loads an op or maps a buffer."""
    clear_stale_build_locks()
    clear_stale_shm_buffers()


def remove_own_shm_buffer() -> None:
    """At exit: this rank's all-reduce buffer (the peers' mappings stay valid after the unlink)."""
    addr, port, rank = (os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK"))
    if addr and port and rank is not None:
        try:
            (Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}").unlink(
                missing_ok=True)
        except OSError:
            pass
