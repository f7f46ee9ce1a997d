"""A backend brings its own flags: FairScale's --sharded_ddp is declared in backends/fairscale.py and composed into
ExtTrainingArguments by the registry (torchtitan's component configs), so the arguments name no backend."""

import dataclasses

from transformers import TrainingArguments

from trainer_ext import ExtArgumentParser, ExtTrainingArguments
from trainer_ext.backends import backend_classes, flag_classes


def test_each_backends_flags_are_composed_into_the_arguments_in_a_stable_order():
    """transformers' fields first, then the backends' own, then ExtTrainingArguments': a positional call (and a
    subclass with TRL's configs) keeps its meaning; the flag's help says its options."""
    names = [f.name for f in dataclasses.fields(ExtTrainingArguments)]
    stock = [f.name for f in dataclasses.fields(TrainingArguments)]
    brought = [f.name for cls in flag_classes() for f in dataclasses.fields(cls)]
    assert brought == ["sharded_ddp"] and [cls.flags for cls in backend_classes() if cls.flags] == list(flag_classes())
    assert names[:len(stock)] == stock and names[len(stock):len(stock) + len(brought)] == brought
    assert not set(brought) & set(ExtTrainingArguments.__dict__.get("__annotations__", {}))  # declared once, there
    parser = ExtArgumentParser(ExtTrainingArguments)
    assert "Options: simple, zero_dp_2, zero_dp_3, offload" in " ".join(parser.format_help().split())
