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
    started (the asynchronous work's wait returns at once). `others.interval`: the steps between agreements the other
    ranks propose; `others.groups`: the group each all-reduce ran on."""

    class Ranks(list):
        interval, groups = 1, []

    others = Ranks()

    def all_reduce(tensor, op, group=None, async_op=False):
        others.groups.append(group)
        rows = [torch.tensor([float(v), -float(others.interval)][:len(tensor)], dtype=tensor.dtype) for v in others]
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


def test_a_signal_to_this_process_is_recorded_and_the_handlers_put_back(monkeypatch, caplog):
    """SIGTERM while training finishes the step (recorded, no exit); a repeat (a launcher forwarding it) changes
    nothing; uninstall restores the handler the process had; one process stops on its own signal; before the first
    optimizer step nothing is saved: the signal ends the run at once."""
    before = signal.getsignal(signal.SIGTERM)
    assert step_end(started(PreemptionCallback()), 1) == (False, False)  # unsignalled: trains on
    callback = PreemptionCallback()
    callback.install()
    assert signal.getsignal(signal.SIGTERM) == callback._handle  # else the signal below ends the test process
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
        assert caplog.messages[-1] == ("received SIGTERM before the first optimizer step: nothing to save, stopping now "
                                       "(exit status 143)")
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


@pytest.mark.parametrize("every_s,step_s,every", [
    (1.0, 0.25, 4),  # 4 steps a second: agree every 4th step
    (1.0, 2.0, 1),  # a step longer than every_s: agree at each step
    (float("inf"), 0.25, 10 ** 6),  # never asked to agree: every 10**6 steps (a number the ranks can exchange)
    (1.0, 0.0, 10 ** 6)])  # steps too fast to time: the same cap
def test_between_logging_steps_the_ranks_agree_about_every_every_s_seconds(ranks, monkeypatch, every_s, step_s, every):
    """K, the steps between two agreements, is every_s over the step time measured since the last agreement, the
    smallest any rank proposes: a K too small is a collective every step, too large a signal that waits minutes (past
    the scheduler's grace period) for the ranks to learn of it."""
    from trainer_ext.checkpoints import preemption

    clock = [100.0]
    monkeypatch.setattr(preemption.time, "perf_counter", lambda: clock[0])
    ranks.extend([0])
    ranks.interval = 10 ** 9  # the other rank would agree more seldom: this rank's K is the agreed one
    agreement = preemption.StopAgreement(1, every_s, "cpu")
    started_at, last = [], 3 * every + 1 if every < 100 else 3
    for step in range(1, last + 1):
        clock[0] += step_s
        before = len(ranks.groups)
        assert agreement.at_step_end(step, 0, False) == 0
        started_at += [step] * (len(ranks.groups) - before)
    assert started_at == [step for step in (1, 1 + every, 1 + 2 * every, 1 + 3 * every) if step <= last]
    if agreement.pending is not None:
        agreement._finish()
    assert agreement.next_step == started_at[-1] + every


def test_the_agreement_runs_on_a_gloo_group_of_its_own(ranks, monkeypatch):
    """On the default group under NCCL the agreement's CPU tensors would fail (or, on the device, queue behind the
    gradients' collectives and sync the device to be read): every all-reduce runs on the gloo group built at train
    begin, which is released at train end."""
    group, released = object(), []
    monkeypatch.setattr(torch.distributed, "is_gloo_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "new_group", lambda backend=None: group if backend == "gloo" else None)
    monkeypatch.setattr(torch.distributed, "destroy_process_group", released.append)
    ranks.extend([0])
    callback = started(PreemptionCallback())
    for step in (1, 2, 3):
        step_end(callback, step, waits=step == 2)
    callback.on_train_end(ARGS, SimpleNamespace(global_step=3), None)  # the agreement started at step 3 completes
    assert len(ranks.groups) == 3 and all(used is group for used in ranks.groups) and released == [group]


def test_the_first_agreement_times_the_steps_from_train_begin(ranks, monkeypatch):
    """The first K comes from the steps since on_train_begin: timed from the first step's end instead, it reads a step
    time of 0 and waits 10**6 steps before the ranks agree again."""
    from trainer_ext.checkpoints import preemption

    clock = [100.0]
    monkeypatch.setattr(preemption.time, "perf_counter", lambda: clock[0])
    ranks.extend([0])
    ranks.interval = 10 ** 9
    callback = started(PreemptionCallback())
    for step in (1, 2):
        clock[0] += 0.25
        step_end(callback, step)
    assert callback._agreement.next_step == 5  # 4 steps a second, agreed at step 1's end


def test_a_loop_that_skipped_on_train_begin_still_agrees(ranks):
    """A later train() (after one that ended, or one that failed) whose loop never called on_train_begin: the
    agreement is built at its first step end, on every rank at the same step, and a signal on another rank stops it."""
    ranks.extend([signal.SIGTERM])
    ended = started(PreemptionCallback())
    ended.on_train_end(ARGS, SimpleNamespace(global_step=0), None)
    failed = PreemptionCallback()
    failed.install()
    failed.uninstall()
    for callback in (ended, failed, PreemptionCallback()):
        assert step_end(callback, 4, waits=True) == (True, True) and callback.signum == signal.SIGTERM


@pytest.mark.parametrize("waits", ["should_log", "should_evaluate", "should_save", "should_training_stop"])
def test_a_step_that_logs_evaluates_saves_or_ends_agrees_at_once(ranks, waits):
    """Those steps wait for every rank already, so the ranks agree there at once: not at the last step, a signal on
    another rank would end the run without the preemption checkpoint; not at a saving step, it would save twice."""
    ranks.extend([signal.SIGTERM])
    callback = started(PreemptionCallback())
    control = SimpleNamespace(should_save=False, should_training_stop=False, should_log=False, should_evaluate=False)
    setattr(control, waits, True)
    callback.on_step_end(ARGS, SimpleNamespace(global_step=1), control)
    assert control.should_save and control.should_training_stop and callback.signum == signal.SIGTERM


def test_one_process_decides_alone_without_a_collective():
    """Without a process group there is nobody to agree with: an all-reduce there would fail (no default group)."""
    assert max_over_ranks(3, "cpu") == 3
