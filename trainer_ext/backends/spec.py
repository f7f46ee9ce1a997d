"""A backend's pure half (the shape of a Lightning `Strategy`'s class attributes and the planner's formulas): read by
the arguments, experiment files, the planner and the checkpoint code before any trainer exists, with no torch and no
backend library imported."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from ..config.values import option_words


# Hooks the backend interface no longer has (issue 46's redesign), and what a backend does instead.
REPLACED_HOOKS = {
    "build_optimizer": "override setup_model_and_optimizer, which builds the optimizer and wraps the model in the "
                       "order the backend needs",
    "wrap_model": "override setup_model_and_optimizer, which wraps the model and builds the optimizer in the order "
                  "the backend needs",
    "unwrap": "drop it: ExtTrainer finds the model inside the wrapper setup_model_and_optimizer returns",
    "on_train_begin": "return a TrainerCallback with its on_train_begin from callbacks(trainer)",
    "learning_rate_in_use": "set the class attribute steps_in_backward = True",
    "arguments_for_training": "return those fields from prepare_process",
    "places_model_on_device": "return RunSettings(place_model_on_device=...) from settle",
    "selected": "set the class attributes flag (and flag_takes_options)",
}


class BackendSpec:
    """What is known of a backend before anything runs: its flags and their problems, the values it settles from
    them, the planner's memory formulas and the files it keeps in a checkpoint. Class level and pure: the argument
    parser, experiment files, `trainer-ext plan` and the checkpoint code read it with no trainer, process group or
    library. The runtime (base.py's Backend) extends it."""

    def __init_subclass__(cls, **kwargs):
        # A backend written against an earlier interface would have its method silently never called (a sharded
        # run training as plain DDP): refused where the class is defined, naming what replaced it.
        super().__init_subclass__(**kwargs)
        for name, instead in REPLACED_HOOKS.items():
            if name in vars(cls):
                raise TypeError(f"{cls.__module__}.{cls.__qualname__}.{name}: the backend interface has no {name} "
                                f"any more: {instead} (CONTRIBUTING.md, 'Adding a backend')")

    name = "ddp"
    flag: str | None = None  # the argument that selects this backend (None: the default when none is selected)
    owned_flags: tuple[str, ...] = ()  # every argument this backend reads (the selecting one first)
    # The dataclass of the flags this backend brings (transformers' TrainingArguments has none of them), composed into
    # ExtTrainingArguments; None: its flags are transformers' own.
    flags: type | None = None
    library: str | None = None  # the module this backend needs installed, and how to install it
    install = ""
    # Its engine steps the optimizer and scheduler inside backward, before transformers reads the rate the step used:
    # ExtTrainer logs the rate the optimizer held before the step instead.
    steps_in_backward = False
    # Its engine needs the process group before a model is built, even on one process (prepare_process forms it: a
    # 1-rank one without a launcher).
    needs_process_group = False
    # Glob patterns of the files or folders holding this backend's own training state in a checkpoint folder (what a
    # checkpoint without Hugging Face weight files must have to be resumable).
    checkpoint_state: tuple[str, ...] = ()
    # Glob patterns of what a resume of this backend reads of a checkpoint besides the weights: its optimizer state
    # (transformers' optimizer.pt by default). Backends with the same patterns read each other's checkpoints.
    optimizer_state: tuple[str, ...] = ("optimizer.pt",)
    # Whether it can continue a checkpoint's weights and step with a new optimizer state (--resume_weights_only).
    resumes_weights_only = True
    # What every rank writes into a checkpoint itself (None: rank 0 writes all of it), which only a folder the hosts
    # share holds together: SageMaker's per-host checkpoint folder refuses such a backend on several hosts.
    rank_written_state: str | None = None

    # The selecting flag is a list of option words (`--sharded_ddp "zero_dp_2 offload"`), shown with it in messages.
    flag_takes_options = False
    # The selecting flag takes a config (a file or inline JSON) whose keys a search space reaches as `<flag>.<path>`
    # (ConfigKeys, below); None: nothing inside it to search.
    config_keys: ConfigKeys | None = None

    # -- moment 1, settle: the arguments (before any trainer exists) --------------------------------------------------
    @classmethod
    def owned_flag_problems(cls, args) -> list[str]:
        """Problems with the flags this backend owns that no machine could fix, one line each; reads `args` only.
        The flag checks (config.checks.flag_problems) collect every backend's before raising once."""
        return []

    @classmethod
    def settle(cls, args, batch) -> tuple[dict, RunSettings]:
        """Once the flags are valid and this backend is selected, before transformers sets up the device: checks
        that depend on this machine, then what the backend settles from its flags and `batch` (config.batch.
        GlobalBatch: this start's split of the global batch over its `world_size` ranks, its fields not yet on the
        arguments): (the fields transformers reads, as they are to be set; RunSettings with what the backend itself
        settled, handed to its constructor, and where the model must stay; the registry fills in its name, the moment,
        the flags given and the batch). Values only: no variable, file or process group (that is prepare_process)."""
        return {}, RunSettings()

    @classmethod
    def arguments_ready(cls, args) -> dict:
        """The last step of ExtTrainingArguments, once transformers set the arguments up: the fields transformers must
        not act on; DeepSpeed under ZeRO-3 also joins a group transformers formed, as on GPUs."""
        return {}

    # -- facts read without a run: the planner's, the checkpoint's ----------------------------------------------------
    # The planner's rows for the settings this backend runs (BackendFormula, below), for either precision.
    memory_formulas: tuple[BackendFormula, ...] = ()

    @classmethod
    def fingerprint(cls, module) -> dict:
        """What a checkpoint records about the (unwrapped) model and a resume must match; a backend whose wrapping or
        partitioning changes what the model reports corrects it."""
        config = getattr(module, "config", None)
        return {
            "model_class": type(module).__name__,
            "model_type": getattr(config, "model_type", None),
            "num_parameters": sum(p.numel() for p in module.parameters()),
        }


@dataclass(frozen=True)
class ConfigKeys:
    """A backend config's keys as a search space reaches them (`deepspeed.zero_optimization.stage`): `problems(path)`,
    one line per problem with a dotted path inside the config (naming the closest valid key); `load(value)`, the config
    a value of the selecting flag stands for (a file, a preset's name, inline JSON) as a dict, raising `error` for a bad
    one."""
    problems: Callable[[str], list[str]]
    load: Callable[[Any], dict]
    error: type[Exception]


@dataclass(frozen=True)
class RunSettings:
    """What the arguments settled once, the one attribute of ours they carry (ExtTrainingArguments when parsed, stock
    TrainingArguments when a process is prepared): the flags the user gave (`flags_given`: recorded when
    ExtTrainingArguments is built, before anything settles; None where nothing says which were typed), the global batch
    this start's ranks share (config.batch.GlobalBatch), the backend's name and what it settled from its flags
    (DeepSpeed: the translated config's resolution; FSDP2: its FSDPSettings; None: nothing of its own), whether that
    was at parsing (False: stock TrainingArguments, which transformers set up before anything settled them), the
    answer to transformers' `place_model_on_device` hook (False: the backend receives the model where it was built;
    None: transformers decides) and the process they were prepared in (training.prepare: once per process). The
    backend's constructor receives it; the registry chooses the backend by it once `backend` is set."""
    backend: str = ""  # "": not settled yet (only what was given is known)
    settled: Any = None
    parsed: bool = True
    place_model_on_device: bool | None = None
    flags_given: frozenset[str] | None = None
    global_batch: Any = None
    prepared_in: str | None = None  # the process prepare_process ran in for these settings (training.prepare)


def run_settings(args) -> RunSettings:
    """These arguments' RunSettings, an empty one where nothing is recorded yet (stock TrainingArguments before
    prepare_process, a namespace): the one place that asks whether they have any."""
    return getattr(args, "run_settings", None) or RunSettings()


def settled_for(backend: type[BackendSpec], args) -> Any:
    """What `backend` settled for these arguments (RunSettings.settled); None where they are not settled yet, or were
    settled for another backend."""
    run = run_settings(args)
    return run.settled if run.backend == backend.name else None


def given_as(backend: type[BackendSpec], args) -> str | None:
    """The backend's selecting flag as the user typed it (for messages: with its option words where it takes them),
    or None when these arguments do not select it. Also once the flag is hidden from transformers (FSDP's on one
    process, at prepare_process): the arguments settled for it then."""
    value = getattr(args, backend.flag, None) if backend.flag else None
    if value and value != "false":
        return " ".join([f"--{backend.flag}", *(option_words(value) if backend.flag_takes_options else ())])
    return f"--{backend.flag}" if backend.flag and run_settings(args).backend == backend.name else None


def missing_library(backend: type[BackendSpec], args) -> str | None:
    """One line when the backend's library (its `library`) is not installed, before transformers or accelerate import
    it."""
    import importlib.util

    if backend.library and importlib.util.find_spec(backend.library) is None:
        return f"{given_as(backend, args) or backend.name} needs {backend.library}, which is not installed: " \
               f"{backend.install}"
    return None


# A parameter's bytes in the compute dtype as a formula's term: 2 in mixed precision (--bf16/--fp16), 4 in fp32. A
# formula's note says "{compute}" for "16-bit" or "fp32" and "{weight}" for the bytes.
COMPUTE = "compute"


@dataclass(frozen=True)
class BackendFormula:
    """Bytes per trained parameter held on one rank: each term is (bytes or COMPUTE, divided by N?). Declared for
    either precision; the planner reads it at one (at_precision)."""
    name: str
    flag: str  # how to select it with trainer_ext
    params: tuple[float | str, bool]
    grads: tuple[float | str, bool]
    optimizer: tuple[float | str, bool]
    communication: float  # volume per step relative to DDP's all-reduce (ZeRO paper, section 7)
    host_optimizer: bool = False  # optimizer state and gradient partition live in CPU memory
    host_params: bool = False  # the parameter partitions live in CPU memory too (ZeRO-3 offload)
    cuda_only: bool = False
    note: str = ""
    preference: int = 0  # the planner recommends the lowest that fits
    # (trained Ψ, N, all parameters, a parameter's bytes in the compute dtype) -> bytes held beyond the terms, e.g.
    # {"grads": ...}
    extra: Callable[[int, int, int, int], dict] | None = None
    frozen_sharded: bool = False  # frozen parameters (a LoRA's base, in the compute dtype) divided by N too
    # (hidden size) -> parameters with fewer elements stay whole on every rank besides their partition
    whole_below: Callable[[int], float] | None = None
    # What changes the activations: mixed precision by torch autocast over fp32 weights; every Linear keeping its
    # input for backward, frozen or not
    autocast: bool = False
    linears_keep_inputs: bool = False

    def at_precision(self, mixed: bool) -> BackendFormula:
        """The terms and note in mixed precision (COMPUTE: 2 bytes, "16-bit") or fp32 (4 bytes, "fp32")."""
        weight = 2 if mixed else 4

        def term(spec):
            return (weight if spec[0] == COMPUTE else spec[0], spec[1])

        note = self.note.replace("{compute}", "16-bit" if mixed else "fp32").replace("{weight}", str(weight))
        return replace(self, params=term(self.params), grads=term(self.grads), optimizer=term(self.optimizer),
                       note=note)

    def bytes(self, num_parameters: int, world_size: int) -> dict[str, float]:
        def term(spec):
            per_param, sharded = spec
            return num_parameters * per_param / (world_size if sharded else 1)

        return {"params": term(self.params), "grads": term(self.grads), "optimizer": term(self.optimizer)}
