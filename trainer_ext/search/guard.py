"""A trial's first process and the leader of its process group: when the search dies, even by SIGKILL, or stops the
trial, the whole trial gets one SIGTERM (every rank finishes its step, checkpoints and exits); launchers alone do not
all pass a signal on (deepspeed's runner does not). Exits with the launcher's status.

    python -m trainer_ext.search.guard SEARCH_PID -- COMMAND ..."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def signal_when_parent_dies(signum: int) -> None:
    """Linux: the kernel sends `signum` to this process when its parent exits (elsewhere: the next search stops
    a trial its dead predecessor left running)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum)


def main(argv: list[str]) -> int:
    search_pid, command = int(argv[0]), argv[argv.index("--") + 1:]
    signal_when_parent_dies(signal.SIGTERM)
    if os.getppid() != search_pid:  # the search died before the line above
        return 128 + signal.SIGTERM
    child = subprocess.Popen(command)

    def pass_on(signum, frame):
        for each in (signal.SIGTERM, signal.SIGINT):
            signal.signal(each, signal.SIG_IGN)  # once: the group's signal reaches this process too
        os.killpg(0, signal.SIGTERM)

    signal.signal(signal.SIGTERM, pass_on)
    signal.signal(signal.SIGINT, pass_on)
    status = child.wait()
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
