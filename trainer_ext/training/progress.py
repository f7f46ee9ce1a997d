"""What a long run shows on its main process: a progress bar with samples/s and ETA, and the backend settings that were
actually resolved, printed once when training starts."""

from __future__ import annotations

import time

from transformers import ProgressCallback, TrainerCallback


class SamplesProgressCallback(ProgressCallback):
    """transformers' progress bar (main process only; tqdm shows the ETA) with samples/s over the whole run."""

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        self._start, self._start_step = time.perf_counter(), state.global_step  # a resumed run starts later

    def on_step_end(self, args, state, control, **kwargs):
        super().on_step_end(args, state, control, **kwargs)
        if state.is_world_process_zero and self.training_bar is not None:
            elapsed = time.perf_counter() - self._start
            samples = (state.global_step - self._start_step) * state.train_batch_size * args.gradient_accumulation_steps \
                * args.world_size
            if elapsed > 0:
                self.training_bar.set_postfix({"samples/s": f"{samples / elapsed:.1f}"}, refresh=False)


class SettingsCallback(TrainerCallback):
    """Prints the resolved backend settings once, on the main process, when training starts."""

    def __init__(self, backend):
        self.backend = backend

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            print(describe_settings(self.backend, args, state), flush=True)


def describe_settings(backend, args, state) -> str:
    """One block: backend, ranks, batch arithmetic, precision, steps, and the backend's own resolved settings."""
    precision = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
    # A resumed state holds the checkpoint's batch size; it is the one trained only when auto_find_batch_size found it.
    per_device = (state.train_batch_size if args.auto_find_batch_size and state.train_batch_size
                  else args.per_device_train_batch_size)
    settings = backend.settings()
    lines = [f"trainer_ext: backend {settings.description} on {args.world_size} rank(s), device {args.device.type}",
             f"  batch {per_device} per device x {args.gradient_accumulation_steps} accumulation x {args.world_size} "
             f"ranks = {per_device * args.gradient_accumulation_steps * args.world_size} per step; "
             f"{state.max_steps} steps; {precision}"]
    lines += [f"  {line}" for line in settings.lines]
    return "\n".join(lines)


def install(trainer) -> None:
    """Swap transformers' bar for ours (same place, same main-process rule) and add the settings print."""
    if not trainer.args.disable_tqdm and trainer.callback_handler.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(SamplesProgressCallback())
    trainer.add_callback(SettingsCallback(trainer.backend))
