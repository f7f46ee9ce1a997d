"""DeepSpeed ZeRO: transformers' integration runs the engine; we hand it the translator's complete config
(real world size, real step count, the model's hidden size) and align its scheduler with transformers'."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback

from ..deepspeed_config import resolve_deepspeed_config
from .base import Backend

logger = logging.getLogger(__name__)

INSTALL = "pip install 'deepspeed>=0.19,<0.20' (or pip install 'trainer_ext[deepspeed]')"
# Consecutive bf16 steps with a non-finite gradient norm after which the run stops: there is no loss scale to lower,
# so the same failure on every batch means the weights or the data, not one unlucky batch, produce inf/NaN.
MAX_CONSECUTIVE_NONFINITE = 10


class DeepSpeedBackend(Backend):
    name = "deepspeed"

    def __init__(self):
        self.resolution = None
        self.overflow_check = None  # how a ZeRO step detects a non-finite gradient, once the engine exists

    def check(self, args) -> None:
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            raise ImportError(f"--deepspeed needs DeepSpeed, which is not installed: {INSTALL}")

        from ..args import cpu_ranks, launch_one_rank_without_launcher
        from ..cuda_arch import prepare_for_deepspeed
        from ..leftovers import clear_leftovers
        from ..options import check_fp16_device

        launch_one_rank_without_launcher()  # stock arguments whose device is not set up yet
        clear_leftovers()  # DeepSpeed loads its optimizer op later, in deepspeed.initialize
        if not cpu_ranks(args):
            prepare_for_deepspeed()  # plain TrainingArguments did not: DeepSpeed could not build FusedAdam

        # Plain TrainingArguments never ran our parse-time checks: the file may enable fp16 on a CPU machine.
        user_config = getattr(args, "deepspeed_user_config", None) or args.deepspeed
        resolution = resolve_deepspeed_config(args, user_config, final=False, cpu_ranks=cpu_ranks(args))
        fp16 = resolution.config.get("fp16", {}).get("enabled") is True
        check_fp16_device(fp16, torch.cuda.is_available(), "fp16" in resolution.effective_flags)

    def before_prepare(self, trainer, num_training_steps: int, resume_from_checkpoint=None) -> None:
        args = trainer.args
        model = trainer.accelerator.unwrap_model(trainer.model)
        hidden_size = getattr(getattr(model, "config", None), "hidden_size", None)
        # ExtTrainingArguments keeps the file as the user wrote it; plain TrainingArguments keep `deepspeed` as is.
        user_config = getattr(args, "deepspeed_user_config", None) or args.deepspeed
        self.resolution = resolve_deepspeed_config(args, user_config, world_size=args.world_size,
                                                   num_training_steps=num_training_steps, hidden_size=hidden_size,
                                                   cpu_ranks=args.device.type == "cpu")
        for flag, value in self.resolution.effective_flags.items():
            if hasattr(args, flag):
                setattr(args, flag, value)
        if resume_from_checkpoint:
            self._reshard_if_world_size_changed(trainer, Path(resume_from_checkpoint))
        hf_config = trainer.accelerator.state.deepspeed_plugin.hf_ds_config
        # In place: accelerate's plugin holds the same dict. The translator already checked every field against
        # the flags; transformers' argument-time checks saw the world size before the process group existed.
        hf_config.config.clear()
        hf_config.config.update(self.resolution.config)
        hf_config.mismatches = []
        if trainer.is_world_process_zero():
            notes = "".join(f"\n  note: {note}" for note in self.resolution.notes)
            logger.warning("DeepSpeed config (resolved for %d ranks, %d steps):\n%s%s", args.world_size,
                           num_training_steps, json.dumps(self.resolution.config, indent=2), notes)

    def _reshard_if_world_size_changed(self, trainer, checkpoint: Path) -> None:
        """DeepSpeed cannot load ZeRO optimizer shards saved by another number of ranks; its universal
        checkpoint format can. Convert once (main process), load it for this run only."""
        saved = saved_world_size(checkpoint)
        world_size = trainer.args.world_size
        if saved is None or saved == world_size:
            return
        tag = (checkpoint / "latest").read_text().strip()
        universal = checkpoint / f"{tag}_universal"
        if trainer.is_world_process_zero() and not (checkpoint / "latest_universal").is_file():
            logger.warning("checkpoint %s was saved on %d ranks, resuming on %d: converting its ZeRO state to "
                           "DeepSpeed's universal format", checkpoint, saved, world_size)
            command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                       str(checkpoint / tag), "--output_folder", str(universal), "--inject_missing_state"]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"converting {checkpoint} to a universal checkpoint failed:\n{done.stderr[-3000:]}")
        trainer.accelerator.wait_for_everyone()
        # Only for this load: with load_universal on, a later ordinary resume would look for latest_universal.
        self.resolution.config.setdefault("checkpoint", {})["load_universal"] = True
        self.resolution.notes.append(f"resuming a {saved}-rank ZeRO checkpoint on {world_size} ranks (universal)")

    def after_prepare(self, trainer) -> None:
        from deepspeed.runtime.lr_schedules import WarmupCosineLR, WarmupLR

        engine = trainer.model_wrapped
        scheduler = getattr(engine, "lr_scheduler", None)
        # DeepSpeed builds its scheduler at iteration -1 and applies that value to the first step; transformers'
        # step k uses iteration k. One step here aligns them (a resumed checkpoint then overwrites the state).
        if isinstance(scheduler, (WarmupLR, WarmupCosineLR)) and scheduler.last_batch_iteration == -1:
            scheduler.step()
        self.overflow_check = check_overflow_by_norm(getattr(engine, "optimizer", None))
        if not any(isinstance(callback, SkippedSteps) for callback in trainer.callback_handler.callbacks):
            trainer.add_callback(SkippedSteps(trainer))

    def evaluates_plain_model(self, trainer) -> bool:
        # Below ZeRO-3 every rank holds all parameters, so evaluating before training needs no engine; stock
        # transformers insists on one and fails ("ZeRO inference only makes sense with ZeRO Stage 3").
        config = trainer.accelerator.state.deepspeed_plugin.hf_ds_config.config
        return trainer.deepspeed is None and config.get("zero_optimization", {}).get("stage", 0) < 3

    def learning_rate_in_use(self, trainer) -> float | None:
        # accelerate runs engine.step() (optimizer and scheduler) inside backward, before transformers reads
        # the rate "before the update"; the engine's rate before the training step is the one used.
        engine = trainer.model_wrapped
        return engine.get_lr()[0] if hasattr(engine, "get_lr") else None

    def save_resolved_config(self, output_dir) -> None:
        if self.resolution is not None:
            path = Path(output_dir) / "ds_config.resolved.json"
            path.write_text(json.dumps(self.resolution.config, indent=2) + "\n")

    def describe(self) -> str:
        return "deepspeed ZeRO-%s" % (self.resolution.config["zero_optimization"].get("stage") if self.resolution else "?")


def check_overflow_by_norm(optimizer) -> str:
    """Let the gradient norm alone decide whether a ZeRO-1/2 step overflowed; returns how overflow is detected.

    DeepSpeed decides twice in DeepSpeedZeroOptimizer.step(): check_overflow() scans every gradient of the partition
    for inf/NaN (4 small kernels per parameter: 785 parameters on BERT-large, 50 ms of a 66 ms bf16 step on an H100,
    CPU-bound), then the norm it computes for clipping anyway, in fp64 per gradient, is tested (is_invalid_grad_norm,
    unless bf16 with check_grad_overflow off). A gradient holding inf or NaN makes that norm non-finite and an fp64
    sum of squares of finite fp16/bf16 values cannot overflow, so the scan adds nothing but time: the same steps are
    skipped and fp16's loss scale moves the same way. DeepSpeed has no public switch for this (fp16 always scans,
    bf16's check_grad_overflow turns off both tests), so the scan is replaced on this optimizer instance; a test
    fails if DeepSpeed renames check_overflow or stops testing the norm."""
    try:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    except ImportError:
        return "DeepSpeed's own"
    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        return "DeepSpeed's own (not a ZeRO-1/2 optimizer)"
    if not getattr(optimizer, "check_grad_overflow", False):
        return ("none: bf16.check_grad_overflow is false in the config, a non-finite gradient norm is not detected"
                if optimizer.dtype == torch.bfloat16 else "gradient norm (fp32)")
    # With offload the scan runs in the gradient hooks (local_overflow); MoE and ZenFlow change the norm: keep theirs.
    if (optimizer.cpu_offload or not optimizer.compute_grad_norm or optimizer.has_moe_layers
            or getattr(optimizer, "zenflow", False) or not callable(getattr(optimizer, "check_overflow", None))):
        return "DeepSpeed's per-parameter scan"

    def check_overflow(partition_gradients=True):
        optimizer.overflow = False  # decided in step() from the gradient norm, right after this call

    optimizer.check_overflow = check_overflow
    return "gradient norm (a non-finite norm skips the step; no per-parameter scan)"


class SkippedSteps(TrainerCallback):
    """Names each optimizer step DeepSpeed skipped for a non-finite gradient norm under bf16 (under fp16 skips are the
    loss scale's normal search and DeepSpeed logs them), and stops a bf16 run after MAX_CONSECUTIVE_NONFINITE in a
    row: the weights are still those of the last good step, and every further step would be skipped too."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.consecutive = []

    def on_optimizer_step(self, args, state, control, **kwargs):
        engine = self.trainer.model_wrapped
        if not args.bf16 or not hasattr(engine, "was_step_applied") or engine.was_step_applied():
            self.consecutive = []
            return
        step = state.global_step + 1
        norm = engine.get_global_grad_norm()
        self.consecutive.append(step)
        main = self.trainer.is_world_process_zero()
        if main:
            logger.warning("step %d skipped: gradient norm %s is not finite (bf16; a gradient holds inf or NaN); "
                           "weights and optimizer state are unchanged", step, norm)
        if len(self.consecutive) >= MAX_CONSECUTIVE_NONFINITE:
            raise NonFiniteGradients(
                f"steps {self.consecutive[0]}-{step}: the gradient norm was not finite {len(self.consecutive)} times "
                f"in a row under bf16, so training stopped; the weights are those after step {self.consecutive[0] - 1} "
                "(finite, not saved again). Lower --learning_rate, raise --warmup_steps or check the data for "
                "inf/NaN, then resume from the last checkpoint", main)


class NonFiniteGradients(SystemExit):
    """Training cannot go on: every recent step had a non-finite gradient norm. Exit status 1, the reason printed
    once (by the main process), no traceback: every rank took the same decision from the same all-reduced norm."""

    def __init__(self, message: str, main_process: bool = True):
        self.message = message
        super().__init__(f"trainer_ext: error: {message}" if main_process else 1)


def saved_world_size(checkpoint: Path) -> int | None:
    """Data-parallel ranks a DeepSpeed checkpoint was saved on (one ZeRO optimizer shard file each)."""
    latest = Path(checkpoint) / "latest"
    if not latest.is_file():
        return None
    shards = list((Path(checkpoint) / latest.read_text().strip()).glob("*zero_pp_rank_*_optim_states.pt"))
    return len(shards) or None
