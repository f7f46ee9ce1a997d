"""Rank-strided batch sampler: one shuffled global order per (seed, epoch); rank r trains on samples r, r+N, ...
so every backend and every world size sees the same global batches."""

from __future__ import annotations

import math

import torch


class RankStridedBatchSampler(torch.utils.data.Sampler):
    """Batches of this rank's share of a seeded permutation.

    The permutation is padded (by wrapping around) to a multiple of the world size so every rank yields the
    same number of batches; with `batch_size × world_size` dividing the dataset there is no padding at all and
    global batch k is exactly samples [k·B·N, (k+1)·B·N) of the permutation, as in a single process with B·N."""

    def __init__(self, num_samples: int, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False):
        if num_samples <= 0:
            raise ValueError("the training set is empty")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def global_order(self) -> list[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_samples, generator=generator).tolist()
        else:
            order = list(range(self.num_samples))
        padded = math.ceil(self.num_samples / self.world_size) * self.world_size
        return order + order[: padded - self.num_samples]

    def __iter__(self):
        mine = self.global_order()[self.rank::self.world_size]
        for start in range(0, len(mine), self.batch_size):
            batch = mine[start:start + self.batch_size]
            if len(batch) < self.batch_size and self.drop_last:
                return
            yield batch

    def __len__(self) -> int:
        per_rank = math.ceil(self.num_samples / self.world_size)
        return per_rank // self.batch_size if self.drop_last else math.ceil(per_rank / self.batch_size)
