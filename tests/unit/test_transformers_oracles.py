"""Cross-checks against transformers' own code: its DeepSpeed auto-fill, its schedulers, its flag defaults."""

import dataclasses
import json
import math

import pytest
import torch
from transformers import TrainingArguments, get_scheduler

from trainer_ext.deepspeed_config import FLAG_DEFAULTS, load_deepspeed_config, resolve_deepspeed_config


class AtWorldSize:
    """Real TrainingArguments seen at another world size (the only thing transformers reads from the launcher)."""

    def __init__(self, args, world_size):
        self._args, self.world_size = args, world_size

    def __getattr__(self, name):
        return getattr(self._args, name)


def transformers_fill(config, args, world_size, num_training_steps, model_hidden_size):
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    class Model:
        config = type("Config", (), {"hidden_size": model_hidden_size})()

    hf_config = HfTrainerDeepSpeedConfig(json.loads(json.dumps(config)))
    view = AtWorldSize(args, world_size)
    hf_config.trainer_config_process(view)
    hf_config.trainer_config_finalize(view, Model(), num_training_steps)
    return hf_config.config


def auto_paths(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, dict):
            yield from auto_paths(value, f"{prefix}{key}.")
        elif value == "auto":
            yield f"{prefix}{key}"


def get(config, path):
    for part in path.split("."):
        config = config[part]
    return config


FLAG_SETS = [
    dict(),
    dict(per_device_train_batch_size=3, gradient_accumulation_steps=4, learning_rate=1e-4, warmup_steps=7),
    dict(adam_beta1=0.8, adam_beta2=0.98, adam_epsilon=1e-6, weight_decay=0.01, max_grad_norm=0.5, warmup_steps=0.1),
    dict(bf16=True, warmup_steps=20),
    dict(fp16=True, per_device_train_batch_size=16, warmup_steps=3),
]


@pytest.mark.deepspeed
@pytest.mark.parametrize("flags", FLAG_SETS)
@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_all_auto_config_matches_transformers_auto_fill(tmp_path, flags, world_size):
    """If our "auto" filling differed from transformers', a user switching to us would silently train differently."""
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, **flags)
    config, _ = load_deepspeed_config("zero2_auto")
    steps, hidden = 120, 384
    theirs = transformers_fill(config, args, world_size, steps, hidden)
    ours = resolve_deepspeed_config(args, config, world_size=world_size, num_training_steps=steps,
                                    hidden_size=hidden).config
    paths = list(auto_paths(config))
    assert len(paths) >= 14
    for path in paths:
        assert get(theirs, path) != "auto", path
        assert get(ours, path) == pytest.approx(get(theirs, path)), path


def test_flag_defaults_match_training_arguments():
    """A wrong default would turn a flag the user never typed into a conflict (or hide a real one)."""
    from trainer_ext import ExtTrainingArguments

    defaults = {f.name: f.default for f in dataclasses.fields(ExtTrainingArguments)}
    for name, value in FLAG_DEFAULTS.items():
        assert getattr(defaults[name], "value", defaults[name]) == value, name


def lr_sequences(flags, steps, config):
    """Per-step learning rates of DeepSpeed's scheduler (built as the engine builds it) and of transformers'."""
    from deepspeed.runtime import lr_schedules

    lr = config["optimizer"]["params"]["lr"]
    ds_optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    ds_scheduler = getattr(lr_schedules, config["scheduler"]["type"])(ds_optimizer, **config["scheduler"]["params"])
    ds_scheduler.step()  # DeepSpeed starts at iteration -1; ExtTrainer primes it so step k uses iteration k

    hf_optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    args = TrainingArguments(output_dir="unused", use_cpu=True, **flags)
    hf_scheduler = get_scheduler(flags.get("lr_scheduler_type", "linear"), hf_optimizer,
                                 num_warmup_steps=args.get_warmup_steps(steps), num_training_steps=steps)
    ours, theirs = [], []
    for _ in range(steps + 3):
        ours.append(ds_optimizer.param_groups[0]["lr"])
        theirs.append(hf_optimizer.param_groups[0]["lr"])
        ds_scheduler.step()
        hf_scheduler.step()
    return ours, theirs


SCHEDULES = [
    dict(lr_scheduler_type="linear", warmup_steps=2),
    dict(lr_scheduler_type="linear", warmup_steps=10, learning_rate=3e-4),
    dict(lr_scheduler_type="linear", warmup_steps=0.1),
    dict(lr_scheduler_type="linear", warmup_ratio=0.25),
    dict(lr_scheduler_type="constant_with_warmup", warmup_steps=5),
    dict(lr_scheduler_type="constant_with_warmup", warmup_steps=0),
    dict(lr_scheduler_type="constant", warmup_steps=5),
]


@pytest.mark.deepspeed
@pytest.mark.parametrize("flags", SCHEDULES)
def test_deepspeed_schedule_equals_transformers_every_step(flags):
    """The learning rate at every step must be transformers' for the same flags (DeepSpeed's default is log warmup)."""
    steps = 97
    hf_flags = dict(flags)
    if "warmup_ratio" in hf_flags:  # transformers 5 spells it --warmup_steps 0.25
        hf_flags["warmup_steps"] = hf_flags.pop("warmup_ratio")
    config = resolve_deepspeed_config(flags, {}, world_size=1, num_training_steps=steps).config
    assert "scheduler" in config
    ours, theirs = lr_sequences(hf_flags, steps, config)
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-9 * max(theirs)


@pytest.mark.parametrize("flags", [dict(lr_scheduler_type="cosine", warmup_steps=10),
                                   dict(lr_scheduler_type="linear", warmup_steps=0),
                                   dict(lr_scheduler_type="linear", warmup_steps=1),
                                   dict(lr_scheduler_type="polynomial", warmup_steps=10)])
def test_schedules_deepspeed_cannot_express_are_left_to_transformers(flags):
    """Emitting an inexact DeepSpeed scheduler would silently change the learning rate."""
    resolution = resolve_deepspeed_config(flags, {}, world_size=1, num_training_steps=50)
    assert "scheduler" not in resolution.config
    assert resolution.scheduler_by_trainer
    assert any("left to the Trainer" in note for note in resolution.notes)


@pytest.mark.deepspeed
def test_deepspeed_cosine_really_differs_from_transformers():
    """Why cosine is left to transformers: DeepSpeed's WarmupCosineLR never reaches the peak rate."""
    params = {"total_num_steps": 50, "warmup_num_steps": 10, "warmup_type": "linear", "warmup_min_ratio": 0,
              "cos_min_ratio": 0}
    config = {"optimizer": {"params": {"lr": 1e-3}}, "scheduler": {"type": "WarmupCosineLR", "params": params}}
    ours, theirs = lr_sequences(dict(lr_scheduler_type="cosine", warmup_steps=10, learning_rate=1e-3), 50, config)
    assert max(theirs) == pytest.approx(1e-3)
    assert max(ours) < 1e-3 * (1 - 1e-4)
    assert not math.isclose(ours[10], theirs[10])
