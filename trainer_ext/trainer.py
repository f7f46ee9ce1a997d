"""ExtTrainer: the transformers Trainer with true losses on N ranks, one global batch order for every backend,
custom losses without subclassing, and the backend chosen once at construction."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import Trainer

from . import progress
from .backends import select_backend
from .checkpoint import (RunCheckpoints, checkpoint_folder, means_newest, model_fingerprint, newest_valid_checkpoint,
                         read_data_state, staging_dir)
from .data.loader import dataloader_with_batch_sampler
from .data.samplers import ResumableBatchSampler
from .errors import UserError, exits_on_user_error
from .preemption import Preempted, PreemptionCallback
from .runtime import (check_process_group, quiet_deepspeed_on_cpu_machines, release_at_exit,
                      share_cores_between_cpu_ranks)
from .sagemaker import prepare_arguments as prepare_sagemaker
from .search.callback import trial_callback
from .settings import OptimizerSettings, SchedulerSettings

logger = logging.getLogger(__name__)

LossFn = Callable[[object, torch.Tensor], torch.Tensor]


class ExtTrainer(Trainer):
    """`Trainer` plus:

    - `loss_fn(outputs, labels) -> loss`: replaces the model's loss (no subclass needed);
    - `class_weights` (or `--class_weights 1.0,3.0`) and `--label_smoothing_factor` for classification;
    - `optimizer_settings` / `scheduler_settings`: the optimizer and schedule, from flags by default.
    """

    @exits_on_user_error
    def __init__(self, model=None, args=None, *positional, loss_fn: LossFn | None = None,
                 class_weights=None, optimizer_settings: OptimizerSettings | None = None,
                 scheduler_settings: SchedulerSettings | None = None, **kwargs):
        quiet_deepspeed_on_cpu_machines()  # plain TrainingArguments did not
        if args is not None:
            prepare_sagemaker(args)  # plain TrainingArguments in a SageMaker job: model, checkpoints, logs placed
        self.backend = select_backend(args)
        if args is not None:
            self.backend.check(args)
        super().__init__(model, args, *positional, **kwargs)
        check_process_group(self.args)
        if self.args.device.type == "cpu":
            share_cores_between_cpu_ranks()  # ExtTrainingArguments did already; plain TrainingArguments did not
        release_at_exit(self)
        self.loss_fn = loss_fn
        weights = class_weights if class_weights is not None else getattr(self.args, "class_weights", None)
        self.class_weights = [float(w) for w in weights] if weights else None
        _check_class_weights(self.class_weights, loss_fn, self.model)
        self.optimizer_settings = optimizer_settings or OptimizerSettings.from_args(self.args)
        self.scheduler_settings = scheduler_settings or SchedulerSettings.from_args(self.args)
        self._model_uses_num_items = None  # decided on the first labelled batch
        self._train_batch_sampler = None  # the training order; its position is saved with every checkpoint
        self._resume_data_state = None  # that position, read from the checkpoint being resumed
        self.checkpoints = RunCheckpoints(self)  # resume, publish, rotate, --checkpoint_uri
        self.training_already_complete = None  # the checkpoint a re-run found complete (train() then trains nothing)
        self.preemption = PreemptionCallback()
        self.add_callback(self.preemption)
        self.search_trial = trial_callback()  # inside `trainer-ext search`: evaluations reach the study's pruner
        if self.search_trial is not None:
            self.add_callback(self.search_trial)
        progress.install(self)  # main process: bar with samples/s and ETA; resolved settings printed at start

    # -- losses ----------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The true loss on every rank count: a per-batch mean for models whose loss is a plain mean (the
        Trainer would multiply it by the world size), transformers' token-count normalisation for the others."""
        labels = inputs.get("labels")
        if labels is not None and self._custom_loss_requested():
            outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
            loss = self._custom_loss(model, outputs, labels)
            self.loss_is_scaled_for_ga = False
            return (loss, outputs) if return_outputs else loss
        if labels is not None and self._model_uses_num_items is None and self.model_accepts_loss_kwargs:
            self._model_uses_num_items = self._loss_uses_num_items(model, inputs)
            self.model_accepts_loss_kwargs = self._model_uses_num_items
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            self.loss_is_scaled_for_ga = None  # transformers' own, correct for losses normalised by item count
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        outputs = model(**inputs)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        self.loss_is_scaled_for_ga = False
        return (loss, outputs) if return_outputs else loss

    def _custom_loss_requested(self) -> bool:
        return self.loss_fn is not None or self.class_weights is not None or self.args.label_smoothing_factor > 0

    def _custom_loss(self, model, outputs, labels):
        if self.loss_fn is not None:
            return self.loss_fn(outputs, labels)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        if logits.dim() > 2:  # token-level: flatten, shifting for causal language models (as the Trainer does)
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

            module = self.backend.unwrap(self.accelerator.unwrap_model(model))
            if type(module).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
                logits, labels = logits[..., :-1, :], labels[..., 1:]
            logits, labels = logits.reshape(-1, logits.size(-1)), labels.reshape(-1)
        weight = None
        if self.class_weights is not None:
            if len(self.class_weights) != logits.size(-1):
                raise UserError(f"--class_weights has {len(self.class_weights)} values but the model has "
                                 f"{logits.size(-1)} classes")
            weight = torch.tensor(self.class_weights, dtype=torch.float32, device=logits.device)
        return F.cross_entropy(logits.float(), labels, weight=weight, ignore_index=-100,
                               label_smoothing=self.args.label_smoothing_factor)

    def _loss_uses_num_items(self, model, inputs) -> bool:
        """Ask the model itself: does its loss change with `num_items_in_batch`? (A plain mean does not.)"""
        module = self.backend.unwrap(self.accelerator.unwrap_model(model))
        inputs = self._prepare_inputs(inputs)
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad():
                losses = [module(**inputs, num_items_in_batch=torch.tensor(n, device=self.args.device))
                          for n in (1.0, 2.0)]
        except TypeError:
            return False
        finally:
            module.train(was_training)
        first, second = (out["loss"] if isinstance(out, dict) else out[0] for out in losses)
        return not torch.allclose(first, second)

    # -- optimizer and schedule ------------------------------------------------------------------------
    def create_optimizer(self, model=None):
        if self.optimizer is not None:
            return self.optimizer
        model = model if model is not None else self.model
        if self.backend.wraps_before_optimizer():  # parameter sharding: optimize the shards it creates
            model = self.model_wrapped = self.backend.wrap_model(self, model)
        settings = self.optimizer_settings
        decay = set(self.get_decay_parameter_names(model))
        groups = [
            {"params": [p for n, p in model.named_parameters() if n in decay and p.requires_grad],
             "weight_decay": settings.weight_decay},
            {"params": [p for n, p in model.named_parameters() if n not in decay and p.requires_grad],
             "weight_decay": 0.0},
        ]
        # --optim picks the class and its options as in the Trainer (transformers 5's default, adamw_torch_fused,
        # is torch's fused AdamW: measured 0.87x the stock Trainer's samples/s with the for-loop AdamW on 2 CPU
        # ranks); the settings give the hyperparameters the class takes.
        optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(self.args, model)
        kwargs.update({key: value for key, value in (("lr", settings.lr), ("betas", settings.betas),
                                                     ("eps", settings.eps)) if key in kwargs or key == "lr"})
        self.optimizer = (self.backend.build_optimizer(self, groups, optimizer_cls, kwargs)
                          or optimizer_cls(groups, **kwargs))
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is None:
            from transformers import get_scheduler

            settings = self.scheduler_settings
            self.lr_scheduler = get_scheduler(settings.type, optimizer if optimizer is not None else self.optimizer,
                                              num_warmup_steps=settings.warmup_for(num_training_steps),
                                              num_training_steps=num_training_steps,
                                              scheduler_specific_kwargs=settings.kwargs)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    # -- data ------------------------------------------------------------------------------------------
    def get_train_dataloader(self):
        """One seeded stream of samples, cut into the same global batches on every backend and world size, and
        continued after a resume at the sample where the checkpoint stopped (see data/samplers.py)."""
        if self.train_dataset is None:
            raise UserError("ExtTrainer: training requires a train_dataset")
        args = self.args
        batch_sampler = ResumableBatchSampler(
            len(self.train_dataset), self._train_batch_size, rank=args.process_index, world_size=args.world_size,
            seed=args.data_seed if args.data_seed is not None else args.seed, drop_last=args.dataloader_drop_last,
            gradient_accumulation_steps=args.gradient_accumulation_steps)
        if self._resume_data_state is not None:
            for warning in batch_sampler.load_state_dict(self._resume_data_state):
                if self.is_world_process_zero():
                    logger.warning("resuming: %s", warning)
        self._train_batch_sampler = batch_sampler
        return dataloader_with_batch_sampler(self, self.train_dataset, "training", batch_sampler)

    def _init_training_state(self, *args, **kwargs):
        epochs_trained, steps_trained_in_current_epoch = super()._init_training_state(*args, **kwargs)
        # The Trainer skips the resumed epoch's first batches through a wrapper that hides set_epoch from us.
        if self._train_batch_sampler is not None:
            self._train_batch_sampler.set_epoch(epochs_trained)
        return epochs_trained, steps_trained_in_current_epoch

    def _get_eval_sampler(self, eval_dataset):
        # Dataset order: accelerate shards it in whole batches and gather_for_metrics drops the padding.
        return torch.utils.data.SequentialSampler(eval_dataset)

    # -- backend hooks ---------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        self._learning_rate_in_use = self.backend.learning_rate_in_use(self)
        return super().training_step(model, inputs, num_items_in_batch)

    def _wrap_model(self, model, training=True, dataloader=None):
        if not training and getattr(self, "_evaluation_engine", None) is not None:
            return self._evaluation_engine
        if training:
            wrapped = self.backend.wrap_model(self, model)
            if wrapped is not None:
                return wrapped
        return super()._wrap_model(model, training, dataloader)

    def _clip_grad_norm(self, model):
        norm = self.backend.clip_grad_norm(self, model, self.args.max_grad_norm)
        return norm if norm is not None else super()._clip_grad_norm(model)

    def _save_optimizer_and_scheduler(self, output_dir):
        self.backend.before_optimizer_save(self)
        super()._save_optimizer_and_scheduler(output_dir)

    def save_model(self, output_dir=None, _internal_call=False):
        state_dict = self.backend.full_state_dict(self)
        if state_dict is None:
            return super().save_model(output_dir, _internal_call)
        if self.args.should_save:
            self._save(output_dir or self.args.output_dir, state_dict=state_dict)

    def evaluation_loop(self, *args, **kwargs):
        engine = self.backend.evaluation_engine(self)
        if engine is not None:  # transformers then builds no engine of its own and prepares nothing (_wrap_model)
            self.deepspeed = self.model_wrapped = self._evaluation_engine = engine
            try:
                return super().evaluation_loop(*args, **kwargs)
            finally:
                self.deepspeed, self.model_wrapped, self._evaluation_engine = None, self.model, None
        if not (self.is_deepspeed_enabled and self.backend.evaluates_plain_model(self)):
            return super().evaluation_loop(*args, **kwargs)
        self.is_deepspeed_enabled = False  # evaluate the replicated model as plain data parallelism does
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            self.is_deepspeed_enabled = True

    def _get_learning_rate(self):
        recorded = getattr(self, "_learning_rate_in_use", None)
        return recorded if recorded is not None else super()._get_learning_rate()

    def _finalize_training(self, trial, num_train_samples, start_time):
        # transformers adds the loss accumulated since the last log as this rank's own, so the final train_loss
        # depended on --logging_steps and on rank 0's batches; the mean over ranks is what a single process logs.
        # (A private method: the only place the remainder is added; tests/test_train_loss.py catches a rename.)
        from transformers.trainer_pt_utils import nested_gather

        if self.args.world_size > 1:
            self._tr_loss = nested_gather(self._tr_loss, self.args.parallel_mode).mean()
        return super()._finalize_training(trial, num_train_samples, start_time)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        self.backend.before_prepare(self, max_steps, resume_from_checkpoint)
        prepared = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        self.backend.after_prepare(self)
        return prepared

    @exits_on_user_error
    def train(self, resume_from_checkpoint=None, **kwargs):
        """Resumes by default: with no `resume_from_checkpoint` (or "auto"/True) the newest complete checkpoint
        in output_dir is used, unless --fresh_start. A SIGTERM/SIGINT ends the run after a checkpoint, with
        `Preempted` (exit status 128 + signal); running the same command again continues exactly."""
        self.checkpoints.open_remote()
        module = self.backend.unwrap(self.accelerator.unwrap_model(self.model))
        checkpoint = self.checkpoints.to_resume(resume_from_checkpoint, model_fingerprint(module))
        if checkpoint:
            # The run's total, counted as transformers counts it for these flags and this data (epochs or max_steps).
            max_steps = self.set_initial_training_values(self.args, self.get_train_dataloader())[-1]
            finished = self.checkpoints.already_complete(checkpoint, max_steps)
            if finished is not None:
                self.training_already_complete = Path(checkpoint)
                return finished
            if self.is_world_process_zero():
                logger.warning("resuming from %s%s", checkpoint, " (pass --fresh_start to start over)"
                               if means_newest(resume_from_checkpoint) else "")
        self._resume_data_state = (read_data_state(checkpoint) if checkpoint and not self.args.ignore_data_skip
                                   else None)
        self.preemption.install()
        try:
            result = super().train(resume_from_checkpoint=checkpoint, **kwargs)
        finally:
            self.preemption.uninstall()
            self.checkpoints.wait()  # a preempted run's last checkpoint too
        if self.preemption.signum:
            saved = newest_valid_checkpoint(checkpoint_folder(self.args))
            logger.warning("preempted: checkpoint %s written; run the same command again to resume", saved)
            raise Preempted(self.preemption.signum, saved)
        if self.search_trial is not None:
            self.search_trial.stop_if_pruned()  # after its checkpoint: the search records the trial as pruned
        if self.is_world_process_zero():
            Path(self.args.output_dir).mkdir(parents=True, exist_ok=True)
            self.backend.save_settings(self.args.output_dir)
        return result

    # -- checkpoints: written aside, published complete (checkpoint.py) ------------------------------------
    def _get_output_dir(self, trial):
        # The Trainer writes a checkpoint into this folder; ours is a staging folder until the save is complete.
        staging = self.checkpoints.staging
        return str(staging) if staging is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial):
        run_dir = Path(checkpoint_folder(self.args) if trial is None else super()._get_output_dir(trial))
        self.checkpoints.staging = staging_dir(run_dir)
        leftover = self.checkpoints.staging / f"checkpoint-{self.state.global_step}"
        if self.args.should_save and leftover.exists():  # a save cut off earlier (or S3's copy of one, on SageMaker)
            shutil.rmtree(leftover)
        self.accelerator.wait_for_everyone()  # before any rank writes into it
        try:
            super()._save_checkpoint(model, trial)
        finally:
            staged, self.checkpoints.staging = self.checkpoints.staging, None
        self.accelerator.wait_for_everyone()  # every rank has written its part
        if self.args.should_save:
            sampler = self._train_batch_sampler
            module = self.backend.unwrap(self.accelerator.unwrap_model(self.model))
            self.checkpoints.publish_staged(
                staged, run_dir, sampler.state_dict(self.state.global_step) if sampler is not None else None,
                {"step": self.state.global_step, "world_size": self.args.world_size,
                 "backend": self.backend.describe(), "model": model_fingerprint(module)})
        self.accelerator.wait_for_everyone()


def _check_class_weights(weights, loss_fn, model) -> None:
    """Before any step: class weights that cannot apply are a mistake, not something to find at the first batch."""
    if weights is None:
        return
    if loss_fn is not None:
        raise UserError("--class_weights and a loss_fn were both given: the loss_fn computes the loss, so the weights "
                        "would be ignored; apply them inside loss_fn, or drop one")
    classes = getattr(getattr(model, "config", None), "num_labels", None)
    if classes is not None and getattr(model.config, "problem_type", None) != "regression" and classes != len(weights):
        raise UserError(f"--class_weights has {len(weights)} values but the model has {classes} classes: give one "
                        "weight per class")
