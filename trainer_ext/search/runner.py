"""The search loop of one worker: start trials up to parallel_trials at a time until the study holds max_trials,
continue the retries Optuna queues for trials whose worker is gone (RDBStorage's heartbeats and fail_stale_trials: a
killed or stopped search, here or on another machine; same values, from the newest checkpoint within reach, in the
original trial's folder), record each trial as COMPLETE, PRUNED or FAIL and never run a finished one again, and wait
for the other workers' trials before the final report. SIGTERM/SIGINT stop the running trials at a checkpoint and hand
them on at once (FAIL + a queued retry) to another worker or to the next run of the same command; a second SIGINT
kills them."""

from __future__ import annotations

import dataclasses
import json
import signal
import time
import warnings
from pathlib import Path

from . import PRUNED_ATTR, TRIAL_ENV
from .copies import fetch_checkpoint, upload_model
from .launch import Launcher, device_slots, group_gone, start, stop, stop_and_wait, trial_environment
from .report import keep_best, short, trial_outcome, write
from .space import SearchSettings, trial_flags
from .study import (fail_stale_trials, folder_number, hand_on, open_study, retried_from, storage, trial_id,
                    with_sampler)
from ..environment.processes import alive, same_process, this_process
from ..integrations import internals
from .workers import StudyLock, this_worker

POLL_S = 0.5
FAILURES_IN_A_ROW = 3  # then the search stops starting trials: the experiment itself is likely broken
INTERRUPTED = (128 + signal.SIGTERM, 128 + signal.SIGINT)  # a trial preempted at a checkpoint
STRAGGLER_S = 120  # a rank still running this long after its launcher exited is stuck


@dataclasses.dataclass
class Trial:
    number: int
    id: int
    params: dict
    folder: int  # N of its folder trial-N: a retry's is its original trial's
    slot: int = 0
    process: object = None
    started: float = 0.0
    exited: float = 0.0
    lost: bool = False  # another worker found its heartbeat stale (FAIL + a retry) while this one ran it

    @property
    def label(self) -> str:
        return f"trial {self.number}" + (f" (retry of trial {self.folder})" if self.folder != self.number else "")


class Search:
    def __init__(self, settings: SearchSettings, experiment: str, flags: list[str], launcher: Launcher,
                 keep_checkpoints: bool = False, configs: dict | None = None, checkpoint_uri: str | None = None,
                 storage_options: dict | None = None):
        self.settings, self.experiment, self.flags, self.launcher = settings, experiment, flags, launcher
        self.keep_checkpoints, self.checkpoint_uri = keep_checkpoints, checkpoint_uri
        self.configs = configs or {}  # the experiment's backend configs, which <flag>.<path> values are set inside
        self.storage_options = storage_options  # --checkpoint_storage_options, to reach the remote copies
        self.study_dir = Path(settings.study_dir)
        self.me = this_worker(self.study_dir)
        self.stopping = 0  # the signal that stops the search
        self.failures = 0
        self.running: dict[int, Trial] = {}
        self.study = self.database = None
        self.beats: dict[int, object] = {}  # trial id -> Optuna's heartbeat thread for a trial this worker runs
        self.lock = StudyLock(settings.storage_url, settings.study_name)
        self.waiting_for: set[int] = set()  # other workers' trials this worker said it waits for
        self.removed: set[str] = set()  # remote copies of finished trials removed

    # -- the loop ------------------------------------------------------------------------------------------
    def run(self) -> int:
        previous = {signum: signal.signal(signum, self._on_signal) for signum in (signal.SIGTERM, signal.SIGINT)}
        try:
            self._loop()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self._leave()
        self._keep_best()
        print("\n" + write(self.study, self.settings, self.study_dir, self.me, plots=True), flush=True)
        if self.stopping:
            print(f"trainer-ext search: stopped by {signal.Signals(self.stopping).name}; run the same command to "
                  "continue the study (interrupted trials resume from their checkpoints, here or on another worker of "
                  "the study)", flush=True)
            return 128 + self.stopping
        return 1 if self.failures >= FAILURES_IN_A_ROW else 0

    def _loop(self) -> None:
        self.study_dir.mkdir(parents=True, exist_ok=True)
        with self.lock:  # workers starting together create the tables and the study once
            self.database = storage(self.settings.storage_url, self.settings.heartbeat_interval,
                                    self.settings.grace_period)
            self.study = open_study(self.settings, self.database)
        slots = device_slots(self.settings.parallel_trials, self.launcher)
        free = list(range(self.settings.parallel_trials))
        waiting: list[Trial] = []
        next_look = 0.0
        while True:
            # Optuna's check, once a heartbeat: a trial whose heartbeat is stale becomes FAIL + a queued retry.
            if not self.stopping and time.monotonic() >= next_look:
                next_look = time.monotonic() + self.settings.heartbeat_interval
                fail_stale_trials(self.study)
                self._check_own()
            while free and not self.stopping:
                trial = waiting.pop(0) if waiting else self._new_trial()
                if trial is None:
                    break
                trial.slot = free.pop(0)
                self._start(trial, slots[trial.slot])
            if not self.running and (self.stopping or not waiting and self._finished()):
                return  # trials taken and not started stay RUNNING: _leave() hands them on
            time.sleep(POLL_S)
            for trial in [trial for trial in self.running.values() if self._ended(trial)]:
                del self.running[trial.number]
                free.append(trial.slot)
                if trial.lost:
                    self._drop(trial.id)
                elif self._record(trial):
                    waiting.append(trial)
                self._keep_best()
                write(self.study, self.settings, self.study_dir, self.me, plots=False)

    def _finished(self) -> bool:
        """Nothing left for this worker: stopped, too many failures, or no trial to ask and none running elsewhere
        (while other workers run trials, this one waits: if their worker dies, Optuna queues a retry it continues)."""
        from optuna.trial import TrialState

        if self.stopping or self.failures >= FAILURES_IN_A_ROW:
            return True
        left = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.WAITING))
        for frozen in left:
            if frozen.number not in self.waiting_for and frozen.state == TrialState.RUNNING:
                self.waiting_for.add(frozen.number)
                owner = frozen.user_attrs.get("owner") or {}
                print(f"trial {frozen.number}: running on {owner.get('host')} (pid {owner.get('pid')}); waiting for it "
                      f"to finish, or to retry it if its heartbeat stops for {self.settings.grace_period} s",
                      flush=True)
        return not left

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
    def _check_own(self) -> None:
        """A trial of this worker that is no longer RUNNING was found stale by another worker (this one looked dead to
        it: stopped, or cut off from the database) and is retried there: this run stops at a checkpoint, unrecorded."""
        from optuna.trial import TrialState

        for trial in self.running.values():
            if not trial.lost and self.database.get_trial(trial.id).state != TrialState.RUNNING:
                trial.lost = True
                print(f"{trial.label}: another worker found its heartbeat stale and retries it: stopping this run at a "
                      "checkpoint, not recording it", flush=True)
                stop(trial.process.pid)

    def _continue(self, frozen) -> Trial | None:
        """A retry Optuna queued for a trial whose worker is gone, now this worker's: its last run's processes stopped
        if they are on this machine, a pruned verdict recorded, otherwise the newest checkpoint within reach fetched
        into this worker's folder of the original trial."""
        from optuna.trial import TrialState

        attrs, owner = frozen.user_attrs, frozen.user_attrs.get("owner") or {}
        trial = Trial(frozen.number, trial_id(frozen), dict(frozen.params), folder_number(frozen))
        process = attrs.get("process")
        if process and alive(process):
            print(f"{trial.label}: still running from the last search; stopping it at a checkpoint", flush=True)
            stop_and_wait(process["pid"])
        self._count_lost_run(frozen)
        if PRUNED_ATTR in attrs:
            self._tell(trial, state=TrialState.PRUNED)
            return None
        reason = "its worker stopped" if attrs.get("left") else \
            f"no heartbeat from its worker for {self.settings.grace_period} s: Optuna failed it as stale"
        self.database.set_trial_user_attr(trial.id, "left", None)
        trial_dir = self.study_dir / f"trial-{trial.folder}"
        trial_dir.mkdir(parents=True, exist_ok=True)
        moved = bool(attrs.get("trial_dir")) and Path(attrs["trial_dir"]) != trial_dir
        if moved:
            self.database.set_trial_user_attr(trial.id, "takeovers", attrs.get("takeovers", 0) + 1)
        try:
            where = fetch_checkpoint(attrs, trial_dir, self.me, self.storage_options)
        except Exception as err:  # noqa: BLE001 - an unreachable copy: the trial's own folder is what is left
            where = f"continues without the remote copy ({type(err).__name__}: {err})"
        print(f"{trial.label}: taken over from {owner.get('host')}:{attrs.get('trial_dir')} ({reason}); it {where}",
              flush=True)
        return trial

    def _new_trial(self) -> Trial | None:
        """A new trial, owned by this worker from the moment it exists; None when the study holds max_trials (counted
        and asked under the lock: workers together ask exactly max_trials)."""
        from optuna.trial import TrialState

        if self.failures >= FAILURES_IN_A_ROW:
            return None
        with self.lock:
            trials = self.study.get_trials(deepcopy=False)
            count = sum(retried_from(trial) is None for trial in trials)  # a retry stands in for its original
            if count >= self.settings.max_trials and not any(t.state == TrialState.WAITING for t in trials):
                return None
            distributions = {name: param.distribution() for name, param in self.settings.space.items()}
            with warnings.catch_warnings():  # ask pops a queued retry first; heartbeats outside optimize() are ours
                warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed")
                asked = with_sampler(self.database, self.settings, count).ask(distributions)
            frozen = self.database.get_trial(trial_id(asked))  # a retry's attributes name its last run's worker
            self.database.set_trial_user_attr(trial_id(asked), "owner", self.me)
            self._beat(trial_id(asked))
        if retried_from(frozen) is not None:
            return self._continue(frozen)
        return Trial(frozen.number, trial_id(frozen), dict(frozen.params), frozen.number)

    def _start(self, trial: Trial, devices) -> None:
        trial_dir = self.study_dir / f"trial-{trial.folder}"
        trial_dir.mkdir(parents=True, exist_ok=True)
        attrs = self.database.get_trial(trial.id).user_attrs
        flags = [*self.flags, "--output_dir", str(trial_dir), *trial_flags(trial.params, self.configs)]
        remote = attrs.get("checkpoint_uri") or (self.checkpoint_uri and
                                                  f"{self.checkpoint_uri.rstrip('/')}/trial-{trial.folder}")
        if remote:  # the copy other workers continue the trial from: the first run's, whatever this worker's flags
            flags += ["--checkpoint_uri", remote]
        command = [*self.launcher.command(devices), "train", self.experiment, *flags]
        spec = {"storage": self.settings.storage_url, "study_name": self.settings.study_name, "trial": trial.id,
                "number": trial.number, "metric": self.settings.metric, "pruner": self.settings.pruner}
        env = trial_environment({TRIAL_ENV: json.dumps(spec)}, devices, self.launcher, self.settings.parallel_trials)
        runs = attrs.get("runs", 0)
        with open(trial_dir / "trial.log", "a") as log:
            log.write(f"\n=== trainer-ext search: {trial.label}, run {runs + 1}, {self.me['host']}, "
                      f"{time.ctime()}\n=== {' '.join(command)}\n")
        history = [*attrs.get("history", []), [self.me["host"], time.time(), None]]  # host, start, end of each run
        for key, value in (("runs", runs + 1), ("run_started", time.time()), ("trial_dir", str(trial_dir)),
                           ("history", history), ("checkpoint_uri", remote)):
            self.database.set_trial_user_attr(trial.id, key, value)
        trial.process, trial.started = start(command, env, trial_dir / "trial.log"), time.monotonic()
        self.database.set_trial_user_attr(trial.id, "process", this_process(trial.process.pid))
        self.running[trial.number] = trial
        values = " ".join(f"{name}={short(value)}" for name, value in trial.params.items())
        print(f"{trial.label} {'continues' if runs else 'starts'}: {values}  (log: {trial_dir}/trial.log)",
              flush=True)

    def _count_lost_run(self, frozen) -> None:
        """A run whose search died never recorded its time: it lasted until its log was last written (a log on another
        machine: until its worker's last heartbeat, unknown here, so the run's time is not counted)."""
        attrs = frozen.user_attrs
        started = attrs.get("run_started")
        log = Path(attrs.get("trial_dir") or self.study_dir / f"trial-{folder_number(frozen)}") / "trial.log"
        if started is None:
            return
        if (attrs.get("owner") or {}).get("host") == self.me["host"] and log.is_file():
            ended = log.stat().st_mtime
            self.database.set_trial_user_attr(trial_id(frozen), "seconds",
                                              attrs.get("seconds", 0.0) + max(0.0, ended - started))
            self._end_run(trial_id(frozen), attrs, ended)
        self.database.set_trial_user_attr(trial_id(frozen), "run_started", None)

    def _end_run(self, trial: int, attrs: dict, ended: float) -> None:
        history = attrs.get("history") or []
        if history and history[-1][2] is None:
            history[-1][2] = ended
            self.database.set_trial_user_attr(trial, "history", history)

    def _leave(self) -> None:
        """Trials this worker owns and leaves RUNNING (stopped by a signal): handed on now, FAIL + a queued retry, so
        another worker or the next run continues them at once instead of after the grace period."""
        for trial in list(self.beats):
            self._drop(trial)
        if self.study is None:
            return
        from optuna.trial import TrialState

        try:
            for frozen in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
                if same_process(frozen.user_attrs.get("owner"), self.me):
                    self.database.set_trial_user_attr(trial_id(frozen), "left", "stopped")
                    hand_on(self.study, self.database, frozen)
        except Exception as err:  # noqa: BLE001 - Optuna retries them once their heartbeat is stale
            print(f"trainer-ext search: could not hand on the trials left ({err})", flush=True)

    def _beat(self, trial: int) -> None:
        """Optuna's heartbeat for a trial this worker runs, stamped with the database's clock until _drop."""
        self.beats[trial] = internals.optuna_heartbeat_thread(trial, self.database)
        self.beats[trial].start()

    def _drop(self, trial: int) -> None:
        beat = self.beats.pop(trial, None)
        if beat is not None:
            beat.join()

    def _keep_best(self) -> None:
        keep_best(self.study, self.study_dir, self.me, self.keep_checkpoints, self.storage_options, self.removed)

    def _record(self, trial: Trial) -> bool:
        """Record how the trial's process ended; True when it should run again now (it was interrupted)."""
        from optuna.trial import TrialState

        status, trial_dir = trial.process.returncode, self.study_dir / f"trial-{trial.folder}"
        frozen = self.database.get_trial(trial.id)
        attrs = frozen.user_attrs
        if frozen.state != TrialState.RUNNING:
            print(f"{trial.label}: another worker found its heartbeat stale and retries it: this run is not recorded",
                  flush=True)
            self._drop(trial.id)
            return False
        spent = attrs.get("seconds", 0.0) + time.monotonic() - trial.started
        self.database.set_trial_user_attr(trial.id, "seconds", spent)
        self.database.set_trial_user_attr(trial.id, "run_started", None)
        self._end_run(trial.id, attrs, time.time())
        name, took = self.settings.metric, f"{spent:.0f} s"
        if PRUNED_ATTR in attrs:
            self._tell(trial, state=TrialState.PRUNED)
            self.failures = 0
            print(f"{trial.label} PRUNED at step {attrs[PRUNED_ATTR]} ({took})", flush=True)
            return False
        if status == 0:
            value, steps, error = trial_outcome(trial_dir, name)
            if steps is not None:
                self.database.set_trial_user_attr(trial.id, "steps", steps)
            if error is None:
                self._share_model(trial, attrs, value)
                self._tell(trial, value)
                self.failures = 0
                print(f"{trial.label} COMPLETE: {name} {value:.4g} after {steps} steps ({took})", flush=True)
                return False
            return self._fail(trial, error)
        if self.stopping or status in INTERRUPTED:
            print(f"{trial.label} interrupted ({took}): it continues from its checkpoint"
                  + (" when the search runs again" if self.stopping else ""), flush=True)
            return not self.stopping
        return self._fail(trial, f"exit status {status}: {_last_error(trial_dir / 'trial.log')}")

    def _tell(self, trial: Trial, value=None, state=None) -> None:
        self._drop(trial.id)
        self.study.tell(trial.number, value, state=state, skip_if_finished=True)

    def _share_model(self, trial: Trial, attrs: dict, value: float) -> None:
        """A trial that becomes the best: its model to the remote copy too, before the trial is recorded (so another
        worker's report finds it), for the other workers' best/; removed with the trial's copy when a better one
        finishes."""
        if not attrs.get("checkpoint_uri"):
            return
        try:
            best = self.study.best_value
        except ValueError:
            best = None
        if best is not None and (value < best if self.settings.direction == "maximize" else value > best):
            return  # never the best (a tie may be: Optuna picks one of equal trials)
        try:
            model_uri = upload_model(self.study_dir / f"trial-{trial.folder}", attrs["checkpoint_uri"],
                                     self.storage_options)
            self.database.set_trial_user_attr(trial.id, "model_uri", model_uri)
        except Exception as err:  # noqa: BLE001 - the model stays in this worker's folder; the report says where
            print(f"trial {trial.number}: its model was not copied to {attrs['checkpoint_uri']} ({err})", flush=True)

    def _fail(self, trial: Trial, error: str) -> bool:
        from optuna.trial import TrialState

        self.database.set_trial_user_attr(trial.id, "error", error)
        self._tell(trial, state=TrialState.FAIL)
        self.failures += 1
        print(f"{trial.label} FAIL: {error} (log: {self.study_dir}/trial-{trial.folder}/trial.log)", flush=True)
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
