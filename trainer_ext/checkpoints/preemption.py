"""Preemption: on SIGTERM (spot reclaim, Kubernetes, SageMaker) or SIGINT, finish the current optimizer step,
save a checkpoint on every rank's behalf, stop, and exit with 128 + the signal number; before the first optimizer step
there is nothing to save, and the run ends at once. The ranks agree on the step to stop after without making any step
wait for them (StopAgreement)."""

from __future__ import annotations

import logging
import signal
import threading
import time

import torch
from transformers import TrainerCallback

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)
ABORT_AFTER_S = 2.0  # a launcher forwards Ctrl-C within this time; a second Ctrl-C from a person comes later
AGREE_EVERY_S = 1.0  # the ranks agree at least this often (in training time) at steps that neither log nor save


class Preempted(SystemExit):
    """Raised by ExtTrainer.train after the preemption checkpoint is written (`checkpoint`), or at once when the signal
    came before the first optimizer step (`checkpoint` None: nothing had trained); exit status 128 + signal."""

    def __init__(self, signum: int, checkpoint):
        self.signum, self.checkpoint = signum, checkpoint
        super().__init__(128 + signum)


class PreemptionCallback(TrainerCallback):
    """Records a signal; every rank learns at the same optimizer step whether any rank got one (StopAgreement), so
    whichever rank the signal reached, every rank saves the same step and stops. A signal before this train() call's
    first optimizer step ends the process at once: nothing trained, nothing to save (a DeepSpeed op build or a long
    first step would otherwise outlast the scheduler's grace period)."""

    def __init__(self, agree_every_s: float = AGREE_EVERY_S):
        self.agree_every_s = agree_every_s
        self.received = 0
        self.signum = 0
        self.stepped = True  # whether this train() call finished an optimizer step (outside train(): nothing to stop)
        self._first_at = 0.0
        self._previous = {}
        self._agreement = None

    def install(self) -> None:
        self.received = self.signum = 0  # a new train() call starts unsignalled
        self.stepped = False
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        self.stepped = True
        self._agreement = None  # a train() that failed: its collective in flight ends on its own (every rank began it)

    def _handle(self, signum, frame) -> None:
        if self.received:
            # Repeated SIGTERMs are the same preemption (a signalled process group plus a launcher forwarding
            # it); a second Ctrl-C, a person who means it, aborts at once.
            if signum == signal.SIGINT and time.monotonic() - self._first_at > ABORT_AFTER_S:
                self.uninstall()
                signal.raise_signal(signum)
            return
        self.received = signum
        self._first_at = time.monotonic()
        name = signal.Signals(signum).name
        if not self.stepped:
            logger.warning("received %s before the first optimizer step: nothing to save, stopping now (exit status "
                           "%d)", name, 128 + signum)
            raise Preempted(signum, None)
        logger.warning("received %s: finishing this step, then saving a checkpoint", name)

    def on_train_begin(self, args, state, control, **kwargs):
        self._agreement = StopAgreement(state.global_step + 1, self.agree_every_s, args.device)

    def on_step_end(self, args, state, control, **kwargs):
        self.stepped = True
        if self._agreement is None:  # a loop that skipped on_train_begin: every rank builds it at this step
            self._agreement = StopAgreement(state.global_step, self.agree_every_s, args.device)
        # A step that logs, evaluates or saves already waits for the ranks: agree there at once.
        waits = control.should_log or control.should_evaluate or control.should_save or control.should_training_stop
        signum = self._agreement.at_step_end(state.global_step, self.received, waits)
        if signum > 0:
            self.signum = int(signum)
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self._agreement is not None:
            self._agreement.close()
            self._agreement = None


class StopAgreement:
    """Which signal (0: none) every rank stops on, decided at the same optimizer step on every rank without a device
    sync or a collective on most steps. At a step that already waits (it logs, evaluates, saves or is the last) the
    ranks agree at once. Elsewhere an asynchronous all-reduce is started every K steps and read at the next step's
    end (one step later: a whole step to arrive, so reading it does not wait), K chosen from the step time so that
    they agree about every `every_s` seconds: a slow step agrees at each step, a 10 ms one every 100. The all-reduce
    (the largest signal number; minus the smallest proposed K) runs on a gloo group of CPU tensors of its own: no
    device stream, copy or sync is involved under NCCL, DeepSpeed or FSDP2, and nothing queues behind the gradients'
    collectives. One process needs no agreement: its own signal stops it at the step it came in."""

    def __init__(self, first_step: int, every_s: float, device):
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.ranks = torch.distributed.get_world_size() if distributed else 1
        self.every_s = every_s
        self.next_step = first_step  # the step whose end starts the next asynchronous agreement
        self.group, self.device = None, torch.device("cpu")
        self.pending = None  # (work, buffer, step started at)
        self._since = (first_step - 1, time.perf_counter())  # the step time since the last agreement is measured
        if self.ranks > 1:
            if torch.distributed.is_gloo_available():  # every rank builds it at train begin: a collective, once
                self.group = torch.distributed.new_group(backend="gloo")
            else:  # the default group on the training device: its read at the next step syncs, every K steps
                self.device = device

    def at_step_end(self, step: int, received: int, waits: bool) -> int:
        """At the end of optimizer step `step` (every rank calls it at every step): the signal to stop on now."""
        if self.ranks == 1:
            return received
        agreed = self._finish() if self.pending is not None else 0
        if agreed:
            return agreed
        if waits:
            self._start(step, received)
            return self._finish()
        if step >= self.next_step:
            self._start(step, received)
        return 0

    def _start(self, step: int, received: int) -> None:
        last_step, last_time = self._since
        now = time.perf_counter()
        per_step = (now - last_time) / max(step - last_step, 1)
        interval = int(min(10 ** 6, max(1.0, self.every_s / max(per_step, 1e-6))))  # every_s may be inf
        self._since = (step, now)
        buffer = torch.tensor([float(received), -float(interval)], dtype=torch.float64, device=self.device)
        work = torch.distributed.all_reduce(buffer, op=torch.distributed.ReduceOp.MAX, group=self.group,
                                            async_op=True)
        self.pending = (work, buffer, step)

    def _finish(self) -> int:
        work, buffer, started = self.pending
        self.pending = None
        work.wait()
        signum, minus_interval = buffer.tolist()  # a CPU tensor: no device sync (and no dispatched scalar read)
        self.next_step = started + int(-minus_interval)
        return int(signum)

    def close(self) -> None:
        """Training ended: the agreement in flight completed (every rank started it), the group released."""
        if self.pending is not None:
            self.pending[0].wait()
            self.pending = None
        if self.group is not None:
            torch.distributed.destroy_process_group(self.group)
            self.group = None


def max_over_ranks(value: float, device) -> float:
    """The largest of every rank's `value` (a decision one rank took that all must follow); `value` alone in one
    process. Blocking: for decisions taken where the ranks wait anyway (an evaluation)."""
    flag = torch.tensor([float(value)], device=device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return flag.item()
