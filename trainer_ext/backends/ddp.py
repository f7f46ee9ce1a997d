"""Plain data parallelism (or one process): transformers and accelerate do everything; nothing to add."""

from .base import Backend, BackendFormula


class DDPBackend(Backend):
    name = "ddp"

    # torch AMP (transformers --fp16/--bf16 under DDP) keeps fp32 weights and gradients: 16 bytes either way.
    memory_formulas = (BackendFormula("ddp", "(no flag)", (4, False), (4, False), (8, False), 1.0, preference=0,
                                      autocast=True),)
