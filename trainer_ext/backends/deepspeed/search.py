"""The DeepSpeed config's keys as a search space reaches them: `deepspeed.zero_optimization.stage` in an experiment's
search section (DeepSpeedBackend.config_keys)."""

from __future__ import annotations

from ...config.values import did_you_mean
from ...deepspeed_config import KNOWN_TOP_LEVEL_KEYS, SECTION_KEYS, DeepSpeedConfigError, load_deepspeed_config
from ..spec import ConfigKeys


def path_problems(path: str) -> list[str]:
    """zero_optimization.stage: the top-level key and, in a ZeRO/fp16/bf16 block, the key inside it."""
    parts = path.split(".")
    if not path or not all(parts):
        return ["give a key of the DeepSpeed config after 'deepspeed.', e.g. deepspeed.zero_optimization.stage"]
    if parts[0] not in KNOWN_TOP_LEVEL_KEYS:
        return [f"{parts[0]!r} is not a DeepSpeed config key" + did_you_mean(parts[0], KNOWN_TOP_LEVEL_KEYS)]
    if parts[0] in SECTION_KEYS and len(parts) > 1 and parts[1] not in SECTION_KEYS[parts[0]]:
        return [f"{parts[1]!r} is not a key of DeepSpeed's {parts[0]}" + did_you_mean(parts[1], SECTION_KEYS[parts[0]])]
    return []


def load(value) -> dict:
    return load_deepspeed_config(value)[0]


CONFIG_KEYS = ConfigKeys(path_problems, load, DeepSpeedConfigError)
