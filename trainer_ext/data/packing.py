"""Packing and padding for causal LMs. `pack` places tokenized samples into rows of at most `max_length` tokens
(best-fit decreasing: each sample, longest first, into the fullest row it still fits), each sample keeping its own
positions 0..n-1 and its first token unlabelled, so that nothing is learnt across a sample boundary. `CausalLMCollator`
pads plain samples (attention mask, labels -100) or packed rows (position ids, no attention mask: transformers then
builds each sample's own causal mask from the position ids; flash attention reads them as one flattened row)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

IGNORE = -100


def pack(lengths: list[int], max_length: int) -> list[list[int]]:
    """Sample indices grouped into rows of at most `max_length` tokens, best-fit decreasing (TRL's "bfd"): fewest
    rows for the lengths, deterministic (ties by index). Each row's indices are in dataset order."""
    if any(length > max_length for length in lengths):
        raise ValueError(f"a sample of {max(lengths)} tokens does not fit a row of {max_length}")
    order = sorted(range(len(lengths)), key=lambda index: (-lengths[index], index))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row number), sorted: the fullest row that fits comes first
    for index in order:
        at = bisect.bisect_left(free, (lengths[index], -1))
        if at == len(free):
            rows.append([index])
            room, number = max_length - lengths[index], len(rows) - 1
        else:
            room, number = free.pop(at)
            rows[number].append(index)
            room -= lengths[index]
        if room > 0:
            bisect.insort(free, (room, number))
    return [sorted(row) for row in rows]


def packed_row(samples: list[dict]) -> dict:
    """One row of several samples: ids and labels concatenated, each sample's first label dropped (it would be
    predicted from the previous sample's last token) and its positions restarting at 0."""
    row = {"input_ids": [], "labels": [], "position_ids": []}
    for sample in samples:
        row["input_ids"] += sample["input_ids"]
        row["labels"] += [IGNORE] + list(sample["labels"][1:])
        row["position_ids"] += list(range(len(sample["input_ids"])))
    return row


def pack_dataset(dataset, max_length: int):
    """A datasets.Dataset of `input_ids`/`labels` samples -> one of packed rows (`position_ids` added)."""
    import datasets

    lengths = [len(ids) for ids in dataset["input_ids"]]
    groups = pack(lengths, max_length)
    columns = dataset.select_columns(["input_ids", "labels"])
    rows = [packed_row([columns[i] for i in group]) for group in groups]
    return datasets.Dataset.from_list(rows)


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
        batch = {"input_ids": [], "labels": [], ("position_ids" if packed else "attention_mask"): []}
        for f in features:
            missing = size - len(f["input_ids"])
            batch["input_ids"].append(list(f["input_ids"]) + [self.pad_id] * missing)
            batch["labels"].append(list(f["labels"]) + [IGNORE] * missing)
            if packed:  # the padding is a "sample" of its own: attended by nothing real
                batch["position_ids"].append(list(f["position_ids"]) + list(range(missing)))
            else:
                batch["attention_mask"].append([1] * len(f["input_ids"]) + [0] * missing)
        tensors = {key: torch.tensor(value, dtype=torch.long) for key, value in batch.items()}
        if packed and self.flatten:
            tensors = {key: value.reshape(1, -1) for key, value in tensors.items()}
        return tensors
