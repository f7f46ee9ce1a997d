"""The two phases: `resolve_deepspeed_config` settles everything the flags and the file decide when the arguments are
parsed, by the passes in passes.py; `finish_deepspeed_config` fills what had to wait (training steps, the model's
hidden size, the world size the process group really has) without changing anything the run already used; `explain`
says where each value came from. Pure: imports neither torch nor deepspeed."""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from ..environment.launcher import resolve_world_size
from .fields import Origin, Source, iter_fields, numbers_from_strings, set_field, show, source_of
from .load import GIVEN_AS_DICT, DeepSpeedConfigError, load_deepspeed_config
from .passes import (Draft, Run, batch, check_keys, clipping, field_types, file_scheduler, flag_scheduler, flag_value,
                     leftover_auto, migrate_legacy, optimizer, precision, precision_safety, untested_optimizer,
                     warmup_steps_for, zero, zero_auto_sizes, zero_auto_value)


@dataclass
class Resolution:
    """A resolved config and what the run must know about it."""

    config: dict
    effective_flags: dict = field(default_factory=dict)  # flag -> value the run uses (written back to args)
    provenance: dict[str, Source] = field(default_factory=dict)  # dotted config field -> where its value came from
    notes: list = field(default_factory=list)  # one line each, for the log
    pending: list = field(default_factory=list)  # fields left "auto" until the step count / model is known
    origin: str = ""  # where the user's config came from, for messages
    world_size: int = 1  # the ranks the batch fields were resolved for
    cpu_ranks: bool = False  # the ZeRO fields were tuned for CPU ranks

    @property
    def sources(self) -> dict[str, str]:
        """Where each field's value came from, in --explain's words."""
        return {path: str(source) for path, source in self.provenance.items()}

    @property
    def scheduler_by_trainer(self) -> bool:
        """No DeepSpeed scheduler: transformers builds its own."""
        return source_of(self.provenance, "scheduler").origin is Origin.TRAINER


def _phase_one(config: dict, run: Run, origin: str) -> Resolution:
    """The passes in order, as transformers' trainer_config_process lists its fill_match lines. Each returns the config
    and its sources after it (the next pass starts from them) and what it found (collected here, read by no pass
    except where a signature names it); every problem is raised at once, at the end."""
    drafts: list[Draft] = []
    # A file (or inline text) of {}: said once, with the run's settings and by ds-config (a dict is a caller's choice).
    empty = [f"{'--deepspeed ' if origin.startswith('(') else 'the DeepSpeed file '}{origin} is empty ({{}}): ZeRO-2 "
             "with trainer_ext's defaults and your flags"] if not config and origin != GIVEN_AS_DICT else []

    def then(draft: Draft) -> tuple[dict, dict[str, Source]]:
        drafts.append(draft)
        return draft.config, draft.sources

    def written_back() -> dict[str, Any]:
        return {flag: value for draft in drafts for flag, value in draft.flags.items()}

    config, sources = then(check_keys(numbers_from_strings(config), {}))
    config, sources = then(field_types(config, sources))
    config, sources = then(migrate_legacy(config, sources))
    config, sources = then(precision(config, sources, run))
    config, sources = then(batch(config, sources, run))
    config, sources = then(clipping(config, sources, run))
    config, sources = then(optimizer(config, sources, run))
    learning_rate = written_back().get("learning_rate", run.flag("learning_rate"))  # a file's lr, written back
    config, sources = then(file_scheduler(config, sources, run, learning_rate))
    config, sources = then(flag_scheduler(config, sources, run, learning_rate))
    config, sources = then(zero(config, sources, run))
    config, sources = then(zero_auto_sizes(config, sources, run))
    config, sources = then(untested_optimizer(config, sources))
    config, sources = then(precision_safety(config, sources))
    pending = [path for draft in drafts for path in draft.pending]
    then(leftover_auto(config, sources, pending, run.final))
    if problems := [problem for draft in drafts for problem in draft.problems]:
        raise DeepSpeedConfigError(problems, origin)
    return Resolution(config=config, effective_flags=written_back(), provenance=sources,
                      notes=empty + [note for draft in drafts for note in draft.notes], pending=pending, origin=origin,
                      world_size=run.world_size, cpu_ranks=run.cpu_ranks)


# ---------------------------------------------------------------------------------------------- public API

def resolve_deepspeed_config(args: Any, config: Any = None, world_size: int | None = None,
                             num_training_steps: int | None = None, hidden_size: int | None = None,
                             final: bool = True, cpu_ranks: bool = False, global_batch: Any = None) -> Resolution:
    """Resolve flags + file into a complete config, the flags the run must use, and where each value came from.

    `config`: dict, JSON text, path or preset name (default: args.deepspeed, else an empty config).
    `final=False` is the argument-time phase: fields needing the step count or the model stay "auto"
    and are listed in `pending` instead of failing. `cpu_ranks`: the ranks run on CPUs (settles the zero fields
    that depend on it, TUNED_ZERO). `world_size`: the ranks the batch fields are for; None, for a caller from Python,
    reads this process's launch (environment.launcher.resolve_world_size), the translator's one look outside its
    arguments (trainer_ext's own callers pass the value). `global_batch`: the split of a global batch kept on this
    world size (config.batch.split_batch: --global_batch_size, or a resumed run's), which the batch fields follow."""
    if config is None:
        config = flag_value(args, "deepspeed") or {}
    user_config, origin = load_deepspeed_config(config)
    run = Run(args, resolve_world_size(world_size), num_training_steps, hidden_size, final, cpu_ranks, global_batch)
    return _phase_one(user_config, run, origin)


def finish_deepspeed_config(resolution: Resolution, args: Any, world_size: int, num_training_steps: int,
                            hidden_size: int | None = None) -> Resolution:
    """Phase 2, when training starts: fill what phase 1 left pending (the training steps, sizes from the model's hidden
    size) and take the world size the process group really has, in a copy. Nothing else changes: the batch fields
    already built the data order, the precision and optimizer the model and its optimizer. A file whose
    train_batch_size was split for another number of ranks than the run has is an error, never a sampler and an engine
    that disagree on the batch."""
    config = copy.deepcopy(resolution.config)
    provenance = dict(resolution.provenance)
    problems = []
    if world_size != resolution.world_size:
        split = [path for path in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
                 if source_of(provenance, path).for_world_size not in (None, world_size)]
        if split:
            raise DeepSpeedConfigError(
                [f"train_batch_size={config['train_batch_size']} in the file was split for {resolution.world_size} "
                 f"rank(s) when the arguments were parsed ({split[0]}={config[split[0]]}; the launcher's "
                 f"WORLD_SIZE), but the process group has {world_size}: launch {resolution.world_size} ranks, or give "
                 f"train_micro_batch_size_per_gpu (--per_device_train_batch_size) instead of train_batch_size"],
                resolution.origin)
        config["train_batch_size"] = (config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"]
                                      * world_size)
        provenance["train_batch_size"] = Source(
            Origin.DERIVED, f" (micro × accumulation × the process group's {world_size} ranks)")
    for path in resolution.pending:
        filled = _pending_value(path, args, num_training_steps, hidden_size)
        if filled is None:
            problems.append(f'{path} is "auto" and needs the model\'s hidden size, which this model does not give: '
                            "write a value in the file")
            continue
        set_field(config, path, filled[0])
        provenance[path] = filled[1]
    if problems:
        raise DeepSpeedConfigError(problems, resolution.origin)
    return dataclasses.replace(resolution, config=config, provenance=provenance, pending=[], world_size=world_size)


def _pending_value(path: str, args: Any, num_training_steps: int, hidden_size: int | None) -> tuple[Any, Source] | None:
    """The value phase 1 could not know, and where it came from."""
    if path == "scheduler.params.total_num_steps":
        return int(num_training_steps), Source(Origin.DERIVED, " (number of training steps)")
    if path == "scheduler.params.warmup_num_steps":  # DeepSpeed warms up over >= 1 step; transformers' checked value
        return (max(1, warmup_steps_for(args, num_training_steps)),
                Source(Origin.DERIVED, " from the warmup flags and the step count"))
    return zero_auto_value(path.rpartition(".")[2], hidden_size, model_given=True)


def build_deepspeed_config(args: Any, world_size: int | None = None, num_training_steps: int | None = None,
                           config: Any = None, hidden_size: int | None = None, cpu_ranks: bool = False) -> dict:
    """The complete DeepSpeed config (no "auto" left) for these flags; raises DeepSpeedConfigError."""
    return resolve_deepspeed_config(args, config, world_size, num_training_steps, hidden_size,
                                    cpu_ranks=cpu_ranks).config


def explain(resolution: Resolution) -> str:
    """One line per field: dotted name, value, where the value came from."""
    rows = [(path, json.dumps(value), source_of(resolution.provenance, path))
            for path, value in iter_fields(resolution.config)]
    width = max(len(path) for path, _, _ in rows)
    value_width = max(len(value) for _, value, _ in rows)
    lines = [f"{path:<{width}}  {value:<{value_width}}  {source}" for path, value, source in rows]
    if resolution.scheduler_by_trainer:
        lines.append(f"{'scheduler':<{width}}  {'-':<{value_width}}  {resolution.provenance['scheduler']}")
    lines += [f"note: {note}" for note in resolution.notes]
    if resolution.effective_flags:
        lines.append("flags taken from the file: " + ", ".join(
            f"--{flag} {show(value)}" for flag, value in resolution.effective_flags.items()))
    return "\n".join(lines)
