"""ExtTrainer: the transformers Trainer with true losses on N ranks, one global batch order for every backend (also
for streaming datasets), custom losses without subclassing, checkpoints published complete and resumed automatically
after a restart, and the backend chosen once at construction. Everything here rides on the Trainer's public hooks; the
four private methods it must override, and every other upstream internal it touches, are behind
integrations/internals.py."""

from __future__ import annotations

import inspect
import json
import logging
import signal
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_pt_utils import find_batch_size

from .training import progress
from .backends import run_settings, select_backend
from .backends.base import OptimizerRecipe
from .checkpoints.format import AUTO, newest_valid_checkpoint, read_data_state, read_loss_sum, resume_request
from .data.loader import check_training_data, dataloader_with_batch_sampler, stream_dataloader
from .config.batch import given_record
from .data.samplers import ResumableBatchSampler, check_global_batch
from .data.stream import TrainingStream, is_stream
from .errors import UserError
from .training.chunked_loss import ChunkedHead, chunk_tokens, output_head
from .training.losses import (EvaluationLosses, NumItemsProbe, base_model, finite_for_logging, shifts_labels, sliced,
                              takes_num_items, token_cross_entropy, token_labels)
from .training.batches import MIXED_PACKED_SAMPLES, mixed_packed_samples
from .training.metrics_check import checked_compute_metrics
from .checkpoints.output_lock import hold_output_dir, release_output_dir
from .checkpoints.preemption import Preempted, PreemptionCallback
from .integrations import internals
from .integrations.internals import PrivateTrainerHooks
from .checkpoints.policy import RunCheckpoints, checkpoint_folder, weights_and_step
from .checkpoints.restarts import RestartReport, failure, note_stop
from .checkpoints.final_model import save_final_model
from .training.prepare import prepare_process
from .environment.launcher import check_process_group, release_at_exit
from .config.checks import hub_problems
from .config.optimizer import OptimizerSettings, SchedulerSettings
from .config.own_flags import BatchFlags, LossFlags, flags_of

logger = logging.getLogger(__name__)

LossFn = Callable[[object, torch.Tensor], torch.Tensor]
# Where the Hub client's errors come from (huggingface_hub's own, its HTTP library's: httpx, or httpx2, requests).
HUB_ERROR_MODULES = ("huggingface_hub", "httpx", "httpx2", "requests", "urllib3")
# Trainer's parameters after model and args, in order: the names of the positional arguments ExtTrainer passes on.
TRAINER_PARAMETERS = tuple(inspect.signature(Trainer.__init__).parameters)[3:]


class ExtTrainer(PrivateTrainerHooks, Trainer):
    """`Trainer` plus:

    - `loss_fn(outputs, labels) -> loss`: replaces the model's loss (no subclass needed); one that names a
      `num_items_in_batch` parameter gets the targets of every rank and micro-batch and divides its sum by them;
    - `class_weights` (or `--class_weights 1.0,3.0`) for classification, `--label_smoothing_factor` for any labels;
    - `optimizer_settings` / `scheduler_settings`: the optimizer and schedule, from flags by default.

    A mistake in what it is given raises a `trainer_ext.errors.UserError` (a ValueError; FileNotFoundError too for a
    missing checkpoint); `trainer_ext.one_line_errors()` at the top of a script makes an uncaught one its one line and
    exit status 2. Building it leaves the process's hooks, exit handlers and environment as they were (the process
    group a launcher formed gets an exit handler that releases it before interpreter teardown).
    """

    def __init__(self, model=None, args=None, *positional, loss_fn: LossFn | None = None,
                 class_weights=None, optimizer_settings: OptimizerSettings | None = None,
                 scheduler_settings: SchedulerSettings | None = None, **kwargs):
        _check_trl_arguments(type(self), args)
        # By name: a trainer between this one and transformers' may take other arguments first (TRL's DPOTrainer takes
        # ref_model second, and took these arguments for its reference model). Trainer's order names the positionals.
        named = dict(zip(TRAINER_PARAMETERS, positional))
        if twice := sorted(set(named) & set(kwargs)):
            raise TypeError(f"{type(self).__name__}() got multiple values for argument {twice[0]!r}")
        kwargs.update(named)
        # transformers refuses a stream without max_steps in its __init__, with a traceback: said first
        check_training_data(kwargs.get("train_dataset"), args)
        if problems := hub_problems(args):  # stock arguments were not checked at parsing
            raise UserError(problems[0])
        prepare_process(args)  # the process set-up the arguments leave to training (once: sharded_loading may have)
        self.backend = select_backend(args)  # checks that it can run here
        super().__init__(model=model, args=args, **kwargs)
        # The user's own optimizer: --optim does not say which optimizer a checkpoint's state belongs to.
        self.user_optimizer = self.optimizer is not None or kwargs.get("optimizer_cls_and_kwargs") is not None
        check_process_group(self.args)
        release_at_exit(self)
        self.loss_fn = loss_fn
        weights = class_weights if class_weights is not None else flags_of(LossFlags, self.args).class_weights
        self.class_weights = [float(w) for w in weights] if weights else None
        _check_class_weights(self.class_weights, loss_fn, self.model)
        self.optimizer_settings = optimizer_settings or OptimizerSettings.from_args(self.args)
        self.scheduler_settings = scheduler_settings or SchedulerSettings.from_args(self.args)
        self._model_uses_num_items = None  # whether the loss reads num_items_in_batch: learnt in the first step
        self._logits_wanted = False  # the evaluation step running needs the logits (prediction_step)
        self._said_token_normalisation = False
        self._train_order = None  # the training order (batch sampler or stream); its position goes in every checkpoint
        self._resume = None  # {"checkpoint", "step", "state", "loss_sum"}: the checkpoint resumed, its step, data
        # position and summed training loss
        self._learning_rate_in_use = None  # the rate of the step being trained, where the backend steps in backward
        self._backend_wrapper = None  # (the backend's wrapper, the model it wrapped): see user_model
        self.fresh_optimizer_groups = None  # each group's hyperparameters as this run built them (create_scheduler)
        self._evaluation_model = None  # the backend's engine for an evaluation (see evaluation_loop)
        self._evaluation_losses = None  # the token-weighted loss of the evaluation running (see evaluation_loop)
        self._batches_checked = set()  # "training", "evaluation": the first batch of each was checked (_check_batch)
        self._chunked_loss_compared = set()  # id() of each model whose chunked loss was compared once (a device read)
        self.checkpoints = RunCheckpoints(self)  # resume, publish, rotate, --checkpoint_uri
        # First: its on_save publishes the checkpoint that every later on_save expects in place.
        self.callback_handler.callbacks.insert(0, self.checkpoints)
        for callback in self.backend.callbacks(self):  # before TrainingHooks: a resume's backend state loaded first
            self.add_callback(callback)
        self.add_callback(TrainingHooks(self))
        self.add_callback(RestartReport(self))  # what a restart continues from, and what it cost
        self.training_already_complete = None  # the checkpoint a re-run found complete (train() then trains nothing)
        self.final_model_dir = None  # where train() saved the final model itself (a SageMaker job's SM_MODEL_DIR)
        self.compute_metrics = checked_compute_metrics(self)  # not a dict of numbers: one line, progress saved
        self.preemption = PreemptionCallback()
        self.add_callback(self.preemption)
        progress.install(self)  # main process: bar with samples/s and ETA; resolved settings printed at start
        if self.args.include_num_input_tokens_seen == "all" and self.is_world_process_zero():
            logger.warning("include_num_input_tokens_seen='all' counts the padding of every batch, which depends on how "
                           "each rank's batches are padded (another number of ranks, another count): 'non_padding' "
                           "counts the samples' own tokens (ExtTrainingArguments reads True so)")

    def init_hf_repo(self, token=None, private=None):
        """--push_to_hub's repository, created when the trainer is built (main process): a Hub that cannot be reached
        or a missing token is one line, not the HTTP library's traceback."""
        try:
            return super().init_hf_repo(token, private)
        except Exception as err:
            if not isinstance(err, OSError) and type(err).__module__.split(".")[0] not in HUB_ERROR_MODULES:
                raise
            said = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise UserError(f"--push_to_hub: the Hub repository could not be created ({said}): check the network and "
                            "your token (huggingface-cli login, or HF_TOKEN), or drop --push_to_hub (the model is "
                            "saved in --output_dir)") from err

    # -- losses ----------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The true loss on every rank count: transformers' normalisation by the targets of every rank
        (`num_items_in_batch`) for losses that read it (token-level ones), the per-batch mean as it is for those that
        do not (a classifier's: the Trainer would multiply it by the world size), and ExtTrainer's own losses."""
        if not model.training:  # an evaluation: each batch's own mean (EvaluationLosses weighs them by targets)
            num_items_in_batch = None
        labels = inputs.get("labels")
        if labels is not None and self._chunked_loss_applies(model, inputs):
            return self._chunked_loss(model, inputs, return_outputs, num_items_in_batch)
        if labels is not None and self._custom_loss_requested():
            outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
            loss = self._custom_loss(model, outputs, labels, num_items_in_batch)
            return (loss, outputs) if return_outputs else loss
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            if self._model_uses_num_items is None and model.training:
                return self._learn_whether_loss_reads_num_items(model, inputs, return_outputs, num_items_in_batch)
            self.loss_is_scaled_for_ga = None  # transformers' own, correct for losses normalised by item count
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.loss_is_scaled_for_ga = False  # a per-batch mean: the Trainer divides it by the accumulation steps
        return super().compute_loss(model, inputs, return_outputs, None)

    def _learn_whether_loss_reads_num_items(self, model, inputs, return_outputs, num_items_in_batch):
        """The first training step, as transformers computes it, with `num_items_in_batch` as a tensor that notes being
        read: a loss that divides by it is normalised by every rank's targets (kept, as transformers scales it); one
        that never reads it is a per-batch mean, which transformers multiplied by the world size (undone, and later
        steps pass no count). No forward of its own: under ZeRO-3 a forward outside the engine cannot run."""
        # Under --torch_compile the probe's step runs the module torch.compile wrapped (`_orig_mod`, eagerly): traced
        # with the probe, the graph would be compiled twice (the probe, then plain tensors), minutes on a CPU.
        eager = internals.uncompiled(model)
        loss, outputs = super().compute_loss(eager, inputs, True, NumItemsProbe.of(num_items_in_batch))
        self._model_uses_num_items = self._on_every_rank(NumItemsProbe.read)
        if self._model_uses_num_items:
            self.loss_is_scaled_for_ga = None
            self._say_where_token_losses_are_normalised()
        else:
            self.model_accepts_loss_kwargs = False
            self.loss_is_scaled_for_ga = False
            if self.args.average_tokens_across_devices:
                loss = loss / self.accelerator.num_processes
        return (loss, outputs) if return_outputs else loss

    def _on_every_rank(self, answer: bool) -> bool:
        """`answer` made the same on every rank (any rank's yes): a rank whose first batch holds no target token could
        otherwise decide alone."""
        if self.args.world_size == 1:
            return answer
        decided = torch.tensor([float(answer)], device=self.args.device)
        return bool(self.accelerator.reduce(decided, reduction="sum").item() > 0)

    def _largest_on_every_rank(self, count: int) -> int:
        """The largest `count` of any rank (every rank calls it together)."""
        if self.args.world_size == 1:
            return count
        counts = self.accelerator.gather(torch.tensor([count], device=self.args.device))
        return int(counts.max().item())

    def _say_where_token_losses_are_normalised(self) -> None:
        """Once, when a loss normalised by the targets is computed on several ranks that each count only their own."""
        if self._said_token_normalisation or self.args.average_tokens_across_devices or self.args.world_size == 1:
            return
        self._said_token_normalisation = True
        if self.is_world_process_zero():
            logger.warning("--average_tokens_across_devices false: each of the %d ranks divides its token losses by "
                           "its own target tokens, so losses and gradients differ from one process's on the same "
                           "batches; leave it on (the default) for the same training on any number of ranks",
                           self.args.world_size)

    def _chunked_loss_applies(self, model, inputs) -> bool:
        """Whether this batch's loss is a causal LM's token cross-entropy ExtTrainer takes chunk by chunk through
        lm_head (--chunked_loss, the default): not a user's loss_fn or class weights, not a loss a trainer between
        this one and transformers' computes (TRL's: SFTTrainer has its own chunked one), not an evaluation whose
        metrics read the logits, not under torch.compile or Liger's kernels (fused already)."""
        if not flags_of(LossFlags, self.args).chunked_loss or self.loss_fn is not None \
                or self.class_weights is not None:
            return False
        if self._parent_computes_loss() or (not model.training and self._logits_wanted) \
                or self.args.torch_compile or self.args.use_liger_kernel:
            return False
        module = self.user_model(model)
        return (token_labels(inputs) is not None and shifts_labels(module) and output_head(module) is not None
                and getattr(base_model(module).config.get_text_config(), "final_logit_softcapping", None) is None)

    def _chunked_loss(self, model, inputs, return_outputs, num_items_in_batch):
        """The causal LM's cross-entropy (with --label_smoothing_factor) over its target tokens, taken through lm_head
        a chunk at a time inside the model's own forward (training/chunked_loss.py), normalised as the model's own
        loss is: by the targets of every rank and micro-batch when transformers counted them, else by this batch's."""
        module = self.user_model(model)
        shifted = inputs.get("shift_labels")
        targets = shifted if torch.is_tensor(shifted) else inputs["labels"][:, 1:]
        config = base_model(module).config.get_text_config()
        head = ChunkedHead(output_head(module), targets, not torch.is_tensor(shifted), chunk_tokens(config.vocab_size),
                           self.args.label_smoothing_factor, self._largest_on_every_rank)
        with head:
            outputs = model(**{k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")})
        compare = id(module) not in self._chunked_loss_compared  # once per model: a read of the device
        total = head.loss(outputs, type(base_model(module)).__name__, compare)
        self._chunked_loss_compared.add(id(module))
        normaliser = num_items_in_batch if num_items_in_batch is not None else targets.ne(-100).sum().clamp(min=1)
        loss = self._normalised(total / torch.as_tensor(normaliser, device=total.device), num_items_in_batch is not None)
        if not return_outputs:
            return loss
        return loss, type(outputs)(**{key: value for key, value in outputs.items() if key not in ("logits", "loss")},
                                   loss=loss)

    def _custom_loss_requested(self) -> bool:
        if self.loss_fn is not None or self.class_weights is not None:
            return True
        # Label smoothing is ExtTrainer's unless a trainer between it and transformers' (TRL's) computes losses itself.
        return self.args.label_smoothing_factor > 0 and not self._parent_computes_loss()

    def _parent_computes_loss(self) -> bool:
        parent = getattr(super().compute_loss, "__func__", None)
        return parent is not None and parent is not Trainer.compute_loss

    def _custom_loss(self, model, outputs, labels, num_items_in_batch):
        """loss_fn, or cross-entropy with --class_weights / --label_smoothing_factor; token-level ones (labels per
        token, shifted for causal LMs, also inside PEFT) divided by the targets of every rank and accumulated
        micro-batch, as transformers normalises a model's own token loss."""
        if self.loss_fn is not None:
            if takes_num_items(self.loss_fn):
                loss = self.loss_fn(outputs, labels, num_items_in_batch=num_items_in_batch)
                return self._normalised(loss, num_items_in_batch is not None)
            return self._normalised(self.loss_fn(outputs, labels), False)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        weight = None
        if self.class_weights is not None:
            if len(self.class_weights) != logits.size(-1):
                raise UserError(f"--class_weights has {len(self.class_weights)} values but the model has "
                                 f"{logits.size(-1)} classes")
            weight = getattr(self, "_class_weight_tensor", None)
            if weight is None or weight.device != logits.device:  # once: a copy to the GPU waits for its stream
                weight = self._class_weight_tensor = torch.tensor(self.class_weights, dtype=torch.float32,
                                                                  device=logits.device)
        # A weighted mean divides by the weights of its targets, which transformers does not count: per batch.
        normaliser = num_items_in_batch if weight is None else None
        shift = logits.dim() > 2 and shifts_labels(self.user_model(model))
        loss = token_cross_entropy(logits, labels, shift, self.args.label_smoothing_factor, weight, normaliser)
        return self._normalised(loss, normaliser is not None)

    def _normalised(self, loss, by_every_rank: bool):
        """A loss divided by the targets of every rank is scaled by the world size, which the gradients' mean over
        ranks undoes (as transformers does); else it is a per-batch mean the Trainer divides by the accumulation."""
        self.loss_is_scaled_for_ga = by_every_rank
        if by_every_rank:
            self._say_where_token_losses_are_normalised()
            if self.args.average_tokens_across_devices:
                loss = loss * self.accelerator.num_processes
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        self._check_batch("evaluation", inputs)
        self._logits_wanted = not prediction_loss_only  # compute_metrics reads them: the loss builds them (evaluation)
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        if self._evaluation_losses is not None and loss is not None:
            self._evaluation_losses.add(inputs, loss, lambda count: super(ExtTrainer, self).prediction_step(
                model, sliced(inputs, count, find_batch_size(inputs)), True, ignore_keys=ignore_keys)[0])
        return loss, logits, labels

    # -- optimizer and schedule ------------------------------------------------------------------------
    def create_optimizer(self, model=None):
        if self.optimizer is not None:
            return self.optimizer
        model = model if model is not None else self.model
        # The backend wraps the model and builds the optimizer, in the order it needs (a wrapper of its own is
        # remembered: is_backend_wrapper, user_model); transformers then finds the model wrapped and prepares only the
        # optimizer. None: accelerate wraps it (DDP).
        wrapped, self.optimizer = self.backend.setup_model_and_optimizer(self, model,
                                                                          OptimizerRecipe(self._optimizer_parts))
        if wrapped is not None and wrapped is not model:
            self._backend_wrapper = (wrapped, model)
            internals.set_wrapped_model(self, wrapped)
        return self.optimizer

    def _optimizer_parts(self, model):
        """The optimizer over `model`'s parameters (the backend's shards, where it wrapped first): (parameter groups,
        class, keyword arguments). --optim picks the class and its options as in the Trainer (transformers 5's
        default, adamw_torch_fused, is torch's fused AdamW: measured 0.87x the stock Trainer's samples/s with the
        for-loop AdamW on 2 CPU ranks); the settings give the hyperparameters the class takes."""
        settings = self.optimizer_settings
        decay = set(self.get_decay_parameter_names(model))
        groups = [
            {"params": [p for n, p in model.named_parameters() if n in decay and p.requires_grad],
             "weight_decay": settings.weight_decay},
            {"params": [p for n, p in model.named_parameters() if n not in decay and p.requires_grad],
             "weight_decay": 0.0},
        ]
        optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(self.args, model)
        kwargs.update({key: value for key, value in (("lr", settings.lr), ("betas", settings.betas),
                                                     ("eps", settings.eps)) if key in kwargs or key == "lr"})
        return groups, optimizer_cls, kwargs

    def is_backend_wrapper(self, model) -> bool:
        """Whether `model` is the backend's own wrapper (what its setup_model_and_optimizer returned)."""
        return self._backend_wrapper is not None and model is self._backend_wrapper[0]

    def user_model(self, model=None):
        """The user's model (default: the trainer's) inside whatever trains it: accelerate's wrappers (DDP, a DeepSpeed
        engine) and the backend's own, which is what its setup_model_and_optimizer returned around it; None without a
        model."""
        model = self.model if model is None else model
        if model is None:
            return None
        model = self.accelerator.unwrap_model(model)
        return self._backend_wrapper[1] if self.is_backend_wrapper(model) else model

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is None:
            from transformers import get_scheduler

            settings = self.scheduler_settings
            self.lr_scheduler = get_scheduler(settings.type, optimizer if optimizer is not None else self.optimizer,
                                              num_warmup_steps=settings.warmup_for(num_training_steps),
                                              num_training_steps=num_training_steps,
                                              scheduler_specific_kwargs=settings.kwargs)
            internals.mark_scheduler_created(self)
            # This run's hyperparameters per group, before a resume loads the checkpoint's over them (see
            # RunCheckpoints.continue_with_this_runs_settings).
            optimizer = optimizer if optimizer is not None else self.optimizer
            self.fresh_optimizer_groups = [{key: value for key, value in group.items() if key != "params"}
                                           for group in optimizer.param_groups]
        return self.lr_scheduler

    # -- data ------------------------------------------------------------------------------------------
    def get_train_dataloader(self):
        """One seeded order of samples, cut into the same global batches on every backend and world size, and
        continued after a resume at the sample where the checkpoint stopped: a batch sampler over a dataset with a
        length (data/samplers.py), a rank's share of the stream over an iterable one (data/stream.py)."""
        if self.train_dataset is None:
            raise UserError("ExtTrainer: training requires a train_dataset")
        args = self.args
        shape = dict(rank=args.process_index, world_size=args.world_size,
                     gradient_accumulation_steps=args.gradient_accumulation_steps)
        resume = self._resume
        if is_stream(self.train_dataset):
            check_training_data(self.train_dataset, args)  # also a training set given after construction
            order = TrainingStream(self.train_dataset, internals.train_batch_size(self), **shape)
            if resume is not None:
                how = order.resume(resume["step"], resume["state"], skipped_by_trainer=not args.ignore_data_skip)
                if self.is_world_process_zero():
                    logger.warning("resuming: %s", how)
            dataloader = stream_dataloader(self, order)
        else:
            check_global_batch(args, len(self.train_dataset), args.world_size,  # never the data repeated unasked
                               repeat=flags_of(BatchFlags, args).repeat_small_dataset)
            order = ResumableBatchSampler(
                len(self.train_dataset), internals.train_batch_size(self), seed=args.data_seed if args.data_seed is not None
                else args.seed, drop_last=args.dataloader_drop_last, **shape)
            if resume is not None and resume["state"] is not None:
                for warning in order.load_state_dict(resume["state"]):
                    if self.is_world_process_zero():
                        logger.warning("resuming: %s", warning)
            dataloader = dataloader_with_batch_sampler(self, self.train_dataset, "training", order)
        self._train_order = order
        return dataloader

    def training_loss_sum(self) -> float | None:
        """The sum of every step's training loss (each the mean over ranks) from step 1 to now, as the checkpoint saved
        now records it so that a resumed run's train_loss covers the whole run; None when a resumed checkpoint did not
        record its own. Every rank calls it (the loss not yet logged is gathered)."""
        sums = internals.loss_sums(self)  # transformers' running sums of this train() call
        if sums is None:
            return None
        from transformers.trainer_pt_utils import nested_gather

        unlogged, logged = sums
        if self.args.world_size > 1:
            unlogged = nested_gather(unlogged, self.args.parallel_mode).mean()
        earlier = self._resume["loss_sum"] if self._resume is not None else 0.0
        return None if earlier is None else earlier + logged + unlogged.item()

    def training_order_state(self) -> dict | None:
        """Where the training order stands after the current step (saved with each checkpoint), with the batch the
        command gave, so that its next start on another world size keeps the global batch (config/batch.py)."""
        if self._train_order is None:
            return None
        batch = run_settings(self.args).global_batch
        given = batch.record() if batch is not None else given_record(self.args.per_device_train_batch_size,
                                                                       self.args.gradient_accumulation_steps)
        return {**self._train_order.state_dict(self.state.global_step), "batch_given": given}

    # -- backend hooks ---------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        self._check_batch("training", inputs)
        if self.backend.steps_in_backward:  # transformers would read the rate after the engine stepped
            self._learning_rate_in_use = self.optimizer.param_groups[0]["lr"]
        return finite_for_logging(self, super().training_step(model, inputs, num_items_in_batch))

    def _check_batch(self, kind: str, inputs) -> None:
        """The first batch of training and of evaluation, before the model sees it: one whose samples would attend to
        each other is refused on every rank (any rank's batch decides: a rank stopping alone would hang the others)."""
        if kind in self._batches_checked:
            return
        self._batches_checked.add(kind)
        if self._on_every_rank(mixed_packed_samples(inputs)):
            raise UserError(f"{kind}: {MIXED_PACKED_SAMPLES}")

    def log(self, logs, start_time=None):
        if self._learning_rate_in_use is not None and "learning_rate" in logs:
            logs["learning_rate"] = self._learning_rate_in_use  # transformers reads it after the engine stepped
        return super().log(logs, start_time)

    def save_model(self, output_dir=None, _internal_call=False):
        # A checkpoint (every rank): the backend's own state, written or gathered first; a sharded model's weights.
        state_dict = self.backend.save(self, output_dir if _internal_call else None)
        if state_dict is None:
            return super().save_model(output_dir, _internal_call)
        if self.args.should_save:
            internals.save_weights(self, output_dir or self.args.output_dir, state_dict)

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        """transformers' loop through the backend's evaluation engine; a token-level loss is reported as the mean over
        every target token of the set (transformers averages batch means: it moved with the eval batch size and the
        number of ranks)."""
        with self.backend.evaluating(self) as engine:  # an engine of the backend's own, where it needs one
            self._evaluation_model, self._evaluation_losses = engine, EvaluationLosses(self)
            try:
                output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                                 metric_key_prefix)
                token_loss = self._evaluation_losses.loss()
            finally:
                self._evaluation_model = self._evaluation_losses = None
        if token_loss is not None and f"{metric_key_prefix}_loss" in output.metrics:
            output.metrics[f"{metric_key_prefix}_loss"] = token_loss
        return output

    @property
    def resumed_checkpoint(self) -> str | None:
        """The checkpoint folder this train() resumes (None: it starts fresh, or has not chosen yet)."""
        return self._resume["checkpoint"] if self._resume is not None else None

    def train(self, resume_from_checkpoint=None, **kwargs):
        """Resumes a restarted command by default: with no `resume_from_checkpoint` (or "auto") the newest complete
        checkpoint in output_dir that an earlier process wrote is used, unless --fresh_start; True the newest (an
        error when there is none), False none, a path that one. A SIGTERM/SIGINT ends the run after a checkpoint,
        with `Preempted` (exit status 128 + signal); running the same command again continues exactly."""
        self.training_already_complete, self._resume, self._learning_rate_in_use = None, None, None
        self.final_model_dir = None
        release_at_exit(self)  # a process group formed since the trainer was built
        hold_output_dir(self)  # not the model's own folder, and no other run writing there (checkpoints/output_lock.py)
        try:
            return self.train_in_output_dir(resume_from_checkpoint, **kwargs)
        finally:  # the lock guards a training run, ended or failed: no file of ours is left among the outputs
            release_output_dir(self)

    def train_in_output_dir(self, resume_from_checkpoint, **kwargs):
        """train() once this process holds output_dir's lock."""
        self.checkpoints.open_remote()
        self.checkpoints.clear_staging()
        # No model yet: model_init builds it inside train() (hyperparameter_search drops it between trials).
        module = self.user_model()
        checkpoint = self.checkpoints.to_resume(resume_from_checkpoint,
                                                self.backend.fingerprint(module) if module is not None else None)
        if checkpoint:
            # The run's total, counted as transformers counts it for these flags and this data (epochs or max_steps).
            max_steps = self.set_initial_training_values(self.args, self.get_train_dataloader())[-1]
            finished = self.checkpoints.already_complete(checkpoint, max_steps)
            if finished is not None:
                self.training_already_complete = Path(checkpoint)
                # A job stopped between its last step and the model's save: its finished model into SM_MODEL_DIR.
                self.final_model_dir = save_final_model(self, finished_before=True)
                return finished
            weights_only = self.checkpoints.check_training_state(Path(checkpoint))
            if self.is_world_process_zero():
                logger.warning("resuming from %s%s", checkpoint, " (pass --fresh_start to start over)"
                               if resume_request(resume_from_checkpoint) == AUTO else "")
            state = read_data_state(checkpoint) if not self.args.ignore_data_skip else None
            self._resume = {"checkpoint": checkpoint, "step": resumed_step(checkpoint), "state": state,
                            "loss_sum": read_loss_sum(checkpoint), "weights_only": weights_only}
            if self._resume["loss_sum"] is None and self.is_world_process_zero():
                logger.warning("resuming from %s, which records no training loss before its step %d (written by stock "
                               "transformers, logging elsewhere): train_loss will cover the steps trained from here",
                               checkpoint, self._resume["step"])
        self.backend.before_train(self, checkpoint)
        self.preemption.install()
        try:
            with weights_and_step(Path(checkpoint)) if checkpoint and self._resume["weights_only"] else \
                    nullcontext(checkpoint) as resumed:
                result = super().train(resume_from_checkpoint=str(resumed) if resumed else None, **kwargs)
        except Exception as error:
            if self.state.global_step > 0:  # a rank that outlives a lost peer says where the group had got to
                note_stop(self, failure(error))
            raise
        finally:
            self.preemption.uninstall()
            self.checkpoints.wait()  # a preempted run's last checkpoint too
        if self.preemption.signum:
            saved = newest_valid_checkpoint(checkpoint_folder(self.args))
            if self.args.should_save:
                note_stop(self, f"stopped on {signal.Signals(self.preemption.signum).name}")
            logger.warning("preempted: checkpoint %s written; run the same command again to resume", saved)
            raise Preempted(self.preemption.signum, saved)
        if self.is_world_process_zero():
            Path(self.args.output_dir).mkdir(parents=True, exist_ok=True)
            self.backend.settings().write(self.args.output_dir)
        self.final_model_dir = save_final_model(self)  # a SageMaker job's model.tar.gz is never left empty
        return result


class TrainingHooks(TrainerCallback):
    """What ExtTrainer adds at the Trainer's events: the training order's epoch where transformers cannot reach it,
    and, resuming, this run's settings over the checkpoint's once transformers and the backend loaded it."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        # Resuming, transformers loaded the weights, scheduler and optimizer file, and the backend's callbacks its own
        # state: this run's settings go back over the checkpoint's.
        if trainer.resumed_checkpoint is not None:
            trainer.checkpoints.continue_with_this_runs_settings(Path(trainer.resumed_checkpoint))
            if not args.auto_find_batch_size:  # the loaded state holds the checkpoint's batch; its next save this one's
                state.train_batch_size = internals.train_batch_size(trainer)

    def on_epoch_begin(self, args, state, control, **kwargs):
        # transformers skips a resumed epoch's first batches through a wrapper that hides set_epoch from the sampler;
        # an epoch begins at a multiple of its steps (or at the resumed step, inside the epoch it resumes).
        order = self.trainer._train_order
        if isinstance(order, ResumableBatchSampler):
            order.set_epoch(state.global_step // order.steps_per_epoch)


def resumed_step(checkpoint) -> int:
    """The optimizer step a checkpoint was saved at (its trainer_state.json)."""
    return int(json.loads((Path(checkpoint) / "trainer_state.json").read_text()).get("global_step", 0))


def _check_trl_arguments(trainer_class, args) -> None:
    """A trainer combining ExtTrainer with one of TRL's reads TRL's arguments class too: given ExtTrainingArguments
    alone, TRL rebuilt them as its own and failed on our fields (`unexpected keyword argument 'sharded_ddp'`)."""
    trl_trainer = next((cls for cls in trainer_class.__mro__ if cls.__module__.split(".")[0] == "trl"), None)
    if trl_trainer is None or args is None or any(cls.__module__.split(".")[0] == "trl" for cls in type(args).__mro__):
        return
    config = trl_trainer.__name__.replace("Trainer", "Config")
    shipped = f" (trainer_ext.trl.Ext{config} is that class)" if config in ("SFTConfig", "DPOConfig") else ""
    raise UserError(f"{trainer_class.__name__} combines ExtTrainer with TRL's {trl_trainer.__name__}, which reads its "
                    f"own arguments class: pass a class deriving from both ExtTrainingArguments and trl.{config}"
                    f"{shipped}, not {type(args).__name__}")


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
