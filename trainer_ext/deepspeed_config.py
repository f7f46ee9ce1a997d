"""Translate TrainingArguments flags plus a user's DeepSpeed config (partial, "auto", or classic) into one
complete ZeRO config that cannot disagree with those flags. Pure: imports neither torch nor deepspeed."""

from __future__ import annotations

import copy
import difflib
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import UserError
from .options import out_of_range

# TrainingArguments defaults of the flags the translator reads; a test checks them against transformers. Arguments
# with no record of what was typed (stock TrainingArguments, a dict) count a flag as given when it differs from these.
FLAG_DEFAULTS: dict[str, Any] = {
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "learning_rate": 5e-5,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_epsilon": 1e-8,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "warmup_steps": 0,
    "lr_scheduler_type": "linear",
    "max_steps": -1,
    "fp16": False,
    "bf16": False,
    # ExtTrainingArguments' own flags
    "fp16_backend": "auto",
    "fp16_opt_level": "O1",
    "warmup_ratio": 0.0,
}

# Every top-level key DeepSpeed 0.19 reads (a test records the keys DeepSpeedConfig looks up and checks this).
KNOWN_TOP_LEVEL_KEYS = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "steps_per_print",
    "optimizer", "scheduler", "fp16", "bf16", "bfloat16", "torch_autocast", "gradient_clipping",
    "prescale_gradients", "gradient_predivide_factor", "gradient_allreduce_op", "zero_optimization",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "activation_checkpointing",
    "flops_profiler", "wall_clock_breakdown", "memory_breakdown", "dump_state", "tensorboard", "wandb",
    "csv_monitor", "comet", "comms_logger", "communication_data_type", "seq_parallel_communication_data_type",
    "aio", "autotuning", "checkpoint", "data_types", "data_efficiency", "dataloader_drop_last",
    "datastates_ckpt", "disable_allgather", "disable_python_gc", "expert_parallel", "hybrid_engine",
    "log_level", "managed_gradient_accumulation", "pipeline", "tensor_parallel", "timers",
    "use_data_before_expert_parallelism", "vocabulary_size", "weight_quantization", "compile",
    "sequence_parallel_size", "monitor_config", "zero_quantized_weights", "fp32_reduce_scatter",
})

# Keys DeepSpeed 0.19 removed and rejects; a test checks this list covers DeepSpeed's own.
REMOVED_TOP_LEVEL_KEYS: dict[str, str] = {
    "amp": 'NVIDIA Apex AMP was removed from DeepSpeed 0.19; use "fp16": {"enabled": true} (--fp16) or --bf16',
    "nebula": "Nebula checkpointing was removed from DeepSpeed 0.19; delete the block",
    "compression_training": "the compression library was removed from DeepSpeed 0.19; delete the block",
    "quantize_training": "MoQ / quantize_training was removed from DeepSpeed 0.19; delete the block",
    "sparse_gradients": "sparse_gradients was removed from DeepSpeed 0.19; delete the key",
    "eigenvalue": "eigenvalue was removed from DeepSpeed 0.19; delete the block",
    "sparse_attention": "sparse attention was removed from DeepSpeed 0.19; delete the block",
    "elasticity": "elastic training was removed from DeepSpeed 0.19; set the batch fields (or flags) directly",
    "graph_harvesting": "graph_harvesting was removed from DeepSpeed 0.19; delete the key",
    "curriculum_learning": "top-level curriculum_learning was removed; use data_efficiency.data_sampling.curriculum_learning",
    "progressive_layer_drop": "progressive layer drop was removed from DeepSpeed 0.19; delete the block",
}

# Fields of DeepSpeed's ZeRO, fp16 and bf16 config models (aliases included); tests compare with DeepSpeed's.
ZERO_KEYS = frozenset({
    "allgather_bucket_size", "allgather_partitions", "allgather_sequential", "compute_grad_norm",
    "contiguous_gradients", "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory",
    "elastic_checkpoint", "enable_sanity_checks", "gather_16bit_weights_on_model_save",
    "ignore_unused_parameters", "leaf_module", "legacy_stage1", "load_from_fp32_weights",
    "log_trace_cache_warnings", "max_live_parameters", "max_reuse_distance", "memory_efficient_linear",
    "model_persistence_threshold", "module_granularity_threshold", "offload_optimizer", "offload_param",
    "overlap_comm", "override_module_apply", "param_persistence_threshold", "parameter_alignment",
    "pipeline_loading_checkpoint", "prefetch_bucket_size", "reduce_bucket_size", "reduce_scatter",
    "round_robin_gradients", "save_muon_momentum_buffer_in_memory", "stage", "stage3_allgather_sequential",
    "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
    "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_model_persistence_threshold",
    "stage3_module_granularity_threshold", "stage3_param_persistence_threshold", "stage3_prefetch_bucket_size",
    "stage3_use_all_reduce_for_fetch_params", "sub_group_size", "use_all_reduce_for_fetch_params",
    "use_multi_rank_bucket_allreduce", "zenflow", "zero_hpz_partition_size", "zero_quantized_gradients",
    "zero_quantized_nontrainable_weights", "zero_quantized_weights",
})
FP16_KEYS = frozenset({
    "enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
    "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads",
})
BF16_KEYS = frozenset({
    "enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
    "bf16_optimizer_states",
})
SECTION_KEYS = {"zero_optimization": ZERO_KEYS, "fp16": FP16_KEYS, "bf16": BF16_KEYS}

# Where a key belongs when it is found at the top level (DeepSpeed would silently ignore it there).
_OPTIMIZER_PARAM_KEYS = ("lr", "betas", "eps", "weight_decay")
_SCHEDULER_PARAM_KEYS = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps",
                         "warmup_type", "warmup_min_ratio", "cos_min_ratio")
NESTED_HOME: dict[str, str] = {
    **{key: "zero_optimization" for key in ZERO_KEYS},
    **{key: "fp16" for key in FP16_KEYS - {"enabled"}},
    **{key: "optimizer.params" for key in _OPTIMIZER_PARAM_KEYS},
    **{key: "scheduler.params" for key in _SCHEDULER_PARAM_KEYS},
}

DEEPSPEED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
# transformers scheduler type -> the DeepSpeed scheduler class of the same shape.
SCHEDULER_FOR_TYPE = {
    "linear": "WarmupDecayLR",
    "constant_with_warmup": "WarmupLR",
    "constant": "WarmupLR",
    "cosine": "WarmupCosineLR",
}

FP16_BLOCK_DEFAULTS = {"loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
# The ZeRO-2 section used when a config has none; "auto" fields are settled by where the ranks run (TUNED_ZERO).
ZERO2_DEFAULTS = {
    "stage": 2,
    "allgather_partitions": True,
    "allgather_bucket_size": 5e8,
    "overlap_comm": "auto",
    "reduce_scatter": "auto",
    "reduce_bucket_size": 5e8,
    "contiguous_gradients": "auto",
}
# ZeRO-1/2 fields whose best value depends on where the ranks run, measured; filled when a file leaves them out or
# says "auto" (a value the user wrote is kept). Each entry: (value, why) by "cpu" / "gpu" / "gpus" (several GPU ranks).
_CPU_PROFILE = "benchmarks/profile_zero2.py, MiniLM, 2 CPU ranks"
_H100 = "BERT-large QA shape, bf16, 1 H100"
TUNED_ZERO = {
    "overlap_comm": {
        "cpu": (False, f"CPU ranks have no side streams to overlap with: steps 9% shorter off ({_CPU_PROFILE})"),
        "gpu": (False, f"one rank has no gradient traffic to overlap; DeepSpeed's stage-2 default, the measured "
                       f"1.06x run ({_H100})"),
        "gpus": (True, "gradient reduction overlaps the backward pass (DeepSpeed's recommended value for several "
                       "ranks; benchmarks/gpu.py's N-rank rows measure it)"),
    },
    "reduce_scatter": {
        "cpu": (False, f"one all-reduce beats per-rank reduce calls on gloo/shm: 9% shorter steps ({_CPU_PROFILE})"),
        "gpu": (True, "DeepSpeed's default"),
        "gpus": (True, "DeepSpeed's default"),
    },
    "contiguous_gradients": {
        "cpu": (False, f"no copy of each gradient into a bucket buffer: 1.137 vs 1.164 s/step, same losses "
                       f"({_CPU_PROFILE})"),
        "gpu": (False, f"no copy of each gradient into a bucket buffer, no reduce_bucket_size buffer held: 0.084 vs "
                       f"0.110 s/step ({_H100})"),
        "gpus": (False, f"no copy of each gradient into a bucket buffer, no reduce_bucket_size buffer held: 0.084 vs "
                        f"0.110 s/step ({_H100})"),
    },
}
# Values DeepSpeed itself uses for zero fields given as "auto" when no model is at hand.
ZERO_AUTO_FALLBACK = {"reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8}
HIDDEN_SIZE_AUTO = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}

# Presets: name -> file in ds_configs/ (a registry, so an unknown name lists the valid ones).
PRESETS = {
    "zero2": "zero2.json",
    "zero2_offload": "zero2_offload.json",
    "zero2_minimal": "zero2_minimal.json",
    "zero2_auto": "zero2_auto.json",
}

# Keys whose values are names, never numbers: their strings are left alone.
_STRING_KEYS = frozenset({"type", "device", "nvme_path", "output_path", "job_name", "tag", "name", "project",
                          "team", "group", "log_level", "communication_data_type", "grad_accum_dtype",
                          "warmup_type", "backend"})
_NUMBER = re.compile(r"^\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*$")
_INTEGER = re.compile(r"^\s*[+-]?\d+\s*$")
AUTO = "auto"


class DeepSpeedConfigError(UserError):
    """Every problem found in a DeepSpeed config and the flags beside it, reported together."""

    def __init__(self, problems: list[str], origin: str | None = None):
        self.problems = list(problems)
        head = f"DeepSpeed config {origin}" if origin else "DeepSpeed config"
        noun = "problem" if len(self.problems) == 1 else "problems"
        super().__init__(f"{head}: {len(self.problems)} {noun}:\n" + "\n".join(f"  - {p}" for p in self.problems))


@dataclass
class Resolution:
    """A resolved config and what the run must know about it."""

    config: dict
    effective_flags: dict = field(default_factory=dict)  # flag -> value the run uses (written back to args)
    sources: dict = field(default_factory=dict)  # dotted config field -> where its value came from
    notes: list = field(default_factory=list)  # one line each, for the log
    pending: list = field(default_factory=list)  # fields left "auto" until the step count / model is known
    scheduler_by_trainer: bool = False  # True: no DeepSpeed scheduler, transformers builds it


# ---------------------------------------------------------------------------------------------- loading

def presets_dir() -> Path:
    """ds_configs/ of a source checkout or editable install, else the copy installed in the package."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "ds_configs", here / "ds_configs"):
        if candidate.is_dir():
            return candidate
    return here.parent / "ds_configs"


def load_deepspeed_config(value: Any) -> tuple[dict, str]:
    """Read --deepspeed: a dict, an inline JSON string, a path to a JSON file, or a preset name.

    Returns a deep copy (the caller's object is never mutated) and a phrase naming where it came from."""
    if isinstance(value, dict):
        return copy.deepcopy(value), "(dict)"
    if isinstance(value, Path):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise DeepSpeedConfigError([f"--deepspeed must be a JSON file, inline JSON, a dict or one of the presets "
                                    f"{sorted(PRESETS)}; got {value!r}"])
    text = value.strip()
    if text.startswith("{"):
        return _parse_json(text, "inline --deepspeed JSON"), "(inline JSON)"
    path = Path(os.path.expanduser(text))
    if not path.exists() and text in PRESETS:
        path = presets_dir() / PRESETS[text]
    if not path.exists():
        hint = difflib.get_close_matches(text, list(PRESETS), n=1)
        also = f"; did you mean the preset {hint[0]!r}?" if hint else ""
        raise DeepSpeedConfigError([f"--deepspeed {text!r}: no such file, and not a preset "
                                    f"(presets: {', '.join(sorted(PRESETS))}){also}"])
    if path.is_dir():
        raise DeepSpeedConfigError([f"--deepspeed {text!r} is a folder; give the JSON file inside it"])
    config = _parse_json(path.read_text(encoding="utf-8"), str(path))
    return config, str(path)


class _DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


def _parse_json(text: str, origin: str) -> dict:
    """JSON, or HJSON (comments, trailing commas) as DeepSpeed itself reads config files; duplicate keys refused."""
    try:
        config = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKey as err:
        raise DeepSpeedConfigError([f"duplicate key {err.args[0]!r} in {origin}: DeepSpeed rejects it; keep one"]) from None
    except json.JSONDecodeError as err:
        config = _parse_hjson(text, origin)
        if config is None:
            raise DeepSpeedConfigError([f"invalid JSON in {origin}, line {err.lineno}, column {err.colno}: "
                                        f"{err.msg}"]) from None
    if not isinstance(config, dict):
        raise DeepSpeedConfigError([f"{origin} must hold a JSON object, got {type(config).__name__}"])
    return config


def _parse_hjson(text: str, origin: str):
    try:
        import hjson  # DeepSpeed's own config reader; optional here
    except ImportError:
        return None
    try:
        return hjson.loads(text, object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKey as err:
        raise DeepSpeedConfigError([f"duplicate key {err.args[0]!r} in {origin}: DeepSpeed rejects it; keep one"]) from None
    except ValueError:
        return None


# ---------------------------------------------------------------------------------------------- helpers

def flag_value(args: Any, name: str) -> Any:
    """A flag from TrainingArguments, an argparse namespace or a dict; its default when absent."""
    if isinstance(args, dict):
        value = args.get(name, FLAG_DEFAULTS.get(name))
    else:
        value = getattr(args, name, FLAG_DEFAULTS.get(name))
    return getattr(value, "value", value)  # enums (SchedulerType) -> their string


def flag_given(args: Any, name: str) -> bool:
    """Whether the user gave this flag: the one place the file-vs-flag rule asks. Arguments that record what was
    given (`flags_given`: ExtTrainingArguments, trainer-ext ds-config) are believed, so a flag typed at its default
    still counts; anything else (stock TrainingArguments, a namespace, a dict) counts a flag that differs from its
    default."""
    given = None if isinstance(args, dict) else getattr(args, "flags_given", None)
    if given is not None:
        return name in given
    return not _same(flag_value(args, name), FLAG_DEFAULTS[name])


def resolve_world_size(world_size: int | None = None) -> int:
    """Explicit argument, else WORLD_SIZE, else an initialised process group, else 1."""
    if world_size is not None:
        return int(world_size)
    if os.environ.get("WORLD_SIZE", "").strip().isdigit():
        return int(os.environ["WORLD_SIZE"])
    dist = sys.modules.get("torch.distributed")  # only if the caller already imported torch
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def warmup_steps_for(args: Any, num_training_steps: int | None) -> int | None:
    """transformers' rule: warmup_steps >= 1 is a step count, < 1 a ratio of the total steps."""
    warmup = flag_value(args, "warmup_steps") or 0
    ratio = flag_value(args, "warmup_ratio") or 0
    return warmup_steps(ratio if ratio and not warmup else warmup, num_training_steps)


def warmup_steps(warmup: float, num_training_steps: int | None) -> int | None:
    """A warmup of >= 1 is a step count, of < 1 a ratio of the total (None while the total is unknown)."""
    if warmup >= 1:
        return int(warmup)
    if warmup == 0:
        return 0
    if num_training_steps is None:
        return None
    return math.ceil(num_training_steps * warmup)


def training_steps_for(args: Any, num_training_steps: int | None) -> int | None:
    if num_training_steps is not None:
        return int(num_training_steps)
    max_steps = flag_value(args, "max_steps")
    return int(max_steps) if max_steps and max_steps > 0 else None


def _numbers_from_strings(node: Any, key: str | None = None) -> Any:
    """"8" -> 8 and "5e8" -> 5e8 everywhere except in keys that hold names."""
    if isinstance(node, dict):
        return {k: _numbers_from_strings(v, k) for k, v in node.items()}
    if isinstance(node, list):
        return [_numbers_from_strings(v, key) for v in node]
    if isinstance(node, str) and key not in _STRING_KEYS and _NUMBER.match(node):
        return int(node) if _INTEGER.match(node) else float(node)
    return node


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    return a == b


def _closest(word: str, choices) -> str | None:
    hits = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return hits[0] if hits else None


def _get(config: dict, path: str) -> Any:
    node = config
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _set(config: dict, path: str, value: Any) -> None:
    parts = path.split(".")
    node = config
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def iter_fields(config: dict, prefix: str = ""):
    """(dotted path, value) of every leaf of a config."""
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from iter_fields(value, path + ".")
        else:
            yield path, value


# ---------------------------------------------------------------------------------------------- resolver

class _Resolver:
    """One pass over flags and file; collects every problem, then the caller raises once."""

    def __init__(self, args, config, origin, world_size, num_training_steps, hidden_size, final, cpu_ranks=False):
        self.args = args
        self.config = _numbers_from_strings(copy.deepcopy(config))
        self.origin = origin
        self.world_size = world_size
        self.num_training_steps = num_training_steps
        self.hidden_size = hidden_size
        self.final = final
        self.cpu_ranks = cpu_ranks
        self.problems: list[str] = []
        self.result = Resolution(config=self.config)

    # -- the file-vs-flag rule ------------------------------------------------------------------
    def flag(self, name):
        return flag_value(self.args, name)

    def flag_is_set(self, name) -> bool:
        return flag_given(self.args, name)

    def source(self, path, where):
        self.result.sources[path] = where

    def reconcile(self, path: str, flag: str, flag_val: Any = None, write_back=None) -> Any:
        """Fill `path` from `flag` unless the file sets it; a file value beats a flag the user did not give and is
        written back; a given flag that disagrees with the file is a conflict. Returns the effective value."""
        if flag_val is None:
            flag_val = self.flag(flag)
        file_val = _get(self.config, path)
        if file_val is None or file_val == AUTO:
            _set(self.config, path, flag_val)
            how = "flag" if self.flag_is_set(flag) else "default"
            self.source(path, f"{how} --{flag}" + (" (file said auto)" if file_val == AUTO else ""))
            return flag_val
        if _same(file_val, flag_val):
            self.source(path, f"file (= --{flag})")
            return file_val
        if self.flag_is_set(flag):
            self.problems.append(
                f"{path}={json.dumps(file_val)} in the file disagrees with --{flag} {_show(flag_val)}: "
                f"drop --{flag}, change {path} to {json.dumps(flag_val)}, or set {path} to \"auto\"")
            return flag_val
        if why := out_of_range(flag, file_val):
            self.problems.append(f"{path}={json.dumps(file_val)} in the file (it would set --{flag}): {why}; fix it "
                                 f"or set {path} to \"auto\"")
            return flag_val
        (write_back or (lambda v: self.result.effective_flags.__setitem__(flag, v)))(file_val)
        self.source(path, f"file (--{flag} left at default {_show(FLAG_DEFAULTS[flag])}, now {_show(file_val)})")
        return file_val

    # -- the passes -----------------------------------------------------------------------------
    def run(self) -> Resolution:
        self.check_keys()
        self.migrate_legacy()
        self.precision()
        self.batch()
        self.reconcile("gradient_clipping", "max_grad_norm")
        self.optimizer()
        self.scheduler()
        self.zero()
        self.precision_safety()
        self.leftover_auto()
        if self.problems:
            raise DeepSpeedConfigError(self.problems, self.origin)
        return self.result

    def check_keys(self):
        for key in list(self.config):
            if key in REMOVED_TOP_LEVEL_KEYS:
                self.problems.append(f"{key}: {REMOVED_TOP_LEVEL_KEYS[key]}")
            elif key in KNOWN_TOP_LEVEL_KEYS:
                continue
            elif key in NESTED_HOME:
                self.problems.append(f"{key} is a top-level key here but belongs inside \"{NESTED_HOME[key]}\" "
                                     f"(DeepSpeed would silently ignore it at the top level): move it there")
            else:
                hint = _closest(key, KNOWN_TOP_LEVEL_KEYS)
                self.problems.append(f"unknown key {key!r}" + (f": did you mean {hint!r}?" if hint else
                                     " (DeepSpeed would silently ignore it): remove it or fix its name"))
        for section, known in SECTION_KEYS.items():
            block = self.config.get(section)
            if block is None:
                continue
            if not isinstance(block, dict):
                self.problems.append(f"{section} must be a JSON object, got {json.dumps(block)}")
                self.config.pop(section)
                continue
            for key in block:
                if key not in known:
                    hint = _closest(key, known)
                    self.problems.append(f"unknown key {section}.{key}" +
                                         (f": did you mean {section}.{hint}?" if hint else ""))

    def migrate_legacy(self):
        if "bfloat16" in self.config:
            if "bf16" in self.config:
                self.problems.append('both "bf16" and its legacy name "bfloat16" are given: keep only "bf16"')
            else:
                self.config["bf16"] = self.config.pop("bfloat16")
                self.result.notes.append('legacy "bfloat16" block renamed to "bf16"')
        zero = self.config.get("zero_optimization")
        if isinstance(zero, dict) and "cpu_offload" in zero:
            legacy = zero.pop("cpu_offload")
            if legacy is True and "offload_optimizer" not in zero:
                zero["offload_optimizer"] = {"device": "cpu"}
                self.source("zero_optimization.offload_optimizer.device", "file (legacy cpu_offload: true)")
            self.result.notes.append('legacy zero_optimization.cpu_offload migrated to '
                                     'offload_optimizer: {"device": "cpu"}' if legacy is True else
                                     'legacy zero_optimization.cpu_offload: false dropped')

    def precision(self):
        fp16 = self.enabled_flag("fp16")
        bf16 = self.enabled_flag("bf16")
        if fp16 and bf16:
            self.problems.append(f"fp16.enabled and bf16.enabled are both true (fp16 from "
                                 f"{self.result.sources['fp16.enabled']}, bf16 from "
                                 f"{self.result.sources['bf16.enabled']}): choose one precision")
        backend = self.flag("fp16_backend")
        if fp16 and backend == "apex":
            self.problems.append("--fp16_backend apex: DeepSpeed 0.19 removed Apex AMP (an \"amp\" block is "
                                 "rejected); use --fp16_backend amp (DeepSpeed's own fp16) or --bf16")
        if fp16:
            block = self.config.setdefault("fp16", {})
            for key, default in FP16_BLOCK_DEFAULTS.items():
                if block.get(key) in (None, AUTO):
                    block[key] = default
                    self.source(f"fp16.{key}", "default")
        else:
            self.config.setdefault("fp16", {}).setdefault("enabled", False)
        self.config.setdefault("bf16", {}).setdefault("enabled", False)

    def enabled_flag(self, name) -> bool:
        if name not in self.config and not self.flag(name):
            return False
        value = self.reconcile(f"{name}.enabled", name)
        if not isinstance(value, bool):
            self.problems.append(f"{name}.enabled must be true, false or \"auto\", got {json.dumps(value)}")
            return False
        return value

    def batch(self):
        problems_before = len(self.problems)
        micro = self.batch_field("train_micro_batch_size_per_gpu", "per_device_train_batch_size")
        accumulation = self.batch_field("gradient_accumulation_steps", "gradient_accumulation_steps")
        total = _get(self.config, "train_batch_size")
        if len(self.problems) > problems_before:
            return
        world = self.world_size
        if total is None or total == AUTO:
            self.config["train_batch_size"] = micro * accumulation * world
            self.source("train_batch_size", "derived (micro × accumulation × world size)")
            return
        if not _positive_int(total):
            self.problems.append(f"train_batch_size must be a positive integer, got {json.dumps(total)}")
            return
        total = int(total)
        self.config["train_batch_size"] = total
        if micro * accumulation * world == total:
            self.source("train_batch_size", "file (consistent)")
            return
        micro_free = self.result.sources["train_micro_batch_size_per_gpu"].startswith("default")
        accumulation_free = self.result.sources["gradient_accumulation_steps"].startswith("default")
        # A file giving only train_batch_size: derive what the user did not set, as DeepSpeed does.
        if micro_free and total % (accumulation * world) == 0:
            self.derive_batch("train_micro_batch_size_per_gpu", "per_device_train_batch_size",
                              total // (accumulation * world))
            return
        if accumulation_free and not micro_free and total % (micro * world) == 0:
            self.derive_batch("gradient_accumulation_steps", "gradient_accumulation_steps", total // (micro * world))
            return
        fixes = []
        if total % (accumulation * world) == 0:
            fixes.append(f"--per_device_train_batch_size {total // (accumulation * world)}")
        if total % (micro * world) == 0:
            fixes.append(f"--gradient_accumulation_steps {total // (micro * world)}")
        fix = " or ".join(fixes) if fixes else "batch flags whose product with the world size equals it"
        self.problems.append(
            f"train_batch_size={total} cannot hold at world size {world}: train_micro_batch_size_per_gpu="
            f"{micro} ({self.result.sources['train_micro_batch_size_per_gpu']}) × gradient_accumulation_steps="
            f"{accumulation} ({self.result.sources['gradient_accumulation_steps']}) × world size {world} = "
            f"{micro * accumulation * world}. Set {fix}, or set train_batch_size to \"auto\" in the file")

    def batch_field(self, path, flag):
        file_val = self.config.get(path)
        if file_val not in (None, AUTO) and not _positive_int(file_val):
            self.problems.append(f"{path} must be a positive integer, got {json.dumps(file_val)}")
            return 1
        flag_val = self.flag(flag)
        if not _positive_int(flag_val):
            self.problems.append(f"--{flag} must be a positive integer, got {flag_val!r}")
            return 1
        return int(self.reconcile(path, flag))

    def derive_batch(self, path, flag, value):
        self.config[path] = value
        self.result.effective_flags[flag] = value
        self.source(path, f"derived from the file's train_batch_size={self.config['train_batch_size']}")

    def optimizer(self):
        optimizer = self.config.get("optimizer")
        if optimizer is None:
            self.config["optimizer"] = {"type": "AdamW", "params": {}}
            self.source("optimizer.type", "default (the Trainer's AdamW)")
            if "zero_allow_untested_optimizer" not in self.config:
                self.config["zero_allow_untested_optimizer"] = True
                self.source("zero_allow_untested_optimizer", "default (needed for AdamW under ZeRO)")
            optimizer = self.config["optimizer"]
        if not isinstance(optimizer, dict) or not isinstance(optimizer.get("type"), str):
            self.problems.append('optimizer must be an object with a "type" string, e.g. {"type": "AdamW", '
                                 f'"params": {{...}}}}; got {json.dumps(optimizer)}')
            return
        params = optimizer.setdefault("params", {})
        adam_like = any(word in optimizer["type"].lower() for word in ("adam", "lamb", "lion"))
        self.reconcile("optimizer.params.lr", "learning_rate")
        if adam_like or "betas" in params:
            self.reconcile_betas()
        if adam_like or "eps" in params:
            self.reconcile("optimizer.params.eps", "adam_epsilon")
        self.reconcile("optimizer.params.weight_decay", "weight_decay")

    def reconcile_betas(self):
        path = "optimizer.params.betas"
        file_val = _get(self.config, path)
        if file_val not in (None, AUTO) and not (isinstance(file_val, list) and len(file_val) == 2):
            self.problems.append(f"{path} must be a list of two numbers, got {json.dumps(file_val)}")
            return
        for index, flag in enumerate(("adam_beta1", "adam_beta2")):
            element = None if file_val in (None, AUTO) else file_val[index]
            flag_val = self.flag(flag)
            if element is None:
                continue
            if not _same(element, flag_val):
                if self.flag_is_set(flag):
                    self.problems.append(f"{path}[{index}]={element} in the file disagrees with --{flag} {flag_val}: "
                                         f"drop --{flag}, make them equal, or set {path} to \"auto\"")
                elif why := out_of_range(flag, element):
                    self.problems.append(f"{path}[{index}]={json.dumps(element)} in the file (it would set "
                                         f"--{flag}): {why}; fix it or set {path} to \"auto\"")
                else:
                    self.result.effective_flags[flag] = element
        betas = [self.result.effective_flags.get("adam_beta1", self.flag("adam_beta1")),
                 self.result.effective_flags.get("adam_beta2", self.flag("adam_beta2"))]
        self.source(path, "file" if file_val not in (None, AUTO) else
                    "flag --adam_beta1/--adam_beta2" if self.flag_is_set("adam_beta1") or
                    self.flag_is_set("adam_beta2") else "default --adam_beta1/--adam_beta2")
        _set(self.config, path, betas)

    def effective(self, flag):
        return self.result.effective_flags.get(flag, self.flag(flag))

    def scheduler(self):
        steps = training_steps_for(self.args, self.num_training_steps)
        if "scheduler" in self.config:
            self.file_scheduler(steps)
            return
        kind = self.flag("lr_scheduler_type")
        lr = self.effective("learning_rate")
        warmup = 0 if kind == "constant" else warmup_steps_for(self.args, steps)
        reason = None
        if kind not in SCHEDULER_FOR_TYPE:
            reason = f"--lr_scheduler_type {kind} has no DeepSpeed counterpart"
        elif kind == "cosine":
            reason = ("DeepSpeed's WarmupCosineLR starts its decay one step late and never reaches the peak "
                      "rate, so it cannot equal transformers' cosine schedule")
        elif warmup == 1 or (warmup == 0 and kind == "linear"):
            reason = (f"--lr_scheduler_type {kind} with {warmup} warmup steps cannot be expressed by DeepSpeed's "
                      "schedulers (they warm up over at least 2 steps)")
        if reason:
            self.result.scheduler_by_trainer = True
            self.result.notes.append(f"scheduler left to the Trainer (transformers' own, exact): {reason}")
            self.source("scheduler", "left to the Trainer")
            return
        scheduler_type = SCHEDULER_FOR_TYPE[kind]
        params: dict[str, Any] = {"warmup_min_lr": 0, "warmup_max_lr": lr, "warmup_type": "linear"}
        if warmup == 0:  # constant rate: min = max, so the warmup length is irrelevant
            params.update(warmup_min_lr=lr, warmup_num_steps=1)
        else:
            params["warmup_num_steps"] = self.needs_steps(warmup, "scheduler.params.warmup_num_steps")
        if scheduler_type == "WarmupDecayLR":
            params["total_num_steps"] = self.needs_steps(steps, "scheduler.params.total_num_steps")
        self.config["scheduler"] = {"type": scheduler_type, "params": params}
        self.source("scheduler.type", f"{'flag' if self.flag_is_set('lr_scheduler_type') else 'default'} "
                                      f"--lr_scheduler_type {kind}")
        for key in params:
            self.source(f"scheduler.params.{key}", "derived from flags (linear warmup, as transformers)")

    def needs_steps(self, value, path):
        if value is not None:
            return value
        self.result.pending.append(path)
        return AUTO

    def file_scheduler(self, steps):
        scheduler = self.config["scheduler"]
        if not isinstance(scheduler, dict) or scheduler.get("type") not in DEEPSPEED_SCHEDULERS:
            given = scheduler.get("type") if isinstance(scheduler, dict) else scheduler
            hint = _closest(str(given), DEEPSPEED_SCHEDULERS)
            self.problems.append(f"scheduler.type {json.dumps(given)} is not a DeepSpeed scheduler "
                                 f"({', '.join(DEEPSPEED_SCHEDULERS)})" + (f": did you mean {hint!r}?" if hint else ""))
            return
        scheduler_type = scheduler["type"]
        kind = self.flag("lr_scheduler_type")
        if self.flag_is_set("lr_scheduler_type") and SCHEDULER_FOR_TYPE.get(kind) != scheduler_type:
            self.problems.append(f"scheduler.type={scheduler_type} in the file disagrees with --lr_scheduler_type "
                                 f"{kind}: drop one of them")
        params = scheduler.setdefault("params", {})
        if scheduler_type in ("WarmupLR", "WarmupDecayLR"):
            if params.get("warmup_min_lr") in (None, AUTO):
                params["warmup_min_lr"] = 0
                self.source("scheduler.params.warmup_min_lr", "default")
            optimizer_lr = _get(self.config, "optimizer.params.lr")
            problems_before = len(self.problems)
            peak = self.reconcile("scheduler.params.warmup_max_lr", "learning_rate", self.effective("learning_rate"))
            if (len(self.problems) == problems_before and isinstance(optimizer_lr, (int, float))
                    and not _same(optimizer_lr, peak)):
                self.problems.append(f"optimizer.params.lr={optimizer_lr} and scheduler.params.warmup_max_lr={peak} "
                                     "disagree (after warmup the rate is warmup_max_lr): make them equal or set "
                                     "both to \"auto\"")
        if scheduler_type in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
            self.reconcile_warmup(steps)
            if params.get("warmup_type") == AUTO:
                params["warmup_type"] = "linear"
                self.source("scheduler.params.warmup_type", "derived (linear, as transformers)")
            elif "warmup_type" not in params:
                self.result.notes.append("scheduler.params.warmup_type is not set: DeepSpeed warms up "
                                         "logarithmically; set it to \"linear\" to match transformers")
        if scheduler_type in ("WarmupDecayLR", "WarmupCosineLR") and params.get("total_num_steps") in (None, AUTO):
            params["total_num_steps"] = self.needs_steps(steps, "scheduler.params.total_num_steps")
            self.source("scheduler.params.total_num_steps", "derived (number of training steps)")
        if scheduler_type == "WarmupCosineLR":
            for key in ("warmup_min_ratio", "cos_min_ratio"):
                if params.get(key) == AUTO:
                    params[key] = 0
                    self.source(f"scheduler.params.{key}", "default")

    def reconcile_warmup(self, steps):
        path = "scheduler.params.warmup_num_steps"
        file_val = _get(self.config, path)
        warmup = warmup_steps_for(self.args, steps)
        flag = "warmup_ratio" if self.flag_is_set("warmup_ratio") else "warmup_steps"
        if file_val in (None, AUTO):
            if warmup is None:
                _set(self.config, path, self.needs_steps(None, path))
            else:
                _set(self.config, path, max(1, warmup))
            self.source(path, f"flag --{flag}" if self.flag_is_set(flag) else "default --warmup_steps")
            return
        if not _positive_int(file_val):
            self.problems.append(f"{path} must be a positive integer, got {json.dumps(file_val)}")
            return
        if not self.flag_is_set("warmup_steps") and not self.flag_is_set("warmup_ratio"):
            self.result.effective_flags["warmup_steps"] = int(file_val)
            self.source(path, "file (--warmup_steps left at default 0)")
        elif warmup is not None and warmup != file_val:
            self.problems.append(f"{path}={file_val} in the file disagrees with --{flag} "
                                 f"{self.flag(flag)} ({warmup} steps): drop one, or set {path} to \"auto\"")
        else:
            self.source(path, f"file (= --{flag})")

    def zero(self):
        zero = self.config.get("zero_optimization")
        if zero is None:
            zero = self.config["zero_optimization"] = dict(ZERO2_DEFAULTS)
            for key in ZERO2_DEFAULTS:
                self.source(f"zero_optimization.{key}", "default (ZeRO-2)")
        if not isinstance(zero, dict):
            return
        stage = zero.get("stage", 0)
        if stage == AUTO:
            zero["stage"] = stage = 2
            self.source("zero_optimization.stage", "default (ZeRO-2)")
        if not (isinstance(stage, int) and not isinstance(stage, bool) and 0 <= stage <= 3):
            self.problems.append(f"zero_optimization.stage must be 0, 1, 2 or 3, got {json.dumps(stage)}")
        if stage in (1, 2):
            self.tuned_zero(zero)
        for key, value in list(zero.items()):
            if value != AUTO:
                continue
            path = f"zero_optimization.{key}"
            if key in HIDDEN_SIZE_AUTO and self.hidden_size:
                zero[key] = HIDDEN_SIZE_AUTO[key](self.hidden_size)
                self.source(path, f"derived from the model's hidden size {self.hidden_size}")
            elif key in HIDDEN_SIZE_AUTO and not self.final:
                self.result.pending.append(path)
            elif key in ZERO_AUTO_FALLBACK:
                zero[key] = ZERO_AUTO_FALLBACK[key]
                self.source(path, "default (DeepSpeed's; no model given to size it)")

    def tuned_zero(self, zero):
        """Fill the TUNED_ZERO fields the file leaves out or sets to "auto", for where these ranks run."""
        where = "cpu" if self.cpu_ranks else "gpu" if self.world_size == 1 else "gpus"
        offload_block = zero.get("offload_optimizer")
        offload = isinstance(offload_block, dict) and offload_block.get("device") not in (None, "none")
        for key, choices in TUNED_ZERO.items():
            if zero.get(key, AUTO) != AUTO:
                continue
            value, why = choices[where]
            if key == "contiguous_gradients" and offload:
                value, why = True, "DeepSpeed requires it with offload_optimizer"
            zero[key] = value
            ranks = {"cpu": "CPU ranks", "gpu": "one GPU rank", "gpus": f"{self.world_size} GPU ranks"}[where]
            self.source(f"zero_optimization.{key}", f"default for {ranks}: {why}")

    def precision_safety(self):
        """fp16 and bf16 skip a step whose gradient norm is not finite; say how, and keep what the file says."""
        bf16 = self.config.get("bf16", {})
        if bf16.get("enabled") is True:
            if bf16.get("check_grad_overflow", AUTO) == AUTO:
                bf16["check_grad_overflow"] = True
                self.source("bf16.check_grad_overflow", "default: a non-finite gradient norm skips the step")
            elif bf16["check_grad_overflow"] is False:
                self.result.notes.append(
                    "bf16.check_grad_overflow is false in the file: a step with a non-finite gradient norm will "
                    "write NaN into the weights. With it true (the default) the step is skipped, at no cost: "
                    "trainer_ext tests the gradient norm DeepSpeed computes anyway")
                return
        if self.config.get("fp16", {}).get("enabled") is True or bf16.get("enabled") is True:
            self.result.notes.append(
                "overflow check: trainer_ext skips a step when the gradient norm DeepSpeed computes for clipping is "
                "not finite, instead of DeepSpeed's per-parameter inf/NaN scan: the same steps are skipped (ZeRO-1/2 "
                f"without offload; DeepSpeed's step phase: 65.9 ms with the scan, 15.7 ms without, {_H100})")

    def leftover_auto(self):
        for path, value in iter_fields(self.config):
            if value != AUTO or path in self.result.pending:
                continue
            self.problems.append(f'{path} is "auto" but nothing fills it: give a value')
        if self.final:
            for path in self.result.pending:
                self.problems.append(f"{path} needs the number of training steps: pass num_training_steps "
                                     "(trainer-ext ds-config: --num_training_steps N or --max_steps N)")


def _positive_int(value) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return isinstance(value, int) and value > 0


def _show(value) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


# ---------------------------------------------------------------------------------------------- public API

def resolve_deepspeed_config(args: Any, config: Any = None, world_size: int | None = None,
                             num_training_steps: int | None = None, hidden_size: int | None = None,
                             final: bool = True, cpu_ranks: bool = False) -> Resolution:
    """Resolve flags + file into a complete config, the flags the run must use, and where each value came from.

    `config`: dict, JSON text, path or preset name (default: args.deepspeed, else an empty config).
    `final=False` is the argument-time phase: fields needing the step count or the model stay "auto"
    and are listed in `pending` instead of failing. `cpu_ranks`: the ranks run on CPUs (settles the zero fields
    that depend on it, TUNED_ZERO)."""
    if config is None:
        config = flag_value(args, "deepspeed") or {}
    user_config, origin = load_deepspeed_config(config)
    resolver = _Resolver(args, user_config, origin, resolve_world_size(world_size),
                         num_training_steps, hidden_size, final, cpu_ranks)
    return resolver.run()


def build_deepspeed_config(args: Any, world_size: int | None = None, num_training_steps: int | None = None,
                           config: Any = None, hidden_size: int | None = None, cpu_ranks: bool = False) -> dict:
    """The complete DeepSpeed config (no "auto" left) for these flags; raises DeepSpeedConfigError."""
    return resolve_deepspeed_config(args, config, world_size, num_training_steps, hidden_size,
                                    cpu_ranks=cpu_ranks).config


def explain(resolution: Resolution) -> str:
    """One line per field: dotted name, value, where the value came from."""
    rows = [(path, json.dumps(value), _source_of(resolution.sources, path))
            for path, value in iter_fields(resolution.config)]
    width = max(len(path) for path, _, _ in rows)
    value_width = max(len(value) for _, value, _ in rows)
    lines = [f"{path:<{width}}  {value:<{value_width}}  {source}" for path, value, source in rows]
    if resolution.scheduler_by_trainer:
        lines.append(f"{'scheduler':<{width}}  {'-':<{value_width}}  {resolution.sources.get('scheduler')}")
    lines += [f"note: {note}" for note in resolution.notes]
    if resolution.effective_flags:
        lines.append("flags taken from the file: " + ", ".join(
            f"--{flag} {_show(value)}" for flag, value in resolution.effective_flags.items()))
    return "\n".join(lines)


def _source_of(sources: dict, path: str) -> str:
    while path:
        if path in sources:
            return sources[path]
        path = path.rpartition(".")[0]
    return "file"
