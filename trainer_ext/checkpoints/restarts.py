"""Restarts, as the user sees them: where a stopped attempt had got to, and what the next one continued from. A rank
whose train() fails (a peer lost: its node killed or unreachable) or that stops on a signal notes the step it reached
in the checkpoint folder (STOPPED); the next start (an elastic restart on another number of ranks, a requeued job)
says in one line which checkpoint it continues from, why that checkpoint was written (the periodic interval or a
signal), how many steps are redone, the world size and global batch it trains with, and what the restart cost,
measured, with the --save_steps that would keep the work redone near that cost. Also read before training: the
training-order record of the checkpoint a start will resume, which keeps the run's global batch (config/batch.py)."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
import uuid
from pathlib import Path

from transformers import TrainerCallback

from ..backends.spec import run_settings
from ..config.own_flags import CheckpointFlags, flags_of
from .format import (AUTO, FRESH, MARKER, NEWEST, checkpoint_folder, newest_valid_checkpoint, read_data_state,
                     resume_request)

logger = logging.getLogger(__name__)

STOPPED = ".trainer_ext.stopped.json"  # the step a stopped attempt reached; removed when a train() call completes
SAVE_SHARE = 0.1  # the suggested interval keeps saving under this share of the training time


def checkpoint_to_resume(args) -> Path | None:
    """The checkpoint a start with these arguments resumes, as train() picks it without a remote copy (its
    --resume_from_checkpoint, else the newest complete one in the checkpoint folder unless --fresh_start); None for a
    fresh start."""
    requested = args.resume_from_checkpoint
    kind = resume_request(requested)
    if kind == FRESH or (kind == AUTO and flags_of(CheckpointFlags, args).fresh_start):
        return None
    if kind in (AUTO, NEWEST):
        folder = checkpoint_folder(args)  # None until transformers gives output_dir its default (trainer_output)
        return newest_valid_checkpoint(folder) if folder else None
    return Path(requested) if Path(requested).is_dir() else None


def resumed_order_state(args) -> tuple[str, dict] | None:
    """(name, data_state.json) of the checkpoint this start will resume, read when the arguments are built: the global
    batch it trained must be settled before accelerate and DeepSpeed read the accumulation. None without one."""
    checkpoint = checkpoint_to_resume(args)
    try:
        state = read_data_state(checkpoint) if checkpoint is not None else None
    except (OSError, ValueError):
        return None
    return (checkpoint.name, state) if isinstance(state, dict) else None


def saved_for(trainer) -> str:
    """Why a checkpoint is being written, for its marker: the signal that stops the run, or the interval."""
    signum = getattr(getattr(trainer, "preemption", None), "signum", 0)
    if signum:
        return signal.Signals(signum).name
    args = trainer.args
    strategy = getattr(args.save_strategy, "value", args.save_strategy)
    return f"--save_steps {args.save_steps:g}" if strategy == "steps" else f"--save_strategy {strategy}"


class RestartReport(TrainerCallback):
    """Measures what a restart costs (a step, a save) while training; says at the start of a resumed train() what
    it continues from (on the main process), and forgets the stopped attempt once a train() call completes."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.begun = None  # (step, time) when this train() call's first step began
        self.step_ended = None  # time the last optimizer step ended (a save follows it at once)
        self.save_seconds = None  # the last checkpoint's save, measured

    def on_train_begin(self, args, state, control, **kwargs):
        self.begun, self.step_ended, self.save_seconds = (state.global_step, time.time()), None, None
        resumed = self.trainer._resume
        if resumed is not None and self.trainer.is_world_process_zero():
            line, suggestion = continuation(Path(resumed["checkpoint"]), args, time.time())
            print(f"trainer_ext: {line}", flush=True)
            if suggestion:
                print(f"trainer_ext: {suggestion}", flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        self.step_ended = time.time()

    def on_save(self, args, state, control, **kwargs):
        if self.step_ended is not None:
            self.save_seconds = time.time() - self.step_ended

    def on_train_end(self, args, state, control, **kwargs):
        if args.should_save:
            (stopped_path(args)).unlink(missing_ok=True)

    def step_seconds(self, step: int) -> float | None:
        """The mean time of this call's steps up to the end of step `step` (its saves included: what the run pays per
        step; not the wait of a step that then failed)."""
        if self.begun is None or self.step_ended is None or step <= self.begun[0]:
            return None
        return (self.step_ended - self.begun[1]) / (step - self.begun[0])


def stopped_path(args) -> Path:
    return Path(checkpoint_folder(args)) / STOPPED


def note_stop(trainer, why: str) -> None:
    """Where this attempt stopped, for the next start to say: by every rank that gets here when train() failed (the
    main process may be the one lost), by the main process after a signal's checkpoint. Never raises: the error that
    stopped the run is the one to report."""
    report = next((c for c in trainer.callback_handler.callbacks if isinstance(c, RestartReport)), None)
    step = trainer.state.global_step
    record = {"step": step, "stopped_at": time.time(), "why": why, "world_size": trainer.args.world_size,
              "step_seconds": report.step_seconds(step) if report else None,
              "save_seconds": report.save_seconds if report else None}
    path = stopped_path(trainer.args)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_name(f"{path.name}.{uuid.uuid4().hex}")
        staged.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(staged, path)  # ranks writing at once: one whole record wins
    except OSError as error:
        logger.warning("could not note where this run stopped in %s: %s", path, error)


def failure(error: BaseException) -> str:
    """How a failed attempt stopped, in a few words: the error's type and the start of its message."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if text.startswith("[") and "] " in text:  # gloo and c10d prefix their source file and line
        text = text.split("] ", 1)[1]
    text = text.split(". ")[0][:120]
    return f"failed: {type(error).__name__}" + (f": {text}" if text else "")


def read_stop(args) -> dict | None:
    try:
        record = json.loads(stopped_path(args).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def continuation(checkpoint: Path, args, now: float) -> tuple[str, str | None]:
    """The line a resumed start says (which checkpoint, why it was written, the steps redone, the world size and global
    batch, what the restart cost), and the --save_steps suggestion when the restart was measured."""
    try:
        marker = json.loads((checkpoint / MARKER).read_text())
    except (OSError, ValueError):
        marker = {}
    step = int(marker.get("step", checkpoint.name.rpartition("-")[2] or 0))
    stop = read_stop(args)
    if stop is not None and int(stop.get("step", -1)) < step:
        stop = None  # a stop before this checkpoint was written: not the attempt that preceded this start
    before, world = marker.get("world_size"), args.world_size
    ranks = f"{world} rank{'s' if world != 1 else ''}" + (f" (was {before})" if before and before != world else "")
    reason = marker.get("saved_for")
    written = f", written for {reason}" if reason and reason.startswith("SIG") else \
        f", written every {reason}" if reason else ""
    if stop is None:
        redone = "no step redone" if reason and reason.startswith("SIG") else \
            "steps redone unknown (no rank of the stopped attempt said where it had got to)"
    else:
        count = int(stop["step"]) - step
        reached = f"it reached step {stop['step']}, then {stop.get('why') or 'stopped'}"
        redone = f"{count} step{'s' if count != 1 else ''} redone ({reached})" if count else f"no step redone ({reached})"
    batch = run_settings(args).global_batch
    kept = f"; {batch.describe()}" if batch is not None and batch.kept_from and batch.changed else ""
    began = stop.get("stopped_at") if stop else None
    cost = now - float(began) if began else None
    took = f"; the restart took {cost:.1f} s" if cost is not None and cost >= 0 else ""
    line = f"continuing on {ranks} from {checkpoint.name}{written}: {redone}{kept}{took}"
    return line, save_steps_advice(args, cost, stop)


def save_steps_advice(args, restart_seconds: float | None, stop: dict | None) -> str | None:
    """--save_steps so that a lost node redoes at most about what the restart itself costs, with saving kept under
    SAVE_SHARE of the training time: from the measured restart, and the step and save times the stopped attempt
    measured. None when they were not measured."""
    step_seconds = (stop or {}).get("step_seconds")
    if not restart_seconds or not step_seconds or restart_seconds <= 0:
        return None
    save_seconds = (stop or {}).get("save_seconds") or 0.0
    steps = max(1, math.ceil(max(restart_seconds, save_seconds / SAVE_SHARE) / step_seconds))
    strategy = getattr(args.save_strategy, "value", args.save_strategy)
    now = f"--save_steps {args.save_steps:g}" if strategy == "steps" else f"--save_strategy {strategy}"
    saving = f", a save {save_seconds:.2f} s" if save_seconds else ""
    return (f"a restart costs {restart_seconds:.1f} s and a step {step_seconds:.3g} s{saving}: --save_steps {steps} "
            f"would redo at most about a restart's worth of steps when a node is lost, with saving under "
            f"{SAVE_SHARE:.0%} of the training time (this run: {now})")
