"""The translator's own tables agree with DeepSpeed's code, and the translator imports without torch."""

import subprocess
import sys

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


@pytest.mark.deepspeed
def test_removed_keys_cover_deepspeed_removals():
    """A block DeepSpeed removed (amp, elasticity, ...) must be refused up front, saying what replaces it."""
    from deepspeed.runtime import config

    assert set(config._REMOVED_TOP_LEVEL_CONFIG_KEYS) <= set(dc.REMOVED_TOP_LEVEL_KEYS)


@pytest.mark.launch
def test_translator_imports_without_torch_or_deepspeed():
    """Config rendering must work on a login node with neither installed."""
    code = ("import sys\n"
            "for name in ('torch', 'deepspeed', 'transformers'):\n"
            "    sys.modules[name] = None  # any import of them now fails\n"
            "from trainer_ext.deepspeed_config import build_deepspeed_config\n"
            "import trainer_ext\n"
            "cfg = build_deepspeed_config({'bf16': True}, world_size=8, num_training_steps=100, config='zero2_auto')\n"
            "assert cfg['train_batch_size'] == 64 and trainer_ext.build_deepspeed_config is build_deepspeed_config\n"
            "print('pure ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "pure ok" in out.stdout


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
