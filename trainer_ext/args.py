"""The old home of ExtTrainingArguments (now trainer_ext.config.flags), kept because every training_args.bin a run
saved before the move pickles the class under this path: torch.load of one still finds it here."""

from .config.flags import ExtArgumentParser, ExtTrainingArguments

__all__ = ["ExtArgumentParser", "ExtTrainingArguments"]
