"""Inside a trial of `trainer-ext search`: after each evaluation during training, rank 0 reports the metric to the
study and asks the pruner; every rank follows its answer, so a pruned trial saves a checkpoint on all ranks and
stops. ExtTrainer adds this callback when the search set TRIAL_ENV: experiment files and scripts need nothing."""

from __future__ import annotations

import json
import logging
import os

from transformers import TrainerCallback

from ..preemption import max_over_ranks
from . import PRUNED_ATTR, PRUNED_STATUS, TRIAL_ENV

logger = logging.getLogger(__name__)


class TrialPruned(SystemExit):
    """Raised by ExtTrainer.train after the pruned trial's checkpoint is written; exit status PRUNED_STATUS."""

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
        self._trial = None
        self._said_missing = False

    def on_train_begin(self, args, state, control, **kwargs):
        self.training = True

    def on_train_end(self, args, state, control, **kwargs):
        self.training = False

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if not self.training:
            return control
        prune = self._report(state, metrics or {}) if state.is_world_process_zero else False
        if max_over_ranks(prune, args.device) > 0:
            self.pruned_at = state.global_step
            control.should_save = True
            control.should_training_stop = True
        return control

    def _report(self, state, metrics: dict) -> bool:
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
        self._trial.report(float(value), state.global_step)
        if state.global_step >= state.max_steps or not self._trial.should_prune():
            return False
        self._trial.set_user_attr(PRUNED_ATTR, state.global_step)
        print(f"trainer_ext: search trial {self.spec['number']} pruned at step {state.global_step} ({metric} "
              f"{value:.4g}): saving a checkpoint and stopping", flush=True)
        return True

    def stop_if_pruned(self) -> None:
        if self.pruned_at is not None:
            raise TrialPruned(self.pruned_at)
