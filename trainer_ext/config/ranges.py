"""The ranges a flag's value must lie in, as tables: flag -> (holds for the value, what the value must be). Pure data
and one lookup (no torch): the flag checks and the DeepSpeed translator (a file's value too) read them."""

from __future__ import annotations

# Values transformers accepts at parse time and fails on later (a ZeroDivisionError at the first batch, torch's
# "Invalid learning rate" once the model is loaded): flag -> (test, what the value must be).
FLAG_RANGES = {
    **dict.fromkeys(("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"),
                    (lambda value: value >= 1, "must be a positive integer")),
    **dict.fromkeys(("learning_rate", "weight_decay", "max_grad_norm", "adam_epsilon"),
                    (lambda value: value >= 0, "must be >= 0")),
    **dict.fromkeys(("adam_beta1", "adam_beta2"), (lambda value: 0 <= value < 1, "must be in [0, 1)")),
}


def out_of_range(flag: str, value) -> str | None:
    """What a value of --flag must be, when this one is not (a DeepSpeed file's value as well as a typed one)."""
    if flag not in FLAG_RANGES:
        return None
    holds, requirement = FLAG_RANGES[flag]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"must be a number and {requirement.removeprefix('must be ')}"
    return None if holds(value) else requirement


STEPS = "a whole number of steps, or a ratio in (0, 1) of the training steps"
# Values transformers would silently replace or ignore (TrainingArguments.__post_init__ and the Trainer, 5.23): each
# flag -> (holds for the value, what it must be). None (unset) always holds.
TRAINING_RANGES = {
    "logging_steps": (lambda v: v > 0, f"must be > 0 ({STEPS}); transformers would log at negative multiples"),
    "eval_steps": (lambda v: v > 0, f"must be > 0 ({STEPS}); transformers would use --logging_steps instead (leave "
                                    "it unset for that)"),
    "save_steps": (lambda v: v > 0, f"must be > 0 ({STEPS}); transformers would never save (--save_strategy no "
                                    "says that)"),
    "save_total_limit": (lambda v: v >= 1, "must be at least 1; transformers would keep every checkpoint (leave it "
                                           "unset for that)"),
    "max_steps": (lambda v: v == -1 or v > 0, "must be a positive number of steps, or -1 to train "
                                              "--num_train_epochs (transformers would ignore it)"),
    "num_train_epochs": (lambda v: v >= 0, "must be >= 0"),
    "global_batch_size": (lambda v: v >= 1, "must be a positive number of samples per optimizer step (leave it unset "
                                            "for per-device batch x accumulation x ranks)"),
    "eval_delay": (lambda v: v >= 0, "must be >= 0 (steps or epochs before the first evaluation)"),
    "label_smoothing_factor": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "dataloader_num_workers": (lambda v: v >= 0, "must be >= 0 (0: load in the main process)"),
    "eval_accumulation_steps": (lambda v: v >= 1, "must be at least 1"),
    "seed": (lambda v: 0 <= v < 2 ** 32, "must be in [0, 2**32) (numpy's seed range)"),
    "data_seed": (lambda v: 0 <= v < 2 ** 32, "must be in [0, 2**32) (numpy's seed range)"),
}
