"""Every resolved config is accepted by DeepSpeed's own config parser, with consistent batch fields."""

import itertools
import json

import pytest

from trainer_ext.deepspeed_config import DeepSpeedConfigError, PRESETS, iter_fields, resolve_deepspeed_config

FILES = [None, *sorted(PRESETS)]
PRECISIONS = {"fp32": {}, "fp16": {"fp16": True}, "bf16": {"bf16": True}}
SCHEDULERS = ["linear", "cosine", "constant_with_warmup", "constant", "polynomial"]


FILE_SCHEDULER = {"zero2": "WarmupLR", "zero2_auto": "WarmupDecayLR"}


def flags_for(precision, accumulation, scheduler, file):
    flags = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": accumulation,
             "warmup_steps": 10, **PRECISIONS[precision]}
    if file not in FILE_SCHEDULER:  # a file's own scheduler conflicts with another --lr_scheduler_type
        flags["lr_scheduler_type"] = scheduler
    if file == "zero2":  # it fixes warmup at 500 steps
        del flags["warmup_steps"]
    return flags


CASES = [
    (world, accumulation, precision, scheduler, file)
    for (world, accumulation, precision, file), scheduler in zip(
        itertools.product((1, 2, 8), (1, 4), PRECISIONS, FILES), itertools.cycle(SCHEDULERS))
]


@pytest.mark.parametrize("world_size,accumulation,precision,scheduler,file", CASES)
def test_resolved_config_is_accepted_by_deepspeed(deepspeed_accepts, world_size, accumulation, precision,
                                                  scheduler, file):
    """A config DeepSpeed rejects, or whose batch fields disagree, would fail at engine start-up."""
    flags = flags_for(precision, accumulation, scheduler, file)
    if file == "zero2" and precision == "bf16":  # the classic file enables fp16: a conflict, tested elsewhere
        with pytest.raises(DeepSpeedConfigError, match="fp16.enabled and bf16.enabled"):
            resolve_deepspeed_config(flags, file, world_size=world_size, num_training_steps=200)
        return
    resolution = resolve_deepspeed_config(flags, file or {}, world_size=world_size, num_training_steps=200,
                                          hidden_size=384)
    config = resolution.config
    assert not [path for path, value in iter_fields(config) if value == "auto"]
    parsed = deepspeed_accepts(json.loads(json.dumps(config)), world_size)
    micro = config["train_micro_batch_size_per_gpu"]
    assert micro == resolution.effective_flags.get("per_device_train_batch_size", 4)
    assert config["gradient_accumulation_steps"] == accumulation
    assert config["train_batch_size"] == micro * accumulation * world_size
    assert (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) == (
        config["train_batch_size"], micro, accumulation)
    expected_fp16 = precision == "fp16" or file == "zero2"
    assert parsed.float16_config.enabled is expected_fp16
    assert parsed.bfloat16_config.enabled is (precision == "bf16")
    assert parsed.zero_optimization_stage == 2
    assert parsed.gradient_clipping == 1.0


@pytest.mark.parametrize("file", sorted(PRESETS))
def test_each_shipped_config_resolves_with_default_flags(deepspeed_accepts, file):
    """A shipped config that does not resolve with plain flags would fail for every new user."""
    config = resolve_deepspeed_config({}, file, world_size=2, num_training_steps=100).config
    deepspeed_accepts(config, 2)


def test_classic_zero2_keeps_its_values_and_offloads(deepspeed_accepts):
    """The pasted classic config must keep its optimizer, scheduler and CPU offload, not be rewritten."""
    resolution = resolve_deepspeed_config({}, "zero2", world_size=2, num_training_steps=1000)
    config = resolution.config
    parsed = deepspeed_accepts(config, 2)
    assert parsed.zero_config.offload_optimizer.device == "cpu"
    assert config["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.8, 0.999], "eps": 1e-8,
                                                               "weight_decay": 3e-7}}
    assert config["scheduler"] == {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5,
                                                                  "warmup_num_steps": 500}}
    assert resolution.effective_flags == {"fp16": True, "learning_rate": 3e-5, "adam_beta1": 0.8,
                                          "weight_decay": 3e-7, "warmup_steps": 500}
    assert any("cpu_offload" in note for note in resolution.notes)


@pytest.mark.parametrize("config", [{}, "zero2_minimal"])
def test_overlap_and_reduce_scatter_default_by_where_the_ranks_run(deepspeed_accepts, config):
    """On CPU ranks there are no side streams to overlap with: off there (9% shorter steps), on elsewhere."""
    for cpu_ranks, expected in ((True, False), (False, True)):
        resolution = resolve_deepspeed_config({"per_device_train_batch_size": 4}, config, world_size=2,
                                              num_training_steps=10, cpu_ranks=cpu_ranks)
        zero = deepspeed_accepts(resolution.config, 2).zero_config
        assert zero.overlap_comm is expected and zero.reduce_scatter is expected
        assert resolution.sources["zero_optimization.overlap_comm"].startswith("default for")
    # A value the user wrote is theirs, on any device.
    written = {"zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_scatter": True}}
    zero = resolve_deepspeed_config({}, written, world_size=2, num_training_steps=10, cpu_ranks=True).config
    assert zero["zero_optimization"]["overlap_comm"] is True and zero["zero_optimization"]["reduce_scatter"] is True
