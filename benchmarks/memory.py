"""Measure what one rank really holds while training (bytes of parameters, gradients, optimizer state, peak memory)
and its step times, for any backend, and write them to one JSON file per rank."""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import torch
from transformers import TrainerCallback


def tensor_bytes(tensors) -> int:
    """Bytes of distinct tensors (a tensor seen twice counts once); of a DTensor (FSDP2), this rank's shard; of a
    tensor on the meta device (built empty), none."""
    seen, total = set(), 0
    for tensor in tensors:
        if torch.is_tensor(tensor) and id(tensor) not in seen:
            seen.add(id(tensor))
            local = tensor.to_local() if hasattr(tensor, "device_mesh") else tensor
            total += 0 if local.is_meta else local.numel() * local.element_size()
    return total


def parameter_bytes(parameters) -> int:
    """Bytes of parameters this rank holds: each whole tensor it has now and, under ZeRO-3, its partition of every
    parameter (`ds_tensor`); a partitioned parameter not gathered at the moment holds an empty tensor."""
    parameters = list(parameters)
    return tensor_bytes([*parameters, *(p.ds_tensor for p in parameters if getattr(p, "ds_tensor", None) is not None)])


def parameter_count(model) -> int:
    """Parameters of the whole model (under ZeRO-3 a parameter's own numel is its gathered size only while gathered)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


class LoadPeak:
    """The largest number of parameter bytes this process held while a model was built and loaded (`with LoadPeak()
    as peak: model = ...from_pretrained(...)`; then `peak.bytes`): every parameter registered in the block is
    followed, and their bytes are summed at each registration (a module under construction holds its parameters
    whole until zero.Init partitions it) and every millisecond (weights gathered to be loaded or initialised)."""

    def __init__(self, interval_s: float = 0.001):
        import weakref

        self.parameters = weakref.WeakValueDictionary()
        self.interval_s = interval_s
        self.bytes = 0

    def sample(self) -> None:
        self.bytes = max(self.bytes, parameter_bytes(list(self.parameters.values())))

    def __enter__(self):
        import threading

        original = self._original = torch.nn.Module.register_parameter
        peak = self

        def register_parameter(module, name, param):
            original(module, name, param)
            if param is not None:
                peak.parameters[id(param)] = param
                peak.sample()

        torch.nn.Module.register_parameter = register_parameter
        self._stop = threading.Event()

        def poll():
            while not self._stop.wait(self.interval_s):
                self.sample()

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        torch.nn.Module.register_parameter = self._original
        self._stop.set()
        self._thread.join()
        self.sample()


def state_bytes(optimizer) -> int:
    """Bytes of a torch optimizer's per-parameter tensors (Adam's two moments); step counters excluded."""
    return tensor_bytes(t for state in optimizer.state.values() for t in state.values()
                        if torch.is_tensor(t) and t.dim() > 0)


def innermost_optimizer(optimizer):
    """The optimizer that owns the state: DeepSpeed's ZeRO optimizer, FairScale's OSS, or a torch optimizer
    (accelerate and transformers wrap each of them)."""
    while True:
        if (hasattr(optimizer, "single_partition_of_fp32_groups") or hasattr(optimizer, "fp32_partitioned_groups_flat")
                or type(optimizer).__name__ == "OSS"):
            return optimizer
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            return optimizer
        optimizer = inner


def optimizer_bytes(optimizer) -> dict[str, int]:
    """{'moments': Adam state, 'master': fp32 master weights kept apart from the model (DeepSpeed's partition)}."""
    optimizer = innermost_optimizer(optimizer)
    if hasattr(optimizer, "single_partition_of_fp32_groups"):  # DeepSpeed ZeRO-1/2
        return {"moments": state_bytes(optimizer.optimizer),
                "master": tensor_bytes(optimizer.single_partition_of_fp32_groups)}
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):  # DeepSpeed ZeRO-3
        return {"moments": state_bytes(optimizer.optimizer),
                "master": tensor_bytes(optimizer.fp32_partitioned_groups_flat)}
    if type(optimizer).__name__ == "OSS":  # FairScale: this rank's shard lives in the wrapped optimizer
        return {"moments": state_bytes(optimizer.optim), "master": 0}
    return {"moments": state_bytes(optimizer), "master": 0}


def gradient_bytes(model, optimizer) -> int:
    """Bytes of gradients this rank holds right before the optimizer step."""
    optimizer = innermost_optimizer(optimizer)
    if getattr(optimizer, "grad_partitions_flat_buffer", None) is not None:  # ZeRO-3: this rank's partitions
        return tensor_bytes([optimizer.grad_partitions_flat_buffer])
    if hasattr(optimizer, "averaged_gradients"):  # DeepSpeed ZeRO-2 (and ZeRO-3 offload): this rank's partition
        held = []
        for value in optimizer.averaged_gradients.values():
            held.extend(value if isinstance(value, (list, tuple)) else [value])
        return tensor_bytes(held)
    return tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)


def peak_memory() -> dict[str, int]:
    """Peak resident memory of this process (and peak CUDA memory allocated, on a GPU)."""
    peak = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux: KiB
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        peak["peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
    return peak


class ModelStateReport(TrainerCallback):
    """Writes `<directory>/rank<R>.json` at the end of training: bytes of parameters, gradients (just before the
    optimizer step of step `measure_step`), optimizer state, peak memory, the time each step ended and the logged
    losses. Works with the stock Trainer too (it only reads the model and the optimizer)."""

    def __init__(self, directory, measure_step: int = 2):
        self.directory = Path(directory)
        self.measure_step = measure_step  # after step 1 the optimizer state exists; gradients exist on every step
        self.record: dict = {"step_end_times": []}
        self._wrapped = False

    def _measure_gradients_before_step(self, model, optimizer) -> None:
        """Gradients live between backward and the step (DeepSpeed steps inside accelerate's backward, before any
        callback runs), so the count is taken inside the innermost optimizer's step."""
        target = innermost_optimizer(optimizer)
        step = target.step
        callback = self

        def measured_step(*args, **kwargs):
            if len(callback.record["step_end_times"]) + 1 == callback.measure_step:
                callback.record["grads_bytes"] = gradient_bytes(model, target)
            return step(*args, **kwargs)

        target.step = measured_step
        self._wrapped = True

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if not self._wrapped and optimizer is not None:
            self._measure_gradients_before_step(model, optimizer)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.record["step_end_times"].append(time.perf_counter())
        if state.global_step == self.measure_step:
            self.record["params_bytes"] = parameter_bytes(model.parameters())
            self.record["params_devices"] = sorted({(p.to_local() if hasattr(p, "device_mesh") else p).device.type
                                                    for p in model.parameters()})  # where this rank's shards live
            self.record["num_parameters"] = parameter_count(model)
            self.record.update({f"{k}_bytes": v for k, v in optimizer_bytes(optimizer).items()})

    def on_train_begin(self, args, state, control, **kwargs):
        self.record["train_begin_time"] = time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        self.record.update(peak_memory())
        self.record["losses"] = [row["loss"] for row in state.log_history if "loss" in row]
        self.record.update(rank=args.process_index, world_size=args.world_size, global_step=state.global_step,
                           per_device_train_batch_size=args.per_device_train_batch_size,
                           gradient_accumulation_steps=args.gradient_accumulation_steps, pid=os.getpid())
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"rank{args.process_index}.json"
        path.write_text(json.dumps(self.record, indent=1) + "\n")
