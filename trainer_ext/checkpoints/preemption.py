"""Preemption: on SIGTERM (spot reclaim, Kubernetes, SageMaker) or SIGINT, finish the current optimizer step,
save a checkpoint on every rank's behalf, stop, and exit with 128 + the signal number; before the first optimizer step
there is nothing to save, and the run ends at once."""

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


class Preempted(SystemExit):
    """Raised by ExtTrainer.train after the preemption checkpoint is written (`checkpoint`), or at once when the signal
    came before the first optimizer step (`checkpoint` None: nothing had trained); exit status 128 + signal."""

    def __init__(self, signum: int, checkpoint):
        self.signum, self.checkpoint = signum, checkpoint
        super().__init__(128 + signum)


class PreemptionCallback(TrainerCallback):
    """Records a signal; at the end of each optimizer step all ranks agree (max over ranks) whether any rank got
    one, so whichever rank the signal reached, every rank saves the same step and stops. A signal before this train()
    call's first optimizer step ends the process at once: nothing trained, nothing to save (a DeepSpeed op build or a
    long first step would otherwise outlast the scheduler's grace period)."""

    def __init__(self):
        self.received = 0
        self.signum = 0
        self.stepped = True  # whether this train() call finished an optimizer step (outside train(): nothing to stop)
        self._first_at = 0.0
        self._previous = {}

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

    def on_step_end(self, args, state, control, **kwargs):
        self.stepped = True
        signum = max_over_ranks(self.received, args.device)
        if signum > 0:
            self.signum = int(signum)
            control.should_save = True
            control.should_training_stop = True
        return control


def max_over_ranks(value: float, device) -> float:
    """The largest of every rank's `value` (a decision one rank took that all must follow); `value` alone in one
    process."""
    flag = torch.tensor([float(value)], device=device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return flag.item()
