"""The search loop: start trials up to parallel_trials at a time until the study holds max_trials, continue the ones a
stopped or killed search left RUNNING (same values, same output_dir, so the trial's checkpoint continues it), record
each trial as COMPLETE, PRUNED or FAIL and never run a finished one again. SIGTERM/SIGINT stop the running trials at a
checkpoint and leave them to the next run of the same command; a second SIGINT kills them."""

from __future__ import annotations

import dataclasses
import json
import signal
import time
from pathlib import Path

from . import PRUNED_ATTR, TRIAL_ENV
from .launch import Launcher, device_slots, group_gone, start, stop, stop_and_wait, trial_environment
from .report import keep_best, short, trial_outcome, write
from .space import SearchSettings, trial_flags
from .study import alive, open_study, storage, this_process, trial_id, with_sampler

POLL_S = 0.5
FAILURES_IN_A_ROW = 3  # then the search stops starting trials: the experiment itself is likely broken
INTERRUPTED = (128 + signal.SIGTERM, 128 + signal.SIGINT)  # a trial preempted at a checkpoint
STRAGGLER_S = 120  # a rank still running this long after its launcher exited is stuck


@dataclasses.dataclass
class Trial:
    number: int
    id: int
    params: dict
    slot: int = 0
    process: object = None
    started: float = 0.0
    exited: float = 0.0


class Search:
    def __init__(self, settings: SearchSettings, experiment: str, flags: list[str], launcher: Launcher,
                 keep_checkpoints: bool = False, deepspeed=None, checkpoint_uri: str | None = None):
        self.settings, self.experiment, self.flags, self.launcher = settings, experiment, flags, launcher
        self.keep_checkpoints, self.deepspeed, self.checkpoint_uri = keep_checkpoints, deepspeed, checkpoint_uri
        self.study_dir = Path(settings.study_dir)
        self.me = this_process()
        self.stopping = 0  # the signal that stops the search
        self.failures = 0
        self.running: dict[int, Trial] = {}
        self.study = self.database = None

    # -- the loop ------------------------------------------------------------------------------------------
    def run(self) -> int:
        previous = {signum: signal.signal(signum, self._on_signal) for signum in (signal.SIGTERM, signal.SIGINT)}
        try:
            self._loop()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        keep_best(self.study, self.study_dir, self.keep_checkpoints)
        print("\n" + write(self.study, self.settings, self.study_dir, plots=True), flush=True)
        if self.stopping:
            print(f"trainer-ext search: stopped by {signal.Signals(self.stopping).name}; run the same command to "
                  "continue the study (interrupted trials resume from their checkpoints)", flush=True)
            return 128 + self.stopping
        return 1 if self.failures >= FAILURES_IN_A_ROW else 0

    def _loop(self) -> None:
        self.study_dir.mkdir(parents=True, exist_ok=True)
        self.database = storage(self.settings.storage_url)
        self.study = open_study(self.settings, self.database)
        slots = device_slots(self.settings.parallel_trials, self.launcher)
        waiting = self._left_running()
        free = list(range(self.settings.parallel_trials))
        while True:
            while free and not self.stopping:
                trial = waiting.pop(0) if waiting else self._new_trial()
                if trial is None:
                    break
                trial.slot = free.pop(0)
                self._start(trial, slots[trial.slot])
            if not self.running:
                return
            time.sleep(POLL_S)
            for trial in [trial for trial in self.running.values() if self._ended(trial)]:
                del self.running[trial.number]
                free.append(trial.slot)
                if self._record(trial):
                    waiting.append(trial)
                keep_best(self.study, self.study_dir, self.keep_checkpoints)
                write(self.study, self.settings, self.study_dir, plots=False)

    def _ended(self, trial: Trial) -> bool:
        """The trial's guard has exited and so has every process it started; a straggler is killed after a while."""
        if trial.process.poll() is None:
            return False
        trial.exited = trial.exited or time.monotonic()
        if not group_gone(trial.process.pid) and time.monotonic() - trial.exited > STRAGGLER_S:
            stop(trial.process.pid, hard=True)
        return group_gone(trial.process.pid)

    def _on_signal(self, signum, frame) -> None:
        again = bool(self.stopping)
        self.stopping = self.stopping or signum
        for trial in list(self.running.values()):
            stop(trial.process.pid, hard=again and signum == signal.SIGINT)
        print(f"trainer-ext search: {signal.Signals(signum).name}: " + (
            "killing the trials" if again and signum == signal.SIGINT else
            "stopping the running trials at a checkpoint (Ctrl-C again kills them)"), flush=True)

    # -- trials --------------------------------------------------------------------------------------------
    def _left_running(self) -> list[Trial]:
        """RUNNING trials whose search is gone: stop what is left of their processes, then continue them."""
        from optuna.trial import TrialState

        resumable = []
        for frozen in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            owner = frozen.user_attrs.get("owner")
            owner_alive = alive(owner)
            if owner_alive is None or (owner_alive and owner["pid"] != self.me["pid"]):
                where = owner["host"] if owner_alive is None else f"the search with pid {owner['pid']}"
                print(f"trial {frozen.number}: running in {where}; left to it", flush=True)
                continue
            process = frozen.user_attrs.get("process")
            if process and alive(process):
                print(f"trial {frozen.number}: still running from the last search; stopping it at a checkpoint",
                      flush=True)
                stop_and_wait(process["pid"])
            self._count_lost_run(frozen)
            if PRUNED_ATTR in frozen.user_attrs:
                self.study.tell(frozen.number, state=TrialState.PRUNED)
                continue
            resumable.append(Trial(frozen.number, trial_id(frozen), dict(frozen.params)))
        return resumable

    def _new_trial(self) -> Trial | None:
        count = len(self.study.get_trials(deepcopy=False))
        if count >= self.settings.max_trials or self.failures >= FAILURES_IN_A_ROW:
            return None
        distributions = {name: param.distribution() for name, param in self.settings.space.items()}
        trial = with_sampler(self.database, self.settings, count).ask(distributions)
        return Trial(trial.number, trial_id(trial), dict(trial.params))

    def _start(self, trial: Trial, devices) -> None:
        trial_dir = self.study_dir / f"trial-{trial.number}"
        trial_dir.mkdir(parents=True, exist_ok=True)
        flags = [*self.flags, "--output_dir", str(trial_dir), *trial_flags(trial.params, self.deepspeed)]
        if self.checkpoint_uri:
            flags += ["--checkpoint_uri", f"{self.checkpoint_uri.rstrip('/')}/trial-{trial.number}"]
        command = [*self.launcher.command(devices), "train", self.experiment, *flags]
        spec = {"storage": self.settings.storage_url, "study_name": self.settings.study_name, "trial": trial.id,
                "number": trial.number, "metric": self.settings.metric, "pruner": self.settings.pruner}
        env = trial_environment({TRIAL_ENV: json.dumps(spec)}, devices, self.launcher, self.settings.parallel_trials)
        runs = self.database.get_trial(trial.id).user_attrs.get("runs", 0)
        with open(trial_dir / "trial.log", "a") as log:
            log.write(f"\n=== trainer-ext search: trial {trial.number}, run {runs + 1}, {time.ctime()}\n"
                      f"=== {' '.join(command)}\n")
        for key, value in (("owner", self.me), ("runs", runs + 1), ("run_started", time.time())):
            self.database.set_trial_user_attr(trial.id, key, value)
        trial.process, trial.started = start(command, env, trial_dir / "trial.log"), time.monotonic()
        self.database.set_trial_user_attr(trial.id, "process", this_process(trial.process.pid))
        self.running[trial.number] = trial
        values = " ".join(f"{name}={short(value)}" for name, value in trial.params.items())
        print(f"trial {trial.number} {'continues' if runs else 'starts'}: {values}  (log: {trial_dir}/trial.log)",
              flush=True)

    def _count_lost_run(self, frozen) -> None:
        """A run whose search died never recorded its time: it lasted until its log was last written."""
        started = frozen.user_attrs.get("run_started")
        log = self.study_dir / f"trial-{frozen.number}" / "trial.log"
        if started is not None and log.is_file():
            lost = max(0.0, log.stat().st_mtime - started)
            self.database.set_trial_user_attr(trial_id(frozen), "seconds", frozen.user_attrs.get("seconds", 0.0) + lost)
            self.database.set_trial_user_attr(trial_id(frozen), "run_started", None)

    def _record(self, trial: Trial) -> bool:
        """Record how the trial's process ended; True when it should run again now (it was interrupted)."""
        from optuna.trial import TrialState

        status, trial_dir = trial.process.returncode, self.study_dir / f"trial-{trial.number}"
        attrs = self.database.get_trial(trial.id).user_attrs
        spent = attrs.get("seconds", 0.0) + time.monotonic() - trial.started
        self.database.set_trial_user_attr(trial.id, "seconds", spent)
        self.database.set_trial_user_attr(trial.id, "run_started", None)
        name, took = self.settings.metric, f"{spent:.0f} s"
        if PRUNED_ATTR in attrs:
            self.study.tell(trial.number, state=TrialState.PRUNED)
            self.failures = 0
            print(f"trial {trial.number} PRUNED at step {attrs[PRUNED_ATTR]} ({took})", flush=True)
            return False
        if status == 0:
            value, steps, error = trial_outcome(trial_dir, name)
            if steps is not None:
                self.database.set_trial_user_attr(trial.id, "steps", steps)
            if error is None:
                self.study.tell(trial.number, value)
                self.failures = 0
                print(f"trial {trial.number} COMPLETE: {name} {value:.4g} after {steps} steps ({took})", flush=True)
                return False
            return self._fail(trial, error)
        if self.stopping or status in INTERRUPTED:
            print(f"trial {trial.number} interrupted ({took}): it continues from its checkpoint"
                  + (" when the search runs again" if self.stopping else ""), flush=True)
            return not self.stopping
        return self._fail(trial, f"exit status {status}: {_last_error(trial_dir / 'trial.log')}")

    def _fail(self, trial: Trial, error: str) -> bool:
        from optuna.trial import TrialState

        self.database.set_trial_user_attr(trial.id, "error", error)
        self.study.tell(trial.number, state=TrialState.FAIL)
        self.failures += 1
        print(f"trial {trial.number} FAIL: {error} (log: {self.study_dir}/trial-{trial.number}/trial.log)", flush=True)
        if self.failures == FAILURES_IN_A_ROW:
            print(f"trainer-ext search: {FAILURES_IN_A_ROW} trials failed in a row: no new trials (see their logs)",
                  flush=True)
        return False


def _last_error(log: Path) -> str:
    """The line of a trial's log that says what went wrong: the last `error:` or exception line, else the last."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    for line in reversed(lines):
        if "error" in line.lower() or "Exception" in line:
            return line[:300]
    return lines[-1][:300] if lines else "no output"
