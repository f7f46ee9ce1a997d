"""The flags trainer_ext adds to transformers' own, declared once, in groups by the concern that reads them: dataclass
mixins that args.py composes into ExtTrainingArguments (as each backend's own flags are), and `flags_of(group, args)`,
the one way a module reads a group from any arguments. ExtTrainer also trains stock TrainingArguments, which lack these
fields: there each takes the default declared here (one set by hand on the object counts), so a stock run behaves as
the same command with ExtTrainingArguments and no module keeps a default of its own (a getattr with a fallback)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TypeVar

from .checks import FP16_BACKENDS, FP16_OPT_LEVELS

Group = TypeVar("Group")


@dataclass
class V4Flags:
    """transformers v4 spellings our users still type: read into transformers 5's own fields when parsed."""

    fp16_backend: str = field(
        default="auto", metadata={"help": "Mixed precision backend for --fp16.", "choices": list(FP16_BACKENDS)}
    )
    fp16_opt_level: str = field(
        default="O1", metadata={"help": "Apex AMP optimisation level.", "choices": list(FP16_OPT_LEVELS)}
    )
    warmup_ratio: float = field(
        default=0.0, metadata={"help": "transformers v4 spelling: warm up over this fraction of the training steps."}
    )


@dataclass
class BatchFlags:
    """The global batch and the data it draws from (config/batch.py, data/samplers.py)."""

    global_batch_size: int | None = field(
        default=None, metadata={"help": "Samples per optimizer step whatever the number of ranks: each start derives "
                                        "--gradient_accumulation_steps from it (lowering the per-device batch only "
                                        "where the accumulation would not be whole). Unset: per-device batch x "
                                        "accumulation x ranks, and a resumed run keeps the global batch it trained "
                                        "with on another number of ranks."}
    )
    repeat_small_dataset: bool = field(
        default=False, metadata={"help": "Train although one global batch is larger than the training data (each "
                                         "step then repeats its samples); refused otherwise."}
    )


@dataclass
class LossFlags:
    """How ExtTrainer takes the loss (trainer.py, the classification recipe)."""

    class_weights: str | None = field(
        default=None, metadata={"help": "Classification loss weight per class, comma separated, e.g. 1.0,3.0."}
    )
    chunked_loss: bool = field(
        default=True, metadata={"help": "Causal LMs: take the cross-entropy through lm_head a chunk of tokens at a "
                                        "time, never building the whole logits (12 bytes a token and vocabulary "
                                        "entry); false for a model whose forward must build them (soft-capped "
                                        "logits: refused at the first step with this flag named)."}
    )


@dataclass
class CheckpointFlags:
    """Where checkpoints go, where they are copied, and which one a run resumes (checkpoints/)."""

    fresh_start: bool = field(
        default=False, metadata={"help": "Start over even if output_dir holds checkpoints (by default a run "
                                         "resumes from the newest complete one)."}
    )
    checkpoint_dir: str | None = field(
        default=None, metadata={"help": "Write checkpoints here and resume from here (default: output_dir; in a "
                                        "SageMaker job, the folder synced with checkpoint_s3_uri)."}
    )
    checkpoint_uri: str | None = field(
        default=None, metadata={"help": "Copy every complete checkpoint here (any fsspec URL: s3://bucket/prefix, "
                                        "gs://..., a local path); start from the newest one when output_dir has none."}
    )
    checkpoint_storage_options: str | None = field(
        default=None, metadata={"help": "fsspec options for --checkpoint_uri as JSON, e.g. "
                                        '\'{"endpoint_url": "http://127.0.0.1:9000"}\'.'}
    )
    resume_weights_only: bool = field(
        default=False, metadata={"help": "Resume a checkpoint that holds no optimizer state this backend reads (saved "
                                         "with --save_only_model, or by another backend): its weights and step "
                                         "continue, the optimizer state starts anew, the schedule continues at its "
                                         "step. Refused without it."}
    )


# ExtTrainingArguments' bases, in this order: their fields follow transformers' and the backends' own, from the last
# group to the first.
OWN_FLAGS = (CheckpointFlags, LossFlags, BatchFlags, V4Flags)


def flags_of(group: type[Group], args) -> Group:
    """`group`'s values in `args`: args itself when it is one (ExtTrainingArguments), else the group built from the
    fields `args` holds (stock TrainingArguments, a namespace), each one it lacks at its declared default."""
    if isinstance(args, group):
        return args
    return group(**{f.name: getattr(args, f.name) for f in fields(group) if hasattr(args, f.name)})
