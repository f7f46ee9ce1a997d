"""TRL's trainers with ExtTrainer's guarantees: `ExtSFTTrainer` is `class ExtSFTTrainer(ExtTrainer, SFTTrainer)` and
`ExtSFTConfig` the arguments both read (ExtTrainingArguments' flags and checks, SFTConfig's fields and defaults);
`ExtDPOTrainer` and `ExtDPOConfig` the same for preference tuning with TRL's DPOTrainer. Needs trl
(`pip install "trainer_ext[trl]"`)."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import MissingLibraryError

try:
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer
except ImportError as err:  # one line at the boundary, not a traceback
    raise MissingLibraryError(f"trainer_ext.trl needs TRL, which cannot be imported ({err}): pip install "
                              "\"trainer_ext[trl]\"") from None

from .config.flags import ExtTrainingArguments
from .trainer import ExtTrainer


@dataclass
class ExtSFTConfig(ExtTrainingArguments, SFTConfig):
    """ExtTrainingArguments plus every SFTConfig field (max_length, packing, completion_only_loss, ...), with TRL's
    defaults (learning rate 2e-5, logging every 10 steps, gradient checkpointing on, bf16 unless fp16): each field
    has the default of the class nearest in the MRO that declares it (ExtTrainingArguments.__init_subclass__)."""


class ExtSFTTrainer(ExtTrainer, SFTTrainer):
    """TRL's SFTTrainer (datasets, chat templates, packing, completion-only loss, its metrics) trained and checkpointed
    by ExtTrainer on any backend."""


@dataclass
class ExtDPOConfig(ExtTrainingArguments, DPOConfig):
    """ExtTrainingArguments plus every DPOConfig field (beta, loss_type, max_length, precompute_ref_log_probs, ...),
    with TRL's defaults (learning rate 1e-6, logging every 10 steps, bf16 unless fp16, dropout disabled)."""


class ExtDPOTrainer(ExtTrainer, DPOTrainer):
    """TRL's DPOTrainer (preference pairs, the reference model or a LoRA model's adapter-disabled base, its rewards,
    margins and accuracies) trained and checkpointed by ExtTrainer on any backend. Arguments as DPOTrainer's:
    `ExtDPOTrainer(model, ref_model=None, args=ExtDPOConfig(...), train_dataset=..., processing_class=...)`."""

    def __init__(self, model=None, ref_model=None, args=None, *positional, **kwargs):
        super().__init__(model, args, *positional, ref_model=ref_model, **kwargs)
