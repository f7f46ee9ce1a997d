"""Translate TrainingArguments flags plus a user's DeepSpeed config (partial, "auto", or classic) into one complete
ZeRO config that cannot disagree with those flags: keys.py holds the tables (flag <-> field among them), load.py reads
the file or preset, fields.py names where each value came from, passes.py holds phase 1's passes and resolve.py runs
the two phases. Pure: imports neither torch nor deepspeed."""

from .keys import (BF16_KEYS, FLAG_DEFAULTS, FP16_KEYS, KNOWN_TOP_LEVEL_KEYS, REMOVED_TOP_LEVEL_KEYS, SECTION_KEYS,
                   TUNED_ZERO, ZERO_KEYS)
from .fields import iter_fields
from .load import PRESETS, DeepSpeedConfigError, load_deepspeed_config, presets_dir
from .passes import flag_given, flag_value
from .resolve import (Resolution, build_deepspeed_config, explain, finish_deepspeed_config, resolve_deepspeed_config,
                      resolve_world_size)

__all__ = ["BF16_KEYS", "FLAG_DEFAULTS", "FP16_KEYS", "KNOWN_TOP_LEVEL_KEYS", "PRESETS",
           "REMOVED_TOP_LEVEL_KEYS", "SECTION_KEYS", "TUNED_ZERO", "ZERO_KEYS", "DeepSpeedConfigError", "Resolution",
           "build_deepspeed_config", "explain", "finish_deepspeed_config", "flag_given", "flag_value", "iter_fields",
           "load_deepspeed_config", "presets_dir", "resolve_deepspeed_config", "resolve_world_size"]
