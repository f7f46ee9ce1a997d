"""Every resolved config is accepted by DeepSpeed's own config parser, with consistent batch fields."""

import itertools
import json

import pytest

from conftest import REPO
from trainer_ext.deepspeed_config import DeepSpeedConfigError, PRESETS, explain, iter_fields, resolve_deepspeed_config

pytestmark = pytest.mark.deepspeed  # every test here runs DeepSpeed's own parser or engine

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
    assert parsed.zero_optimization_stage == (3 if file and file.startswith("zero3") else 2)
    assert parsed.gradient_clipping == 1.0


def _leaves(tree: dict, path=()):
    for key, value in tree.items():
        yield from _leaves(value, (*path, key)) if isinstance(value, dict) else [((*path, key), value)]


@pytest.mark.parametrize("file", sorted(PRESETS))
def test_each_shipped_config_resolves_with_default_flags(deepspeed_accepts, file):
    """A shipped config that does not resolve with plain flags would fail for every new user; one whose written values
    were rewritten, or whose batch fields disagree, would train something else than the file says."""
    written = json.loads((REPO / "ds_configs" / PRESETS[file]).read_text())
    resolution = resolve_deepspeed_config({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 3}, file,
                                          world_size=2, num_training_steps=100)
    config = resolution.config
    parsed = deepspeed_accepts(config, 2)
    assert (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) \
        == (4 * 3 * 2, 4, 3)
    assert parsed.zero_optimization_stage == written["zero_optimization"]["stage"]
    for path, value in _leaves(written):
        if value == "auto" or path == ("zero_optimization", "cpu_offload"):  # legacy key: migrated, said in a note
            continue
        resolved = config
        for key in path:
            resolved = resolved[key]
        assert resolved == value, f"{file}: {'.'.join(path)} written {value!r}, resolved {resolved!r}"


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


# (where the ranks run, world size) -> (overlap_comm, reduce_scatter, contiguous_gradients) as DeepSpeed parses them.
TUNED = {("cpu", 2): (False, False, False), ("gpu", 1): (False, True, False), ("gpu", 2): (True, True, False)}


@pytest.mark.parametrize("config", [{}, "zero2_minimal", {"zero_optimization": {"stage": 2}},
                                    {"zero_optimization": {"stage": 1}}])
@pytest.mark.parametrize("where,world_size", list(TUNED))
def test_zero_defaults_by_where_the_ranks_run(deepspeed_accepts, config, where, world_size):
    """The measured ZeRO-1/2 defaults, for fields a file leaves out or sets to "auto", as DeepSpeed itself reads them:
    contiguous_gradients off everywhere (faster on an H100 and on CPU ranks), overlap_comm only with several GPUs,
    reduce_scatter off on CPU ranks; each with its reason for --explain."""
    resolution = resolve_deepspeed_config({"per_device_train_batch_size": 4}, config, world_size=world_size,
                                          num_training_steps=10, cpu_ranks=where == "cpu")
    zero = deepspeed_accepts(resolution.config, world_size).zero_config
    assert (zero.overlap_comm, zero.reduce_scatter, zero.contiguous_gradients) == TUNED[(where, world_size)]
    for key in ("overlap_comm", "reduce_scatter", "contiguous_gradients"):
        assert resolution.sources[f"zero_optimization.{key}"].startswith("default for ")
    assert "s/step" in resolution.sources["zero_optimization.contiguous_gradients"]  # the measurement behind it


def test_zero_values_the_user_wrote_are_kept(deepspeed_accepts):
    """A value in the file is the user's on any device; offload keeps contiguous gradients (DeepSpeed needs them);
    ZeRO-3 gets its own fields (tests/integration/test_zero3.py), none of the ZeRO-1/2 ones tuned here."""
    written = {"zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_scatter": True,
                                     "contiguous_gradients": True}}
    for cpu_ranks in (True, False):
        zero = resolve_deepspeed_config({}, written, world_size=2, num_training_steps=10, cpu_ranks=cpu_ranks).config
        assert {k: zero["zero_optimization"][k] for k in ("overlap_comm", "reduce_scatter", "contiguous_gradients")} \
            == {"overlap_comm": True, "reduce_scatter": True, "contiguous_gradients": True}
    for config in ("zero2_offload", {"zero_optimization": {"stage": 2, "cpu_offload": True}}):
        resolved = resolve_deepspeed_config({}, config, world_size=1, num_training_steps=10).config
        assert deepspeed_accepts(resolved, 1).zero_config.contiguous_gradients is True
    # ZeRO-3: what the user wrote stays, and none of the ZeRO-1/2 measurements decides a stage-3 field.
    stage3_written = {"stage": 3, "overlap_comm": False, "sub_group_size": 123456,
                      "stage3_max_live_parameters": 7654321, "stage3_param_persistence_threshold": 1000,
                      "stage3_gather_16bit_weights_on_model_save": False}
    stage3 = resolve_deepspeed_config({}, {"zero_optimization": stage3_written}, world_size=1, num_training_steps=10)
    assert {key: stage3.config["zero_optimization"][key] for key in stage3_written} == stage3_written
    assert not any("s/step" in source for key, source in stage3.sources.items() if key.startswith("zero_optimization"))
    assert deepspeed_accepts(stage3.config, 1).zero_optimization_stage == 3


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_keeps_skipping_nonfinite_steps(deepspeed_accepts, precision):
    """bf16 keeps DeepSpeed's check_grad_overflow on and fp16 its dynamic loss scale (a non-finite norm skips the
    step; trainer_ext drops only the per-parameter scan, see tests/integration/test_overflow_check.py); the log and --explain say
    so."""
    resolution = resolve_deepspeed_config({precision: True}, {}, world_size=1, num_training_steps=10)
    parsed = deepspeed_accepts(resolution.config, 1)
    if precision == "bf16":
        assert parsed.bfloat16_config.check_grad_overflow is True
    else:  # dynamic loss scaling: an overflow lowers the scale and skips the step
        assert parsed.float16_config.loss_scale == 0 and parsed.float16_config.enabled is True
    assert any(note.startswith("overflow check: trainer_ext skips a step") for note in resolution.notes)
    assert "overflow check" in explain(resolution)


def test_check_grad_overflow_false_in_the_file_is_kept_with_a_warning(deepspeed_accepts):
    """The user's false stays false (DeepSpeed then detects nothing under bf16), and the consequence is said."""
    resolution = resolve_deepspeed_config({}, {"bf16": {"enabled": True, "check_grad_overflow": False}},
                                          world_size=1, num_training_steps=10)
    assert deepspeed_accepts(resolution.config, 1).bfloat16_config.check_grad_overflow is False
    assert any("write NaN into the weights" in note for note in resolution.notes)


# Values a file may hold for a scalar field, good and bad: words, numbers of each kind and sign, bounds, bool-like text,
# null and containers. Each is read as DeepSpeed would get it (the translator's numeric strings as numbers).
SCALARS = ["huge", "", "true", "Yes", "off", "cpu", "nvme", "CPU", "cpuu", "/tmp", None, [], {}, [1], -1, 0, 1, 2, 3, 4,
           0.5, 1.0, 1.5, -0.5, 5e8, 5e8 + 0.5, 1e30, float("inf"), float("nan"), True, False, "8", "5e8", "-1", "0.25",
           "1_000"]


def oracle_models():
    """Each FIELD_TYPES section -> (DeepSpeed's model, the section's other fields for the check, where the section sits
    in a file)."""
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                       DeepSpeedZeroOffloadParamConfig)

    zero3 = {"zero_optimization": {"stage": 3}}  # offload ratio < 1 is a stage-3 setting
    return {"zero_optimization": (DeepSpeedZeroConfig, {"stage": 2}, {}),
            # With a folder: "nvme" without one DeepSpeed's model accepts, and fails at its first swap (we refuse it).
            "zero_optimization.offload_optimizer": (DeepSpeedZeroOffloadOptimizerConfig, {"nvme_path": "/nvme"}, zero3),
            "zero_optimization.offload_param": (DeepSpeedZeroOffloadParamConfig, {"nvme_path": "/nvme"}, zero3),
            "fp16": (DeepSpeedFP16Config, {}, {}), "bf16": (DeepSpeedBF16Config, {}, {})}


def test_each_field_is_refused_exactly_when_deepspeeds_own_model_refuses_it(deepspeed_accepts):
    """`"reduce_bucket_size": "huge"` rendered fine and failed in DeepSpeed's pydantic check once the model was loaded,
    with a traceback; a table stricter than DeepSpeed's models would refuse files DeepSpeed trains with."""
    from pydantic import ValidationError

    from trainer_ext.deepspeed_config.fields import numbers_from_strings, set_field
    from trainer_ext.deepspeed_config.keys import FIELD_TYPES

    disagreements, checked = [], 0
    for section, (model, base, around) in oracle_models().items():
        for key in FIELD_TYPES[section]:
            for value in SCALARS:
                block = {**base, key: value}
                try:
                    model(**numbers_from_strings(block))
                    theirs = "accepts"
                except (ValidationError, ValueError, TypeError, AssertionError):  # each raised by some validator
                    theirs = "refuses"
                config = json.loads(json.dumps(around))
                set_field(config, section, {**base, **(get_block(config, section)), key: value})
                try:
                    resolve_deepspeed_config({}, config, world_size=1, num_training_steps=10)
                    ours = "accepts"
                except DeepSpeedConfigError as err:
                    ours = "refuses"
                    assert all(f"{section}.{key}" in problem for problem in err.problems), err.problems
                checked += 1
                if ours != theirs:
                    disagreements.append(f"{section}.{key}={value!r}: DeepSpeed {theirs}, we {ours}")
    assert not disagreements, "\n".join(disagreements)
    assert checked > 2500


def get_block(config, section):
    from trainer_ext.deepspeed_config.fields import get_field

    return get_field(config, section) or {}


def test_the_top_level_scalars_checked_are_deepspeeds_and_of_its_types(deepspeed_accepts):
    """TOP_LEVEL_TYPES names fields DeepSpeed reads at the top level (its parser's defaults have the type the table
    asks for), and a wrong type there is refused by ds-config and training alike."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from trainer_ext.backends.deepspeed.backend import deepspeed_refusals
    from trainer_ext.deepspeed_config.fields import read_field
    from trainer_ext.deepspeed_config.keys import KNOWN_TOP_LEVEL_KEYS, TOP_LEVEL_TYPES

    reader = DeepSpeedConfig.__new__(DeepSpeedConfig)
    reader._initialize_params({})  # noqa: SLF001
    for key, spec in TOP_LEVEL_TYPES.items():
        assert key in KNOWN_TOP_LEVEL_KEYS
        default = getattr(reader, key)
        assert read_field(spec, default)[0] and isinstance(default, bool) == (spec.kind == "bool"), (key, default)
        [problem] = deepspeed_refusals({key: "often"})
        assert problem.startswith(f'{key}="often": must be ')
