"""The training order as a resumable chain: shuffle (seed + data epoch) -> repeat -> shard by rank -> batch -> skip,
so every backend, world size and restart trains on the same global batches.

The repeated, shuffled dataset is one endless stream of sample indices; global optimizer step k trains on stream
positions [offset + k·G, offset + (k+1)·G) where G = per-device batch × accumulation × world size. Rank r takes
positions r, r+N, r+2N, ... of that range (shard after the repeat, so no rank ever needs padding), cut into
micro-batches. Where a restart continues is then one number, the samples consumed, whatever G and N were before.
The skip comes last and works on these index batches (accelerate's `skip_first_batches` over this sampler, as the
Trainer calls it): skipped samples are never loaded or tokenized.
"""

from __future__ import annotations

import math

import torch

from ..errors import UserError


class ResumableBatchSampler(torch.utils.data.Sampler):
    """Batches of sample indices for one rank; `set_epoch` picks the Trainer's epoch, `state_dict` / `load_state_dict`
    carry the position in the stream across restarts (also with another world size or global batch).

    A Trainer epoch is `ceil(len(dataset) / G)` optimizer steps (`floor` with drop_last): every sample is seen once
    per epoch, and the last global batch is completed from the next shuffle of the stream rather than padded."""

    def __init__(self, num_samples: int, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 drop_last: bool = False, gradient_accumulation_steps: int = 1):
        if num_samples <= 0:
            raise UserError("the training set is empty: give a train_dataset with at least one sample")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.rank, self.world_size = rank, world_size
        self.seed, self.drop_last = seed, drop_last
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.epoch = 0
        self.offset = 0  # stream position of optimizer step 0 (non-zero after resuming with another global batch)
        self._orders: dict[int, list[int]] = {}

    # -- the chain -------------------------------------------------------------------------------------
    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.gradient_accumulation_steps * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        rounding = math.floor if self.drop_last else math.ceil
        return max(1, rounding(self.num_samples / self.global_batch_size))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def data_order(self, data_epoch: int) -> list[int]:
        """Shuffle: one permutation of the dataset per pass over it, from seed + pass number."""
        if data_epoch not in self._orders:
            generator = torch.Generator().manual_seed(self.seed + data_epoch)
            order = torch.randperm(self.num_samples, generator=generator).tolist()
            self._orders = {k: v for k, v in self._orders.items() if k >= data_epoch - 1}  # keep the cache small
            self._orders[data_epoch] = order
        return self._orders[data_epoch]

    def sample_at(self, position: int) -> int:
        """Repeat: stream position -> dataset index (pass `position // len`, place `position % len`). Positions before
        0 only occur in batches skipped after a resume with a larger global batch."""
        return self.data_order(position // self.num_samples)[position % self.num_samples]

    def micro_batch(self, epoch: int, index: int) -> list[int]:
        """Shard + batch: micro-batch `index` of this rank in Trainer epoch `epoch`."""
        start = self.step_position(epoch * self.steps_per_epoch) + index * self.batch_size * self.world_size
        return [self.sample_at(start + self.rank + self.world_size * i) for i in range(self.batch_size)]

    def step_position(self, global_step: int) -> int:
        """Samples consumed (stream position) before optimizer step `global_step` of this run."""
        return self.offset + global_step * self.global_batch_size

    def __iter__(self):
        for index in range(len(self)):
            yield self.micro_batch(self.epoch, index)

    def __len__(self) -> int:
        return self.steps_per_epoch * self.gradient_accumulation_steps

    # -- state -----------------------------------------------------------------------------------------
    def state_dict(self, global_step: int) -> dict:
        """Where training stands after `global_step` optimizer steps."""
        return {"global_step": global_step, "samples_consumed": self.step_position(global_step),
                "global_batch_size": self.global_batch_size,
                "num_samples": self.num_samples, "seed": self.seed, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> list[str]:
        """Continue at `state["samples_consumed"]` from optimizer step `state["global_step"]`; returns warnings for changes
        that alter the run (they never repeat or drop a sample of the stream; a changed order or size would)."""
        problems = [f"{key} changed from {state[key]} to {getattr(self, key)}"
                    for key in ("num_samples", "seed") if key in state and state[key] != getattr(self, key)]
        if problems:
            raise UserError("cannot continue the training order of the checkpoint: " + "; ".join(problems) +
                             ". Resume with the same dataset and --seed/--data_seed, or pass "
                             "--ignore_data_skip to restart the order (samples may repeat), or --fresh_start")
        self.offset = int(state["samples_consumed"]) - int(state["global_step"]) * self.global_batch_size
        warnings = []
        if state.get("global_batch_size", self.global_batch_size) != self.global_batch_size:
            warnings.append(
                f"the global batch changed from {state['global_batch_size']} to {self.global_batch_size} (per-device "
                "batch x accumulation x world size): training continues at sample "
                f"{state['samples_consumed']} of the same order, none repeated or dropped; from here on steps, "
                "epochs and the learning-rate schedule count batches of the new size (--global_batch_size "
                f"{state['global_batch_size']} keeps the old one on any number of ranks)")
        return warnings


_SAID: set[str] = set()  # the dataloader is built more than once per run: say it once


def global_batch_problem(args, num_samples: int, world_size: int, repeat: bool) -> str | None:
    """A global batch larger than the training data repeats every sample within one optimizer step (and calls it
    one epoch): refused, unless --repeat_small_dataset (`repeat`), when it is said once instead."""
    per_device, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    batch = per_device * accumulation * world_size
    if num_samples <= 0 or batch <= num_samples:
        return None
    what = (f"a global batch of {batch} samples (--per_device_train_batch_size {per_device} x "
            f"--gradient_accumulation_steps {accumulation} x {world_size} rank(s)) is larger than the {num_samples} "
            f"training sample(s): each optimizer step would see every sample about {batch / num_samples:.3g} times")
    if repeat:
        if args.process_index == 0 and what not in _SAID:
            _SAID.add(what)
            print(f"trainer_ext: {what} (--repeat_small_dataset)", flush=True)
        return None
    fits = num_samples // (per_device * world_size)
    fix = (f"--gradient_accumulation_steps {fits}" if fits >= 1 else
           f"--per_device_train_batch_size {max(1, num_samples // world_size)} and --gradient_accumulation_steps 1")
    return f"{what}: lower the batch (e.g. {fix}), add data, or pass --repeat_small_dataset to train on it repeated"


def check_global_batch(args, num_samples: int, world_size: int, repeat: bool) -> None:
    problem = global_batch_problem(args, num_samples, world_size, repeat)
    if problem:
        raise UserError(problem)
