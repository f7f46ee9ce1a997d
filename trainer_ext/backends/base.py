"""The Backend interface: what ExtTrainer asks of DDP, DeepSpeed or FairScale, and the registry choosing one."""

from __future__ import annotations

from importlib import import_module


class Backend:
    """Hooks around transformers' own set-up; the default (DDP through accelerate) needs none of them."""

    name = "ddp"

    def check(self, args) -> None:
        """Fail before any work if this backend cannot run with these arguments on this machine."""

    def before_prepare(self, trainer, num_training_steps: int, resume_from_checkpoint=None) -> None:
        """Called once the step count (and the checkpoint to resume, if any) is known, before wrapping."""

    def after_prepare(self, trainer) -> None:
        """Called after wrapping, before the first step (and before a checkpoint is loaded)."""

    def build_optimizer(self, trainer, param_groups, optimizer_cls, kwargs):
        """The optimizer over these parameter groups; None: the plain `optimizer_cls`."""
        return None

    def wraps_before_optimizer(self) -> bool:
        """True when the optimizer must be built on the wrapped model's parameters (parameter sharding)."""
        return False

    def wrap_model(self, trainer, model):
        """The model wrapped for training; None: transformers/accelerate wrap it (DDP)."""
        return None

    def unwrap(self, model):
        return model

    def clip_grad_norm(self, trainer, model, max_norm: float):
        """The pre-clip total norm after clipping; None: transformers clips."""
        return None

    def before_optimizer_save(self, trainer) -> None:
        """Called on every rank before rank 0 saves the optimizer state."""

    def full_state_dict(self, trainer):
        """The whole model's weights when the model is sharded (collective); None otherwise."""
        return None

    def evaluates_plain_model(self, trainer) -> bool:
        """True: an evaluation before training may run the unwrapped model (no engine needed for it)."""
        return False

    def learning_rate_in_use(self, trainer) -> float | None:
        """The rate the coming optimizer step will use, where transformers would read it too late."""
        return None

    def describe(self) -> str:
        return self.name


# name -> (module, class); a new backend is one file plus one line here.
BACKENDS = {
    "ddp": (".ddp", "DDPBackend"),
    "deepspeed": (".deepspeed", "DeepSpeedBackend"),
    "fairscale": (".fairscale", "FairScaleBackend"),
}


def select_backend(args) -> Backend:
    options = list(getattr(args, "sharded_ddp", None) or [])
    name = "deepspeed" if getattr(args, "deepspeed", None) else "fairscale" if options else "ddp"
    module, cls = BACKENDS[name]
    backend_class = getattr(import_module(module, __package__), cls)
    return backend_class(options) if name == "fairscale" else backend_class()
