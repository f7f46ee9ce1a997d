"""TRL's trainers with ExtTrainer's guarantees: `ExtSFTTrainer` is `class ExtSFTTrainer(ExtTrainer, SFTTrainer)` and
`ExtSFTConfig` the arguments both read (ExtTrainingArguments' flags and checks, SFTConfig's fields and defaults);
`ExtDPOTrainer` and `ExtDPOConfig` the same for preference tuning with TRL's DPOTrainer. Needs trl
(`pip install "trainer_ext[trl]"`)."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import MissingLibraryError, UserError

try:
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer
except ImportError as err:  # one line at the boundary, not a traceback
    raise MissingLibraryError(f"trainer_ext.trl needs TRL, which cannot be imported ({err}): pip install "
                              "\"trainer_ext[trl]\"") from None

from .args import ExtTrainingArguments
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
        from .trainer import TRAINER_PARAMETERS

        check_precomputed_reference(args, {**dict(zip(TRAINER_PARAMETERS, positional)), **kwargs})
        super().__init__(model, args, *positional, ref_model=ref_model, **kwargs)


def check_precomputed_reference(args, given: dict) -> None:
    """--precompute_ref_log_probs on N ranks: TRL writes the reference's log-probs next to the dataset's cache files
    on the main process and the other ranks read them there; an in-memory dataset (Dataset.from_list/from_dict) has
    its cache in a temporary folder of each process, so the other ranks failed (FileNotFoundError, measured)."""
    if not getattr(args, "precompute_ref_log_probs", False) or getattr(args, "world_size", 1) < 2:
        return
    import datasets

    for name in ("train_dataset", "eval_dataset"):
        value = given.get(name)
        for dataset in (value.values() if isinstance(value, dict) else [value]):
            if isinstance(dataset, datasets.Dataset) and not dataset.cache_files:
                raise UserError(f"--precompute_ref_log_probs on {args.world_size} ranks with an in-memory {name} "
                                "(Dataset.from_list / from_dict): TRL stores the reference log-probs beside the "
                                "dataset's files, which only the main process has then; load it from files "
                                "(datasets.load_dataset('json', data_files=...)) or save and load it "
                                "(save_to_disk / load_from_disk)")
