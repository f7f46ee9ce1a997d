"""ExtTrainer: the transformers Trainer with true losses on N ranks, one global batch order for every backend,
custom losses without subclassing, and the backend chosen once at construction."""

from __future__ import annotations

import json
import logging
import weakref
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import Trainer

from . import progress
from .args import quiet_deepspeed_on_cpu_machines, share_cores_between_cpu_ranks
from .backends import select_backend
from .checkpoint import (DATA_STATE, CheckpointError, check_compatible, damage, model_fingerprint, newest_valid_checkpoint,
                         problem_with, publish, read_data_state, rotate, staging_dir)
from .data.samplers import ResumableBatchSampler
from .errors import UserError, exits_on_user_error
from .leftovers import remove_own_shm_buffer
from .preemption import Preempted, PreemptionCallback
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
        self.backend = select_backend(args)
        if args is not None:
            self.backend.check(args)
        super().__init__(model, args, *positional, **kwargs)
        _check_process_group(self.args)
        if self.args.device.type == "cpu":
            share_cores_between_cpu_ranks()  # ExtTrainingArguments did already; plain TrainingArguments did not
        _release_process_group_at_exit()
        _TRAINERS.add(self)
        self.loss_fn = loss_fn
        weights = class_weights if class_weights is not None else getattr(self.args, "class_weights", None)
        self.class_weights = [float(w) for w in weights] if weights else None
        _check_class_weights(self.class_weights, loss_fn, self.model)
        self.optimizer_settings = optimizer_settings or OptimizerSettings.from_args(self.args)
        self.scheduler_settings = scheduler_settings or SchedulerSettings.from_args(self.args)
        self._model_uses_num_items = None  # decided on the first labelled batch
        self._staging = None  # set while a checkpoint is being written
        self._train_batch_sampler = None  # the training order; its position is saved with every checkpoint
        self._resume_data_state = None  # that position, read from the checkpoint being resumed
        self.remote = None  # --checkpoint_uri
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
        dataloader = _dataloader_with_batch_sampler(self, self.train_dataset, "training", batch_sampler)
        _unshard(dataloader, batch_sampler)
        return dataloader

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
        self.remote = self._remote_checkpoints()
        checkpoint = self._checkpoint_to_resume(resume_from_checkpoint)
        finished = self._already_complete(checkpoint)
        if finished is not None:
            return finished
        if checkpoint and self.is_world_process_zero():
            logger.warning("resuming from %s%s", checkpoint, " (pass --fresh_start to start over)"
                           if resume_from_checkpoint in (None, "auto", True) else "")
        self._resume_data_state = (read_data_state(checkpoint) if checkpoint and not self.args.ignore_data_skip
                                   else None)
        self.preemption.install()
        try:
            result = super().train(resume_from_checkpoint=checkpoint, **kwargs)
        finally:
            self.preemption.uninstall()
            if self.remote is not None:
                self.remote.wait()  # a preempted run's last checkpoint too
        if self.preemption.signum:
            saved = newest_valid_checkpoint(self.args.output_dir)
            logger.warning("preempted: checkpoint %s written; run the same command again to resume", saved)
            raise Preempted(self.preemption.signum, saved)
        if self.search_trial is not None:
            self.search_trial.stop_if_pruned()  # after its checkpoint: the search records the trial as pruned
        if self.is_world_process_zero() and hasattr(self.backend, "save_resolved_config"):
            Path(self.args.output_dir).mkdir(parents=True, exist_ok=True)
            self.backend.save_resolved_config(self.args.output_dir)
        return result

    def _already_complete(self, checkpoint):
        """A re-run of a finished command (a scheduler or spot restart) finds its last checkpoint at the run's final
        step: train nothing, touch no checkpoint, load the finished weights for evaluation/prediction, say so once.
        (transformers would train one step more, rotate an older checkpoint away and overwrite the metrics.)"""
        from transformers import TrainerState
        from transformers.trainer_utils import TrainOutput
        from transformers.trainer import TRAINER_STATE_NAME

        if not checkpoint:
            return None
        state = TrainerState.load_from_json(str(Path(checkpoint) / TRAINER_STATE_NAME))
        # The run's total, counted as transformers counts it for these flags and this data (epochs or max_steps).
        max_steps = self.set_initial_training_values(self.args, self.get_train_dataloader())[-1]
        if state.global_step < max_steps:
            return None
        self.training_already_complete = Path(checkpoint)
        deepspeed = self.is_deepspeed_enabled
        self.is_deepspeed_enabled = False  # below ZeRO-3 every checkpoint holds the whole model in model.safetensors
        try:
            self._load_from_checkpoint(str(checkpoint))
        finally:
            self.is_deepspeed_enabled = deepspeed
        self.state = state
        final = Path(self.args.output_dir)
        where = final if any(final.glob("model*.safetensors")) or any(final.glob("pytorch_model*.bin")) else checkpoint
        if self.is_world_process_zero():
            print(f"trainer_ext: training already complete at step {state.global_step} ({checkpoint}): nothing to "
                  f"train; the model is in {where}", flush=True)
        losses = [row["train_loss"] for row in state.log_history if "train_loss" in row]
        return TrainOutput(state.global_step, losses[-1] if losses else float("nan"), {"already_complete": True})

    def _remote_checkpoints(self):
        """--checkpoint_uri, checked (write, list, read) by the process that saves, before anything trains."""
        uri = getattr(self.args, "checkpoint_uri", None)
        if not uri:
            return None
        from .remote import RemoteCheckpoints

        remote = RemoteCheckpoints(uri, getattr(self.args, "checkpoint_storage_options", None))
        if self.args.should_save and not getattr(self.args, "checkpoint_uri_checked", False):
            remote.check()
        return remote

    def _checkpoint_to_resume(self, requested):
        if requested in (None, "auto", True):
            if requested is None and getattr(self.args, "fresh_start", False):
                return None
            found = self._newest_intact_checkpoint()
            if found is None and self.remote is not None:
                if self.args.should_save:
                    self.remote.download_newest(self.args.output_dir)
                self.accelerator.wait_for_everyone()
                found = self._newest_intact_checkpoint()
            if self.is_world_process_zero() and not found:
                logger.info("no complete checkpoint in %s: starting from scratch", self.args.output_dir)
            checkpoint = str(found) if found else None
        else:
            checkpoint = str(requested)
            if not Path(checkpoint).is_dir():
                raise CheckpointError(f"--resume_from_checkpoint {checkpoint}: no such folder (give a checkpoint-N "
                                      "folder, or auto for the newest complete one in --output_dir)")
            damaged = self._decided_by_main_process(lambda: damage(Path(checkpoint)))
            if damaged:
                raise CheckpointError(f"--resume_from_checkpoint {checkpoint}: {damaged}; resume from another checkpoint, "
                                 "or pass --resume_from_checkpoint auto to take the newest intact one")
            problem = problem_with(Path(checkpoint))
            if problem:
                logger.warning("resuming from %s although %s", checkpoint, problem)
        if checkpoint:
            module = self.backend.unwrap(self.accelerator.unwrap_model(self.model))
            check_compatible(checkpoint, model_fingerprint(module))
        return checkpoint

    def _newest_intact_checkpoint(self):
        """The newest complete checkpoint whose files are all as written (sizes and checksums)."""
        return self._decided_by_main_process(lambda: newest_valid_checkpoint(self.args.output_dir, checksums=True))

    def _decided_by_main_process(self, decide):
        """`decide()` run once, by the main process (reading a checkpoint's files once, not once per rank), and its
        answer shared: every rank must resume from the same checkpoint."""
        answer = decide() if self.args.process_index == 0 else None
        if self.args.world_size > 1:
            from accelerate.utils import broadcast_object_list

            answer = broadcast_object_list([answer], from_process=0)[0]
        return answer

    # -- checkpoints: written aside, published complete --------------------------------------------------
    def _get_output_dir(self, trial):
        return str(self._staging) if self._staging is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial):
        run_dir = Path(super()._get_output_dir(trial))
        self._staging = staging_dir(run_dir)
        try:
            super()._save_checkpoint(model, trial)
        finally:
            staged, self._staging = self._staging, None
        self.accelerator.wait_for_everyone()  # every rank has written its part
        if self.args.should_save:
            name = f"checkpoint-{self.state.global_step}"
            if self._train_batch_sampler is not None:
                state = self._train_batch_sampler.state_dict(self.state.global_step)
                (staged / name / DATA_STATE).write_text(json.dumps(state, indent=2) + "\n")
            module = self.backend.unwrap(self.accelerator.unwrap_model(self.model))
            info = {"step": self.state.global_step, "world_size": self.args.world_size,
                    "backend": self.backend.describe(), "model": model_fingerprint(module)}
            final = publish(staged / name, run_dir, info)
            best = self.state.best_model_checkpoint
            if best and Path(best).parent == staged:
                self.state.best_model_checkpoint = str(final)
            deleted = rotate(run_dir, self.args.save_total_limit, keep=Path(self.state.best_model_checkpoint)
                             if self.state.best_model_checkpoint else None)
            if self.remote is not None:  # in the background: the next step does not wait for the copy
                self.remote.upload(final)
                self.remote.delete([path.name for path in deleted])
            if staged.is_dir() and not any(staged.iterdir()):
                staged.rmdir()
        self.accelerator.wait_for_everyone()


_RELEASE_REGISTERED = []
_TRAINERS = weakref.WeakSet()  # released before the process group at exit


def _release_process_group_at_exit() -> None:
    """Destroy the process group before interpreter teardown: left alive, its C++ threads can abort a rank that
    already finished ("terminate called without an active exception", exit -6), failing a finished job."""
    if _RELEASE_REGISTERED:
        return
    import atexit

    def release():
        # A DDP wrapper or DeepSpeed engine still referenced keeps the group alive past destroy_process_group, to
        # be torn down mid-interpreter-shutdown: drop the trainers' references first.
        for trainer in list(_TRAINERS):
            trainer.model_wrapped, trainer.deepspeed = trainer.model, None
            trainer.accelerator.free_memory()
        import gc

        gc.collect()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        remove_own_shm_buffer()

    atexit.register(release)
    _RELEASE_REGISTERED.append(release)


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


def _check_process_group(args) -> None:
    """A launcher started N ranks but they did not form one group: each would train alone, N times over."""
    import os

    launched = os.environ.get("WORLD_SIZE", "1")
    if launched.isdigit() and int(launched) > 1 and args.world_size == 1:
        raise UserError(f"{launched} ranks were launched but this one trains alone (world size 1): on a machine "
                           "without a GPU pass --use_cpu, or use trainer_ext.ExtTrainingArguments, which sets it")


def _dataloader_with_batch_sampler(trainer, dataset, description, batch_sampler):
    from functools import partial

    import datasets
    from torch.utils.data import DataLoader
    from transformers.trainer_utils import seed_worker

    args = trainer.args
    collator = trainer.data_collator
    if isinstance(dataset, datasets.Dataset):
        dataset = trainer._remove_unused_columns(dataset, description=description)
    else:
        collator = trainer._get_collator_with_removed_columns(trainer.data_collator, description=description)
    params = {"batch_sampler": batch_sampler, "collate_fn": collator, "num_workers": args.dataloader_num_workers,
              "pin_memory": args.dataloader_pin_memory, "persistent_workers": args.dataloader_persistent_workers,
              "prefetch_factor": args.dataloader_prefetch_factor}
    if args.dataloader_num_workers > 0 and args.dataloader_multiprocessing_context:
        params["multiprocessing_context"] = args.dataloader_multiprocessing_context
    params["worker_init_fn"] = partial(seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index)
    return trainer.accelerator.prepare(DataLoader(dataset, **params))


def _unshard(dataloader, batch_sampler) -> None:
    """accelerate wraps every batch sampler to shard it over ranks; ours is already one rank's share."""
    wrapper = getattr(dataloader, "batch_sampler", None)
    if wrapper is not None and getattr(wrapper, "batch_sampler", None) is batch_sampler:
        wrapper.num_processes, wrapper.process_index = 1, 0
