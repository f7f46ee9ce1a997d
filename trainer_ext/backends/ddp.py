"""Plain data parallelism (or one process): transformers and accelerate do everything; nothing to add."""

from .base import Backend


class DDPBackend(Backend):
    name = "ddp"
