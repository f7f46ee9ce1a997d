"""The preemption agreement in process (checkpoints/preemption.py): a signal is recorded, and the stop is decided from
every rank's signal (simulated ranks: torch.distributed's all-reduce applied to the values the other ranks hold), so
whichever rank a signal reached, all save the same step and stop. tests/integration/test_preemption.py signals a real
rank of a launched run."""

import os
import signal
from types import SimpleNamespace

import pytest
import torch

from trainer_ext.checkpoints.preemption import Preempted, PreemptionCallback, max_over_ranks


@pytest.fixture
def ranks(monkeypatch):
    """This process as one rank of a group whose other ranks hold the values the test puts in `others`."""
    others = []

    def all_reduce(tensor, op):
        values = torch.stack([tensor, *[torch.tensor([float(v)]) for v in others]])
        reduced = {torch.distributed.ReduceOp.MAX: values.max(0).values, torch.distributed.ReduceOp.SUM: values.sum(0),
                   torch.distributed.ReduceOp.MIN: values.min(0).values}[op]
        tensor.copy_(reduced)

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    return others


def step_end(callback):
    control = SimpleNamespace(should_save=False, should_training_stop=False)
    callback.on_step_end(SimpleNamespace(device="cpu"), None, control)
    return control.should_save, control.should_training_stop


@pytest.mark.parametrize("here,others,stop", [
    (0, [0, 0], 0),  # nobody signalled: train on
    (0, [signal.SIGTERM, 0], signal.SIGTERM),  # another rank got it: this one stops too
    (signal.SIGINT, [0, 0], signal.SIGINT),  # this rank got it: the others learn it from the same reduction
    (signal.SIGINT, [signal.SIGTERM, signal.SIGTERM], signal.SIGTERM)])
def test_every_rank_stops_at_the_step_any_rank_was_signalled(ranks, here, others, stop):
    """A rank that stopped on its own signal alone would save a checkpoint the others never reach (and hang them in
    their next collective); the decision is the largest signal over every rank."""
    ranks.extend(others)
    callback = PreemptionCallback()
    callback.received = here
    assert step_end(callback) == (bool(stop), bool(stop))
    assert callback.signum == stop
    assert max_over_ranks(here, "cpu") == max(here, *others)


def test_a_signal_to_this_process_is_recorded_and_the_handlers_put_back(monkeypatch):
    """SIGTERM while training finishes the step (recorded, no exit); a repeat (a launcher forwarding it) changes
    nothing; uninstall restores the handler the process had; one process stops on its own signal."""
    before = signal.getsignal(signal.SIGTERM)
    callback = PreemptionCallback()
    callback.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert callback.received == signal.SIGTERM
        assert step_end(callback) == (True, True) and callback.signum == signal.SIGTERM
    finally:
        callback.uninstall()
    assert signal.getsignal(signal.SIGTERM) is before
    callback.install()  # a new train() starts unsignalled
    callback.uninstall()
    assert callback.received == 0 and step_end(callback) == (False, False)
    assert Preempted(signal.SIGTERM, None).code == 143


def test_a_second_ctrl_c_from_a_person_aborts_and_a_forwarded_one_does_not(monkeypatch):
    """Ctrl-C reaches the ranks twice within ABORT_AFTER_S (the terminal's process group and the launcher forwarding
    it): still one preemption. A second SIGINT later is a person who means it: the handlers go and the signal is
    raised again at once; a later SIGTERM is not."""
    from trainer_ext.checkpoints import preemption

    raised, clock = [], [100.0]
    monkeypatch.setattr(preemption.signal, "raise_signal", raised.append)
    monkeypatch.setattr(preemption.time, "monotonic", lambda: clock[0])
    callback = PreemptionCallback()
    callback.install()
    try:
        callback._handle(signal.SIGINT, None)
        clock[0] += preemption.ABORT_AFTER_S  # still within: the launcher's copy
        callback._handle(signal.SIGINT, None)
        clock[0] += 1
        callback._handle(signal.SIGTERM, None)
        assert raised == [] and callback.received == signal.SIGINT
        assert signal.getsignal(signal.SIGINT) == callback._handle
        callback._handle(signal.SIGINT, None)
        assert raised == [signal.SIGINT] and signal.getsignal(signal.SIGINT) != callback._handle
    finally:
        callback.uninstall()
