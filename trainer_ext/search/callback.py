"""Inside a trial of `trainer-ext search`: after each evaluation during training, rank 0 reports the metric to the
study at the number of training samples seen so far (not steps: trials with other batch sizes are compared at the same
amount of data) and asks the pruner; every rank follows its answer, so a pruned trial saves a checkpoint on all ranks
and stops. Under successive halving and Hyperband with min_resource given, an evaluation also runs at the first step
that reaches each rung's sample count. `trainer-ext train`, the command each trial runs, passes this callback to the
recipe when the search set TRIAL_ENV (`trial_callback`): ExtTrainer knows nothing of searches, experiment files need
nothing. A pruned trial ends when training does (its checkpoint written), with exit status PRUNED_STATUS."""

from __future__ import annotations

import json
import logging
import os

from transformers import TrainerCallback

from ..checkpoints.preemption import max_over_ranks
from . import PRUNED_ATTR, PRUNED_STATUS, TRIAL_ENV

logger = logging.getLogger(__name__)
# Optuna's defaults for the rung pruners' (reduction_factor, min_early_stopping_rate).
RUNG_DEFAULTS = {"successive_halving": (4, 0), "hyperband": (3, 0)}


class TrialPruned(SystemExit):
    """Raised when the pruned trial's training ends (on_train_end; ExtTrainer.train waits for its checkpoint on the way
    out); exit status PRUNED_STATUS."""

    def __init__(self, step: int):
        self.step = step
        super().__init__(PRUNED_STATUS)


def trial_callback() -> SearchTrialCallback | None:
    """The callback of the search trial this process runs, or None outside a search."""
    text = os.environ.get(TRIAL_ENV)
    return SearchTrialCallback(json.loads(text)) if text else None


class SearchTrialCallback(TrainerCallback):
    def __init__(self, spec: dict):
        self.spec = spec
        self.training = False  # evaluations before and after training are not intermediate values
        self.pruned_at = None
        self.rungs = rungs(spec.get("pruner") or {})
        self._trial = None
        self._said_missing = False

    def on_train_begin(self, args, state, control, **kwargs):
        self.training = True

    def on_step_end(self, args, state, control, **kwargs):
        """Evaluate at the first step that reaches a rung's sample count (the pruner decides there)."""
        if self.rungs:
            batch = samples_per_step(args)
            before, now = (state.global_step - 1) * batch, state.global_step * batch
            if any(before < rung <= now for rung in self.rungs(now)):
                control.should_evaluate = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.training = False
        if self.pruned_at is not None:  # on every rank; the search records the trial as pruned
            raise TrialPruned(self.pruned_at)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if not self.training:
            return control
        prune = self._report(args, state, metrics or {}) if state.is_world_process_zero else False
        if max_over_ranks(prune, args.device) > 0:
            self.pruned_at = state.global_step
            control.should_save = True
            control.should_training_stop = True
        return control

    def _report(self, args, state, metrics: dict) -> bool:
        """Rank 0: record this evaluation in the study; True when the pruner stops the trial here."""
        metric, value = self.spec["metric"], metrics.get(self.spec["metric"])
        if value is None:
            if not self._said_missing:
                logger.warning("search: the evaluation reports no %s (it has %s): nothing to prune on", metric,
                               ", ".join(sorted(metrics)))
                self._said_missing = True
            return False
        if self._trial is None:
            from .study import running_trial

            self._trial = running_trial(self.spec["storage"], self.spec["study_name"], self.spec["trial"],
                                        self.spec["pruner"])
        samples = state.global_step * samples_per_step(args)
        from optuna.exceptions import UpdateFinishedTrialError

        try:
            self._trial.report(float(value), samples)
        except UpdateFinishedTrialError:  # its worker looked dead (stopped?) and another retries it: not recorded
            logger.warning("search: trial %s was failed as stale and is retried elsewhere: this evaluation is not "
                           "recorded; the search stops this run when its worker continues", self.spec["number"])
            return False
        if state.global_step >= state.max_steps or not self._trial.should_prune():
            return False
        self._trial.set_user_attr(PRUNED_ATTR, state.global_step)
        print(f"trainer_ext: search trial {self.spec['number']} pruned at step {state.global_step}, {samples} samples "
              f"({metric} {value:.4g}): saving a checkpoint and stopping", flush=True)
        return True


def samples_per_step(args) -> int:
    """Training samples in one optimizer step over all ranks: the unit of the pruner's budget."""
    return args.train_batch_size * args.gradient_accumulation_steps * max(1, args.world_size)


def rungs(pruner: dict):
    """The sample counts at which a successive halving or Hyperband pruner given min_resource (in samples) compares
    trials, as a function of the samples trained so far (the rungs up to there); None for other pruners and without
    min_resource (Optuna's 1 sample, or auto: the pruner then decides at the regular evaluations)."""
    if pruner.get("type") not in RUNG_DEFAULTS or pruner.get("min_resource", "auto") == "auto":
        return None
    factor, rate = RUNG_DEFAULTS[pruner["type"]]
    factor, rate = float(pruner.get("reduction_factor", factor)), int(pruner.get("min_early_stopping_rate", rate))
    first = float(pruner["min_resource"]) * factor ** rate

    def up_to(samples: int) -> list[float]:
        found, rung = [], first
        while rung <= samples:
            found.append(rung)
            rung *= factor
        return found

    return up_to
