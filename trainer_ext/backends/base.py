"""The Backend interface: what ExtTrainer asks of DDP, DeepSpeed or FairScale, and the registry choosing one."""

from __future__ import annotations

from importlib import import_module


class Backend:
    """Hooks around transformers' own set-up; the default (DDP through accelerate) needs none of them."""

    name = "ddp"

    def check(self, args) -> None:
        """Fail before any work if this backend cannot run with these arguments on this machine."""

    def before_prepare(self, trainer, num_training_steps: int) -> None:
        """Called once the step count is known, before the model and optimizer are wrapped."""

    def after_prepare(self, trainer) -> None:
        """Called after wrapping, before the first step (and before a checkpoint is loaded)."""

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
}


def select_backend(args) -> Backend:
    if getattr(args, "sharded_ddp", None):
        raise NotImplementedError(
            f"--sharded_ddp {' '.join(args.sharded_ddp)}: the FairScale backend is not in this release yet; "
            "use --deepspeed zero2_minimal (ZeRO-2) for sharded optimizer state")
    name = "deepspeed" if getattr(args, "deepspeed", None) else "ddp"
    module, cls = BACKENDS[name]
    return getattr(import_module(module, __package__), cls)()
