"""The backend registry: one file per backend, one line here each. The arguments, experiment files, the planner, the
checkpoint code and ExtTrainer all loop over it; importing it imports no torch."""

from __future__ import annotations

from importlib import import_module

from .base import Backend

# In order of precedence when choosing; the last one (no flag) is the default.
BACKENDS = {
    "fairscale": (".fairscale", "FairScaleBackend"),
    "deepspeed": (".deepspeed", "DeepSpeedBackend"),
    "fsdp": (".fsdp", "FSDPBackend"),
    "ddp": (".ddp", "DDPBackend"),
}


def backend_classes() -> list[type[Backend]]:
    return [getattr(import_module(module, __name__), name) for module, name in BACKENDS.values()]


def backend_flags() -> list[str]:
    """The arguments that choose a backend (`deepspeed`, `sharded_ddp`)."""
    return [cls.flag for cls in backend_classes() if cls.flag]


def owned_flags() -> dict[str, tuple[str, ...]]:
    """Selecting flag -> every argument that backend reads (its section of an experiment file and its companions)."""
    return {cls.flag: cls.owned_flags or (cls.flag,) for cls in backend_classes() if cls.flag}


def checkpoint_state_patterns() -> list[str]:
    """Globs of the backends' own training-state files in a checkpoint folder (checkpoint.py asks, knowing none)."""
    return [pattern for cls in backend_classes() for pattern in cls.checkpoint_state]


def prepare_environment() -> None:
    """What every installed backend library needs in the process environment, selected or not."""
    for cls in backend_classes():
        cls.prepare_environment()


def backend_class(args) -> type[Backend]:
    """The backend these arguments select (several selected is a problem `selection_problems` reports)."""
    classes = backend_classes()
    return next((cls for cls in classes if cls.selected(args)), next(cls for cls in classes if cls.flag is None))


def selection_problems(args) -> list[str]:
    """Every backend's own flag problems, and more than one backend chosen."""
    classes = backend_classes()
    problems = [problem for cls in classes for problem in cls.flag_problems(args)]
    chosen = [cls for cls in classes if cls.selected(args)]
    if len(chosen) > 1:
        problems.append(f"{' and '.join(cls.given_as(args) for cls in chosen)} both choose a backend: give only one "
                        "of them")
    return problems


def select_backend(args) -> Backend:
    return backend_class(args)(args)


def sharded_loading(args):
    """`with sharded_loading(args): model = AutoModel....from_pretrained(...)`: the selected backend's model
    construction context, so one script serves every backend. ZeRO-3 builds and loads the model partitioned (also
    `from_config`; a model class called directly is built whole), so no rank ever holds all of it; FSDP2 with
    `--fsdp_config cpu_ram_efficient_loading true` loads it on rank 0 only, the other ranks build it empty (also
    `from_config` and a class called directly) and receive their shards after fully_shard; any other backend changes
    nothing."""
    return backend_class(args).model_sharded_context(args) if args is not None else Backend.model_sharded_context(args)


__all__ = ["BACKENDS", "Backend", "backend_class", "backend_classes", "backend_flags", "checkpoint_state_patterns",
           "owned_flags", "prepare_environment", "select_backend", "selection_problems", "sharded_loading"]
