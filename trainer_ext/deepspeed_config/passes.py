"""Phase 1's passes over the flags and the user's file, in the order resolve.py runs them. Each takes the config and
its sources (where each value came from) plus only what else it reads, and returns a Draft: its own copy of both after
the pass, and the problems, notes, flags taken from the file and fields left pending it found. None changes what it
was given, and none reads what another wrote except through the config and its signature."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..config.optimizer import warmup_steps
from ..config.ranges import out_of_range
from ..errors import closest
from .fields import (Origin, Source, copy_tree, flag_source, get_field, iter_fields, positive_int, read_field,
                     requirement, same, set_field, show)
from .keys import (ADAM_DEEPSPEED_PARAMS, AUTO, DEEPSPEED_OPTIMIZER_NAMES, DEEPSPEED_OPTIMIZERS, DEEPSPEED_SCHEDULERS, FIELD_FLAGS,
                   FIELD_TYPES, FLAG_DEFAULTS, FP16_BLOCK_DEFAULTS, H100_RUN, HIDDEN_SIZE_AUTO, KNOWN_TOP_LEVEL_KEYS,
                   GIVEN_BY_DEEPSPEED, NESTED_HOME, NESTED_SECTION_KEYS, OFFLOAD_DEVICES, OPTIMIZER_CLASS_PARAMS, REMOVED_TOP_LEVEL_KEYS, SCHEDULER_FOR_TYPE,
                   OPTIMIZER_PARAMS_SINCE, SECTION_KEYS, STAGE3_ALIASES, STAGE3_ONLY_KEYS, TORCH_OPTIMIZERS, TUNED_ZERO, ZERO2_DEFAULTS,
                   ZERO3_COST, ZERO3_DEFAULTS, ZERO3_GRANULARITY, ZERO_AUTO_FALLBACK, ZERO_TESTED_OPTIMIZERS)

FLAG, DEFAULT, FILE, DERIVED = Origin.FLAG, Origin.DEFAULT, Origin.FILE, Origin.DERIVED
PRECISIONS = ("fp16", "bf16")

# ---------------------------------------------------------------------------------------------- the flags


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
    return not same(flag_value(args, name), FLAG_DEFAULTS[name])


def warmup_steps_for(args: Any, num_training_steps: int | None) -> int | None:
    """transformers' rule: warmup_steps >= 1 is a step count, < 1 a ratio of the total steps."""
    warmup = flag_value(args, "warmup_steps") or 0
    ratio = flag_value(args, "warmup_ratio") or 0
    return warmup_steps(ratio if ratio and not warmup else warmup, num_training_steps)


@dataclass(frozen=True)
class Run:
    """What the passes read besides the config: the flags, and what is known of the run when they run."""

    args: Any
    world_size: int
    num_training_steps: int | None
    hidden_size: int | None
    final: bool  # False at argument time: what needs the step count or the model waits (Draft.pending)
    cpu_ranks: bool
    global_batch: Any = None  # config/batch.py's split of the global batch (GlobalBatch), where the caller has one

    def flag(self, name: str) -> Any:
        return flag_value(self.args, name)

    def given(self, name: str) -> bool:
        return flag_given(self.args, name)

    @property
    def training_steps(self) -> int | None:
        if self.num_training_steps is not None:
            return int(self.num_training_steps)
        max_steps = self.flag("max_steps")
        return int(max_steps) if max_steps and max_steps > 0 else None


@dataclass
class Draft:
    """One pass's own copy of the config and its sources, and what the pass found; the pass returns it."""

    config: dict
    sources: dict[str, Source]
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # one line each, for the log and --explain
    flags: dict[str, Any] = field(default_factory=dict)  # flag -> the file's value the run must use
    pending: list[str] = field(default_factory=list)  # fields left "auto" until the step count / model is known

    @classmethod
    def of(cls, config: dict, sources: dict[str, Source]) -> Draft:
        return cls(copy_tree(config), dict(sources))

    def fill(self, path: str, value: Any, source: Source) -> None:
        set_field(self.config, path, value)
        self.sources[path] = source

    def waits(self, value: Any, path: str) -> Any:
        """The value, or "auto" and `path` pending when it needs the step count nobody gave yet."""
        if value is not None:
            return value
        self.pending.append(path)
        return AUTO


def fill_from_flag(draft: Draft, run: Run, path: str, flag_val: Any = None) -> Any:
    """Fill `path` from its flag (FIELD_FLAGS) unless the file sets it; a file value beats a flag the user did not
    give and is written back; a given flag that disagrees with the file is a conflict. Returns the effective value."""
    flag = FIELD_FLAGS[path]
    if flag_val is None:
        flag_val = run.flag(flag)
    file_val = get_field(draft.config, path)
    if file_val is None or file_val == AUTO:
        draft.fill(path, flag_val, flag_source(run.given(flag), f" --{flag}", file_said_auto=file_val == AUTO))
        return flag_val
    if same(file_val, flag_val):
        draft.sources[path] = Source(FILE, f" (= --{flag})")
        return file_val
    if run.given(flag):
        draft.problems.append(
            f"{path}={json.dumps(file_val)} in the file disagrees with --{flag} {show(flag_val)}: "
            f"drop --{flag}, change {path} to {json.dumps(flag_val)}, or set {path} to \"auto\"")
        return flag_val
    if why := out_of_range(flag, file_val):
        draft.problems.append(f"{path}={json.dumps(file_val)} in the file (it would set --{flag}): {why}; fix it "
                              f"or set {path} to \"auto\"")
        return flag_val
    draft.flags[flag] = file_val
    draft.sources[path] = Source(FILE, f" (--{flag} left at default {show(FLAG_DEFAULTS[flag])}, now {show(file_val)})")
    return file_val


# ---------------------------------------------------------------------------------------------- the passes

def check_keys(config: dict, sources: dict[str, Source]) -> Draft:
    """Removed, misplaced and unknown keys, at the top level and in the zero / fp16 / bf16 sections."""
    draft = Draft.of(config, sources)
    for key in list(draft.config):
        if key in REMOVED_TOP_LEVEL_KEYS:
            draft.problems.append(f"{key}: {REMOVED_TOP_LEVEL_KEYS[key]}")
        elif key in KNOWN_TOP_LEVEL_KEYS:
            continue
        elif key in NESTED_HOME:
            draft.problems.append(f"{key} is a top-level key here but belongs inside \"{NESTED_HOME[key]}\" "
                                  f"(DeepSpeed would silently ignore it at the top level): move it there")
        else:
            hint = closest(key, KNOWN_TOP_LEVEL_KEYS)
            draft.problems.append(f"unknown key {key!r}" + (f": did you mean {hint!r}?" if hint else
                                  " (DeepSpeed would silently ignore it): remove it or fix its name"))
    for section, known in SECTION_KEYS.items():
        block = draft.config.get(section)
        if block is None:
            continue
        if not isinstance(block, dict):
            draft.problems.append(f"{section} must be a JSON object, got {json.dumps(block)}")
            draft.config.pop(section)
            continue
        for key in block:
            if key not in known:
                hint = closest(key, known)
                draft.problems.append(f"unknown key {section}.{key}" +
                                      (f": did you mean {section}.{hint}?" if hint else ""))
    for path, known in NESTED_SECTION_KEYS.items():
        block = get_field(draft.config, path)
        for key in block if isinstance(block, dict) else ():
            if key not in known:
                hint = closest(key, known)
                draft.problems.append(f"unknown key {path}.{key} (DeepSpeed refuses it)" +
                                      (f": did you mean {path}.{hint}?" if hint else
                                       f"; the keys there: {', '.join(sorted(known))}"))
    return draft


def field_types(config: dict, sources: dict[str, Source]) -> Draft:
    """Every scalar of the zero_optimization (and its offload blocks), fp16 and bf16 sections read as DeepSpeed's own
    models read it (FIELD_TYPES): a value they refuse is a problem, and removed so no later pass reports it again; one
    they accept in another spelling ("true", 1) is written as DeepSpeed reads it."""
    draft = Draft.of(config, sources)
    for section, types in FIELD_TYPES.items():
        block = get_field(draft.config, section)
        for key, value in list(block.items()) if isinstance(block, dict) else ():
            if key not in types or value == AUTO:
                continue
            accepted, read = read_field(types[key], value)
            if accepted:
                block[key] = read
                continue
            del block[key]
            hint = closest(value, OFFLOAD_DEVICES) if types[key].kind == "device" and isinstance(value, str) else None
            draft.problems.append(f"{section}.{key}={json.dumps(value)}: must be {requirement(types[key])}, as "
                                  "DeepSpeed requires" + (f" (did you mean {json.dumps(hint)}?)" if hint else "")
                                  + ": fix the value, or remove the key for DeepSpeed's default")
    return draft


def migrate_legacy(config: dict, sources: dict[str, Source]) -> Draft:
    """Old spellings written as DeepSpeed 0.19 reads them: bfloat16, cpu_offload, ZeRO-3's renamed keys."""
    draft = Draft.of(config, sources)
    if "bfloat16" in draft.config:
        if "bf16" in draft.config:
            draft.problems.append('both "bf16" and its legacy name "bfloat16" are given: keep only "bf16"')
        else:
            draft.config["bf16"] = draft.config.pop("bfloat16")
            draft.notes.append('legacy "bfloat16" block renamed to "bf16"')
    section = draft.config.get("zero_optimization")
    if isinstance(section, dict) and "cpu_offload" in section:
        legacy = section.pop("cpu_offload")
        if legacy is True and "offload_optimizer" not in section:
            section["offload_optimizer"] = {"device": "cpu"}
            draft.sources["zero_optimization.offload_optimizer.device"] = Source(FILE, " (legacy cpu_offload: true)")
        draft.notes.append('legacy zero_optimization.cpu_offload migrated to offload_optimizer: {"device": "cpu"}'
                           if legacy is True else 'legacy zero_optimization.cpu_offload: false dropped')
    if isinstance(section, dict):
        _migrate_legacy_stage3(draft, section)
    return draft


def _migrate_legacy_stage3(draft: Draft, section: dict) -> None:
    """ZeRO-3's deprecated keys and its unprefixed spellings, written as DeepSpeed 0.19 and transformers do."""
    renames = {"stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
               **STAGE3_ALIASES}
    for old, new in renames.items():
        if old not in section:
            continue
        value = section.pop(old)
        if new in section and not same(section[new], value):
            draft.problems.append(f"zero_optimization.{old}={json.dumps(value)} and its newer name {new}="
                                  f"{json.dumps(section[new])} disagree: keep only {new}")
            continue
        section.setdefault(new, value)
        draft.sources[f"zero_optimization.{new}"] = Source(FILE, f" (written as {old})")
        draft.notes.append(f"zero_optimization.{old} renamed to {new}")
    pin = section.pop("cpu_offload_use_pin_memory", None)
    if section.get("cpu_offload_param") is True and "offload_param" not in section:
        section["offload_param"] = {"device": "cpu"}
        draft.sources["zero_optimization.offload_param.device"] = Source(FILE, " (legacy cpu_offload_param: true)")
    if "cpu_offload_param" in section:
        legacy = section.pop("cpu_offload_param")
        draft.notes.append('legacy zero_optimization.cpu_offload_param migrated to offload_param: {"device": "cpu"}'
                           if legacy is True else 'legacy zero_optimization.cpu_offload_param: false dropped')
    if pin is not None:
        for block in ("offload_param", "offload_optimizer"):
            if isinstance(section.get(block), dict):
                section[block].setdefault("pin_memory", bool(pin))
                draft.sources[f"zero_optimization.{block}.pin_memory"] = Source(
                    FILE, " (legacy cpu_offload_use_pin_memory)")
        draft.notes.append("legacy zero_optimization.cpu_offload_use_pin_memory moved into the offload blocks' "
                           "pin_memory")


def precision(config: dict, sources: dict[str, Source], run: Run) -> Draft:
    """fp16.enabled / bf16.enabled from --fp16 / --bf16 (at most one), and the fp16 block's loss scaling."""
    draft = Draft.of(config, sources)
    fp16, bf16 = (_enabled(draft, run, name) for name in PRECISIONS)
    if fp16 and bf16:  # a file value refused for disagreeing with a typed flag has no source: the flag stands
        fp16_from, bf16_from = (draft.sources.get(f"{name}.enabled", Source(FLAG, f" --{name}")) for name in PRECISIONS)
        draft.problems.append(f"fp16.enabled and bf16.enabled are both true (fp16 from {fp16_from}, bf16 from "
                              f"{bf16_from}): choose one precision")
    if fp16 and run.flag("fp16_backend") == "apex":
        draft.problems.append("--fp16_backend apex: DeepSpeed 0.19 removed Apex AMP (an \"amp\" block is rejected); "
                              "use --fp16_backend amp (DeepSpeed's own fp16) or --bf16")
    if fp16 and getattr(run.args, "use_cpu", False) and not run.flag("fp16"):  # --fp16 --use_cpu: flag_problems
        draft.problems.append("fp16 needs a CUDA device and --use_cpu trains on the CPU — fp16 comes from the "
                              "DeepSpeed file's fp16.enabled: set it to \"auto\" (or use --deepspeed zero2_minimal), "
                              "or use --bf16")
    if fp16:
        block = draft.config.setdefault("fp16", {})
        for key, default in FP16_BLOCK_DEFAULTS.items():
            if block.get(key) in (None, AUTO):
                block[key] = default
                draft.sources[f"fp16.{key}"] = Source(DEFAULT)
        for key in ("loss_scale_window", "min_loss_scale") if block["loss_scale"] == 0 else ():
            if block[key] <= 0:  # DeepSpeed's own rule: the dynamic loss scale divides by one, floors at the other
                draft.problems.append(f"fp16.{key}={json.dumps(block[key])}: must be > 0 while the loss scale is "
                                      "dynamic (fp16.loss_scale 0), as DeepSpeed requires: fix the value, or remove "
                                      f"the key for the default {FP16_BLOCK_DEFAULTS[key]}")
    else:
        draft.config.setdefault("fp16", {}).setdefault("enabled", False)
    draft.config.setdefault("bf16", {}).setdefault("enabled", False)
    return draft


def _enabled(draft: Draft, run: Run, name: str) -> bool:
    if name not in draft.config and not run.flag(name):
        draft.fill(f"{name}.enabled", False, Source(DEFAULT, f" --{name}"))  # not "file": the file has no section
        return False
    value = fill_from_flag(draft, run, f"{name}.enabled")
    if not isinstance(value, bool):
        draft.problems.append(f"{name}.enabled must be true, false or \"auto\", got {json.dumps(value)}")
        return False
    return value


def batch(config: dict, sources: dict[str, Source], run: Run) -> Draft:
    """Micro batch and accumulation from the flags, train_batch_size their product with the world size; a file giving
    only train_batch_size has the field the user left at its default derived from it, as DeepSpeed does."""
    draft = Draft.of(config, sources)
    kept = run.global_batch  # config/batch.py's split, when it keeps a global batch
    if kept is not None and kept.kept_from:
        return _kept_batch(draft, kept)
    micro = _batch_field(draft, run, "train_micro_batch_size_per_gpu")
    accumulation = _batch_field(draft, run, "gradient_accumulation_steps")
    if draft.problems:
        return draft
    total, world = get_field(draft.config, "train_batch_size"), run.world_size
    if total is None or total == AUTO:
        draft.fill("train_batch_size", micro * accumulation * world,
                   Source(DERIVED, " (micro × accumulation × world size)"))
        return draft
    if not positive_int(total):
        draft.problems.append(f"train_batch_size must be a positive integer, got {json.dumps(total)}")
        return draft
    total = int(total)
    draft.config["train_batch_size"] = total
    if micro * accumulation * world == total:
        draft.sources["train_batch_size"] = Source(FILE, " (consistent)")
        return draft
    micro_free = draft.sources["train_micro_batch_size_per_gpu"].origin is DEFAULT
    accumulation_free = draft.sources["gradient_accumulation_steps"].origin is DEFAULT
    split = Source(DERIVED, f" from the file's train_batch_size={total}", for_world_size=world)
    if micro_free and total % (accumulation * world) == 0:
        draft.fill("train_micro_batch_size_per_gpu", total // (accumulation * world), split)
        draft.flags["per_device_train_batch_size"] = total // (accumulation * world)
        return draft
    if accumulation_free and not micro_free and total % (micro * world) == 0:
        draft.fill("gradient_accumulation_steps", total // (micro * world), split)
        draft.flags["gradient_accumulation_steps"] = total // (micro * world)
        return draft
    draft.problems.append(_batch_problem(draft, total, micro, accumulation, world))
    return draft


def _kept_batch(draft: Draft, kept) -> Draft:
    """A global batch kept on this world size (--global_batch_size, or the resumed run's on another number of ranks):
    config/batch.py split it before this pass, as it does for every backend; a file that pins another split cannot
    keep it."""
    wanted = {"train_micro_batch_size_per_gpu": kept.per_device, "gradient_accumulation_steps": kept.accumulation,
              "train_batch_size": kept.size}
    pinned = [f"{path}={json.dumps(value)}" for path, want in wanted.items()
              if (value := get_field(draft.config, path)) not in (None, AUTO) and value != want]
    if pinned:
        draft.problems.append(
            f"{', '.join(pinned)} in the file cannot keep the global batch of {kept.size} ({kept.kept_from}) on "
            f"{kept.world_size} rank(s), which trains {kept.per_device} per device x {kept.accumulation} accumulation: "
            f"set {'them' if len(pinned) > 1 else 'it'} to \"auto\" in the file")
        return draft
    source = Source(DERIVED, f" (global batch {kept.size}, {kept.kept_from}, on {kept.world_size} rank(s))",
                    for_world_size=kept.world_size)
    for path, value in wanted.items():
        draft.fill(path, value, source)
    return draft


def _batch_problem(draft: Draft, total: int, micro: int, accumulation: int, world: int) -> str:
    """train_batch_size against the two other batch fields: which values would agree, changed where they came from (a
    field the file writes is fixed in the file: a flag would then disagree with it)."""
    values = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation}
    in_file = [path for path in values if draft.sources[path].origin is FILE]
    product = micro * accumulation * world
    named = [f"train_batch_size={total}", *(f"{path}={values[path]}" for path in in_file)]
    factors = [str(value) if path in in_file else f"{path}={value} ({draft.sources[path]})"
               for path, value in values.items()]
    head = (f"{', '.join(named[:-1])} and {named[-1]}" if len(named) > 1 else named[0]) + (
        f" in the file cannot hold at world size {world}: {' × '.join(factors)} × {world} rank"
        f"{'s' if world != 1 else ''} = {product}, not {total}")
    if total % (micro * accumulation) == 0 and total // (micro * accumulation) != world:
        ranks = total // (micro * accumulation)
        head += f" (they hold on {ranks} rank{'s' if ranks != 1 else ''})"
    # Each field that would make the product equal train_batch_size, and the product itself for train_batch_size.
    other = {"train_micro_batch_size_per_gpu": accumulation, "gradient_accumulation_steps": micro}
    flag_fixes, file_fixes = [], [f"train_batch_size to {product}"]
    for path in values:
        if total % (other[path] * world):
            continue
        agreeing = total // (other[path] * world)
        if path in in_file:
            file_fixes.append(f"{path} to {agreeing}")
        else:
            flag_fixes.append(f"--{FIELD_FLAGS[path]} {agreeing}")
    if "train_micro_batch_size_per_gpu" in in_file and total % (micro * world):
        head += (f"; {total} is not a multiple of train_micro_batch_size_per_gpu × world size = {micro} × {world}, "
                 "so no gradient_accumulation_steps can fix it")
    fixes = (f"set {' or '.join(flag_fixes)}, or " if flag_fixes else "") + "in the file set " + " or ".join(file_fixes)
    return f"{head}. To make them agree, {fixes} (or set train_batch_size to \"auto\")"


def _batch_field(draft: Draft, run: Run, path: str) -> int:
    file_val = draft.config.get(path)
    if file_val not in (None, AUTO) and not positive_int(file_val):
        draft.problems.append(f"{path} must be a positive integer, got {json.dumps(file_val)}")
        return 1
    flag = FIELD_FLAGS[path]
    if not positive_int(flag_val := run.flag(flag)):
        draft.problems.append(f"--{flag} must be a positive integer, got {flag_val!r}")
        return 1
    return int(fill_from_flag(draft, run, path))


def clipping(config: dict, sources: dict[str, Source], run: Run) -> Draft:
    """gradient_clipping from --max_grad_norm."""
    draft = Draft.of(config, sources)
    fill_from_flag(draft, run, "gradient_clipping")
    return draft


def optimizer_type_problem(name: str) -> str | None:
    """An optimizer.type DeepSpeed cannot build: it asserts when the engine starts, after the model is loaded."""
    if name.lower() in DEEPSPEED_OPTIMIZERS or name in TORCH_OPTIMIZERS:
        return None
    hint = closest(name, [*DEEPSPEED_OPTIMIZER_NAMES, *TORCH_OPTIMIZERS])
    return (f"optimizer.type {json.dumps(name)} is not an optimizer DeepSpeed builds: "
            + (f"did you mean {hint!r}? " if hint else "")
            + f"(DeepSpeed's: {', '.join(DEEPSPEED_OPTIMIZER_NAMES)}; torch.optim's: {', '.join(TORCH_OPTIMIZERS)})")


def _block(config: dict, key: str) -> dict:
    value = config.get(key)
    return value if isinstance(value, dict) else {}


def built_optimizer(config: dict) -> tuple[str, tuple[str, ...]] | None:
    """(the optimizer class DeepSpeed 0.19 builds for the config's optimizer block, the optimizer.params it takes:
    DeepSpeed's own first, then the class's less those DeepSpeed gives it itself), as engine._configure_basic_optimizer
    chooses: the Adam family's FusedAdam, CPU Adam under offload_optimizer, torch's with torch_adam; Adagrad and Lion
    on the CPU under offload; Lamb; any other name a torch.optim class. None for those built another way (Muon, mup's
    MuAdam, MuAdamW, MuSGD) or not at all."""
    block, zero = _block(config, "optimizer"), _block(config, "zero_optimization")
    kind, params = block.get("type"), _block(block, "params")
    if not isinstance(kind, str):
        return None
    on_cpu = _block(zero, "offload_optimizer").get("device") in ("cpu", "nvme") and zero.get("stage", 0) in (1, 2, 3)
    name, own = kind.lower(), ()
    if name in ("adam", "adamw"):
        own = ADAM_DEEPSPEED_PARAMS
        if params.get("torch_adam") is True:
            own += ("foreach",)  # popped and given back explicitly
            adam_w_mode = name == "adamw" or params.get("adam_w_mode", True)
            built = "torch.optim.AdamW" if adam_w_mode else "torch.optim.Adam"
        else:
            built = "DeepSpeedCPUAdam" if on_cpu else "FusedAdam"
    elif name == "adagrad":
        built = "DeepSpeedCPUAdagrad" if on_cpu else "torch.optim.Adagrad"
    elif name == "lion":
        built = "DeepSpeedCPULion" if on_cpu else "FusedLion"
    elif name == "lamb":
        built = "FusedLamb"
    elif name not in DEEPSPEED_OPTIMIZERS and kind in TORCH_OPTIMIZERS:
        built = f"torch.optim.{kind}"
    else:
        return None
    given = GIVEN_BY_DEEPSPEED.get(built, ())
    newer = tuple(key for key, since in OPTIMIZER_PARAMS_SINCE.get(built, {}).items() if installed_torch() >= since)
    return built, own + tuple(key for key in OPTIMIZER_CLASS_PARAMS[built] + newer if key not in given and key not in own)


def installed_torch() -> tuple[int, int]:
    """(major, minor) of the installed torch, read from its metadata (torch itself is not imported); (0, 0) without it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return tuple(int(part) for part in version("torch").split("+")[0].split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return (0, 0)


def optimizer_params_problems(config: dict) -> list[str]:
    """optimizer.params keys the optimizer DeepSpeed builds does not take: its constructor's TypeError on every rank,
    once data and model are loaded (DeepSpeed's own ValueError for max_grad_norm)."""
    built, params = built_optimizer(config), _block(_block(config, "optimizer"), "params")
    if built is None:
        return []
    kind, (name, accepted) = config["optimizer"]["type"], built
    problems = []
    for key in params:
        if key == "max_grad_norm":
            problems.append('optimizer.params.max_grad_norm: DeepSpeed refuses gradient clipping there: set '
                            '"gradient_clipping" (or --max_grad_norm) instead')
        elif key not in accepted:
            hint = closest(key, accepted)
            warmup = ('; a warmup belongs to the schedule: --warmup_steps N, or "scheduler": {"type": "WarmupLR", '
                      '"params": {"warmup_num_steps": N}}' if "warmup" in str(key).lower() else "")
            problems.append(f"optimizer.params.{key}: not a parameter of {name}, the optimizer DeepSpeed builds for "
                            f"optimizer.type {json.dumps(kind)}" + (f" (did you mean {hint!r}?)" if hint else "")
                            + f"{warmup}; it takes {', '.join(accepted)}")
    return problems


def optimizer(config: dict, sources: dict[str, Source], run: Run) -> Draft:
    """The file's optimizer (else the Trainer's AdamW) with its rate, betas, eps and weight decay from the flags."""
    draft = Draft.of(config, sources)
    if draft.config.get("optimizer") is None:
        draft.config["optimizer"] = {"type": "AdamW", "params": {}}
        draft.sources["optimizer.type"] = Source(DEFAULT, " (the Trainer's AdamW)")
        if "zero_allow_untested_optimizer" not in draft.config:
            draft.fill("zero_allow_untested_optimizer", True, Source(DEFAULT, " (needed for AdamW under ZeRO)"))
    block = draft.config["optimizer"]
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        draft.problems.append('optimizer must be an object with a "type" string, e.g. {"type": "AdamW", "params": '
                              f'{{...}}}}; got {json.dumps(block)}')
        return draft
    if problem := optimizer_type_problem(block["type"]):
        draft.problems.append(problem)
    draft.problems += optimizer_params_problems(draft.config)  # the file's own, before the flags fill any
    params = block.setdefault("params", {})
    adam_like = any(word in block["type"].lower() for word in ("adam", "lamb", "lion"))
    fill_from_flag(draft, run, "optimizer.params.lr")
    if adam_like or "betas" in params:
        _betas(draft, run)
    if adam_like or "eps" in params:
        fill_from_flag(draft, run, "optimizer.params.eps")
    fill_from_flag(draft, run, "optimizer.params.weight_decay")
    return draft


def _betas(draft: Draft, run: Run) -> None:
    """optimizer.params.betas element by element against --adam_beta1 / --adam_beta2."""
    path = "optimizer.params.betas"
    file_val = get_field(draft.config, path)
    if file_val not in (None, AUTO) and not (isinstance(file_val, list) and len(file_val) == 2):
        draft.problems.append(f"{path} must be a list of two numbers, got {json.dumps(file_val)}")
        return
    for index, flag in enumerate(FIELD_FLAGS[path]):
        element = None if file_val in (None, AUTO) else file_val[index]
        flag_val = run.flag(flag)
        if element is None or same(element, flag_val):
            continue
        if run.given(flag):
            draft.problems.append(f"{path}[{index}]={element} in the file disagrees with --{flag} {flag_val}: "
                                  f"drop --{flag}, make them equal, or set {path} to \"auto\"")
        elif why := out_of_range(flag, element):
            draft.problems.append(f"{path}[{index}]={json.dumps(element)} in the file (it would set --{flag}): "
                                  f"{why}; fix it or set {path} to \"auto\"")
        else:
            draft.flags[flag] = element
    betas = [draft.flags.get(flag, run.flag(flag)) for flag in FIELD_FLAGS[path]]
    draft.fill(path, betas, Source(FILE) if file_val not in (None, AUTO) else
               flag_source(run.given("adam_beta1") or run.given("adam_beta2"), " --adam_beta1/--adam_beta2"))


def file_scheduler(config: dict, sources: dict[str, Source], run: Run, learning_rate: float) -> Draft:
    """The file's DeepSpeed scheduler, checked against --lr_scheduler_type, its rate and warmup against the flags,
    "auto" filled. `learning_rate`: the rate the optimizer pass settled (a file's lr written back)."""
    draft = Draft.of(config, sources)
    if "scheduler" not in draft.config:
        return draft
    block, steps = draft.config["scheduler"], run.training_steps
    if not isinstance(block, dict):  # "scheduler": "WarmupLR", a name where DeepSpeed reads an object
        draft.problems.append('scheduler must be an object with a "type" string, e.g. {"type": "WarmupLR", "params": '
                              f'{{"warmup_num_steps": "auto"}}}}; got {json.dumps(block)}')
        return draft
    if block.get("type") not in DEEPSPEED_SCHEDULERS:
        given = block.get("type")
        hint = closest(str(given), DEEPSPEED_SCHEDULERS)
        draft.problems.append(f"scheduler.type {json.dumps(given)} is not a DeepSpeed scheduler "
                              f"({', '.join(DEEPSPEED_SCHEDULERS)})" + (f": did you mean {hint!r}?" if hint else ""))
        return draft
    scheduler_type = block["type"]
    kind = run.flag("lr_scheduler_type")
    if run.given("lr_scheduler_type") and SCHEDULER_FOR_TYPE.get(kind) != scheduler_type:
        draft.problems.append(f"scheduler.type={scheduler_type} in the file disagrees with --lr_scheduler_type "
                              f"{kind}: drop one of them")
    params = block.setdefault("params", {})
    if scheduler_type in ("WarmupLR", "WarmupDecayLR"):
        if params.get("warmup_min_lr") in (None, AUTO):
            draft.fill("scheduler.params.warmup_min_lr", 0, Source(DEFAULT))
        optimizer_lr = get_field(draft.config, "optimizer.params.lr")
        problems_before = len(draft.problems)
        peak = fill_from_flag(draft, run, "scheduler.params.warmup_max_lr", learning_rate)
        if (len(draft.problems) == problems_before and isinstance(optimizer_lr, (int, float))
                and not same(optimizer_lr, peak)):
            draft.problems.append(f"optimizer.params.lr={optimizer_lr} and scheduler.params.warmup_max_lr={peak} "
                                  "disagree (after warmup the rate is warmup_max_lr): make them equal or set both to "
                                  "\"auto\"")
    if scheduler_type in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        _warmup(draft, run, steps)
        if params.get("warmup_type") == AUTO:
            draft.fill("scheduler.params.warmup_type", "linear", Source(DERIVED, " (linear, as transformers)"))
        elif "warmup_type" not in params:
            draft.notes.append("scheduler.params.warmup_type is not set: DeepSpeed warms up logarithmically; set it "
                               "to \"linear\" to match transformers")
    if scheduler_type in ("WarmupDecayLR", "WarmupCosineLR") and params.get("total_num_steps") in (None, AUTO):
        draft.fill("scheduler.params.total_num_steps", draft.waits(steps, "scheduler.params.total_num_steps"),
                   Source(DERIVED, " (number of training steps)"))
    if scheduler_type == "WarmupCosineLR":
        for key in ("warmup_min_ratio", "cos_min_ratio"):
            if params.get(key) == AUTO:
                draft.fill(f"scheduler.params.{key}", 0, Source(DEFAULT))
    return draft


def _warmup(draft: Draft, run: Run, steps: int | None) -> None:
    """scheduler.params.warmup_num_steps against --warmup_steps / --warmup_ratio."""
    path = "scheduler.params.warmup_num_steps"
    file_val = get_field(draft.config, path)
    warmup = warmup_steps_for(run.args, steps)
    steps_flag, ratio_flag = FIELD_FLAGS[path]
    flag = ratio_flag if run.given(ratio_flag) else steps_flag
    if file_val in (None, AUTO):
        value = draft.waits(None, path) if warmup is None else max(1, warmup)
        draft.fill(path, value, Source(FLAG, f" --{flag}") if run.given(flag) else Source(DEFAULT, " --warmup_steps"))
        return
    if not positive_int(file_val):
        draft.problems.append(f"{path} must be a positive integer, got {json.dumps(file_val)}")
        return
    if not run.given(steps_flag) and not run.given(ratio_flag):
        draft.flags[steps_flag] = int(file_val)
        draft.sources[path] = Source(FILE, " (--warmup_steps left at default 0)")
    elif warmup is not None and warmup != file_val:
        draft.problems.append(f"{path}={file_val} in the file disagrees with --{flag} {run.flag(flag)} ({warmup} "
                              f"steps): drop one, or set {path} to \"auto\"")
    else:
        draft.sources[path] = Source(FILE, f" (= --{flag})")


def flag_scheduler(config: dict, sources: dict[str, Source], run: Run, learning_rate: float) -> Draft:
    """No scheduler in the file: DeepSpeed's of the same shape as --lr_scheduler_type (linear warmup, as transformers),
    else none: the Trainer builds transformers' own. `learning_rate`: the rate the optimizer pass settled (a file's lr
    written back onto --learning_rate)."""
    draft = Draft.of(config, sources)
    if "scheduler" in draft.config:
        return draft
    steps = run.training_steps
    kind = run.flag("lr_scheduler_type")
    warmup = 0 if kind == "constant" else warmup_steps_for(run.args, steps)
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
        draft.notes.append(f"scheduler left to the Trainer (transformers' own, exact): {reason}")
        draft.sources["scheduler"] = Source(Origin.TRAINER)
        return draft
    scheduler_type = SCHEDULER_FOR_TYPE[kind]
    params: dict[str, Any] = {"warmup_min_lr": 0, "warmup_max_lr": learning_rate, "warmup_type": "linear"}
    if warmup == 0:  # constant rate: min = max, so the warmup length is irrelevant; transformers' (checked) one
        typed = warmup_steps_for(run.args, steps)
        params.update(warmup_min_lr=learning_rate, warmup_num_steps=draft.waits(
            None if typed is None else max(1, typed), "scheduler.params.warmup_num_steps"))
    else:
        params["warmup_num_steps"] = draft.waits(warmup, "scheduler.params.warmup_num_steps")
    if scheduler_type == "WarmupDecayLR":
        params["total_num_steps"] = draft.waits(steps, "scheduler.params.total_num_steps")
    draft.config["scheduler"] = {"type": scheduler_type, "params": params}
    draft.sources["scheduler.type"] = flag_source(run.given("lr_scheduler_type"), f" --lr_scheduler_type {kind}")
    for key in params:
        draft.sources[f"scheduler.params.{key}"] = Source(DERIVED, " from flags (linear warmup, as transformers)")
    return draft


def zero(config: dict, sources: dict[str, Source], run: Run) -> Draft:
    """The ZeRO section (ZeRO-2 when the file has none): its stage checked, the fields for where the ranks run (stage
    1-2) or ZeRO-3's filled."""
    draft = Draft.of(config, sources)
    section = draft.config.get("zero_optimization")
    if section is None:
        section = draft.config["zero_optimization"] = dict(ZERO2_DEFAULTS)
        for key in ZERO2_DEFAULTS:
            draft.sources[f"zero_optimization.{key}"] = Source(DEFAULT, " (ZeRO-2)")
    if not isinstance(section, dict):
        return draft
    stage = section.get("stage", 0)
    if stage == AUTO:
        section["stage"] = stage = 2
        draft.sources["zero_optimization.stage"] = Source(DEFAULT, " (ZeRO-2)")
    if not (isinstance(stage, int) and not isinstance(stage, bool) and 0 <= stage <= 3):
        draft.problems.append(f"zero_optimization.stage must be 0, 1, 2 or 3, got {json.dumps(stage)}")
    if stage in (1, 2):
        _tuned_zero(draft, section, run)
    if stage == 3:
        _zero3_defaults(draft, section, run)
    elif isinstance(stage, int) and (ignored := sorted(STAGE3_ONLY_KEYS & set(section))):
        draft.notes.append(f"zero_optimization.{', zero_optimization.'.join(ignored)}: read only at stage 3; "
                           f"DeepSpeed ignores {'it' if len(ignored) == 1 else 'them'} at stage {stage}")
    _nvme(draft, section, stage)
    return draft


def nvme_offloads(config: dict) -> list[tuple[str, Any]]:
    """(dotted nvme_path field, its value) of each offload block that swaps to NVMe: ZeRO-3's only (ZeRO-1/2 keep the
    optimizer state in CPU memory whatever the device says)."""
    section = config.get("zero_optimization")
    if not isinstance(section, dict) or section.get("stage") != 3:
        return []
    return [(f"zero_optimization.{name}.nvme_path", section[name].get("nvme_path"))
            for name in ("offload_optimizer", "offload_param")
            if isinstance(section.get(name), dict) and section[name].get("device") == "nvme"]


def _nvme(draft: Draft, section: dict, stage: Any) -> None:
    """NVMe offload: a folder is needed at stage 3 (checked on the training machine itself, never here); below it the
    device trains as "cpu"."""
    block = section.get("offload_optimizer")
    if stage in (1, 2) and isinstance(block, dict) and block.get("device") == "nvme":
        draft.notes.append(f"zero_optimization.offload_optimizer.device \"nvme\" at stage {stage}: DeepSpeed's "
                           "ZeRO-1/2 keep the optimizer state in CPU memory (only ZeRO-3 swaps to NVMe): it trains as "
                           "\"cpu\", and nvme_path is not used")
    for field, path in nvme_offloads(draft.config):
        if not path:
            draft.problems.append(f"{field.rpartition('.')[0]}.device is \"nvme\" but nvme_path is not set: give the "
                                  "folder on the NVMe drive (\"nvme_path\": \"/local_nvme\"), or offload to \"cpu\"")
        else:
            draft.notes.append(f"{field} {path}: ZeRO-3 swaps to this folder; training checks on each machine that "
                               "it exists and is writable before any work (trainer-ext ds-config cannot: it may run "
                               "elsewhere)")


def _zero3_defaults(draft: Draft, section: dict, run: Run) -> None:
    """Fill the ZERO3_DEFAULTS fields the file leaves out; "auto" ones are then sized from the hidden size."""
    for key, (value, why) in ZERO3_DEFAULTS.items():
        if key in section and not (section[key] == AUTO and value != AUTO):
            continue
        section[key] = value
        draft.sources[f"zero_optimization.{key}"] = Source(DEFAULT, f" for ZeRO-3: {why}")
    granularity_key = "stage3_module_granularity_threshold"
    if section.get(granularity_key, AUTO) == AUTO:
        section[granularity_key], why = ZERO3_GRANULARITY
        draft.sources[f"zero_optimization.{granularity_key}"] = Source(DEFAULT, f" for ZeRO-3: {why}")
    if section["stage3_gather_16bit_weights_on_model_save"] is False:
        draft.notes.append("zero_optimization.stage3_gather_16bit_weights_on_model_save is false in the file: "
                           "checkpoints and output_dir hold ZeRO shards only, no model from_pretrained can load "
                           "(DeepSpeed's zero_to_fp32.py rebuilds one)")
    draft.notes.append(f"ZeRO-3 partitions the parameters too: {ZERO3_COST}")
    granularity = section.get("stage3_module_granularity_threshold", 0)
    if run.cpu_ranks and isinstance(granularity, (int, float)) and granularity > 0:  # measured: 0.19.8, 2 CPU ranks
        draft.problems.append(f"zero_optimization.stage3_module_granularity_threshold={json.dumps(granularity)} "
                              "fails on CPU ranks at the first optimizer step (DeepSpeed's stage-3 zero_grad calls "
                              "record_stream, which CPU tensors do not have): set it to 0, or run on GPUs")


def _tuned_zero(draft: Draft, section: dict, run: Run) -> None:
    """Fill the TUNED_ZERO fields the file leaves out or sets to "auto", for where these ranks run."""
    where = "cpu" if run.cpu_ranks else "gpu" if run.world_size == 1 else "gpus"
    ranks = {"cpu": "CPU ranks", "gpu": "one GPU rank", "gpus": f"{run.world_size} GPU ranks"}[where]
    offload_block = section.get("offload_optimizer")
    offload = isinstance(offload_block, dict) and offload_block.get("device") not in (None, "none")
    for key, choices in TUNED_ZERO.items():
        if section.get(key, AUTO) != AUTO:
            continue
        value, why = choices[where]
        if key == "contiguous_gradients" and offload:
            value, why = True, "DeepSpeed requires it with offload_optimizer"
        section[key] = value
        draft.sources[f"zero_optimization.{key}"] = Source(DEFAULT, f" for {ranks}: {why}")


def zero_auto_value(key: str, hidden_size: int | None, model_given: bool) -> tuple[Any, Source] | None:
    """A zero_optimization field given as "auto": transformers' rule from the model's hidden size h, else DeepSpeed's
    own default; None when neither has a value for it."""
    if key in HIDDEN_SIZE_AUTO and hidden_size:
        rule, meaning, whose = HIDDEN_SIZE_AUTO[key]
        return rule(hidden_size), Source(DERIVED, f" from the model's hidden size h = {hidden_size} ({whose}: "
                                                  f"{meaning})")
    if key in ZERO_AUTO_FALLBACK:
        why = "the model gives no hidden size to size it" if model_given else "no model given to size it"
        return ZERO_AUTO_FALLBACK[key], Source(DEFAULT, f" (DeepSpeed's; {why})")
    return None


def zero_auto_sizes(config: dict, sources: dict[str, Source], run: Run) -> Draft:
    """zero_optimization fields left "auto": sized from the model's hidden size, else DeepSpeed's defaults, or pending
    until the model is known (phase 2 sizes them by the same rule)."""
    draft = Draft.of(config, sources)
    section = draft.config.get("zero_optimization")
    for key, value in list(section.items()) if isinstance(section, dict) else ():
        if value != AUTO:
            continue
        path = f"zero_optimization.{key}"
        if key in HIDDEN_SIZE_AUTO and not run.hidden_size and not run.final:
            draft.pending.append(path)
        elif sized := zero_auto_value(key, run.hidden_size, model_given=False):
            section[key], draft.sources[path] = sized
    return draft


def untested_optimizer(config: dict, sources: dict[str, Source]) -> Draft:
    """ZeRO refuses an optimizer it was not tested with (torch's SGD, ...) unless the file allows it."""
    draft = Draft.of(config, sources)
    optimizer, zero = config.get("optimizer"), config.get("zero_optimization")
    name = optimizer.get("type") if isinstance(optimizer, dict) else None
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    allowed = config.get("zero_allow_untested_optimizer") is True
    tested = isinstance(name, str) and name.lower() in ZERO_TESTED_OPTIMIZERS
    if (isinstance(name, str) and optimizer_type_problem(name) is None and not tested
            and isinstance(stage, int) and stage > 0 and not allowed):
        draft.problems.append(f"optimizer.type {json.dumps(name)} under ZeRO stage {stage}: DeepSpeed refuses an "
                              "optimizer it did not test with ZeRO unless the file sets "
                              "\"zero_allow_untested_optimizer\": true (add it, or use AdamW)")
    return draft


def precision_safety(config: dict, sources: dict[str, Source]) -> Draft:
    """fp16 and bf16 skip a step whose gradient norm is not finite; say how, and keep what the file says."""
    draft = Draft.of(config, sources)
    bf16 = draft.config.get("bf16", {})
    if bf16.get("enabled") is True:
        if bf16.get("check_grad_overflow", AUTO) == AUTO:
            draft.fill("bf16.check_grad_overflow", True, Source(DEFAULT, ": a non-finite gradient norm skips the step"))
        elif bf16["check_grad_overflow"] is False:
            draft.notes.append("bf16.check_grad_overflow is false in the file: a step with a non-finite gradient norm "
                               "will write NaN into the weights. With it true (the default) the step is skipped, at "
                               "no cost: trainer_ext tests the gradient norm DeepSpeed computes anyway")
            return draft
    if draft.config.get("fp16", {}).get("enabled") is True or bf16.get("enabled") is True:
        draft.notes.append("overflow check: trainer_ext skips a step when the gradient norm DeepSpeed computes for "
                           "clipping is not finite, instead of DeepSpeed's per-parameter inf/NaN scan: the same steps "
                           "are skipped (ZeRO-1/2 without offload; DeepSpeed's step phase: 65.9 ms with the scan, "
                           f"15.7 ms without, {H100_RUN})")
    return draft


def leftover_auto(config: dict, sources: dict[str, Source], pending: list[str], final: bool) -> Draft:
    """An "auto" nothing filled is named; in the final phase, so is one still waiting for the step count."""
    draft = Draft.of(config, sources)
    for path, value in iter_fields(config):
        if value == AUTO and path not in pending:
            draft.problems.append(f'{path} is "auto" but nothing fills it: give a value')
    if final:
        for path in pending:
            draft.problems.append(f"{path} needs the number of training steps: pass num_training_steps "
                                  "(trainer-ext ds-config: --num_training_steps N or --max_steps N)")
    return draft
