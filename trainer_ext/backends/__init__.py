"""The backend registry: one file per backend, one line here each. The arguments, experiment files, the planner, the
checkpoint code and ExtTrainer all loop over it; importing it imports no torch."""

from __future__ import annotations

from dataclasses import replace
from importlib import import_module

from ..errors import ArgumentsError
from .base import Backend
from .spec import RunSettings, given_as, missing_library, run_settings

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
    """The backend these arguments settled for (RunSettings), else the one their flags select (several selected is a
    problem `selection_problems` reports)."""
    classes = backend_classes()
    run = run_settings(args)
    if run.backend:
        settled = next((cls for cls in classes if cls.name == run.backend), None)
        if settled is None:  # e.g. training_args.bin of a backend registered from outside, loaded without it
            raise ArgumentsError(f"these arguments were settled for the backend {run.backend!r}, which is not "
                                 f"registered in this process (registered: {', '.join(cls.name for cls in classes)}): "
                                 "register it in trainer_ext.backends.BACKENDS first, or build the arguments again")
        return settled
    return next((cls for cls in classes if given_as(cls, args) is not None),
                [cls for cls in classes if cls.flag is None][-1])


def rank_written(args) -> tuple[str, str] | None:
    """The selected backend's flag as given and what its ranks each write into a checkpoint (for SageMaker's refusal
    on several hosts: ("--deepspeed", "each rank's optimizer partition")); None when rank 0 writes all of it."""
    cls = backend_class(args)
    return (given_as(cls, args), cls.rank_written_state) if cls.rank_written_state else None


def selection_problems(args) -> list[str]:
    """Every backend's own flag problems, and more than one backend chosen."""
    classes = backend_classes()
    problems = [problem for cls in classes for problem in cls.owned_flag_problems(args)]
    chosen = [cls for cls in classes if given_as(cls, args) is not None]
    if len(chosen) > 1:
        problems.append(f"{' and '.join(given_as(cls, args) for cls in chosen)} both choose a backend: give only one "
                        "of them")
    return problems


def settle(args, batch, parsing: bool) -> dict:
    """Everything the run settles, once, for config.settings to write in one go: this start's split of the global
    batch (`batch`, config.batch.GlobalBatch: the per-device batch and accumulation transformers and accelerate read),
    the fields the selected backend settles from its flags and that batch (a DeepSpeed file may decide the batch flags:
    its fields win), and `run_settings`, which keeps the batch and the flags given and hands what the backend settled
    to its constructor. `parsing`: ExtTrainingArguments, before transformers reads them; else stock
    TrainingArguments, which transformers set up already (the backend's `prepare_process` then rebuilds what it
    built)."""
    cls = backend_class(args)
    fields, run = cls.settle(args, batch)
    return {**batch.fields(), **fields, "run_settings": replace(
        run, backend=cls.name, parsed=parsing, flags_given=run_settings(args).flags_given, global_batch=batch)}


def import_libraries_quietly(selected: type[Backend] | None = None) -> None:
    """The backends' libraries that transformers or accelerate import whenever they are installed, selected or not,
    imported now without what their import says or sets (DeepSpeed: "Setting accelerator to CPU" and its variables);
    before the process group forms, where DeepSpeed trains (`selected`), what its communication backend would load in
    vain (its CPU all-reduce)."""
    from .deepspeed.ops import import_deepspeed_quietly

    import_deepspeed_quietly(trains=selected is not None and selected.name == "deepspeed")


def select_backend(args) -> Backend:
    return backend_class(args)(args)


__all__ = ["BACKENDS", "Backend", "backend_class", "backend_classes", "backend_flags", "checkpoint_state_patterns",
           "flag_classes", "given_as", "import_libraries_quietly", "missing_library", "owned_flags", "rank_written",
           "RunSettings", "run_settings", "select_backend", "selection_problems", "settle"]
