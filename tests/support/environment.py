"""This interpreter and what a process started from it inherits: the repository and the environment's own python and
scripts, the environment without rank variables, a free port, the launchers. Importing it sets OMP_WAIT_POLICY and
puts this environment's bin first on PATH, which must happen before torch loads (support/__init__.py imports it
first)."""

import os
import socket
import sys
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning (set before torch loads its OpenMP; launched processes inherit it). Two
# test files at a time put more threads than cores on CI's 2 cores, where spinning threads steal the cores the working
# ones need: three concurrent one-process run_glue.py runs took 70 s of wall and 139 s of CPU with the default policy,
# 24 s and 47 s with PASSIVE. The policy changes no arithmetic (the same threads, the same kernels).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# This environment's bin first on PATH, as when it is activated (`make test` runs .venv/bin/python without activating
# it): torch builds DeepSpeed's ops with the first `ninja` on PATH, and pip's ninja 1.13 and a system 1.11 hash the
# build commands differently, so each switch rebuilt the ops (25 s for the shared-memory op alone, measured): the
# SageMaker job (its toolkit needs the bin first to find torchrun) rebuilt them, the next DeepSpeed test rebuilt them
# back. The product finds its launchers through sys.executable, not PATH, so this hides no lookup of its own.
_BIN = os.path.dirname(sys.executable)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _BIN:
    os.environ["PATH"] = _BIN + os.pathsep + os.environ.get("PATH", "")

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
BIN = Path(sys.executable).parent
DISTRIBUTED_ENV = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


def clean_env() -> dict:
    """This process's environment without the variables that would make a child think it is a rank."""
    return {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launcher(name):
    """This environment's `torchrun` / `deepspeed` script, or its module where packages were installed elsewhere
    (a GPU machine given wheels with pip --target has no script beside its python)."""
    if (BIN / name).exists():
        return [BIN / name]
    return [PYTHON, "-m", {"torchrun": "torch.distributed.run", "deepspeed": "deepspeed.launcher.runner"}[name]]


def with_hooks(**variables) -> dict:
    """clean_env() with tests/scripts/hooks/sitecustomize.py on PYTHONPATH and its `variables` set."""
    env = clean_env()
    hooks = str(REPO / "tests" / "scripts" / "hooks")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [hooks, env.get("PYTHONPATH")]))
    return {**env, **variables}


def signal_at_step(step: int, rank: int, signal_name: str = "SIGTERM") -> dict:
    """clean_env() for a run whose rank `rank` sends itself `signal_name` when it ends optimizer step `step`
    (tests/scripts/hooks): a preemption at the same step every run, on any machine."""
    return with_hooks(TRAINER_EXT_TEST_SIGNAL=f"{step}:{rank}:{signal_name}")


def count_tokenized(folder) -> dict:
    """clean_env() for a run whose processes count the texts they tokenize in `folder` (tests/scripts/hooks), read
    back by tokenized_per_rank."""
    return with_hooks(TRAINER_EXT_TEST_COUNT_TOKENIZED=str(folder))


def tokenized_per_rank(folder) -> dict:
    """{rank: texts tokenized} of every process that counted into `folder` (count_tokenized)."""
    counts = {}
    for record in Path(folder).glob("rank*"):
        rank = int(record.name[4:].split(".")[0])
        counts[rank] = counts.get(rank, 0) + sum(int(line) for line in record.read_text().split())
    return counts
