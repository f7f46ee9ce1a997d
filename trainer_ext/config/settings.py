"""The settings builder's door: the one place trainer_ext writes onto a TrainingArguments object. Everything else
computes values and hands them here, at two moments: when ExtTrainingArguments is parsed (trainer_ext/args.py: the
text flags read, a SageMaker job's folders, CPU ranks' device flags, what the selected backend settles
(backends.settle) and, once transformers has set the arguments up, its `arguments_ready`), and when a process is
prepared for training (training/prepare.py: the same for stock TrainingArguments, which parsed nothing, and what the
backend's `prepare_process` returns). What is written is either a field transformers itself reads (the resolved
DeepSpeed config as `deepspeed`, the batch and rate flags a DeepSpeed file decided, `fsdp_config`, `use_cpu`,
`output_dir`, ...), or our one attribute, `run_settings` (backends.RunSettings, frozen: the flags the user gave, this
start's split of the global batch, which backend and what it settled, handed to its constructor, where the model stays,
and the process it was prepared in). Building ExtTrainer on arguments already settled changes no field and adds no
attribute (tests/integration/test_settings_once.py); it records the process in run_settings, so that a second
prepare_process there does nothing and arguments loaded in another process (training_args.bin) are prepared again."""

from __future__ import annotations


def write(args, values: dict) -> None:
    """Set these fields on `args`: the only assignment to a TrainingArguments object in trainer_ext
    (tests/unit/test_internals.py fails on any other)."""
    for name, value in values.items():
        setattr(args, name, value)

