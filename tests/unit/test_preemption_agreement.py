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
    """This process as one rank of a group whose other ranks hold the signals the test puts in `others` (each
    proposing to agree again after 1 step): torch.distributed's all-reduce applied to their values, completed when
    started (the asynchronous work's wait returns at once)."""
    others = []

    def all_reduce(tensor, op, group=None, async_op=False):
        rows = [torch.tensor([float(v), -1.0][:len(tensor)], dtype=tensor.dtype) for v in others]
        values = torch.stack([tensor, *rows])
        reduced = {torch.distributed.ReduceOp.MAX: values.max(0).values, torch.distributed.ReduceOp.SUM: values.sum(0),
                   torch.distributed.ReduceOp.MIN: values.min(0).values}[op]
        tensor.copy_(reduced)
        return SimpleNamespace(wait=lambda: None) if async_op else None

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1 + len(others))
    monkeypatch.setattr(torch.distributed, "is_gloo_available", lambda: False)  # the default group: no group built
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    return others


ARGS = SimpleNamespace(device="cpu")


def step_end(callback, step=1, waits=False):
    """on_step_end of optimizer step `step`; `waits`: a step that logs (the ranks agree at once there)."""
    control = SimpleNamespace(should_save=False, should_training_stop=False, should_log=waits, should_evaluate=False)
    callback.on_step_end(ARGS, SimpleNamespace(global_step=step), control)
    return control.should_save, control.should_training_stop


def started(callback):
    """A callback of a train() call that has begun and taken its first optimizer step."""
    callback.on_train_begin(ARGS, SimpleNamespace(global_step=0), None)
    return callback


@pytest.mark.parametrize("here,others,stop", [
    (0, [0, 0], 0),  # nobody signalled: train on
    (0, [signal.SIGTERM, 0], signal.SIGTERM),  # another rank got it: this one stops too
    (signal.SIGINT, [0, 0], signal.SIGINT),  # this rank got it: the others learn it from the same reduction
    (signal.SIGINT, [signal.SIGTERM, signal.SIGTERM], signal.SIGTERM)])
def test_every_rank_stops_at_the_step_any_rank_was_signalled(ranks, here, others, stop):
    """A rank that stopped on its own signal alone would save a checkpoint the others never reach (and hang them in
    their next collective); the decision is the largest signal over every rank, at a step that logs at once, and
    between logging steps at the end of the step after the agreement started (read one step later: never waited on)."""
    ranks.extend(others)
    at_once = started(PreemptionCallback())
    at_once.received = here
    assert step_end(at_once, 1, waits=True) == (bool(stop), bool(stop)) and at_once.signum == stop
    later = started(PreemptionCallback())
    later.received = here
    assert step_end(later, 1) == (False, False)  # the agreement of step 1 started, not read
    assert step_end(later, 2) == (bool(stop), bool(stop)) and later.signum == stop
    assert max_over_ranks(here, "cpu") == max(here, *others)


def test_a_signal_to_this_process_is_recorded_and_the_handlers_put_back(monkeypatch):
    """SIGTERM while training finishes the step (recorded, no exit); a repeat (a launcher forwarding it) changes
    nothing; uninstall restores the handler the process had; one process stops on its own signal; before the first
    optimizer step nothing is saved: the signal ends the run at once."""
    before = signal.getsignal(signal.SIGTERM)
    callback = PreemptionCallback()
    callback.install()
    try:
        step_end(started(callback), 1)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert callback.received == signal.SIGTERM
        assert step_end(callback, 2) == (True, True) and callback.signum == signal.SIGTERM
    finally:
        callback.uninstall()
    assert signal.getsignal(signal.SIGTERM) is before
    callback.install()  # a new train() starts unsignalled
    try:
        assert callback.received == 0
        with pytest.raises(Preempted) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
        assert stopped.value.checkpoint is None and stopped.value.code == 143
    finally:
        callback.uninstall()
    assert signal.getsignal(signal.SIGTERM) is before
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
    callback.stepped = True  # past the first optimizer step
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
