"""`trainer-ext ds-config --explain` word for word, and every problem's wording, for cases that together reach every
kind of source, note and problem the translator writes: tests/unit/translator_golden.txt is what they print.

After an intended change of wording: `python tests/unit/test_translator_golden.py` rewrites the file; read its diff."""

import difflib
import sys
from pathlib import Path
from types import SimpleNamespace

from trainer_ext.config.batch import settle
from trainer_ext.deepspeed_config import DeepSpeedConfigError, explain, finish_deepspeed_config, resolve_deepspeed_config

GOLDEN = Path(__file__).with_name("translator_golden.txt")
REPO = Path(__file__).resolve().parents[2]


def typed(**flags):
    """Arguments that record what was typed, as ExtTrainingArguments and `trainer-ext ds-config` do."""
    return SimpleNamespace(**flags, flags_given=set(flags) - {"use_cpu"})


LEGACY_ZERO3 = {"stage": 3, "cpu_offload_param": True, "cpu_offload_use_pin_memory": True, "cpu_offload": True,
                "stage3_gather_fp16_weights_on_model_save": True, "max_live_parameters": 2e8,
                "prefetch_bucket_size": "auto", "sub_group_size": 1e9}
WARMUP_AUTO = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto", "warmup_type": "linear"}}}
# name -> (flags, config, keyword arguments of resolve_deepspeed_config, phase 2's (world size, steps, hidden size))
CASES = {
    "the classic file, nothing typed (ds-config)": (typed(), "zero2", dict(world_size=2, num_training_steps=100), None),
    "every field auto, flags as a dict, phase 2 on the process group's 4 ranks": (
        dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=1e-4, warmup_steps=0.1,
             bf16=True, adam_epsilon=1e-6, max_grad_norm=0.5),
        "zero2_auto", dict(world_size=2, final=False), (4, 50, 64)),
    "no file, --fp16 and cosine on 8 GPUs": (
        dict(fp16=True, lr_scheduler_type="cosine", warmup_steps=10), {}, dict(world_size=8, num_training_steps=100),
        None),
    "legacy ZeRO-3 on CPU ranks, bfloat16, no model": (
        typed(per_device_train_batch_size=8, warmup_steps=10, use_cpu=True),
        {"zero_optimization": LEGACY_ZERO3, "bfloat16": {"enabled": "auto"}, "train_batch_size": "auto",
         "gradient_clipping": 1.0},
        dict(world_size=2, num_training_steps=100, cpu_ranks=True), None),
    "ZeRO-3 at argument time, then a model without a hidden size": (
        {}, {"zero_optimization": {"stage": 3}}, dict(world_size=2, num_training_steps=100, final=False),
        (2, 100, None)),
    "ZeRO-3 values written, consolidation off, a model's hidden size": (
        dict(warmup_steps=5, lr_scheduler_type="constant_with_warmup"),
        {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False,
                               "reduce_bucket_size": "auto", "sub_group_size": 123456},
         "bf16": {"enabled": True, "check_grad_overflow": False}},
        dict(world_size=1, num_training_steps=100, hidden_size=384), None),
    "train_batch_size alone, split for 2 ranks; constant rate; offload at stage 2": (
        dict(lr_scheduler_type="constant"),
        {"train_batch_size": 32, "zero_optimization": {"stage": "auto", "cpu_offload": False,
                                                       "offload_optimizer": {"device": "cpu"},
                                                       "offload_param": {"device": "cpu"}}},
        dict(world_size=2, final=False), (2, 30, None)),
    "... and the same on the process group's 4 ranks": (
        dict(lr_scheduler_type="constant"), {"train_batch_size": 32}, dict(world_size=2, final=False), (4, 30, None)),
    "accumulation from train_batch_size, file schedulers, auto optimizer": (
        typed(per_device_train_batch_size=4, warmup_ratio=0.1, learning_rate=2e-5, adam_beta2=0.99, fp16=True),
        {"train_batch_size": 48, "optimizer": {"type": "Lion", "params": {"lr": "auto", "betas": "auto",
                                                                           "weight_decay": "auto"}},
         "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_min_ratio": "auto", "cos_min_ratio": "auto",
                                                            "warmup_type": "auto", "warmup_num_steps": 10}},
         "fp16": {"enabled": "auto", "loss_scale": "auto"}},
        dict(world_size=3, num_training_steps=100), None),
    "a file that agrees with every typed flag": (
        typed(per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=3e-5, adam_beta1=0.8,
              adam_epsilon=1e-8, weight_decay=3e-7, max_grad_norm=1.0, fp16=True, warmup_steps=500,
              lr_scheduler_type="constant_with_warmup"),
        {**dict(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2, train_batch_size=8,
                gradient_clipping=1.0), "fp16": {"enabled": True},
         "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.8, 0.999], "eps": 1e-8,
                                                   "weight_decay": 3e-7}},
         "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 500, "warmup_type": "linear"}}},
        dict(world_size=1, num_training_steps=1000), None),
    "warmup from a ratio on CPU ranks, waiting for the step count": (
        typed(warmup_ratio=0.1), {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_type": "linear"}},
                                  "zero_optimization": {"stage": 1}},
        dict(world_size=1, final=False, cpu_ranks=True), (1, 200, None)),
    "every key problem at once": (
        {}, {"zero_optimisation": {"stage": 2}, "gradient_acumulation_steps": 4, "foo_bar_baz": 1, "lr": 1,
             "amp": {"enabled": True}, "fp16": True, "zero_optimization": {"stage": 5, "overlap_com": True,
                                                                          "max_live_parameters": 10,
                                                                          "stage3_max_live_parameters": 1000},
             "bf16": {"enabled": "yes"}, "bfloat16": {"enabled": True}, "steps_per_print": "auto",
             "optimizer": {"type": "SGD"}},
        dict(world_size=2, num_training_steps=100), None),
    "every value problem at once": (
        dict(per_device_train_batch_size=0, fp16=True, fp16_backend="apex", bf16=True, learning_rate=1e-4,
             warmup_steps=10),
        {"gradient_accumulation_steps": -2, "gradient_clipping": "x",
         "optimizer": {"type": "Adamm", "params": {"lr": 3e-5, "betas": [0.9, 1.5], "eps": -1}},
         "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 50, "warmup_max_lr": 1e-3}},
         "zero_optimization": {"stage": 3, "stage3_module_granularity_threshold": 1}},
        dict(world_size=2, cpu_ranks=True), None),
    "conflicts with typed flags": (
        typed(per_device_train_batch_size=8, adam_beta2=0.98, weight_decay=0.01, lr_scheduler_type="cosine",
              use_cpu=True),
        {"train_batch_size": 100, "fp16": {"enabled": True},
         "optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95], "weight_decay": 0.1}},
         "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}},
        dict(world_size=2, num_training_steps=100), None),
    "fp16 off in the file against --fp16 --bf16 (a KeyError before)": (
        typed(fp16=True, bf16=True), {"fp16": {"enabled": False}}, dict(world_size=1, num_training_steps=10), None),
    "batch fields that cannot hold, a missing step count, no optimizer type": (
        dict(warmup_steps=10),
        {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
         "optimizer": "AdamW"},
        dict(world_size=2), None),
    "batch fields no flag can mend, an unknown scheduler": (
        dict(warmup_steps=10), {"train_batch_size": 7, "scheduler": {"type": "WarmupLinear"}}, dict(world_size=2),
        None),
    "a scheduler given as a name, not an object": (
        dict(warmup_steps=10), {"scheduler": "WarmupLR"}, {}, None),
    "a file scheduler's auto warmup, nothing typed": (typed(), WARMUP_AUTO, dict(world_size=1, num_training_steps=100),
                                                      None),
    "... from --warmup_ratio": (typed(warmup_ratio=0.2), WARMUP_AUTO, dict(world_size=1, num_training_steps=100), None),
    "... from --warmup_steps 1": (typed(warmup_steps=1), WARMUP_AUTO, dict(world_size=1, num_training_steps=100), None),
    "--global_batch_size 32 kept on 2 ranks": (
        dict(per_device_train_batch_size=8), {},
        dict(world_size=2, num_training_steps=100, global_batch=settle(8, 1, 2, global_batch_size=32)), None),
    "... against a file that pins the accumulation": (
        dict(per_device_train_batch_size=8), {"gradient_accumulation_steps": 4, "train_micro_batch_size_per_gpu": 8},
        dict(world_size=2, num_training_steps=100, global_batch=settle(8, 1, 2, global_batch_size=32)), None),
    "a file scheduler without params": (
        {}, {"scheduler": {"type": "WarmupDecayLR"}}, dict(world_size=1, num_training_steps=100), None),
    "... with its own step count": (
        {}, {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 50}}},
        dict(world_size=1, num_training_steps=100), None),
    "--lr_scheduler_type constant with --warmup_steps 10: a constant rate, as transformers' constant": (
        dict(lr_scheduler_type="constant", warmup_steps=10), {}, dict(world_size=1, num_training_steps=100), None),
    "linear with --warmup_ratio 0.1 over 100 steps": (
        dict(warmup_ratio=0.1), {}, dict(world_size=1, num_training_steps=100), None),
    "... at argument time, then 100 steps": (dict(warmup_ratio=0.1), {}, dict(world_size=1, final=False), (1, 100, None)),
    "linear with one warmup step: left to the Trainer": (
        dict(warmup_steps=1), {}, dict(world_size=1, num_training_steps=100), None),
    "constant with --warmup_ratio 0.1 over 100 steps": (
        dict(lr_scheduler_type="constant", warmup_ratio=0.1), {}, dict(world_size=1, num_training_steps=100), None),
    "constant with --warmup_ratio 0.1 at argument time, then 100 steps": (
        dict(lr_scheduler_type="constant", warmup_ratio=0.1), {}, dict(world_size=1, final=False), (1, 100, None)),
    "stock arguments giving both warmups: the steps win, as in transformers 4": (
        dict(warmup_steps=5, warmup_ratio=0.1), {}, dict(world_size=1, num_training_steps=100), None),
}


def render(name: str) -> str:
    flags, config, kwargs, phase_two = CASES[name]
    try:
        resolution = resolve_deepspeed_config(flags, config, **kwargs)
        text = explain(resolution)
        if phase_two:
            text += "\n-- phase 2 --\n" + explain(finish_deepspeed_config(resolution, flags, *phase_two))
    except DeepSpeedConfigError as err:
        text = f"DeepSpeedConfigError: {err}".replace(str(REPO), ".")
    return f"## {name}\n{text}\n"


def rendered() -> str:
    return "\n".join(render(name) for name in CASES)


def test_explain_and_problems_are_word_for_word_as_recorded():
    """A pass that fills a field from another source, or in another order, or says it otherwise, changes what users
    read in --explain and in the error message; tests/unit/translator_golden.txt holds what they read today."""
    now = rendered()
    diff = "".join(difflib.unified_diff(GOLDEN.read_text().splitlines(True), now.splitlines(True), "recorded", "now"))
    assert not diff, f"the translator's output changed (python {__file__} rewrites the record):\n{diff}"


if __name__ == "__main__":
    GOLDEN.write_text(rendered())
    print(f"wrote {GOLDEN} ({len(CASES)} cases)", file=sys.stderr)
