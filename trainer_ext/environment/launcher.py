"""The process this run lives in: what the launcher started (ranks, cores, devices), the variables a job started
without a launcher needs, and the process group's check and release at exit. Imports torch only when called, so the
pure translator can read the launcher's facts."""

from __future__ import annotations

import logging
import os
import sys
import weakref

from ..errors import ArgumentsError, UserError
from ..integrations import internals
from .variables import set_variables

logger = logging.getLogger(__name__)


def world_size_from_environment() -> int | None:
    """Ranks the launcher (torchrun, torch.distributed.launch, deepspeed) started, from WORLD_SIZE; None if unset."""
    value = os.environ.get("WORLD_SIZE", "").strip()
    return int(value) if value.isdigit() else None


def launched_world_size() -> int:
    """Ranks the launcher started (1 without one)."""
    return world_size_from_environment() or 1


def resolve_world_size(world_size: int | None = None) -> int:
    """Explicit argument, else the launcher's WORLD_SIZE, else an initialised process group, else 1."""
    if world_size is not None:
        return int(world_size)
    launched = world_size_from_environment()
    if launched is not None:
        return launched
    dist = sys.modules.get("torch.distributed")  # only if the caller already imported torch
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def local_ranks() -> int:
    """Ranks started on this machine: the deepspeed launcher's LOCAL_SIZE, torchrun's LOCAL_WORLD_SIZE (LOCAL_SIZE
    first: under the deepspeed launcher accelerate's CPU device set-up writes LOCAL_WORLD_SIZE=1 on every rank)."""
    for key in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
        value = os.environ.get(key, "").strip()
        if value.isdigit():
            return int(value)
    return 1


def share_cores_between_cpu_ranks() -> int | None:
    """torchrun and torch.distributed.launch give each of several ranks OMP_NUM_THREADS=1; the deepspeed launcher
    sets nothing, so each CPU rank starts one thread per core and N ranks ask for N times the machine. Give each rank
    its share of the cores, as torchrun would, unless the user chose a number (on 2 cores and MiniLM the stock
    Trainer measured the same either way: benchmarks/results/backends.md). Returns the threads set, or None."""
    ranks = local_ranks()
    if "OMP_NUM_THREADS" in os.environ or ranks < 2:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // ranks)
    set_variables({"OMP_NUM_THREADS": str(threads)})  # for processes this one starts
    import torch

    torch.set_num_threads(threads)
    logger.info("%d CPU ranks on %d cores and OMP_NUM_THREADS unset: %d threads per rank (set OMP_NUM_THREADS to "
                "choose)", ranks, cores, threads)
    return threads


# Variables only a launcher or a cluster's scheduler sets: with one of them the rank variables are the job's own.
LAUNCHER_VARIABLES = (
    "TORCHELASTIC_RUN_ID",  # torchrun, python -m torch.distributed.launch, accelerate launch
    "CROSS_RANK", "LOCAL_SIZE",  # the deepspeed launcher
    "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE",  # mpirun (Open MPI, MPICH, MVAPICH)
    "SLURM_PROCID",  # srun
    "KUBERNETES_SERVICE_HOST",  # a Kubernetes pod: PyTorchJob gives each pod its rank variables, no launcher
    "SM_CURRENT_HOST",  # SageMaker
    "TRAINER_EXT_RANKS_BY_HAND",  # the user starts every rank with the variables set, on purpose
)
RANK_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def rank_variables_problem() -> str | None:
    """WORLD_SIZE > 1 in a process no launcher started (left over in a shell, a .env file, a notebook): it would wait
    for peers that never come, printing nothing, until the rendezvous times out (30 min). One line instead."""
    world = world_size_from_environment()
    if world is None or world <= 1 or any(key in os.environ for key in LAUNCHER_VARIABLES):
        return None
    given = " ".join(f"{key}={os.environ[key]}" for key in RANK_VARIABLES if key in os.environ)
    present = " ".join(key for key in RANK_VARIABLES if key in os.environ)
    return (f"{given} are set but no launcher started this process: it would wait forever for {world - 1} other "
            f"rank(s). For one process: unset {present}; for {world} ranks: start them with a launcher (torchrun "
            f"--nproc_per_node {world} ..., deepspeed --num_gpus {world} ...); if you start each rank yourself, set "
            "TRAINER_EXT_RANKS_BY_HAND=1")


def check_rank_variables() -> None:
    problem = rank_variables_problem()
    if problem:
        raise UserError(problem)


def launch_one_rank_without_launcher() -> bool:
    """`python script.py ...` with no launcher, for a backend whose engine needs a process group even on one process:
    give this process the variables a launcher would give a 1-rank job. Returns True when it set them."""
    if any(key in os.environ for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return False
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    set_variables({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
    set_variables({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}, keep_set=True)
    return True


def form_process_group(args) -> None:
    """For a backend whose engine needs the process group before a model is built (ZeRO-3's zero.Init, fully_shard's
    mesh), also on one process: under a launcher, transformers' device set-up (the arguments' `device`, which the
    Trainer would run when built) forms it now; in `python script.py ...` with no launcher, the variables a launcher
    would give a 1-rank job first, then that set-up run again (it ran when the arguments were built, without them).
    The one place trainer_ext has a process group formed."""
    if launch_one_rank_without_launcher():
        internals.forget_device_setup(args)  # running transformers' device set-up again resets accelerate's
    args.device  # noqa: B018 (the property sets up the process group)


def accelerator_available() -> bool:
    import torch

    accelerator = getattr(torch, "accelerator", None)
    return accelerator.is_available() if accelerator is not None else torch.cuda.is_available()


def prepare_cpu_ranks(args) -> dict:
    """Ranks launched on a machine without a GPU form one gloo group (--use_cpu), with no pinned memory (nothing to pin
    for; torch would warn on every dataloader): the fields to set (config.settings writes them). Values only: each
    rank's share of the cores is prepare_process's."""
    launched, values = launched_world_size(), {}
    if launched > 1 and not args.use_cpu and not accelerator_available():
        # Without it transformers 5 leaves each CPU rank on its own: N independent runs, no error.
        logger.warning("%d ranks launched and no GPU: setting --use_cpu so the ranks form one gloo process group",
                       launched)
        values["use_cpu"] = True
    if (values or cpu_ranks(args)) and not accelerator_available():
        values["dataloader_pin_memory"] = False
    return values


def cpu_ranks(args) -> bool:
    """Whether these arguments train on CPUs (before the device exists): --use_cpu, or no accelerator at all."""
    return bool(getattr(args, "use_cpu", False)) or not accelerator_available()


_TRAINERS = weakref.WeakSet()  # released before the process group at exit


def release_at_exit(trainer) -> None:
    """Destroy the process group before interpreter teardown, then let each trainer's backend clean up after itself:
    left alive, the group's C++ threads can abort a rank that already finished ("terminate called without an active
    exception", exit -6), failing a finished job. Only where a process group exists (a launched rank, or a backend's
    1-rank group): a trainer in a notebook or a single process leaves the exit handlers as it found them. Called when
    the trainer is built and when it trains (a group may form in between); once per trainer."""
    import torch

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()) or trainer in _TRAINERS:
        return
    if not _TRAINERS:
        import atexit

        atexit.register(_release)
    _TRAINERS.add(trainer)


def _release() -> None:
    import gc

    import torch

    # A wrapper or engine still referenced keeps the group alive past destroy_process_group, to be torn down
    # mid-interpreter-shutdown: drop the trainers' references first.
    afterwards = []
    for trainer in list(_TRAINERS):
        internals.set_wrapped_model(trainer, trainer.model)
        trainer.accelerator.free_memory()
        afterwards.append(trainer.backend.teardown(trainer))
    gc.collect()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    for cleanup in filter(None, afterwards):
        cleanup()


def check_process_group(args) -> None:
    """A launcher started N ranks but they did not form one group: each would train alone, N times over."""
    launched = launched_world_size()
    if launched > 1 and args.world_size == 1:
        raise UserError(f"{launched} ranks were launched but this one trains alone (world size 1): on a machine "
                        "without a GPU pass --use_cpu, or use trainer_ext.ExtTrainingArguments, which sets it")


def check_fp16_device(fp16: bool, cuda_available: bool, where: str = "") -> None:
    """fp16 on a machine without CUDA, refused before training; `where`: where fp16 came from, when not the flag (a
    backend's own file says what to change in it)."""
    if fp16 and not cuda_available:
        raise ArgumentsError("fp16 needs a CUDA device and this machine has none: use --bf16 (or fp32) on CPU"
                             + (f" — {where}" if where else ""))


# -- elastic launches (torchrun's agent and rendezvous) ------------------------------------------------------------
def elastic_restarts() -> tuple[int, int] | None:
    """(restarts so far, restarts allowed) of the torchrun agent that started this worker (its
    TORCHELASTIC_RESTART_COUNT and TORCHELASTIC_MAX_RESTARTS; a group growing for a joining node is not counted);
    None outside an elastic agent."""
    count, most = (os.environ.get(key, "").strip() for key in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"))
    return (int(count), int(most)) if count.isdigit() and most.isdigit() else None


def signal_when_the_agent_dies() -> bool:
    """A worker of torchrun's agent (torch.distributed.launch and accelerate launch run the same agent) gets SIGTERM
    when that agent dies (kill -9 of it, an OOM kill): it then checkpoints and stops with its group, as on a
    scheduler's signal, and the other nodes' agents restart on the ranks left, instead of training on unsupervised
    where no restart reaches it. Linux only (prctl); True when set."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return False
    import ctypes
    import signal

    set_parent_death_signal = 1  # PR_SET_PDEATHSIG
    return ctypes.CDLL(None, use_errno=True).prctl(set_parent_death_signal, int(signal.SIGTERM), 0, 0, 0) == 0


def bound_collective_waits(args) -> None:
    """--ddp_timeout (transformers' default: 1800 s) bounds every collective of the process group, so a rank whose peer
    vanished without closing its connections (a node's power or network lost) fails after it, and its agent restarts
    the group, instead of waiting forever. transformers hands it to the group on GPUs; the gloo group of CPU ranks kept
    torch's 30 minutes."""
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized() and cpu_ranks(args):
        internals.set_process_group_timeout(args.ddp_timeout)


def rendezvous_store_problem() -> str | None:
    """torch 2.13's c10d rendezvous shares its first round's store (TORCHELASTIC_USE_AGENT_STORE) and publishes rank 0's
    address only in that round: a node that joins a later round (a new node, a node's agent restarted by its scheduler)
    waits 60 s for it, and the group fails. A multi-node job torchrun may restart is told once; None otherwise (one
    node, the static rendezvous of --master_addr, no restarts, or the variable set)."""
    restarts = elastic_restarts()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not restarts or restarts[1] == 0:
        return None
    if os.environ.get("TORCHELASTIC_RUN_ID", "none") in ("none", "") or launched_world_size() <= local_ranks():
        return None
    return ("torchrun restarts this job (--max-restarts) with the rendezvous store of its first round, whose address "
            "torch 2.13 does not publish again: a node joining later waits 60 s and the group fails; set "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for every node's torchrun (docs/operations.md, Elastic and "
            "preemptible clusters)")
