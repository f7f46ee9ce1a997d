"""The Backend interface: a backend's whole life, as the arguments, ExtTrainer, the checkpoint code and the planner ask
for it (the shape of Lightning's `Strategy`); none of them names a backend. A backend module imports torch and its
library only when a method runs, so the registry (backends/__init__.py) and the pure planner can read every backend's
flags, checks and memory formulas on a machine without them."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable

from ..integrations import internals


class Backend:
    """The default (DDP through accelerate, or one process) needs none of the hooks; a backend overrides what it does
    differently. Class-level methods run before any trainer exists (argument parsing, `trainer-ext plan`); the
    instance methods follow one run: set up, wrap model and optimizer, step, save and load its own state, hand over
    the whole model's weights, tear down."""

    name = "ddp"
    flag: str | None = None  # the argument that selects this backend (None: the default when none is selected)
    owned_flags: tuple[str, ...] = ()  # every argument this backend reads (the selecting one first)
    library: str | None = None  # the module this backend needs installed, and how to install it
    install = ""
    # Parameter sharding: the model is wrapped before the optimizer, which is built on the shards.
    wraps_before_optimizer = False
    # Its engine needs a process group even on one process (prepare_process forms a 1-rank one without a launcher).
    needs_process_group = False
    # Glob patterns of the files or folders holding this backend's own training state in a checkpoint folder (what a
    # checkpoint without Hugging Face weight files must have to be resumable).
    checkpoint_state: tuple[str, ...] = ()
    # Glob patterns of what a resume of this backend reads of a checkpoint besides the weights: its optimizer state
    # (transformers' optimizer.pt by default). Backends with the same patterns read each other's checkpoints.
    optimizer_state: tuple[str, ...] = ("optimizer.pt",)
    # Whether it can continue a checkpoint's weights and step with a new optimizer state (--resume_weights_only).
    resumes_weights_only = True

    # -- the arguments and the process (class level: before any trainer exists) ------------------------------------
    @classmethod
    def missing_library(cls, args) -> str | None:
        """One line when this backend's library is not installed (before transformers or accelerate import it)."""
        import importlib.util

        if cls.library and importlib.util.find_spec(cls.library) is None:
            return f"{cls.given_as(args)} needs {cls.library}, which is not installed: {cls.install}"
        return None

    @classmethod
    def selected(cls, args) -> bool:
        return bool(cls.flag and getattr(args, cls.flag, None))

    @classmethod
    def given_as(cls, args) -> str:
        """The selecting flag as the user typed it, for messages."""
        return f"--{cls.flag}"

    @classmethod
    def owned_flag_problems(cls, args) -> list[str]:
        """Problems with the flags this backend owns that no machine could fix, one line each; reads `args` only.
        The flag checks (config.checks.flag_problems) collect every backend's before raising once."""
        return []

    @classmethod
    def prepare_arguments(cls, args) -> None:
        """Once the flags are valid and this backend is selected, before transformers sets up the device: checks
        that depend on this machine, and what the backend settles from its flags (their values as it reads them,
        written onto `args`). Values only: no variable, file or process group (that is prepare_process)."""

    @classmethod
    def arguments_ready(cls, args) -> None:
        """The last step of ExtTrainingArguments, once transformers set the arguments up: values transformers must
        not act on (written onto `args`); DeepSpeed under ZeRO-3 also joins a group transformers formed, as on GPUs."""

    @classmethod
    def prepare_process(cls, args) -> None:
        """trainer_ext.prepare_process's part for this backend, once the arguments exist and before a model is built
        or trained: what its engine needs of the process (the 1-rank group is formed already where
        needs_process_group says so)."""

    @classmethod
    def places_model_on_device(cls, args) -> bool | None:
        """transformers' `place_model_on_device` hook: False when the backend must receive the model where it was
        built; None lets transformers decide."""
        return None

    @classmethod
    def model_sharded_context(cls, args):
        """The context models are built and loaded in (`trainer_ext.sharded_loading(args)`, after prepare_process):
        partitioned as they are built where the backend can, else nothing."""
        return nullcontext()

    @classmethod
    def memory_formulas(cls, mixed: bool) -> list:
        """The planner's rows (BackendFormula, below) for the settings this backend runs."""
        return []

    def __init__(self, args=None):
        self.args = args

    # -- setting up a trainer's run (ExtTrainer calls these from the Trainer's public hooks) -------------------------
    def check(self, args) -> None:
        """Fail before any work if this backend cannot run with these arguments on this machine; its library not
        installed is one line (the one availability check: missing_library)."""
        problem = self.missing_library(args)
        if problem:
            from ..errors import MissingLibraryError

            raise MissingLibraryError(problem)

    def callbacks(self, trainer) -> list:
        """TrainerCallbacks this backend adds to the trainer when it is built."""
        return []

    def before_train(self, trainer, checkpoint) -> None:
        """At the start of train(), once the checkpoint to resume (or None) is chosen, before transformers prepares
        anything."""

    def build_optimizer(self, trainer, param_groups, optimizer_cls, kwargs):
        """The optimizer over these parameter groups; None: the plain `optimizer_cls`."""
        return None

    def wrap_model(self, trainer, model):
        """The model wrapped for training (called once the optimizer exists, or before it with
        wraps_before_optimizer); None: accelerate wraps it (DDP). A wrapper that is a new object is trained through
        as it is: transformers then prepares only the optimizer."""
        return None

    def unwrap(self, model):
        """The user's model inside this backend's wrapper."""
        return model

    def optimizer_hyperparameters(self, trainer) -> list[dict] | None:
        """Where this backend builds the optimizer from its own settings: each parameter group's hyperparameters as this
        run's flags set them (lr, betas, eps, weight_decay), which a resume puts back over the checkpoint's; None: the
        optimizer ExtTrainer built."""
        return None

    def on_train_begin(self, trainer) -> None:
        """After transformers wrapped and prepared the model and optimizer, before the first step."""

    def load_checkpoint(self, trainer, checkpoint) -> None:
        """Resuming: this backend's own training state from the checkpoint folder, on every rank, after transformers
        loaded what it loads itself (weights before wrapping, scheduler, the optimizer file) and before the first
        step."""

    # -- each step ---------------------------------------------------------------------------------------------------
    def clip_grad_norm(self, trainer, model, max_norm: float):
        """The pre-clip total norm after clipping; None: transformers clips."""
        return None

    def learning_rate_in_use(self, trainer) -> float | None:
        """The rate the coming optimizer step will use, where transformers would read it too late."""
        return None

    # -- checkpoints and weights ---------------------------------------------------------------------------------
    def save_checkpoint(self, trainer, folder) -> None:
        """Every rank, when a checkpoint is saved into `folder` (its staging folder), before transformers writes the
        weights and rank 0 the optimizer file: this backend's own training state (written or gathered here)."""

    def full_state_dict(self, trainer):
        """The whole model's weights when the model is sharded (collective; the main process's copy is saved);
        None otherwise."""
        return None

    def load_weights(self, trainer, checkpoint) -> None:
        """A finished run's weights into this trainer's model (for its evaluation/prediction); the Trainer's own
        loader by default, as a resume loads them."""
        internals.load_from_checkpoint(trainer, checkpoint)

    def model_fingerprint(self, module) -> dict:
        """What a checkpoint records about the model, and a resume must match (a backend whose wrapping changes what the
        model reports corrects it)."""
        config = getattr(module, "config", None)
        return {
            "model_class": type(module).__name__,
            "model_type": getattr(config, "model_type", None),
            "num_parameters": sum(p.numel() for p in module.parameters()),
        }

    @contextmanager
    def evaluating(self, trainer):
        """Around each evaluation loop: yields the model to evaluate through when transformers' own choice cannot run
        it (an engine of the backend's own), else None."""
        yield None

    # -- what it tells and leaves behind ---------------------------------------------------------------------------
    def describe(self) -> str:
        return self.name

    def settings_lines(self) -> list[str]:
        """The settings this backend resolved, for the block printed when training starts."""
        return []

    def save_settings(self, output_dir) -> None:
        """Write the resolved settings next to the model (main process, after training)."""

    def drop_references(self, trainer) -> None:
        """At exit, before the process group is destroyed: release what holds it (engines of the backend's own, the
        trainer's references to them)."""

    def teardown(self) -> None:
        """At exit, after the process group is gone: clean up what this backend leaves on the machine."""


@dataclass(frozen=True)
class BackendFormula:
    """Bytes per trained parameter held on one rank: each term is (bytes, divided by N?)."""
    name: str
    flag: str  # how to select it with trainer_ext
    params: tuple[float, bool]
    grads: tuple[float, bool]
    optimizer: tuple[float, bool]
    communication: float  # volume per step relative to DDP's all-reduce (ZeRO paper, section 7)
    host_optimizer: bool = False  # optimizer state and gradient partition live in CPU memory
    host_params: bool = False  # the parameter partitions live in CPU memory too (ZeRO-3 offload)
    cuda_only: bool = False
    note: str = ""
    preference: int = 0  # the planner recommends the lowest that fits
    # (trained Ψ, N, all parameters) -> bytes held beyond the terms, e.g. {"grads": ...}
    extra: Callable[[int, int, int], dict] | None = None
    frozen_sharded: bool = False  # frozen parameters (a LoRA's base, in the compute dtype) divided by N too
    # (hidden size) -> parameters with fewer elements stay whole on every rank besides their partition
    whole_below: Callable[[int], float] | None = None
    # What changes the activations: mixed precision by torch autocast over fp32 weights; every Linear keeping its
    # input for backward, frozen or not
    autocast: bool = False
    linears_keep_inputs: bool = False

    def bytes(self, num_parameters: int, world_size: int) -> dict[str, float]:
        def term(spec):
            per_param, sharded = spec
            return num_parameters * per_param / (world_size if sharded else 1)

        return {"params": term(self.params), "grads": term(self.grads), "optimizer": term(self.optimizer)}
