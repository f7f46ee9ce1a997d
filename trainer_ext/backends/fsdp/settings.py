"""FSDP2's settings, pure: what `--fsdp` and `--fsdp_config` (a dict, inline JSON or a file, transformers' keys) decide,
resolved once into a frozen FSDPSettings with every problem named (the argument checks and `trainer-ext plan` read it
without torch); the backend (backend.py) receives them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ...config.values import option_words
from ...errors import closest

OPTIONS = ("full_shard", "shard_grad_op", "offload", "auto_wrap")
FSDP1_OPTIONS = ("hybrid_shard", "hybrid_shard_zero2", "no_shard")  # sharding strategies FSDP2 does not have
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
CONFIG_KEYS = ("version", "reshard_after_forward", "cpu_offload", "offload_params", "activation_checkpointing",
               "cpu_ram_efficient_loading", "state_dict_type", "auto_wrap_policy", "transformer_layer_cls_to_wrap",
               "min_num_params")
FSDP1_KEYS = ("sharding_strategy", "backward_prefetch", "forward_prefetch", "use_orig_params", "sync_module_states",
              "limit_all_gathers")
XLA_KEYS = ("xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt", "xla_fsdp_settings")  # transformers adds the first three, off
SHARDS = "optimizer_shards"  # the checkpoint's folder of optimizer shards (torch.distributed.checkpoint)



@dataclass(frozen=True)
class FSDPSettings:
    """What `--fsdp` and `--fsdp_config` decide, resolved once from the flags."""

    reshard_after_forward: bool = True  # full_shard; False: shard_grad_op (parameters stay gathered until backward)
    offload: bool = False  # shards in CPU memory, the optimizer step on the CPU
    auto_wrap_policy: str = "TRANSFORMER_BASED_WRAP"
    layer_classes: tuple[str, ...] = ()  # transformer_layer_cls_to_wrap; () -> the model's _no_split_modules
    min_num_params: int = 0  # SIZE_BASED_WRAP
    activation_checkpointing: bool = False
    cpu_ram_efficient_loading: bool = False

    def describe(self) -> str:
        return "full_shard" if self.reshard_after_forward else "shard_grad_op"


def read_config(value, problems: list[str]) -> dict:
    """--fsdp_config as a dict: a dict, inline JSON, or a JSON file (transformers' forms), `fsdp_` prefixes dropped;
    a copy, never the caller's."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        text = value
        if not value.lstrip().startswith("{"):
            try:
                text = Path(value).read_text()
            except OSError as err:
                problems.append(f"--fsdp_config {value}: cannot read it ({err.strerror}); give a JSON file or inline "
                                "JSON such as '{\"transformer_layer_cls_to_wrap\": [\"BertLayer\"]}'")
                return {}
        try:
            value = json.loads(text)
        except ValueError as err:
            problems.append(f"--fsdp_config {value}: not JSON ({err})")
            return {}
    if not isinstance(value, dict):
        problems.append(f"--fsdp_config: expected a JSON object, got {type(value).__name__}")
        return {}
    return {key[5:] if key.startswith("fsdp_") else key: json.loads(json.dumps(item)) for key, item in value.items()}


def as_bool(config: dict, key: str, default: bool, problems: list[str]) -> bool:
    value = config.get(key, default)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if isinstance(value, bool):
        return value
    problems.append(f"--fsdp_config {key}={value!r}: expected true or false")
    return default


def resolve_settings(fsdp, fsdp_config) -> tuple[FSDPSettings, dict, list[str]]:
    """(settings, the config as a dict, problems) for `--fsdp` and `--fsdp_config`; pure. The option words become the
    config keys transformers gives them (full_shard/shard_grad_op: reshard_after_forward, offload: cpu_offload)."""
    problems: list[str] = []
    words = option_words(fsdp)
    for word in words:
        if word in FSDP1_OPTIONS:
            problems.append(f"--fsdp {word}: a sharding strategy of FSDP1 only; this backend runs FSDP2 (torch's "
                            "fully_shard), which has full_shard (parameters resharded after forward) and shard_grad_op "
                            "(kept until backward): use one of them")
        elif word not in OPTIONS:
            hint = closest(word, OPTIONS)
            problems.append(f"--fsdp: unknown option {word!r}" + (f", did you mean {hint!r}?" if hint else "")
                            + f" (valid: {', '.join(OPTIONS)})")
    if "full_shard" in words and "shard_grad_op" in words:
        problems.append("--fsdp: 'full_shard' and 'shard_grad_op' exclude each other; choose one")
    config = read_config(fsdp_config, problems)
    for key in config:
        if key in FSDP1_KEYS:
            problems.append(f"--fsdp_config {key}: an FSDP1 setting; FSDP2 (this backend) has no such option: drop it")
        elif key in XLA_KEYS:
            if config[key] not in (False, None, "false", {}):
                problems.append(f"--fsdp_config {key}: PyTorch/XLA FSDP is not supported (TPUs); drop it")
        elif key not in CONFIG_KEYS:
            hint = closest(key, CONFIG_KEYS)
            problems.append(f"--fsdp_config: unknown key {key!r}" + (f", did you mean {hint!r}?" if hint else "")
                            + f" (keys: {', '.join(CONFIG_KEYS)})")
    version = config.get("version", 2)
    if str(version) != "2":
        problems.append(f"--fsdp_config version={version}: FSDP1 is deprecated in transformers and not supported "
                        "here; this backend runs FSDP2: drop version (or set 2)")
    strategy = {"full_shard": True, "shard_grad_op": False}
    chosen = [strategy[word] for word in words if word in strategy]
    reshard = as_bool(config, "reshard_after_forward", chosen[0] if chosen else True, problems)
    if chosen and "reshard_after_forward" in config and reshard != chosen[0]:
        problems.append(f"--fsdp {next(w for w in words if w in strategy)} and --fsdp_config reshard_after_forward="
                        f"{config['reshard_after_forward']} disagree: keep one of them")
    offload = "offload" in words or as_bool(config, "cpu_offload", False, problems) \
        or as_bool(config, "offload_params", False, problems)  # accelerate config's fsdp_offload_params
    policy = str(config.get("auto_wrap_policy", WRAP_POLICIES[0])).upper()
    if policy not in WRAP_POLICIES:
        problems.append(f"--fsdp_config auto_wrap_policy={config['auto_wrap_policy']!r}: choose one of "
                        f"{', '.join(WRAP_POLICIES)}")
    layers = config.get("transformer_layer_cls_to_wrap") or ()
    if isinstance(layers, str):
        layers = [name.strip() for name in layers.split(",") if name.strip()]  # accelerate's comma-separated form
    minimum = config.get("min_num_params", 0)
    if not isinstance(minimum, int) or isinstance(minimum, bool) or minimum < 0:
        problems.append(f"--fsdp_config min_num_params={minimum!r}: expected a whole number >= 0")
        minimum = 0
    if str(config.get("state_dict_type", STATE_DICT_TYPES[0])).upper() not in STATE_DICT_TYPES:
        problems.append(f"--fsdp_config state_dict_type={config['state_dict_type']!r}: choose one of "
                        f"{', '.join(STATE_DICT_TYPES)} (checkpoints hold both the consolidated model and the shards)")
    settings = FSDPSettings(reshard, offload, policy, tuple(layers), minimum,
                            as_bool(config, "activation_checkpointing", False, problems),
                            as_bool(config, "cpu_ram_efficient_loading", False, problems))
    return settings, config, problems
