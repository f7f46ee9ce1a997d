"""Training on an iterable (streaming) dataset: its items in the order the source yields them, pass after pass
(`set_epoch(pass)` first, where the source has it), cut into the same global batches as a map-style set (rank r takes
items r, r+N, r+2N, ... of each global batch, as data/samplers.py does), and continued after a resume where the
checkpoint stopped: from the source's own saved position when it can say exactly where it stands (`state_dict()` /
`load_state_dict()`, e.g. a datasets.IterableDataset without a shuffle buffer), else by reading and discarding the
items already trained on since the start of their pass."""

from __future__ import annotations

import copy
import json
import logging
from collections import OrderedDict

import torch

from ..errors import UserError
from ..integrations import internals

logger = logging.getLogger(__name__)

SNAPSHOTS = 8  # step boundaries whose source position is remembered (a checkpoint asks for the latest)


class Placeholder:
    """One item of a micro-batch transformers skips when it resumes (it skips the first global_step x accumulation
    micro-batches of the epoch): nothing is read or collated for it."""


def is_stream(dataset) -> bool:
    """A dataset to train on as a stream: an IterableDataset, or anything without a length."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return True
    try:
        len(dataset)
    except (TypeError, NotImplementedError):
        return True
    return False


def collate_with_placeholders(collate):
    """The collator, answering a placeholder micro-batch with an empty one (it is skipped, never trained on)."""
    def collate_batch(items):
        if items and isinstance(items[0], Placeholder):
            return {}
        return collate(items)
    return collate_batch


# datasets 3.0-3.5.1 resumed a stream from its state_dict() one step off (tests/unit/test_stream.py, make
# test-oldest); 3.6.0 is the first release found exact.
DATASETS_EXACT_FROM = (3, 6)


def _datasets_version() -> str:
    from importlib.metadata import version

    return version("datasets")


def _older_than(release: tuple[int, ...]) -> bool:
    import re

    numbers = tuple(int(part) for part in re.findall(r"\d+", _datasets_version())[:len(release)])
    return numbers < release


def exact_state(source) -> str | None:
    """Why the source cannot be resumed from its own saved position, or None when it can."""
    if not (callable(getattr(source, "state_dict", None)) and callable(getattr(source, "load_state_dict", None))):
        return "it has no state_dict()/load_state_dict() to say where it stands"
    iterable = internals.example_iterable(source)  # datasets: the chain of example iterables behind the dataset
    if iterable is not None and _older_than(DATASETS_EXACT_FROM):
        return (f"datasets {_datasets_version()} does not restore a stream's position exactly (measured: from "
                f"{'.'.join(map(str, DATASETS_EXACT_FROM))} it does)")
    while iterable is not None:
        if type(iterable).__name__ == "BufferShuffledExamplesIterable":
            return "datasets does not save a shuffle buffer (shuffle(buffer_size=...)) with the stream's position"
        iterable = getattr(iterable, "ex_iterable", None)
    return None


class TrainingStream(torch.utils.data.IterableDataset):
    """One rank's items of a source stream. Stream position p is the p-th item the source yielded since training
    began (passes concatenated); optimizer step k trains positions [offset + k·G, offset + (k+1)·G), G the global
    batch. `state_dict(k)` says where step k begins; `resume(...)` continues there."""

    def __init__(self, source, batch_size: int, rank: int = 0, world_size: int = 1, gradient_accumulation_steps: int = 1):
        self.source = source
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.start = 0  # position where the next iteration begins
        self.offset = 0  # position of optimizer step 0
        self.placeholders = 0  # micro-batches transformers skips first (a resume)
        self.pass_index, self.pass_begin = 0, 0  # the pass `start` is in, and the position where that pass began
        self.source_state = None  # the source's own position at `start`, when it can be resumed exactly
        self.unsaved = exact_state(source)  # why the source's own position is not used (None: it is)
        self._snapshots: OrderedDict[int, tuple] = OrderedDict()

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.gradient_accumulation_steps * self.world_size

    def step_position(self, global_step: int) -> int:
        return self.offset + global_step * self.global_batch_size

    # -- state -----------------------------------------------------------------------------------------------------
    def state_dict(self, global_step: int) -> dict:
        """Where training stands after `global_step` optimizer steps (what a checkpoint saves)."""
        position = self.step_position(global_step)
        state = {"kind": "stream", "global_step": global_step, "samples_consumed": position,
                 "global_batch_size": self.global_batch_size, "world_size": self.world_size}
        snapshot = self._snapshots.get(position)
        if snapshot is not None:  # absent with dataloader workers: the stream is read in their processes
            state["pass"], state["pass_begin"], source_state = snapshot
            if source_state is not None:
                try:
                    json.dumps(source_state)
                    state["source_state"] = source_state
                except (TypeError, ValueError):
                    self.unsaved = "its state_dict() is not JSON (numbers, strings, lists and dicts)"
        return state

    def resume(self, global_step: int, state: dict | None, skipped_by_trainer: bool) -> str:
        """Continue at optimizer step `global_step`: at the position `state` (a checkpoint's) gives, or, without one,
        from the first item (the order restarts, as with --ignore_data_skip). `skipped_by_trainer`: transformers will
        skip the first global_step x accumulation micro-batches, which are then placeholders. Returns how, for the
        log."""
        if state is None:
            self.start, self.offset = 0, -global_step * self.global_batch_size if not skipped_by_trainer else 0
            return ("the training stream restarts at its first item" if not skipped_by_trainer else
                    f"skipping the stream's first {global_step * self.global_batch_size} items by reading them "
                    "(the checkpoint does not say where the stream stood)")
        if state.get("kind") != "stream":
            raise UserError("the checkpoint was written while training on a dataset with a length (map-style), and "
                            "this run trains on a stream (an IterableDataset): resume with the same kind of dataset, or "
                            "pass --ignore_data_skip to start the stream over, or --fresh_start")
        position = int(state["samples_consumed"])
        self.start = position
        self.offset = position - global_step * self.global_batch_size
        self.placeholders = global_step * self.gradient_accumulation_steps if skipped_by_trainer else 0
        self.pass_index, self.pass_begin = int(state.get("pass", 0)), int(state.get("pass_begin", 0))
        if self.unsaved is None and "source_state" in state:
            self.source_state = state["source_state"]
            return f"the training stream continues at item {position} from the dataset's saved position (exact)"
        why = self.unsaved or "the checkpoint has no saved position of it (dataloader workers read the stream)"
        return (f"the training stream continues at item {position} by reading and discarding the "
                f"{position - self.pass_begin} items before it in its pass ({why})")

    # -- iteration -------------------------------------------------------------------------------------------------
    def __iter__(self):
        worker = torch.utils.data.get_worker_info()
        worker_id, workers = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        for index in range(self.placeholders):
            if index % workers == worker_id:
                yield from (Placeholder() for _ in range(self.batch_size))
        chunk = self.batch_size * self.world_size  # the items of one micro-batch of every rank
        for number, items in enumerate(self._chunks(chunk, main=worker is None)):
            if (self.placeholders + number) % workers == worker_id:
                yield from items[self.rank::self.world_size]

    def _chunks(self, size: int, main: bool):
        """The stream from `start` in micro-batch chunks of `size` items; at each step boundary the source's position
        is remembered (main process), right after reading the chunk that ends there, so a checkpoint taken after
        that step finds it."""
        position, pass_index, pass_begin = self.start, self.pass_index, self.pass_begin
        load = self.source_state
        discard = 0 if load is not None else self.start - pass_begin  # read and dropped: trained on before
        if load is None:
            position = pass_begin
        chunk = []
        while True:
            if hasattr(self.source, "set_epoch"):
                self.source.set_epoch(pass_index)
            if load is not None:
                self.source.load_state_dict(copy.deepcopy(load))
            from_start, load, count = load is None, None, 0
            for item in self.source:
                count += 1
                position += 1
                if discard:
                    discard -= 1
                    continue
                chunk.append(item)
                if len(chunk) == size:
                    if main and (position - self.offset) % self.global_batch_size == 0:
                        self._remember(position, pass_index, pass_begin)
                    yield chunk
                    chunk = []
            if count == 0 and from_start:
                raise UserError("the training stream yielded no item in a whole pass: give a train_dataset that "
                                "yields examples (an IterableDataset whose __iter__ yields them)")
            pass_index, pass_begin = pass_index + 1, position

    def _remember(self, position: int, pass_index: int, pass_begin: int) -> None:
        state = copy.deepcopy(self.source.state_dict()) if self.unsaved is None else None
        self._snapshots[position] = (pass_index, pass_begin, state)
        while len(self._snapshots) > SNAPSHOTS:
            self._snapshots.popitem(last=False)
