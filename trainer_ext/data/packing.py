"""Packing and padding for causal LMs. `best_fit_decreasing` places tokenized samples into rows of at most
`max_length` tokens (each sample, longest first, into the fullest row it still fits) in O(n log n) on arrays;
`PackedRows` reads each row's samples from memory-mapped token sequences when the row is asked for, each sample keeping
its own positions 0..n-1 and its first token unlabelled, so that nothing is learnt across a sample boundary.
`CausalLMCollator` pads plain samples (attention mask, labels -100) or packed rows (position ids, no attention mask:
transformers then builds each sample's own causal mask from the position ids; flash attention reads them as one
flattened row)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

IGNORE = -100


def best_fit_decreasing(lengths, max_length: int, progress=None) -> tuple[np.ndarray, np.ndarray]:
    """Rows of sample indices, best-fit decreasing (TRL's "bfd"): fewest rows for the lengths, deterministic (ties by
    index). Returns (order, starts): row r holds samples order[starts[r]:starts[r + 1]], in dataset order, rows
    numbered as they were opened. O(n log n): one sort, then per sample a heap operation and a word-parallel search
    of the rooms left (a bit per possible room: the smallest room that fits is the lowest bit set at or above the
    sample's length). `progress(done)` is called now and then."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and lengths.max() > max_length:
        raise ValueError(f"a sample of {lengths.max()} tokens does not fit a row of {max_length}")
    by_size = np.lexsort((np.arange(len(lengths)), -lengths))  # longest first, ties by index
    row_of = np.empty(len(lengths), dtype=np.int64)
    rows_with_room: dict[int, list[int]] = {}  # room left -> heap of the row numbers with that room
    rooms = 0  # bit r set: some row has exactly r tokens of room
    opened = 0
    for done, (index, length) in enumerate(zip(by_size.tolist(), lengths[by_size].tolist())):
        fitting = rooms >> length
        if fitting:
            room = length + (fitting & -fitting).bit_length() - 1
            waiting = rows_with_room[room]
            number = heapq.heappop(waiting)  # the earliest opened of the fullest rows that fit
            if not waiting:
                rooms ^= 1 << room
        else:
            number, room = opened, max_length
            opened += 1
        row_of[index] = number
        left = room - length
        if left:
            waiting = rows_with_room.setdefault(left, [])
            if not waiting:
                rooms |= 1 << left
            heapq.heappush(waiting, number)
        if progress is not None and done % 65536 == 65535:
            progress(done + 1)
    order = np.lexsort((np.arange(len(lengths)), row_of))
    starts = np.zeros(opened + 1, dtype=np.int64)
    np.cumsum(np.bincount(row_of, minlength=opened), out=starts[1:])
    if progress is not None:
        progress(len(lengths))
    return order, starts


def pack(lengths: list[int], max_length: int) -> list[list[int]]:
    """best_fit_decreasing's rows as lists of sample indices."""
    order, starts = best_fit_decreasing(lengths, max_length)
    return [order[begin:end].tolist() for begin, end in zip(starts[:-1].tolist(), starts[1:].tolist())]


def packed_row(samples: list[dict]) -> dict:
    """One row of several samples: ids and labels concatenated, each sample's first label dropped (it would be
    predicted from the previous sample's last token) and its positions restarting at 0."""
    ids = [np.asarray(sample["input_ids"]) for sample in samples]
    labels = [np.asarray(sample["labels"]).copy() for sample in samples]
    for label in labels:
        label[:1] = IGNORE
    return {"input_ids": np.concatenate(ids).tolist(), "labels": np.concatenate(labels).tolist(),
            "position_ids": np.concatenate([np.arange(len(sample)) for sample in ids]).tolist()}


class PackedRows:
    """A map-style dataset of packed rows over token sequences (data/tokens.py's TokenTable, memory-mapped): row i is
    built from its samples when it is read, so packing copies nothing and no rank holds the whole set."""

    def __init__(self, samples, order: np.ndarray, starts: np.ndarray):
        self.samples, self.order, self.starts = samples, order, starts

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, index: int) -> dict:
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        index %= len(self)
        members = self.order[self.starts[index]:self.starts[index + 1]].tolist()
        return packed_row([self.samples.sample(member) for member in members])


def pack_dataset(dataset, max_length: int):
    """For a user's own script: a datasets.Dataset of `input_ids`/`labels` samples -> a datasets.Dataset of packed rows
    (best_fit_decreasing's, `position_ids` added, other columns dropped). The recipe packs its memory-mapped cache with
    PackedRows instead; this one holds the rows in memory as the dataset it returns."""
    import datasets

    columns = dataset.select_columns(["input_ids", "labels"])
    order, starts = best_fit_decreasing(np.fromiter(map(len, columns["input_ids"]), np.int64, len(columns)), max_length)
    return datasets.Dataset.from_list([packed_row([columns[i] for i in order[begin:end].tolist()])
                                       for begin, end in zip(starts[:-1].tolist(), starts[1:].tolist())])


def padded_length(longest: int, multiple: int | None, fixed: int | None) -> int:
    if fixed:
        return fixed
    if multiple:
        return -(-longest // multiple) * multiple
    return longest


@dataclass
class CausalLMCollator:
    """Batches of samples (right-padded: `pad_id`, attention mask 0, labels -100) or of packed rows (`position_ids`
    present: padded with a block of its own positions, no attention mask). `pad_to_multiple_of` rounds the length up;
    `length` pads every batch to one length (one shape: torch.compile compiles once). `flatten`: packed rows are
    concatenated into one row of batch size 1, which flash attention needs to see the samples' boundaries."""

    pad_id: int
    pad_to_multiple_of: int | None = None
    length: int | None = None
    flatten: bool = False

    def __call__(self, features: list[dict]) -> dict:
        import torch

        packed = "position_ids" in features[0]
        longest = max(len(f["input_ids"]) for f in features)
        size = max(padded_length(longest, self.pad_to_multiple_of, self.length), longest)
        batch = {"input_ids": np.full((len(features), size), self.pad_id, dtype=np.int64),
                 "labels": np.full((len(features), size), IGNORE, dtype=np.int64)}
        extra = "position_ids" if packed else "attention_mask"
        batch[extra] = np.zeros((len(features), size), dtype=np.int64)
        for row, f in enumerate(features):
            filled = len(f["input_ids"])
            batch["input_ids"][row, :filled] = f["input_ids"]
            batch["labels"][row, :filled] = f["labels"]
            if packed:  # the padding is a "sample" of its own: attended by nothing real
                batch[extra][row, :filled] = f["position_ids"]
                batch[extra][row, filled:] = np.arange(size - filled)
            else:
                batch[extra][row, :filled] = 1
        tensors = {key: torch.from_numpy(value) for key, value in batch.items()}
        if packed and self.flatten:
            tensors = {key: value.reshape(1, -1) for key, value in tensors.items()}
        return tensors
