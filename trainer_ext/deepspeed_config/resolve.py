"""The two phases: `resolve_deepspeed_config` settles everything the flags and the file decide when the arguments are
parsed; `finish_deepspeed_config` fills what had to wait (training steps, the model's hidden size, the world size the
process group really has) without changing anything the run already used. Pure: imports neither torch nor deepspeed."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any

from .keys import (AUTO, DEEPSPEED_OPTIMIZER_NAMES, DEEPSPEED_OPTIMIZERS, DEEPSPEED_SCHEDULERS, FLAG_DEFAULTS,
                   FP16_BLOCK_DEFAULTS, H100_RUN, HIDDEN_SIZE_AUTO, INTEGER_TEXT, KNOWN_TOP_LEVEL_KEYS, NESTED_HOME,
                   NUMBER_TEXT, REMOVED_TOP_LEVEL_KEYS, SCHEDULER_FOR_TYPE, SECTION_KEYS, STAGE3_ALIASES,
                   STAGE3_ONLY_KEYS, STRING_KEYS, TORCH_OPTIMIZERS, TUNED_ZERO, ZERO2_DEFAULTS, ZERO3_COST,
                   ZERO3_DEFAULTS, ZERO_AUTO_FALLBACK, ZERO_TESTED_OPTIMIZERS)
from ..config.optimizer import warmup_steps
from ..config.ranges import out_of_range
from ..errors import closest
from ..runtime import world_size_from_environment
from .load import DeepSpeedConfigError, load_deepspeed_config

@dataclass
class Resolution:
    """A resolved config and what the run must know about it."""

    config: dict
    effective_flags: dict = field(default_factory=dict)  # flag -> value the run uses (written back to args)
    sources: dict = field(default_factory=dict)  # dotted config field -> where its value came from
    notes: list = field(default_factory=list)  # one line each, for the log
    pending: list = field(default_factory=list)  # fields left "auto" until the step count / model is known
    scheduler_by_trainer: bool = False  # True: no DeepSpeed scheduler, transformers builds it
    origin: str = ""  # where the user's config came from, for messages
    world_size: int = 1  # the ranks the batch fields were resolved for
    cpu_ranks: bool = False  # the ZeRO fields were tuned for CPU ranks


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
    """Explicit argument, else the launcher's WORLD_SIZE, else an initialised process group, else 1."""
    if world_size is not None:
        return int(world_size)
    launched = world_size_from_environment()
    if launched is not None:
        return launched
    dist = sys.modules.get("torch.distributed")  # only if the caller already imported torch
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def warmup_steps_for(args: Any, num_training_steps: int | None) -> int | None:
    """transformers' rule: warmup_steps >= 1 is a step count, < 1 a ratio of the total steps."""
    warmup = flag_value(args, "warmup_steps") or 0
    ratio = flag_value(args, "warmup_ratio") or 0
    return warmup_steps(ratio if ratio and not warmup else warmup, num_training_steps)


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
    if isinstance(node, str) and key not in STRING_KEYS and NUMBER_TEXT.match(node):
        return int(node) if INTEGER_TEXT.match(node) else float(node)
    return node


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    return a == b


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
        self.result = Resolution(config=self.config, origin=origin, world_size=world_size, cpu_ranks=cpu_ranks)

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
        self.untested_optimizer()
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
                hint = closest(key, KNOWN_TOP_LEVEL_KEYS)
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
                    hint = closest(key, known)
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
        if isinstance(zero, dict):
            self.migrate_legacy_stage3(zero)

    def migrate_legacy_stage3(self, zero):
        """ZeRO-3's deprecated keys and its unprefixed spellings, written as DeepSpeed 0.19 and transformers do."""
        renames = {"stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
                   **STAGE3_ALIASES}
        for old, new in renames.items():
            if old not in zero:
                continue
            value = zero.pop(old)
            if new in zero and not _same(zero[new], value):
                self.problems.append(f"zero_optimization.{old}={json.dumps(value)} and its newer name {new}="
                                     f"{json.dumps(zero[new])} disagree: keep only {new}")
                continue
            zero.setdefault(new, value)
            self.source(f"zero_optimization.{new}", f"file (written as {old})")
            self.result.notes.append(f"zero_optimization.{old} renamed to {new}")
        pin = zero.pop("cpu_offload_use_pin_memory", None)
        if zero.get("cpu_offload_param") is True and "offload_param" not in zero:
            zero["offload_param"] = {"device": "cpu"}
            self.source("zero_optimization.offload_param.device", "file (legacy cpu_offload_param: true)")
        if "cpu_offload_param" in zero:
            legacy = zero.pop("cpu_offload_param")
            self.result.notes.append('legacy zero_optimization.cpu_offload_param migrated to offload_param: '
                                     '{"device": "cpu"}' if legacy is True else
                                     'legacy zero_optimization.cpu_offload_param: false dropped')
        if pin is not None:
            for block in ("offload_param", "offload_optimizer"):
                if isinstance(zero.get(block), dict):
                    zero[block].setdefault("pin_memory", bool(pin))
                    self.source(f"zero_optimization.{block}.pin_memory", "file (legacy cpu_offload_use_pin_memory)")
            self.result.notes.append("legacy zero_optimization.cpu_offload_use_pin_memory moved into the offload "
                                     "blocks' pin_memory")

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
        if fp16 and getattr(self.args, "use_cpu", False) and not self.flag("fp16"):  # --fp16 --use_cpu: flag_problems
            self.problems.append("fp16 needs a CUDA device and --use_cpu trains on the CPU — fp16 comes from the "
                                 "DeepSpeed file's fp16.enabled: set it to \"auto\" (or use --deepspeed zero2_minimal),"
                                 " or use --bf16")
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
            self.config[name] = {"enabled": False}
            self.source(f"{name}.enabled", f"default --{name}")  # not "file": the file has no {name} section
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
        problem = optimizer_type_problem(optimizer["type"])
        if problem:
            self.problems.append(problem)
        params = optimizer.setdefault("params", {})
        adam_like = any(word in optimizer["type"].lower() for word in ("adam", "lamb", "lion"))
        self.reconcile("optimizer.params.lr", "learning_rate")
        if adam_like or "betas" in params:
            self.reconcile_betas()
        if adam_like or "eps" in params:
            self.reconcile("optimizer.params.eps", "adam_epsilon")
        self.reconcile("optimizer.params.weight_decay", "weight_decay")

    def untested_optimizer(self):
        """ZeRO refuses an optimizer it was not tested with (torch's SGD, ...) unless the file allows it."""
        optimizer, zero = self.config.get("optimizer"), self.config.get("zero_optimization")
        name = optimizer.get("type") if isinstance(optimizer, dict) else None
        stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
        allowed = self.config.get("zero_allow_untested_optimizer") is True
        tested = isinstance(name, str) and name.lower() in ZERO_TESTED_OPTIMIZERS
        if (isinstance(name, str) and optimizer_type_problem(name) is None and not tested
                and isinstance(stage, int) and stage > 0 and not allowed):
            self.problems.append(f"optimizer.type {json.dumps(name)} under ZeRO stage {stage}: DeepSpeed refuses an "
                                 "optimizer it did not test with ZeRO unless the file sets "
                                 "\"zero_allow_untested_optimizer\": true (add it, or use AdamW)")

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
        if warmup == 0:  # constant rate: min = max, so the warmup length is irrelevant; transformers' (checked) one
            typed = warmup_steps_for(self.args, steps)
            params.update(warmup_min_lr=lr, warmup_num_steps=self.needs_steps(
                None if typed is None else max(1, typed), "scheduler.params.warmup_num_steps"))
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
            hint = closest(str(given), DEEPSPEED_SCHEDULERS)
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
        if stage == 3:
            self.zero3_defaults(zero)
        elif isinstance(stage, int) and (ignored := sorted(STAGE3_ONLY_KEYS & set(zero))):
            self.result.notes.append(f"zero_optimization.{', zero_optimization.'.join(ignored)}: read only at stage 3; "
                                     f"DeepSpeed ignores {'it' if len(ignored) == 1 else 'them'} at stage {stage}")
        for key, value in list(zero.items()):
            if value != AUTO:
                continue
            path = f"zero_optimization.{key}"
            if key in HIDDEN_SIZE_AUTO and self.hidden_size:
                rule, meaning = HIDDEN_SIZE_AUTO[key]
                zero[key] = rule(self.hidden_size)
                self.source(path, f"derived from the model's hidden size h = {self.hidden_size} (transformers' rule: "
                                  f"{meaning})")
            elif key in HIDDEN_SIZE_AUTO and not self.final:
                self.result.pending.append(path)
            elif key in ZERO_AUTO_FALLBACK:
                zero[key] = ZERO_AUTO_FALLBACK[key]
                self.source(path, "default (DeepSpeed's; no model given to size it)")

    def zero3_defaults(self, zero):
        """Fill the ZERO3_DEFAULTS fields the file leaves out; "auto" ones are then sized from the hidden size."""
        for key, (value, why) in ZERO3_DEFAULTS.items():
            if key in zero and not (zero[key] == AUTO and value != AUTO):
                continue
            zero[key] = value
            self.source(f"zero_optimization.{key}", f"default for ZeRO-3: {why}")
        if zero["stage3_gather_16bit_weights_on_model_save"] is False:
            self.result.notes.append("zero_optimization.stage3_gather_16bit_weights_on_model_save is false in the "
                                     "file: checkpoints and output_dir hold ZeRO shards only, no model from_pretrained "
                                     "can load (DeepSpeed's zero_to_fp32.py rebuilds one)")
        self.result.notes.append(f"ZeRO-3 partitions the parameters too: {ZERO3_COST}")
        granularity = zero.get("stage3_module_granularity_threshold", 0)
        if self.cpu_ranks and isinstance(granularity, (int, float)) and granularity > 0:  # measured: 0.19.8, 2 CPU ranks
            self.problems.append(f"zero_optimization.stage3_module_granularity_threshold={json.dumps(granularity)} "
                                 "fails on CPU ranks at the first optimizer step (DeepSpeed's stage-3 zero_grad calls "
                                 "record_stream, which CPU tensors do not have): set it to 0, or run on GPUs")

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
                f"without offload; DeepSpeed's step phase: 65.9 ms with the scan, 15.7 ms without, {H100_RUN})")

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

def optimizer_type_problem(name: str) -> str | None:
    """An optimizer.type DeepSpeed cannot build: it asserts when the engine starts, after the model is loaded."""
    if name.lower() in DEEPSPEED_OPTIMIZERS or name in TORCH_OPTIMIZERS:
        return None
    hint = closest(name, [*DEEPSPEED_OPTIMIZER_NAMES, *TORCH_OPTIMIZERS])
    return (f"optimizer.type {json.dumps(name)} is not an optimizer DeepSpeed builds: "
            + (f"did you mean {hint!r}? " if hint else "")
            + f"(DeepSpeed's: {', '.join(DEEPSPEED_OPTIMIZER_NAMES)}; torch.optim's: {', '.join(TORCH_OPTIMIZERS)})")


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


def finish_deepspeed_config(resolution: Resolution, args: Any, world_size: int, num_training_steps: int,
                            hidden_size: int | None = None) -> Resolution:
    """Phase 2, when training starts: fill what phase 1 left pending (the training steps, sizes from the model's hidden
    size) and take the world size the process group really has, in a copy. Nothing else changes: the batch fields
    already built the data order, the precision and optimizer the model and its optimizer. A file whose
    train_batch_size was split for another number of ranks than the run has is an error, never a sampler and an engine
    that disagree on the batch."""
    config = copy.deepcopy(resolution.config)
    sources = dict(resolution.sources)
    problems = []
    if world_size != resolution.world_size:
        split = [path for path in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
                 if resolution.sources.get(path, "").startswith("derived from the file's train_batch_size")]
        if split:
            raise DeepSpeedConfigError(
                [f"train_batch_size={config['train_batch_size']} in the file was split for {resolution.world_size} "
                 f"rank(s) when the arguments were parsed ({split[0]}={config[split[0]]}; the launcher's "
                 f"WORLD_SIZE), but the process group has {world_size}: launch {resolution.world_size} ranks, or give "
                 f"train_micro_batch_size_per_gpu (--per_device_train_batch_size) instead of train_batch_size"],
                resolution.origin)
        config["train_batch_size"] = (config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"]
                                      * world_size)
        sources["train_batch_size"] = f"derived (micro × accumulation × the process group's {world_size} ranks)"
    for path in resolution.pending:
        value, where = _pending_value(path, args, num_training_steps, hidden_size)
        if value is None:
            problems.append(f'{path} is "auto" and needs the model\'s hidden size, which this model does not give: '
                            "write a value in the file")
            continue
        _set(config, path, value)
        sources[path] = where
    if problems:
        raise DeepSpeedConfigError(problems, resolution.origin)
    return dataclasses.replace(resolution, config=config, sources=sources, pending=[], world_size=world_size)


def _pending_value(path: str, args: Any, num_training_steps: int, hidden_size: int | None) -> tuple[Any, str]:
    """The value phase 1 could not know, and where it came from."""
    if path == "scheduler.params.total_num_steps":
        return int(num_training_steps), "derived (number of training steps)"
    if path == "scheduler.params.warmup_num_steps":  # DeepSpeed warms up over >= 1 step; transformers' checked value
        return max(1, warmup_steps_for(args, num_training_steps)), "derived from the warmup flags and the step count"
    key = path.rpartition(".")[2]
    if hidden_size:
        rule, meaning = HIDDEN_SIZE_AUTO[key]
        return rule(hidden_size), (f"derived from the model's hidden size h = {hidden_size} (transformers' rule: "
                                   f"{meaning})")
    if key in ZERO_AUTO_FALLBACK:
        return ZERO_AUTO_FALLBACK[key], "default (DeepSpeed's; the model gives no hidden size to size it)"
    return None, ""


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
