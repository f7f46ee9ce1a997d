"""The one door to upstream internals. Every private name of transformers, accelerate, DeepSpeed, torch, datasets and
Optuna that trainer_ext overrides, calls, reads or writes, and every public-named internal it writes (attributes
those libraries set for themselves), is here behind a named function; no other module names one
(tests/unit/test_internals.py greps for them). tests/unit/test_trainer_contract.py checks each against the installed
releases, from UPSTREAM below; docs/versions.md lists them with the reason each is needed.

The four private Trainer methods ExtTrainer must override (no public hook reaches what they change) are
PrivateTrainerHooks, mixed in before the Trainer."""

from __future__ import annotations

import functools
from contextlib import contextmanager


class PrivateTrainerHooks:
    """Mixed in before transformers' Trainer: `class ExtTrainer(PrivateTrainerHooks, Trainer)`."""

    def _get_output_dir(self, trial):
        # Where transformers writes a checkpoint: its staging folder, so that a half-written checkpoint never carries
        # a checkpoint-N name; RunCheckpoints.on_save publishes it complete (the only place this folder is chosen).
        return self.checkpoints.stage(super()._get_output_dir(trial))

    def _wrap_model(self, model, training=True, dataloader=None):
        # evaluation_loop asks this method, not model_wrapped, for the model to run: the backend's evaluation engine
        # (ZeRO-3 before training) must come from here; a backend's own training wrapper (FairScale) is not one
        # accelerate recognises, so transformers would wrap it again.
        if not training and self._evaluation_model is not None:
            return self._evaluation_model
        if training and self.is_backend_wrapper(model):
            return model
        return super()._wrap_model(model, training, dataloader)

    def _clip_grad_norm(self, model):
        # With sharded gradients (FairScale) the norm must be taken over every rank's shard; transformers' only
        # clipping call (accelerate's clip_grad_norm_) would clip each rank by its own shard's norm.
        norm = self.backend.clip_grad_norm(self, model, self.args.max_grad_norm)
        return norm if norm is not None else super()._clip_grad_norm(model)

    def _finalize_training(self, trial, num_train_samples, start_time):
        # transformers adds the loss accumulated since the last log as this rank's own, so the final train_loss
        # depended on --logging_steps and on rank 0's batches; the mean over ranks is what a single process logs.
        # And it averages only this call's steps: after a resume, the sum it divides is made the whole run's.
        # (The only place the remainder is added before train_loss is computed.)
        from transformers.trainer_pt_utils import nested_gather

        if self.args.world_size > 1:
            self._tr_loss = nested_gather(self._tr_loss, self.args.parallel_mode).mean()
        earlier = self._resume.get("loss_sum") if self._resume is not None else None
        if earlier is not None and self.state.global_step > 0:
            unlogged = self._tr_loss.item()
            whole_run = (earlier + self._total_loss_scalar + unlogged) / self.state.global_step
            steps_now = self.state.global_step - self._initial_global_step
            self._total_loss_scalar = whole_run * max(steps_now, 0.001) - unlogged
        return super()._finalize_training(trial, num_train_samples, start_time)


# -- what the contract test checks: (library object, name, kind) for every internal named below --------------------
# kind: "method" (called or overridden: must exist), "attribute" (the library's own code must use it under this name),
# "written" (a public-named attribute the library sets itself and reads later).
UPSTREAM = (
    ("transformers.Trainer", "_get_output_dir", "method"),
    ("transformers.Trainer", "_wrap_model", "method"),
    ("transformers.Trainer", "_clip_grad_norm", "method"),
    ("transformers.Trainer", "_finalize_training", "method"),
    ("transformers.Trainer", "_load_from_checkpoint", "method"),
    ("transformers.Trainer", "_load_callback_state", "method"),
    ("transformers.Trainer", "_remove_unused_columns", "method"),
    ("transformers.Trainer", "_get_collator_with_removed_columns", "method"),
    ("transformers.Trainer", "_save", "method"),
    ("transformers.Trainer", "_save_checkpoint", "method"),
    ("transformers.Trainer", "_tr_loss", "attribute"),
    ("transformers.Trainer", "_total_loss_scalar", "attribute"),
    ("transformers.Trainer", "_initial_global_step", "attribute"),
    ("transformers.Trainer", "_globalstep_last_logged", "attribute"),
    ("transformers.Trainer", "_created_lr_scheduler", "attribute"),
    ("transformers.Trainer", "_train_batch_size", "attribute"),
    ("transformers.TrainingArguments", "_setup_devices", "attribute"),
    ("transformers.Trainer", "model_wrapped", "written"),
    ("transformers.Trainer", "deepspeed", "written"),
    ("transformers.Trainer", "is_deepspeed_enabled", "written"),
    ("accelerate.Accelerator", "scaler", "written"),
    ("accelerate.utils.DeepSpeedPlugin", "hf_ds_config", "written"),
    ("transformers.PretrainedConfig", "_attn_implementation", "attribute"),
    ("transformers.PreTrainedModel", "_no_split_modules", "attribute"),
    ("transformers.PreTrainedModel", "_weight_conversions", "attribute"),
    ("transformers.PreTrainedModel", "from_pretrained", "written"),
    ("torch.optim.lr_scheduler.LRScheduler", "_last_lr", "attribute"),
    ("torch.nn.Module", "_non_persistent_buffers_set", "attribute"),
    ("torch.nn.Module", "_is_fsdp_managed_module", "written"),
    ("torch.nn.Module", "_orig_mod", "attribute"),
    ("torch.distributed.distributed_c10d", "_set_pg_timeout", "method"),
    ("torch._C", "DisableTorchFunctionSubclass", "method"),
    ("deepspeed.runtime.config.DeepSpeedConfig", "_initialize_params", "method"),
    ("deepspeed.comm.torch.TorchBackend", "__compatible_ops__", "attribute"),
    ("datasets.IterableDataset", "_ex_iterable", "attribute"),
    ("optuna.trial.FrozenTrial", "_trial_id", "attribute"),
    ("optuna.storages._heartbeat", "get_heartbeat_thread", "method"),
)


# -- transformers' TrainingArguments -------------------------------------------------------------------------------
def forget_device_setup(args) -> None:
    """Drop transformers' cached device set-up (a cached_property), so that reading `args.device` runs it again."""
    args.__dict__.pop("_setup_devices", None)


# -- transformers' Trainer ---------------------------------------------------------------------------------------
def load_from_checkpoint(trainer, checkpoint) -> None:
    """The weights of a checkpoint folder into the trainer's model, as transformers' resume loads them."""
    trainer._load_from_checkpoint(str(checkpoint))


def load_callback_state(trainer) -> None:
    """Stateful callbacks (early stopping, ...) from trainer.state, as transformers' resume restores them."""
    trainer._load_callback_state()


def remove_unused_columns(trainer, dataset, description: str):
    return trainer._remove_unused_columns(dataset, description=description)


def collator_without_unused_columns(trainer, collator, description: str):
    return trainer._get_collator_with_removed_columns(collator, description=description)


def save_checkpoint(trainer) -> None:
    """A checkpoint of the training so far, exactly as the Trainer writes one at a save step."""
    trainer._save_checkpoint(trainer.model_wrapped, trial=None)


def save_weights(trainer, output_dir, state_dict) -> None:
    """The Trainer's writer of a model's weights, config and tokenizer for a state dict gathered by a backend."""
    trainer._save(output_dir, state_dict=state_dict)


def train_batch_size(trainer) -> int:
    """The per-device batch this train() call runs (auto_find_batch_size may have lowered it)."""
    return trainer._train_batch_size


def set_train_batch_size(trainer, size: int) -> None:
    trainer._train_batch_size = size


def mark_scheduler_created(trainer) -> None:
    """The scheduler is the Trainer's to rebuild on the next train() (as one it created itself)."""
    trainer._created_lr_scheduler = True


def loss_sums(trainer):
    """(loss since the last log as a tensor, sum of the logged losses) of the running train() call; None before."""
    if not hasattr(trainer, "_tr_loss"):
        return None
    return trainer._tr_loss, trainer._total_loss_scalar


def loss_since_last_log(trainer):
    """(the training loss summed on the device since the last logging step, the optimizer steps that sum is divided
    by if this step logs) inside a training loop; None outside one."""
    if not hasattr(trainer, "_tr_loss"):
        return None
    return trainer._tr_loss, 1 + trainer.state.global_step - trainer._globalstep_last_logged


# transformers' training loop filters a non-finite step loss out of the logged loss with this host read of the device
# value after every micro-batch (Trainer._run_epoch, --logging_nan_inf_filter); tests/unit/test_internals.py checks that
# the installed release still reads it so.
NAN_INF_FILTER = "torch.isnan(tr_loss_step) or torch.isinf(tr_loss_step)"


def filtered_on_device(loss):
    """A step loss that was made finite on the device (as transformers' filter would have made it), returned to
    transformers' loop: its NAN_INF_FILTER is answered False without reading the value; every other operation on it
    sees a plain tensor."""
    return loss.as_subclass(_filtered_loss_class())


@functools.cache
def _filtered_loss_class():
    import torch

    checks, plain = (torch.isnan, torch.isinf), torch._C.DisableTorchFunctionSubclass

    class FilteredLoss(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func in checks and len(args) == 1 and not kwargs:
                return False  # finite by construction: the `or` of NAN_INF_FILTER needs a bool, not a device read
            with plain():
                return func(*args, **(kwargs or {}))

    return FilteredLoss


def set_wrapped_model(trainer, model) -> None:
    """What the Trainer runs and saves through (its model_wrapped)."""
    trainer.model_wrapped = model


def set_deepspeed_engine(trainer, engine) -> None:
    """The Trainer's own reference to the DeepSpeed engine it would have built (None: released)."""
    trainer.deepspeed = engine


def set_deepspeed_enabled(trainer, enabled: bool) -> None:
    """Whether the Trainer's code takes its DeepSpeed paths (saving, loading, the engine's step)."""
    trainer.is_deepspeed_enabled = enabled


def set_grad_scaler(trainer, scaler) -> None:
    """accelerate's fp16 gradient scaler, replaced (FairScale's sharded one)."""
    trainer.accelerator.scaler = scaler


def wrap_hf_ds_config(plugin, wrap) -> None:
    """accelerate's DeepSpeed plugin keeps transformers' config object; replaced by `wrap(it)`."""
    plugin.hf_ds_config = wrap(plugin.hf_ds_config)


# -- transformers' models and configs --------------------------------------------------------------------------------
def attention_implementation(config) -> str | None:
    return config._attn_implementation


def set_attention_implementation(config, implementation: str) -> None:
    config._attn_implementation = implementation


def no_split_modules(module) -> tuple:
    """The layer classes a model says must not be split across devices (transformers' own FSDP wrap policy reads it)."""
    return tuple(getattr(module, "_no_split_modules", None) or ())


def keep_used_weight_conversions(model) -> None:
    """transformers' record of the key renamings its loader tried: only those that matched the checkpoint kept."""
    conversions = getattr(model, "_weight_conversions", None)
    if conversions:
        model._weight_conversions = [conversion for conversion in conversions if conversion.was_used()]


@contextmanager
def from_pretrained_replaced(replacement):
    """PreTrainedModel.from_pretrained is `replacement(model_class, *args, **kwargs)` inside (every model class), the
    original afterwards; the original is passed to `replacement` as its first argument's loader."""
    from transformers import PreTrainedModel

    loader = PreTrainedModel.__dict__["from_pretrained"]
    PreTrainedModel.from_pretrained = classmethod(lambda model_class, *args, **kwargs: replacement(
        loader.__func__, model_class, *args, **kwargs))
    try:
        yield
    finally:
        PreTrainedModel.from_pretrained = loader


# -- torch -------------------------------------------------------------------------------------------------------
def uncompiled(model):
    """The module torch.compile wrapped (the model itself when not compiled)."""
    return getattr(model, "_orig_mod", model)


def torch_function_subclass_disabled():
    """Inside, a tensor subclass's __torch_function__ is not called (torch's own idiom for one, from its C module)."""
    import torch

    return torch._C.DisableTorchFunctionSubclass()


def set_last_learning_rates(scheduler, rates) -> None:
    """What the scheduler's get_last_lr() returns (the rate transformers logs)."""
    scheduler._last_lr = list(rates)


def non_persistent_buffer_names(module) -> set:
    return module._non_persistent_buffers_set


def mark_fsdp_managed(model) -> None:
    """torch.compile treats the module as FSDP-managed (its parameters change between calls)."""
    model._is_fsdp_managed_module = True


# -- DeepSpeed, datasets, Optuna ---------------------------------------------------------------------------------
def deepspeed_config_reader(section: str, value):
    """DeepSpeed's own config field readers for one section, without its batch-size checks (which need the whole
    file): DeepSpeedConfig._initialize_params on an otherwise empty config. Raises what DeepSpeed raises."""
    from deepspeed.runtime.config import DeepSpeedConfig

    reader = DeepSpeedConfig.__new__(DeepSpeedConfig)
    reader._initialize_params({section: value})
    return reader


def example_iterable(dataset):
    """datasets' chain of example iterables behind an IterableDataset (None for another object)."""
    return getattr(dataset, "_ex_iterable", None)


def optuna_trial_id(trial) -> int:
    """The storage's id of an Optuna trial (what its storage API is keyed by)."""
    return trial._trial_id


def optuna_heartbeat_thread(trial_id: int, storage):
    """Optuna's own heartbeat for one trial, the thread Study.optimize runs (public API has only record_heartbeat):
    start() stamps at once and then every heartbeat_interval; join() stops it."""
    from optuna.storages._heartbeat import get_heartbeat_thread

    return get_heartbeat_thread(trial_id, storage)


# -- DeepSpeed ----------------------------------------------------------------------------------------------------
def skip_deepspeed_cpu_allreduce_op() -> None:
    """DeepSpeed's communication backend, formed on CPU ranks, compiles and loads its shared-memory all-reduce
    (deepspeed/comm/torch.py, build_shm_op), which only tensor-parallel inference calls (inference_all_reduce); the
    collectives of training go through torch.distributed either way. Marked not compatible, as DeepSpeed itself marks
    an op this machine cannot build (its `deepspeed.ops.__compatible_ops__`, which build_shm_op reads), it is neither
    built (151 s of a 2-core CI run's CPU) nor given its /dev/shm buffer (~66 MB a rank). For this process, as
    DS_ACCELERATOR=cpu is."""
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


# -- torch.distributed -------------------------------------------------------------------------------------------
def set_process_group_timeout(seconds: float) -> None:
    """The default process group's collectives fail after `seconds` (transformers does not pass --ddp_timeout to the
    gloo group of CPU ranks): torch's public set_timeout from 2.15 on; before it, its private setter (the public
    init_process_group takes a timeout only when the group is formed)."""
    from datetime import timedelta

    import torch.distributed

    if hasattr(torch.distributed, "set_timeout"):
        torch.distributed.set_timeout(timedelta(seconds=seconds))
    else:
        from torch.distributed import distributed_c10d

        distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))
