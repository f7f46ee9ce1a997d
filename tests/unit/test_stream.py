"""The training stream over an iterable dataset (trainer_ext/data/stream.py), in one process: rank shares, passes, and
a resume at any step equal to the uninterrupted continuation, from the dataset's own state or by reading past."""

import datasets
import pytest
import torch

from trainer_ext.data.stream import (DATASETS_EXACT_FROM, Placeholder, TrainingStream, _older_than,
                                     collate_with_placeholders, exact_state)
from trainer_ext.errors import UserError

pytestmark = pytest.mark.oldest

ITEMS = 10  # a pass: global batches of 4 (2 ranks x 2) end inside passes


class Passes(torch.utils.data.IterableDataset):
    """0..ITEMS-1 in an order that depends on the pass (set_epoch), with no saved state."""

    def __init__(self):
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(ITEMS, generator=torch.Generator().manual_seed(self.epoch)).tolist()
        yield from (100 * self.epoch + i for i in order)


class StatefulPasses(Passes):
    """The same, able to say where it stands (how many items of the pass it yielded)."""

    def __init__(self):
        super().__init__()
        self.done = self.start = 0

    def state_dict(self):
        return {"epoch": self.epoch, "done": self.done}

    def load_state_dict(self, state):
        self.epoch, self.start = state["epoch"], state["done"]

    def __iter__(self):
        start, self.start = self.start, 0
        for self.done, item in enumerate(super().__iter__(), 1):
            if self.done > start:
                yield item


def datasets_stream(shuffled=False):
    stream = datasets.Dataset.from_list([{"x": i} for i in range(ITEMS)]).to_iterable_dataset(num_shards=2)
    return stream.shuffle(seed=3, buffer_size=4) if shuffled else stream


def take(stream, micro_batches):
    """The first `micro_batches` micro-batches of one rank's share."""
    batches, batch = [], []
    for item in stream:
        batch.append(item["x"] if isinstance(item, dict) else item)
        if len(batch) == stream.batch_size:
            batches.append(batch)
            batch = []
            if len(batches) == micro_batches:
                return batches
    return batches


def ranks(make, steps, accumulation=1, resume=None):
    """Each of 2 ranks' micro-batches for `steps` optimizer steps (from `resume` = (step, state) when given)."""
    shares = []
    for rank in range(2):
        stream = TrainingStream(make(), batch_size=2, rank=rank, world_size=2, gradient_accumulation_steps=accumulation)
        if resume is not None:
            stream.resume(resume[0], resume[1], skipped_by_trainer=False)
        shares.append((stream, take(stream, steps * accumulation)))
    return shares


@pytest.mark.parametrize("make,exact", [(Passes, False), (StatefulPasses, True),
                                        (datasets_stream, not _older_than(DATASETS_EXACT_FROM)),  # measured
                                        (lambda: datasets_stream(shuffled=True), False)],
                         ids=["plain", "stateful", "datasets", "datasets shuffled"])
def test_a_resume_at_any_step_continues_the_uninterrupted_stream(make, exact):
    """Fails when a stream resumed at step k (in any pass, from the dataset's state or by reading past) trains other
    items than the uninterrupted run, or a source that cannot be resumed exactly is treated as one that can."""
    assert (exact_state(make()) is None) == exact
    uninterrupted = ranks(make, 12)
    # The stream in order: rank 0 and rank 1 alternate within each micro-batch chunk.
    every = [x for zero, one in zip(*(share for _, share in uninterrupted)) for pair in zip(zero, one) for x in pair]
    passes = [sorted(x % 100 for x in every[k * ITEMS:(k + 1) * ITEMS]) for k in range(3)]
    assert passes[0] == passes[1] == passes[2] == list(range(ITEMS))  # each pass holds every item once
    for step in (1, 2, 5, 7):  # 4 items a step: steps 5 and 7 stop inside the second and third pass
        # The checkpoint of step k is rank 0's state (taken while it trained step k).
        reader = TrainingStream(make(), batch_size=2, rank=0, world_size=2)
        take(reader, step)
        state = reader.state_dict(step)
        assert state["samples_consumed"] == 4 * step and ("source_state" in state) == exact
        resumed = ranks(make, 12 - step, resume=(step, state))
        for (_, theirs), (_, ours) in zip(uninterrupted, resumed):
            assert ours == theirs[step:]


def test_ranks_take_every_nth_item_of_each_global_batch_with_accumulation():
    """Fails when the stream is cut into global batches differently from the map-style sampler (rank r: items r,
    r+N, ... of each micro-batch chunk), which the equality with one process relies on."""
    (first, zero), (_, one) = ranks(RangeStream, 3, accumulation=2)
    assert zero[:2] == [[0, 2], [4, 6]] and one[:2] == [[1, 3], [5, 7]]
    assert first.state_dict(3)["samples_consumed"] == 24


class RangeStream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from range(1000)


def test_placeholders_stand_for_the_batches_transformers_skips_and_are_never_collated():
    """Fails when the micro-batches transformers skips at a resume read or collate data, or are not as many."""
    reader = TrainingStream(RangeStream(), batch_size=2, rank=0, world_size=2, gradient_accumulation_steps=2)
    take(reader, 6)
    stream = TrainingStream(RangeStream(), batch_size=2, rank=1, world_size=2, gradient_accumulation_steps=2)
    stream.resume(3, reader.state_dict(3), skipped_by_trainer=True)
    items = list(zip(range(8 * 2), iter(stream)))
    assert all(isinstance(item, Placeholder) for _, item in items[:12]) and items[12][1] == 25
    collate = collate_with_placeholders(lambda batch: pytest.fail("collated a placeholder"))
    assert collate([Placeholder(), Placeholder()]) == {}


def test_dataloader_workers_keep_the_order():
    """Fails when dataloader workers each read the stream and hand out duplicates or another order."""
    def batches(workers):
        stream = TrainingStream(Passes(), batch_size=2, rank=1, world_size=2)
        loader = torch.utils.data.DataLoader(stream, batch_size=2, num_workers=workers)
        return [batch.tolist() for _, batch in zip(range(9), loader)]
    assert batches(2) == batches(0)


def test_an_empty_stream_is_one_line_not_a_hang():
    """Fails when a stream that yields nothing loops forever instead of saying so."""
    with pytest.raises(UserError, match="yielded no item in a whole pass"):
        next(iter(TrainingStream([], batch_size=2)))
