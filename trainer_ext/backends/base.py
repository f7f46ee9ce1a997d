"""The Backend interface: what the arguments, ExtTrainer and the planner ask of DDP, DeepSpeed or FairScale. A backend
module imports torch and its library only when a method runs, so the registry (backends/__init__.py) and the pure
planner can read every backend's flag, checks and memory formulas on a machine without them."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable


class Backend:
    """The default (DDP through accelerate, or one process) needs none of the hooks; a backend overrides what it does
    differently. Class-level methods run before any trainer exists (argument parsing, `trainer-ext plan`)."""

    name = "ddp"
    flag: str | None = None  # the argument that selects this backend (None: the default when none is selected)
    library: str | None = None  # the module this backend needs installed, and how to install it
    install = ""

    # -- the arguments (class level: before any trainer exists) ---------------------------------------------------
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
    def flag_problems(cls, args) -> list[str]:
        """Problems with this backend's own flags that no machine could fix, one line each (normalising them in
        place); ExtTrainingArguments and `trainer-ext ds-config` collect every backend's before raising once."""
        return []

    @classmethod
    def prepare_arguments(cls, args) -> None:
        """Once the flags are valid and this backend is selected, before transformers sets up the device: checks
        that depend on this machine, and what the backend settles from the flags (written onto `args`)."""

    @classmethod
    def arguments_ready(cls, args) -> None:
        """The last step of ExtTrainingArguments, once transformers set the arguments up: what must exist before the
        script loads its model."""

    @classmethod
    def places_model_on_device(cls, args) -> bool | None:
        """transformers' `place_model_on_device` hook: False when the backend must receive the model where it was
        built; None lets transformers decide."""
        return None

    @classmethod
    def memory_formulas(cls, mixed: bool) -> list:
        """The planner's rows (BackendFormula, below) for the settings this backend runs."""
        return []

    def __init__(self, args=None):
        self.args = args

    # -- a trainer's run (ExtTrainer calls these from the Trainer's public hooks) ------------------------------------
    def check(self, args) -> None:
        """Fail before any work if this backend cannot run with these arguments on this machine."""

    def callbacks(self, trainer) -> list:
        """TrainerCallbacks this backend adds to the trainer when it is built."""
        return []

    def before_train(self, trainer, checkpoint) -> None:
        """At the start of train(), once the checkpoint to resume (or None) is chosen, before transformers prepares
        anything."""

    def on_train_begin(self, trainer) -> None:
        """After transformers wrapped and prepared the model and optimizer and loaded any checkpoint, before the first
        step."""

    def build_optimizer(self, trainer, param_groups, optimizer_cls, kwargs):
        """The optimizer over these parameter groups; None: the plain `optimizer_cls`."""
        return None

    def wraps_before_optimizer(self) -> bool:
        """True when the optimizer must be built on the wrapped model's parameters (parameter sharding)."""
        return False

    def wrap_model(self, trainer, model):
        """The model wrapped for training (called once the optimizer exists, or before it with
        wraps_before_optimizer); None: accelerate wraps it (DDP)."""
        return None

    def unwrap(self, model):
        return model

    def clip_grad_norm(self, trainer, model, max_norm: float):
        """The pre-clip total norm after clipping; None: transformers clips."""
        return None

    def before_checkpoint_save(self, trainer) -> None:
        """Called on every rank when a checkpoint is saved, before rank 0 writes the optimizer state."""

    def full_state_dict(self, trainer):
        """The whole model's weights when the model is sharded (collective); None otherwise."""
        return None

    def load_weights(self, trainer, checkpoint) -> None:
        """A finished run's weights into this trainer's model (for its evaluation/prediction); the Trainer's own
        loader by default, as a resume loads them."""
        trainer._load_from_checkpoint(str(checkpoint))

    @contextmanager
    def evaluating(self, trainer):
        """Around each evaluation loop: yields the model to evaluate through when transformers' own choice cannot run
        it (ZeRO-3 before training: partitioned parameters need an engine), else None."""
        yield None

    def learning_rate_in_use(self, trainer) -> float | None:
        """The rate the coming optimizer step will use, where transformers would read it too late."""
        return None

    # -- what it tells and leaves behind ---------------------------------------------------------------------------
    def describe(self) -> str:
        return self.name

    def settings_lines(self) -> list[str]:
        """The settings this backend resolved, for the block printed when training starts."""
        return []

    def save_settings(self, output_dir) -> None:
        """Write the resolved settings next to the model (main process, after training)."""

    def drop_references(self) -> None:
        """At exit, before the process group is destroyed: release what holds it (engines of the backend's own)."""

    def teardown(self) -> None:
        """At exit, after the process group is gone: clean up what this backend leaves on the machine."""


@dataclass(frozen=True)
class BackendFormula:
    """Bytes per parameter held on one rank: each term is (bytes, divided by N?)."""
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
    extra: Callable[[int, int], dict] | None = None  # (Ψ, N) -> bytes held beyond the terms, e.g. {"grads": ...}

    def bytes(self, num_parameters: int, world_size: int) -> dict[str, float]:
        def term(spec):
            per_param, sharded = spec
            return num_parameters * per_param / (world_size if sharded else 1)

        return {"params": term(self.params), "grads": term(self.grads), "optimizer": term(self.optimizer)}
