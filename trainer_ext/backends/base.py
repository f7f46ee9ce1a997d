"""The Backend interface: a backend's runtime, as ExtTrainer, the process set-up and the checkpoint code ask for it (the
shape of Lightning's `Strategy`); none of them names a backend. Moments 2 and 3 of a backend: preparing the process
(and the model's context), then the trainer's hooks (model and optimizer, resume, clipping, saving, evaluation,
teardown). Moment 1, settling its flags, is its pure half: spec.py's BackendSpec. A backend module imports torch and
its library only when a method runs, so the registry (backends/__init__.py) and the planner read every backend on a
machine without them."""

from __future__ import annotations

import json
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..integrations import internals
from .spec import BackendFormula, BackendSpec, RunSettings, missing_library, settled_for


@dataclass(frozen=True)
class ResolvedSettings:
    """What a backend settled for this run, as it tells it: a short description (messages, checkpoint records), the
    lines printed when training starts, the files written next to the final model, the hyperparameters of an
    optimizer it builds from its own settings (which a resume puts back over the checkpoint's; None: ExtTrainer's),
    and which optimizer state its checkpoints hold where the backend decides it: {"state": what must match to resume
    (None: not known, nothing checked), "name", "given": how it was chosen, "back": how to choose it again}; None: the
    optimizer transformers builds for --optim (checkpoints/policy.py's optimizer_record)."""
    description: str
    lines: tuple[str, ...] = ()
    files: dict = field(default_factory=dict)  # file name -> JSON content
    optimizer: dict | None = None
    optimizer_state: dict | None = None

    def write(self, output_dir) -> None:
        for name, content in self.files.items():
            (Path(output_dir) / name).write_text(json.dumps(content, indent=2) + "\n")


@dataclass(frozen=True)
class OptimizerRecipe:
    """How ExtTrainer builds the optimizer over a module (--optim's class and options, its rates and weight decay, as
    the Trainer chooses them): `parts(module)` gives (parameter groups, optimizer class, its keyword arguments), for a
    backend that builds it otherwise (FairScale's OSS), and `build(module)` the optimizer itself."""
    parts: Callable

    def build(self, module):
        groups, optimizer_cls, kwargs = self.parts(module)
        return optimizer_cls(groups, **kwargs)


class Backend(BackendSpec):
    """The default (DDP through accelerate, or one process) needs none of the hooks; a backend overrides what it does
    differently. Building one for a run's arguments checks that it can run here (its library first); `settled` is what
    it settled from its flags when they were parsed (RunSettings)."""

    def __init__(self, args=None):
        self.args = args
        self.settled = settled_for(type(self), args)
        if args is not None:
            problem = missing_library(type(self), args)
            if problem:
                from ..errors import MissingLibraryError

                raise MissingLibraryError(problem)

    # -- moment 2, prepare the process and the model's context (before a trainer exists) ------------------------------
    @classmethod
    def prepare_process(cls, args) -> dict:
        """trainer_ext.prepare_process's part for this backend, once the arguments are settled and before a model is
        built or trained: what its engine needs of the process (the process group is formed already where
        needs_process_group says so). Returns the fields transformers must see for training (config.settings writes
        them): what transformers built before stock TrainingArguments were settled (RunSettings.parsed False),
        rebuilt, and what only the process knows."""
        return {}

    @classmethod
    def model_sharded_context(cls, args):
        """The context models are built and loaded in (`trainer_ext.sharded_loading(args)`, after prepare_process):
        partitioned as they are built where the backend can, else nothing."""
        return nullcontext()

    # -- moment 3, the trainer's hooks (ExtTrainer calls these from the Trainer's public hooks) ----------------------
    def callbacks(self, trainer) -> list:
        """TrainerCallbacks this backend adds to the trainer when it is built: its steps at transformers' own events,
        run before ExtTrainer's. Its on_train_begin comes after transformers wrapped and prepared the model and
        optimizer, before the first step; resuming (trainer.resumed_checkpoint), this backend's own training state
        is loaded there, on every rank, after what transformers loads itself (weights before wrapping, scheduler, the
        optimizer file) and before this run's hyperparameters are put back over the checkpoint's."""
        return []

    def before_train(self, trainer, checkpoint) -> None:
        """At the start of train(), once the checkpoint to resume (or None) is chosen, before transformers prepares
        anything."""

    def setup_model_and_optimizer(self, trainer, model, optimizer: OptimizerRecipe):
        """The model wrapped for training and its optimizer, in the order the backend needs (Lightning Fabric's
        `setup_module_and_optimizers`): a backend that shards parameters wraps first and builds the optimizer on the
        shards; one whose wrapper takes the optimizer builds it first. `optimizer` builds --optim's class over a
        module's parameters (OptimizerRecipe). Returns (wrapper, optimizer); wrapper None: accelerate wraps the model
        (DDP). A wrapper that is a new object is trained through as it is: transformers then prepares only the
        optimizer, and ExtTrainer finds the user's model in it as the one it handed over (ExtTrainer.user_model)."""
        return None, optimizer.build(model)

    def clip_grad_norm(self, trainer, model, max_norm: float):
        """The pre-clip total norm after clipping; None: transformers clips."""
        return None

    def save(self, trainer, folder):
        """Every rank, when the model is saved. Into a checkpoint (`folder`, its staging folder; None for the final
        model), before transformers writes the weights and rank 0 the optimizer file: this backend's own training
        state, written or gathered. Returns the whole model's weights when the model is sharded (collective; the main
        process's copy is saved), else None: transformers saves the model."""
        return None

    def load_weights(self, trainer, checkpoint) -> None:
        """A finished run's weights into this trainer's model (for its evaluation/prediction); the Trainer's own
        loader by default, as a resume loads them."""
        internals.load_from_checkpoint(trainer, checkpoint)

    @contextmanager
    def evaluating(self, trainer):
        """Around each evaluation loop: yields the model to evaluate through when transformers' own choice cannot run
        it (an engine of the backend's own), else None."""
        yield None

    def settings(self) -> ResolvedSettings:
        """What this backend resolved for the run (printed when training starts, written next to the model)."""
        return ResolvedSettings(self.name)

    # -- ... and at its end --------------------------------------------------------------------------------------------
    def teardown(self, trainer) -> Callable[[], None] | None:
        """At exit, before the process group is destroyed: release what holds it (engines of the backend's own, the
        trainer's references to them). Returns what to run once the group is gone (cleaning up what the backend
        leaves on the machine), or None."""
        return None


__all__ = ["Backend", "BackendFormula", "BackendSpec", "OptimizerRecipe", "ResolvedSettings", "RunSettings"]
