"""trainer_ext: one transformers training script for one CPU, N GPUs with DeepSpeed ZeRO-2/3, or FairScale
sharded DDP. Heavy names load on first use, so `trainer_ext.deepspeed_config` imports without torch."""

from importlib import import_module

__version__ = "0.1.0"

_LAZY = {
    "ExtTrainer": ".trainer",
    "ExtTrainingArguments": ".args",
    "ExtSeq2SeqTrainer": ".seq2seq",
    "ExtSeq2SeqTrainingArguments": ".seq2seq",
    "OptimizerSettings": ".config.optimizer",
    "SchedulerSettings": ".config.optimizer",
    "ExtArgumentParser": ".args",
    "run_experiment": ".experiment",
    "build_deepspeed_config": ".deepspeed_config",
    "resolve_deepspeed_config": ".deepspeed_config",
    "load_deepspeed_config": ".deepspeed_config",
    "DeepSpeedConfigError": ".deepspeed_config",
    "ArgumentsError": ".errors",
    "exit_process": ".errors",
    "one_line_errors": ".errors",
    "Preempted": ".checkpoints.preemption",
    "sharded_loading": ".training.prepare",
    "prepare_process": ".training.prepare",
}
__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'trainer_ext' has no attribute {name!r}")
