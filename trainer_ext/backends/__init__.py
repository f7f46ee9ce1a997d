"""The backend registry: one file per backend, one line here each. The arguments, experiment files, the planner, the
checkpoint code and ExtTrainer all loop over it; importing it imports no torch."""

from __future__ import annotations

from importlib import import_module

from .base import Backend

# In order of precedence when choosing; the last one (no flag) is the default.
BACKENDS = {
    "fairscale": (".fairscale", "FairScaleBackend"),
    "deepspeed": (".deepspeed.backend", "DeepSpeedBackend"),
    "fsdp": (".fsdp.backend", "FSDPBackend"),
    "ddp": (".ddp", "DDPBackend"),
}


def backend_classes() -> list[type[Backend]]:
    return [getattr(import_module(module, __name__), name) for module, name in BACKENDS.values()]


def backend_flags() -> list[str]:
    """The arguments that choose a backend (`deepspeed`, `sharded_ddp`)."""
    return [cls.flag for cls in backend_classes() if cls.flag]


def flag_classes() -> tuple[type, ...]:
    """The dataclasses of the flags the backends bring themselves, for ExtTrainingArguments' bases (in this order:
    their fields follow transformers' own)."""
    return tuple(cls.flags for cls in backend_classes() if cls.flags is not None)


def owned_flags() -> dict[str, tuple[str, ...]]:
    """Selecting flag -> every argument that backend reads (its section of an experiment file and its companions)."""
    return {cls.flag: cls.owned_flags or (cls.flag,) for cls in backend_classes() if cls.flag}


def checkpoint_state_patterns() -> list[str]:
    """Globs of the backends' own training-state files in a checkpoint folder (checkpoints/format.py
    asks, knowing none)."""
    return [pattern for cls in backend_classes() for pattern in cls.checkpoint_state]


def backend_class(args) -> type[Backend]:
    """The backend these arguments select (several selected is a problem `selection_problems` reports)."""
    classes = backend_classes()
    return next((cls for cls in classes if cls.selected(args)), next(cls for cls in classes if cls.flag is None))


def rank_written(args) -> tuple[str, str] | None:
    """The selected backend's flag as given and what its ranks each write into a checkpoint (for SageMaker's refusal
    on several hosts: ("--deepspeed", "each rank's optimizer partition")); None when rank 0 writes all of it."""
    cls = backend_class(args)
    return (cls.given_as(args), cls.rank_written_state) if cls.rank_written_state else None


def selection_problems(args) -> list[str]:
    """Every backend's own flag problems, and more than one backend chosen."""
    classes = backend_classes()
    problems = [problem for cls in classes for problem in cls.owned_flag_problems(args)]
    chosen = [cls for cls in classes if cls.selected(args)]
    if len(chosen) > 1:
        problems.append(f"{' and '.join(cls.given_as(args) for cls in chosen)} both choose a backend: give only one "
                        "of them")
    return problems


def select_backend(args) -> Backend:
    return backend_class(args)(args)


__all__ = ["BACKENDS", "Backend", "backend_class", "backend_classes", "backend_flags", "checkpoint_state_patterns",
           "flag_classes",
           "owned_flags", "rank_written", "select_backend", "selection_problems"]
