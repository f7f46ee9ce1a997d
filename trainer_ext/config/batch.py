"""The global batch (samples per optimizer step: per-device batch x accumulation x world size) is the user's whatever
the world size. `--global_batch_size N` says it outright; without it, a run resumed from a checkpoint keeps the global
batch that run trained with as long as the command gives the same per-device batch and accumulation (an elastic
restart, a requeued job on fewer nodes: the same command, another WORLD_SIZE). This start's ranks then share it by the
accumulation steps; the per-device batch is lowered only where the accumulation could not be whole (never raised: the
memory a rank needs stays what the user chose). A global batch the world size does not divide is refused, naming the
world sizes and global batches that would work: an exact run or none, never a silently different one. Pure: the world
size and the resumed run's record are given."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ArgumentsError
from .own_flags import BatchFlags, flags_of

GLOBAL_BATCH_FLAG = "global_batch_size"


@dataclass(frozen=True)
class GlobalBatch:
    """How this start splits the run's global batch over its ranks, and what the command itself gave."""

    per_device: int
    accumulation: int
    world_size: int
    given_per_device: int  # the command's --per_device_train_batch_size
    given_accumulation: int  # the command's --gradient_accumulation_steps
    kept_from: str | None = None  # why the global batch is not the command's own product: its source, in words

    @property
    def size(self) -> int:
        return self.per_device * self.accumulation * self.world_size

    @property
    def changed(self) -> bool:
        """Whether this start trains another per-device batch or accumulation than the command gives."""
        return (self.per_device, self.accumulation) != (self.given_per_device, self.given_accumulation)

    def record(self) -> dict:
        """What a checkpoint records beside the global batch (data_state.json's "batch_given"), so that a later start
        of the same command keeps it."""
        return given_record(self.given_per_device, self.given_accumulation)

    def fields(self) -> dict:
        """The arguments' fields for this split (config/settings writes them)."""
        return {"per_device_train_batch_size": self.per_device, "gradient_accumulation_steps": self.accumulation}

    def describe(self) -> str:
        """One line for the log, when the split is not the command's own."""
        lowered = (f"; the per-device batch lowered from {self.given_per_device} so the accumulation is whole"
                   if self.per_device < self.given_per_device else "")
        return (f"global batch {self.size} ({self.kept_from}) on {self.world_size} rank(s): {self.per_device} per device "
                f"x {self.accumulation} accumulation (the command gives {self.given_per_device} x "
                f"{self.given_accumulation}){lowered}")


def given_record(per_device: int, accumulation: int) -> dict:
    return {"per_device_train_batch_size": per_device, "gradient_accumulation_steps": accumulation}


def same_command(record: dict, per_device: int, accumulation: int) -> bool:
    """Whether a checkpoint's training-order record (data_state.json) was written by a start of this command (another
    world size allowed). A checkpoint written before "batch_given" existed trained the command's own product."""
    given = record.get("batch_given")
    if given is not None:
        return given == given_record(per_device, accumulation)
    saved, ranks = record.get("global_batch_size"), record.get("world_size")
    return saved is not None and ranks is not None and per_device * accumulation * int(ranks) == int(saved)


def settle(per_device: int, accumulation: int, world_size: int, global_batch_size: int | None = None,
           resumed: dict | None = None, resumed_from: str = "the checkpoint") -> GlobalBatch:
    """The per-device batch and accumulation this start trains with: `global_batch_size` (the flag) first, else the
    global batch of the `resumed` checkpoint's record (its data_state.json) when the command is the same, else the
    command's own. Raises ArgumentsError when the world size does not divide the global batch."""
    command = GlobalBatch(per_device, accumulation, world_size, per_device, accumulation)
    if global_batch_size is not None:
        target, source = int(global_batch_size), f"--{GLOBAL_BATCH_FLAG}"
    elif resumed and resumed.get("global_batch_size") and same_command(resumed, per_device, accumulation):
        target, source = int(resumed["global_batch_size"]), f"the run's, from {resumed_from}"
    else:
        return command
    if target == command.size:
        return GlobalBatch(per_device, accumulation, world_size, per_device, accumulation, source)
    if target % world_size:
        raise ArgumentsError(indivisible(target, source, world_size))
    per_rank = target // world_size
    fitting = max(size for size in range(1, min(per_device, per_rank) + 1) if per_rank % size == 0)
    return GlobalBatch(fitting, per_rank // fitting, world_size, per_device, accumulation, source)


def indivisible(target: int, source: str, world_size: int) -> str:
    """The one line for a global batch these ranks cannot share evenly: the world sizes that can, and the nearest
    global batches this one can."""
    ranks = [size for size in range(1, min(target, 4 * world_size) + 1) if target % size == 0]
    below = target - target % world_size
    batches = " or ".join(str(size) for size in (below, below + world_size) if size > 0)
    sizes = ", ".join(map(str, ranks[:-1])) + f" or {ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
    return (f"the global batch of {target} samples ({source}) cannot be shared evenly by {world_size} ranks: run on "
            f"{sizes} ranks (an elastic torchrun's --nnodes MIN:MAX x --nproc_per_node only among them), or give "
            f"--{GLOBAL_BATCH_FLAG} {batches} (another global batch from here on)")


def split_batch(args, world_size: int, resumed: tuple[str, dict] | None) -> GlobalBatch:
    """The global batch these arguments train with on `world_size` ranks, split (its `fields()` are what
    transformers, accelerate and DeepSpeed's translator then read). `resumed`: (name, data_state.json) of the
    checkpoint this start resumes."""
    where, record = resumed or ("", None)
    return settle(args.per_device_train_batch_size, args.gradient_accumulation_steps, world_size,
                  flags_of(BatchFlags, args).global_batch_size, record, where)
