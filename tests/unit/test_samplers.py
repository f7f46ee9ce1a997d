"""The training order: shuffle -> repeat -> shard -> batch, and its state across restarts (same or other world
size, same or other global batch)."""

import pytest

from trainer_ext.data.samplers import ResumableBatchSampler


def steps(num_samples, batch_size, world_size=1, accumulation=1, seed=3, epochs=1, state=None, first_step=0):
    """The sets of samples of each optimizer step, all ranks together, from `first_step` (as the Trainer iterates)."""
    samplers = [ResumableBatchSampler(num_samples, batch_size, rank=r, world_size=world_size, seed=seed,
                                      gradient_accumulation_steps=accumulation) for r in range(world_size)]
    for sampler in samplers:
        if state is not None:
            sampler.load_state_dict(state)
    per_epoch = samplers[0].steps_per_epoch
    result = []
    for step in range(first_step, epochs * per_epoch):
        epoch, index = divmod(step, per_epoch)
        for sampler in samplers:
            sampler.set_epoch(epoch)
        batches = [[sampler.micro_batch(epoch, index * accumulation + m) for m in range(accumulation)]
                   for sampler in samplers]
        result.append(sorted(i for rank in batches for micro in rank for i in micro))
    return result, samplers[0]


@pytest.mark.parametrize("batch_size,world_size,accumulation", [(8, 2, 1), (4, 2, 2), (2, 4, 2), (16, 1, 1),
                                                                 (8, 1, 2)])
def test_every_split_of_a_global_batch_trains_the_same_samples(batch_size, world_size, accumulation):
    """Global batch k holds the same samples whatever the per-device batch, accumulation and world size."""
    reference, _ = steps(37, 16, epochs=3)
    split, _ = steps(37, batch_size, world_size, accumulation, epochs=3)
    assert split == reference


def test_each_pass_over_the_data_is_a_permutation_and_the_stream_needs_no_padding():
    """Every sample once per pass; the last global batch of an epoch continues into the next pass."""
    sampler = ResumableBatchSampler(37, 4, world_size=2, seed=5)
    stream = [sampler.sample_at(p) for p in range(3 * 37)]
    for data_pass in range(3):
        assert sorted(stream[37 * data_pass:37 * (data_pass + 1)]) == list(range(37))
    assert stream[:37] != stream[37:74]  # a new shuffle per pass
    assert sampler.steps_per_epoch == 5 and len(sampler) == 5  # ceil(37 / 8)
    ranks = [ResumableBatchSampler(37, 4, rank=r, world_size=2, seed=5) for r in range(2)]
    flat = [i for k in range(5) for rank in ranks for i in rank.micro_batch(0, k)]
    assert sorted(flat) == sorted(stream[:40])  # 37 samples + 3 from the next pass: nothing padded, none dropped


def test_drop_last_makes_an_epoch_the_whole_global_batches():
    """With --dataloader_drop_last an epoch must be whole global batches only (37 samples, batch 8: 4 steps)."""
    sampler = ResumableBatchSampler(37, 4, world_size=2, drop_last=True)
    assert sampler.steps_per_epoch == 4 and len(sampler) == 4


def test_resuming_continues_the_uninterrupted_order_exactly():
    """Restart at step 7 (in the second epoch): the following batches are those of the uninterrupted run."""
    uninterrupted, sampler = steps(37, 4, world_size=2, accumulation=2, epochs=4)
    saved = sampler.state_dict(7)
    assert saved["samples_consumed"] == 7 * 16
    resumed, _ = steps(37, 4, world_size=2, accumulation=2, epochs=4, state=saved, first_step=7)
    assert resumed == uninterrupted[7:]


@pytest.mark.parametrize("batch_size,world_size", [(16, 1), (4, 4)])
def test_resuming_on_another_world_size_with_the_same_global_batch(batch_size, world_size):
    """Resuming on 1 or 4 ranks with the same global batch must continue the exact order of the 2-rank run."""
    uninterrupted, sampler = steps(37, 8, world_size=2, epochs=4)
    resumed, _ = steps(37, batch_size, world_size, epochs=4, state=sampler.state_dict(6), first_step=6)
    assert resumed == uninterrupted[6:]


@pytest.mark.parametrize("new_batch,new_world", [(16, 2), (2, 2), (12, 1)])
def test_a_changed_global_batch_repeats_and_drops_no_sample(new_batch, new_world):
    """Old steps then new steps cover the stream's positions 0..M exactly once, in the same order of batches."""
    old_steps, old = steps(37, 8, world_size=2, epochs=3)
    saved = old.state_dict(5)  # 80 samples consumed
    new = ResumableBatchSampler(37, new_batch, world_size=new_world, seed=3)
    warnings = new.load_state_dict(saved)
    assert warnings == [
        f"the global batch changed from 16 to {new_batch * new_world} (per-device batch x accumulation x world size): "
        "training continues at sample 80 of the same order, none repeated or dropped; from here on steps, epochs and "
        "the learning-rate schedule count batches of the new size (--global_batch_size 16 keeps the old one on any "
        "number of ranks)"]
    new_steps, _ = steps(37, new_batch, new_world, epochs=12, state=saved, first_step=5)
    trained = [i for step in old_steps[:5] for i in step] + [i for step in new_steps[:6] for i in step]
    reference = ResumableBatchSampler(37, 1, seed=3)
    assert sorted(trained) == sorted(reference.sample_at(p) for p in range(len(trained)))
    position = 80
    for step in new_steps[:6]:  # each new global batch is the next slice of the stream
        assert step == sorted(reference.sample_at(p) for p in range(position, position + len(step)))
        position += len(step)


def test_a_changed_dataset_or_seed_is_refused_with_the_way_out():
    """Resuming on other data or another seed would skip the wrong samples; refuse, naming --ignore_data_skip."""
    saved = ResumableBatchSampler(37, 8, seed=3).state_dict(2)
    with pytest.raises(ValueError) as refused:
        ResumableBatchSampler(40, 8, seed=4).load_state_dict(saved)
    assert str(refused.value) == (
        "cannot continue the training order of the checkpoint: num_samples changed from 37 to 40; seed changed from 3 "
        "to 4. Resume with the same dataset and --seed/--data_seed, or pass --ignore_data_skip to restart the order "
        "(samples may repeat), or --fresh_start")
    with pytest.raises(ValueError, match=r": seed changed from 3 to 4\. Resume"):
        ResumableBatchSampler(37, 8, seed=4).load_state_dict(saved)


def test_the_saved_position_is_the_checkpoints_data_state():
    """data_state.json's fields (a resume by a later release reads them); a state from before the global batch was
    recorded continues without a warning."""
    sampler = ResumableBatchSampler(37, 4, rank=1, world_size=2, seed=3, gradient_accumulation_steps=2)
    assert sampler.state_dict(5) == {"global_step": 5, "samples_consumed": 80, "global_batch_size": 16,
                                     "num_samples": 37, "seed": 3, "world_size": 2}
    assert sampler.load_state_dict({"global_step": 5, "samples_consumed": 80, "num_samples": 37, "seed": 3}) == []
    assert sampler.step_position(5) == 80


def test_iteration_yields_the_epoch_set_by_set_epoch():
    """The Trainer calls set_epoch; ignoring it would repeat the first epoch's order in every epoch."""
    sampler = ResumableBatchSampler(20, 4, seed=1)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first
    sampler.set_epoch(0)
    assert list(sampler) == first == [sampler.micro_batch(0, k) for k in range(5)]


def test_each_pass_is_the_permutation_its_seed_and_pass_number_give():
    """The order is part of a checkpoint's meaning: a resume (even by a later release) must compute the same
    permutation, torch.randperm seeded with seed + pass, for every pass."""
    import torch

    sampler = ResumableBatchSampler(37, 4, seed=5)
    for data_pass in (0, 1, 2, 0):
        expected = torch.randperm(37, generator=torch.Generator().manual_seed(5 + data_pass)).tolist()
        assert sampler.data_order(data_pass) == expected
    assert sampler.global_batch_size == 4 and ResumableBatchSampler(37, 4, world_size=2,
                                                                    gradient_accumulation_steps=3).global_batch_size == 24
    assert ResumableBatchSampler(37, 4).data_order(0) == torch.randperm(  # the seed a user's own sampler gets
        37, generator=torch.Generator().manual_seed(0)).tolist()


def test_reading_the_stream_keeps_the_permutations_of_this_pass_and_the_one_before():
    """Every sample read looks its pass's permutation up: none kept would draw a randperm per sample (quadratic), all
    kept would hold one per pass of a long run; an epoch spans two passes and is read again when iterated again."""
    sampler = ResumableBatchSampler(5, 2, seed=1)
    assert [sampler.sample_at(position) for position in range(40)][35:] == sampler.data_order(7)
    assert sorted(sampler._orders) == [6, 7]


def test_an_empty_training_set_and_a_rank_outside_the_world_are_refused():
    """An empty training set would train on nothing: one line naming the fix; a rank outside the world size would
    read another rank's samples. One sample is a training set."""
    from trainer_ext.errors import UserError

    with pytest.raises(UserError) as empty:
        ResumableBatchSampler(0, 2)
    assert str(empty.value) == "the training set is empty: give a train_dataset with at least one sample"
    assert list(ResumableBatchSampler(1, 1)) == [[0]]
    for rank in (2, -1):
        with pytest.raises(ValueError) as outside:
            ResumableBatchSampler(8, 2, rank=rank, world_size=2)
        assert str(outside.value) == f"rank {rank} is outside world size 2"


def test_a_global_batch_larger_than_the_data_is_refused_with_a_batch_that_fits(monkeypatch, capsys):
    """Each optimizer step would repeat every sample (and call it an epoch): refused before training with a batch
    that fits, unless --repeat_small_dataset, which is said once, on the main process."""
    from types import SimpleNamespace

    from trainer_ext.data import samplers
    from trainer_ext.errors import UserError

    monkeypatch.setattr(samplers, "_SAID", set())
    args = SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=3, process_index=0)  # stock
    what = ("a global batch of 24 samples (--per_device_train_batch_size 4 x --gradient_accumulation_steps 3 x 2 "
            "rank(s)) is larger than the 20 training sample(s): each optimizer step would see every sample about 1.2 "
            "times")
    assert samplers.global_batch_problem(args, 20, 2, False) == (
        f"{what}: lower the batch (e.g. --gradient_accumulation_steps 2), add data, or pass --repeat_small_dataset to "
        "train on it repeated")
    with pytest.raises(UserError, match=r"^a global batch of 24 samples .* --repeat_small_dataset to train on it"):
        samplers.check_global_batch(args, 20, 2, False)
    assert samplers.global_batch_problem(args, 24, 2, False) is None
    assert samplers.global_batch_problem(args, 0, 2, False) is None
    samplers.check_global_batch(args, 24, 2, False)
    one = SimpleNamespace(per_device_train_batch_size=2, gradient_accumulation_steps=1, process_index=0)
    assert samplers.global_batch_problem(one, 1, 1, False).endswith(
        "(e.g. --per_device_train_batch_size 1 and --gradient_accumulation_steps 1), add data, or pass "
        "--repeat_small_dataset to train on it repeated")
    fits_once = SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=4, process_index=0)
    assert "(e.g. --gradient_accumulation_steps 1)" in samplers.global_batch_problem(fits_once, 10, 2, False)
    wide = SimpleNamespace(per_device_train_batch_size=8, gradient_accumulation_steps=1, process_index=0)
    assert "(e.g. --per_device_train_batch_size 5 and --gradient_accumulation_steps 1)" in \
        samplers.global_batch_problem(wide, 20, 4, False)
    assert samplers.global_batch_problem(args, 20, 2, True) is None and samplers.global_batch_problem(args, 20, 2, True) \
        is None
    assert capsys.readouterr().out == f"trainer_ext: {what} (--repeat_small_dataset)\n"
    monkeypatch.setattr(samplers, "_SAID", set())
    assert samplers.global_batch_problem(SimpleNamespace(**vars(args) | {"process_index": 1}), 20, 2, True) is None
    assert capsys.readouterr().out == ""


def test_the_repeated_small_dataset_notice_is_flushed_when_said(monkeypatch):
    """Printed before training, in a launched rank's block-buffered stdout: unflushed, it would show up after the run's
    own lines (or never, if the run is killed)."""
    import io
    import sys
    from types import SimpleNamespace

    from trainer_ext.data import samplers

    class Stdout(io.StringIO):
        def flush(self):
            flushed.append(self.getvalue())

    flushed = []
    monkeypatch.setattr(samplers, "_SAID", set())
    monkeypatch.setattr(sys, "stdout", Stdout())
    args = SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=1, process_index=0)
    assert samplers.global_batch_problem(args, 3, 1, repeat=True) is None
    assert len(flushed) == 1 and flushed[0].startswith("trainer_ext: a global batch of 4 samples")
