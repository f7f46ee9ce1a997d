"""Who a process is on this machine (host, pid, start time: survives pid reuse) and whether it still runs. Shared by
the output folder's lock and the search's workers; a leaf module."""

from __future__ import annotations

import socket


def this_process(pid: int | None = None) -> dict:
    """Identity of a process on this machine that survives pid reuse: host, pid and start time."""
    import psutil

    process = psutil.Process(pid)
    return {"host": socket.gethostname(), "pid": process.pid, "started": process.create_time()}


def same_process(a: dict | None, b: dict | None) -> bool:
    return bool(a and b) and all(a.get(key) == b.get(key) for key in ("host", "pid", "started"))


def alive(record: dict | None) -> bool | None:
    """Whether the process recorded is still running; None when it runs on another machine (we cannot tell)."""
    import psutil

    if not record:
        return False
    if record.get("host") != socket.gethostname():
        return None
    try:
        return abs(psutil.Process(record["pid"]).create_time() - record["started"]) < 0.01
    except psutil.Error:
        return False
