"""The translator's own tables agree with DeepSpeed's code (tests/integration/test_import_cycles.py checks that it
imports without torch)."""


import pytest

from trainer_ext import deepspeed_config as dc


def model_keys(model):
    fields = model.model_fields
    return set(fields) | {f.alias for f in fields.values() if f.alias}


@pytest.mark.deepspeed
def test_known_top_level_keys_cover_every_key_deepspeed_reads(deepspeed_accepts):
    """A key DeepSpeed reads but we call unknown would block a valid config."""
    seen = set()

    class Recording(dict):
        def get(self, key, default=None):
            seen.add(key)
            return super().get(key, default)

        def __getitem__(self, key):
            seen.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            seen.add(key)
            return super().__contains__(key)

    deepspeed_accepts(Recording({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8,
                                 "zero_optimization": {"stage": 2}}), 1)
    assert len(seen) > 30
    assert seen - dc.KNOWN_TOP_LEVEL_KEYS - set(dc.REMOVED_TOP_LEVEL_KEYS) == set()


@pytest.mark.deepspeed
def test_section_keys_equal_deepspeed_models():
    """Key lists behind DeepSpeed's would block valid ZeRO/fp16/bf16 keys or let ones it ignores pass silently."""
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    assert dc.ZERO_KEYS == model_keys(DeepSpeedZeroConfig)
    assert dc.FP16_KEYS == model_keys(DeepSpeedFP16Config)
    assert dc.BF16_KEYS == model_keys(DeepSpeedBF16Config)


def field_kind(model, key) -> tuple[str, bool]:
    """A pydantic field's FieldType kind, and whether its model accepts null for it."""
    import enum
    import pathlib
    import typing

    from pydantic import BaseModel

    field = next(field for name, field in model.model_fields.items() if key in (name, field.alias))
    try:
        nullable = model(**{key: None}) is not None  # Optional, or a validator's own reading of null
    except (ValueError, TypeError):
        nullable = False
    annotation = field.annotation
    if typing.get_origin(annotation) is typing.Union:
        (annotation,) = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "object", nullable
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return ("stage" if issubclass(annotation, int) else "device"), nullable
    return {bool: "bool", int: "int", float: "float", pathlib.Path: "path"}[annotation], nullable


@pytest.mark.deepspeed
def test_field_types_follow_deepspeeds_models():
    """A field DeepSpeed checks that the table lacks (or types otherwise) would pass ds-config and fail once the model
    is loaded; the nested offload blocks refuse unknown keys as DeepSpeed does."""
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig, OffloadDeviceEnum,
                                                       DeepSpeedZeroOffloadParamConfig)

    from trainer_ext.deepspeed_config.keys import FIELD_TYPES, NESTED_SECTION_KEYS, OFFLOAD_DEVICES

    models = {"zero_optimization": DeepSpeedZeroConfig, "fp16": DeepSpeedFP16Config, "bf16": DeepSpeedBF16Config,
              "zero_optimization.offload_optimizer": DeepSpeedZeroOffloadOptimizerConfig,
              "zero_optimization.offload_param": DeepSpeedZeroOffloadParamConfig}
    assert set(FIELD_TYPES) == set(models)
    for section, model in models.items():
        assert set(FIELD_TYPES[section]) == model_keys(model), section
        if section in NESTED_SECTION_KEYS:
            assert NESTED_SECTION_KEYS[section] == model_keys(model)
        for name, field in model.model_fields.items():
            for key in {name, field.alias} - {None}:
                spec = FIELD_TYPES[section][key]
                assert (spec.kind, spec.nullable) == field_kind(model, key), f"{section}.{key}"
                if f"{section}.{key}" == "fp16.loss_scale":  # bounded by DeepSpeed's own validator, not by Field()
                    continue
                gt, ge, le = ([getattr(bound, name) for bound in field.metadata if hasattr(bound, name)] or [None]
                              for name in ("gt", "ge", "le"))
                assert (spec.low, spec.low_open, spec.high) == (gt[0] if gt[0] is not None else ge[0],
                                                                gt[0] is not None, le[0]), f"{section}.{key}"
    assert set(OFFLOAD_DEVICES) == {device.value for device in OffloadDeviceEnum}


@pytest.mark.deepspeed
def test_removed_keys_cover_deepspeed_removals():
    """A block DeepSpeed removed (amp, elasticity, ...) must be refused up front, saying what replaces it."""
    from deepspeed.runtime import config

    assert set(config._REMOVED_TOP_LEVEL_CONFIG_KEYS) <= set(dc.REMOVED_TOP_LEVEL_KEYS)


@pytest.mark.deepspeed
def test_optimizer_names_equal_deepspeeds_and_torchs(deepspeed_accepts):
    """optimizer.type is checked against these lists before training: a list behind DeepSpeed's or torch's would
    refuse an optimizer DeepSpeed builds, or let through one it asserts on when the engine starts."""
    import inspect

    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
    from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS, is_zero_supported_optimizer

    # DeepSpeed completes its list on the engine's first check (Muon, imported late): ask it as the engine does
    # (deepspeed_accepts started its process group).
    is_zero_supported_optimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)]))

    assert dc.keys.DEEPSPEED_OPTIMIZERS == set(DEEPSPEED_OPTIMIZERS)
    assert set(dc.keys.TORCH_OPTIMIZERS) == {
        name for name, value in vars(torch.optim).items()
        if inspect.isclass(value) and issubclass(value, torch.optim.Optimizer) and value is not torch.optim.Optimizer}
    # ZeRO's tested classes, by the optimizer.type that builds them (torch's Adam/AdamW/Adagrad, DeepSpeed's fused and
    # CPU Adam, Adagrad and Lion)
    tested = {cls.__name__.lower().removeprefix("deepspeedcpu").removeprefix("fused").removeprefix("zenflowcpu")
              .removesuffix("withauxadam") for cls in ZERO_SUPPORTED_OPTIMIZERS}
    assert dc.keys.ZERO_TESTED_OPTIMIZERS == tested


@pytest.mark.deepspeed
def test_optimizer_parameters_equal_the_classes_deepspeed_builds():
    """optimizer.params is checked against these tables before any work: a table behind a class's constructor would
    refuse a parameter it takes, or let through one that fails in it (TypeError on every rank, model loaded)."""
    import inspect

    import torch
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.ops.lamb import FusedLamb
    from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion

    classes = {cls.__name__: cls for cls in (FusedAdam, DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, FusedLamb, FusedLion,
                                              DeepSpeedCPULion)}
    classes.update({f"torch.optim.{name}": getattr(torch.optim, name) for name in dc.keys.TORCH_OPTIMIZERS})
    assert dc.keys.OPTIMIZER_CLASS_PARAMS.keys() == classes.keys()
    installed = dc.passes.installed_torch()
    for name, cls in classes.items():
        newer = tuple(key for key, since in dc.keys.OPTIMIZER_PARAMS_SINCE.get(name, {}).items() if installed >= since)
        assert dc.keys.OPTIMIZER_CLASS_PARAMS[name] + newer == tuple(inspect.signature(cls.__init__).parameters)[2:], \
            name


def test_a_parameter_a_newer_torch_added_is_taken_from_that_release_on(monkeypatch):
    """torch 2.15 gave LBFGS `maximize` (found by make test-newest): taken where the installed torch has it, refused
    in one line before any work where it does not (the constructor's TypeError on every rank otherwise)."""
    config = {"optimizer": {"type": "LBFGS", "params": {"maximize": True}}}
    monkeypatch.setattr(dc.passes, "installed_torch", lambda: (2, 13))
    assert "optimizer.params.maximize: not a parameter of torch.optim.LBFGS" in dc.passes.optimizer_params_problems(
        config)[0]
    monkeypatch.setattr(dc.passes, "installed_torch", lambda: (2, 15))
    assert dc.passes.optimizer_params_problems(config) == []
