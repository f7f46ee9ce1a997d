"""A trial's processes: `trainer-ext train` under the launcher the user chose (one process, torchrun, deepspeed,
torch.distributed.launch) with a port of its own, its share of the GPUs and CPU cores when trials run side by side,
and a process group of its own, led by guard.py, that the search stops with one signal."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time

from ..config.values import did_you_mean

LAUNCHERS = ("python", "torchrun", "deepspeed", "torch.distributed.launch")
# A launcher's variables in the search's own environment would make each trial's process think it is a rank.
DISTRIBUTED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
STOP_WAIT_S = 600  # a stopped trial finishes its step and writes its checkpoint; a large model takes minutes


@dataclasses.dataclass
class Launcher:
    name: str = "python"
    nproc_per_node: int = 1

    def problems(self) -> list[str]:
        if self.name not in LAUNCHERS:
            return [f"--launcher {self.name}: expected one of {', '.join(LAUNCHERS)}"
                    + did_you_mean(self.name, LAUNCHERS)]
        if self.nproc_per_node < 1:
            return [f"--nproc_per_node {self.nproc_per_node}: must be at least 1"]
        if self.name == "python" and self.nproc_per_node > 1:
            return [f"--nproc_per_node {self.nproc_per_node} needs a launcher: add --launcher torchrun (or deepspeed, "
                    "torch.distributed.launch)"]
        return []

    def command(self, devices: list[str] | None = None) -> list[str]:
        """The words before `train experiment.yaml ...`; `devices`: the GPUs this trial may use (None: all)."""
        if self.name == "python":
            return [sys.executable, "-m", "trainer_ext"]
        port = str(free_port())
        if self.name == "deepspeed":  # deepspeed's runner ignores CUDA_VISIBLE_DEVICES next to --num_gpus
            where = ["--include", "localhost:" + ",".join(devices)] if devices else \
                ["--num_gpus", str(self.nproc_per_node)]
            return [sys.executable, "-m", "deepspeed.launcher.runner", *where, "--master_port", port, "--module",
                    "trainer_ext"]
        module = "torch.distributed.run" if self.name == "torchrun" else self.name
        return [sys.executable, "-m", module, "--nproc_per_node", str(self.nproc_per_node), "--master_port", port,
                "-m", "trainer_ext"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def device_slots(parallel_trials: int, launcher: Launcher) -> list[list[str] | None]:
    """The GPUs of each of `parallel_trials` trial slots: disjoint sets of --nproc_per_node; None each without GPUs
    or for one trial at a time (it sees what the search sees)."""
    from ..errors import UserError

    if parallel_trials == 1:
        return [None]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        devices = [device.strip() for device in visible.split(",") if device.strip()]
    else:
        import torch  # device_count asks NVML: no CUDA context in the search process

        devices = [str(index) for index in range(torch.cuda.device_count())]
    if not devices:
        return [None] * parallel_trials
    needed = parallel_trials * launcher.nproc_per_node
    if len(devices) < needed:
        raise UserError(f"{parallel_trials} trials at a time x --nproc_per_node {launcher.nproc_per_node} need "
                        f"{needed} GPUs and {len(devices)} are visible: lower parallel_trials")
    return [devices[slot * launcher.nproc_per_node:(slot + 1) * launcher.nproc_per_node]
            for slot in range(parallel_trials)]


def trial_environment(extra: dict, devices: list[str] | None, launcher: Launcher, parallel_trials: int) -> dict:
    env = {key: value for key, value in os.environ.items() if key not in DISTRIBUTED_ENV}
    env.update(extra, PYTHONUNBUFFERED="1")
    if devices is not None:
        if launcher.name == "deepspeed":
            env.pop("CUDA_VISIBLE_DEVICES", None)  # its --include names them
        else:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    if parallel_trials > 1 and "OMP_NUM_THREADS" not in os.environ:  # side by side, each rank gets its share of cores
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        env["OMP_NUM_THREADS"] = str(max(1, cores // (parallel_trials * launcher.nproc_per_node)))
    return env


def start(command: list[str], env: dict, log_path) -> subprocess.Popen:
    """The trial in a new session led by guard.py, its output appended to `log_path`."""
    with open(log_path, "a") as log:
        guard = [sys.executable, "-m", "trainer_ext.search.guard", str(os.getpid()), "--", *command]
        return subprocess.Popen(guard, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)


def stop(pid: int, hard: bool = False) -> None:
    """SIGTERM to the trial's guard, which passes it once to the whole trial (each rank checkpoints and stops);
    `hard`: SIGKILL to every process of the trial."""
    try:
        os.killpg(pid, signal.SIGKILL) if hard else os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:  # the guard is gone and some of the trial is not: signal what is left
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def group_gone(pid: int) -> bool:
    """No process of the trial is left (a launcher may exit before its ranks finish their checkpoint)."""
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


def stop_and_wait(pid: int, timeout: float = STOP_WAIT_S) -> None:
    """A trial left behind by a search that died: stop it at a checkpoint and wait until all of it has exited."""
    stop(pid)
    deadline = time.monotonic() + timeout
    while not group_gone(pid) and time.monotonic() < deadline + 30:
        if time.monotonic() > deadline:
            stop(pid, hard=True)
        time.sleep(0.5)
