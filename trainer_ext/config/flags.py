"""The path ExtTrainingArguments had from 2026-11-24 to 2026-11-28 (now trainer_ext.args, above the backends whose
settings it settles): a training_args.bin saved then pickles trainer_ext.config.flags.ExtTrainingArguments, and
torch.load of one finds it here. Nothing in trainer_ext imports this module."""

from ..args import ExtArgumentParser, ExtTrainingArguments

__all__ = ["ExtArgumentParser", "ExtTrainingArguments"]
