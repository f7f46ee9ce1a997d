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


class ActivationCounter:
    """The bytes of activations one training step of `model` holds at its peak moments, counted on any device (CPU
    ranks have no peak-memory counter): enter before the forward, leave after the backward. During the forward: every
    tensor autograd saves for backward (torch's saved-tensor hooks; deduplicated by storage; parameters, views of them
    and scalars left out), those saved inside the model's layers apart; the logits the model returns; the two
    gradients the cross entropy's backward holds (its log-softmax node's); with gradient checkpointing, what one layer
    saves when it is recomputed (the first layer run once more as its recomputation runs it, its graph dropped).
    `results()['activation_peak_bytes']`: the larger of the cross entropy's backward (everything saved, plus its two
    gradients) and a layer's recomputation (what the layers saved, plus that layer's): the two moments
    trainer_ext.planner.decoder_activation_bytes predicts."""

    def __init__(self, model):
        from transformers.modeling_layers import GradientCheckpointingLayer

        self.model = model
        self.layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        self.saved: dict[int, int] = {}  # storage -> bytes, for the whole forward
        self.in_layers: set[int] = set()
        self.recomputed: dict[int, int] = {}
        self.logits_bytes = self.loss_backward_bytes = 0
        self.recording = self.inside_layer = False
        self.handles: list = []

    def _kept(self, tensor, into: dict) -> bool:
        """Counts a saved tensor's storage once; parameters (a ZeRO-3 or FSDP2 gathered one too) and scalars are not
        activations."""
        parameter = isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter)
        if parameter or tensor.dim() == 0:
            return False
        storage = tensor.untyped_storage()
        if storage.data_ptr() in self.parameter_storages or storage.nbytes() == 0:
            return False
        into.setdefault(storage.data_ptr(), storage.nbytes())
        return True

    def _pack(self, tensor):
        if self.recording and self._kept(tensor, self.saved):
            if self.inside_layer:
                self.in_layers.add(tensor.untyped_storage().data_ptr())
            node = tensor.grad_fn
            if type(node).__name__ == "LogSoftmaxBackward0" and not self.loss_backward_bytes:
                self.loss_backward_bytes = -1  # hooked once
                node.register_hook(self._loss_backward)
        return tensor

    def _loss_backward(self, grad_inputs, grad_outputs):
        self.loss_backward_bytes = tensor_bytes([*grad_inputs, *grad_outputs])

    def _probe(self, layer, checkpoint):
        """The layer's checkpointing function, which first runs the layer as its recomputation will, counting what it
        saves (once)."""
        def probing(function, *args, **kwargs):
            layer._gradient_checkpointing_func = checkpoint
            # the layer's input, which the checkpoint holds already, is not counted twice
            held = {arg.untyped_storage().data_ptr(): 0 for arg in args if torch.is_tensor(arg)}
            with torch.autograd.graph.saved_tensors_hooks(lambda t: (self._kept(t, held), t)[1], lambda t: t):
                function(*args, **kwargs)
            self.recomputed = {key: size for key, size in held.items() if size}
            return checkpoint(function, *args, **kwargs)
        return probing

    def __enter__(self):
        self.parameter_storages = {(p.to_local() if hasattr(p, "device_mesh") else p).untyped_storage().data_ptr()
                                   for p in self.model.parameters()}
        for layer in self.layers:
            self.handles.append(layer.register_forward_pre_hook(lambda *_: setattr(self, "inside_layer", True)))
            self.handles.append(layer.register_forward_hook(lambda *_: setattr(self, "inside_layer", False)))
        self.checkpoint = None
        if self.layers and getattr(self.layers[0], "gradient_checkpointing", False):
            first, self.checkpoint = self.layers[0], self.layers[0]._gradient_checkpointing_func
            first._gradient_checkpointing_func = self._probe(first, self.checkpoint)
        self.handles.append(self.model.get_output_embeddings().register_forward_hook(
            lambda module, inputs, output: setattr(self, "logits_bytes", tensor_bytes([output]))))
        self.handles.append(self.model.register_forward_hook(lambda *_: setattr(self, "recording", False)))
        self.recording = True
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)
        for handle in self.handles:
            handle.remove()
        if self.checkpoint is not None:  # the probe not run (no forward): the layer's own function back
            self.layers[0]._gradient_checkpointing_func = self.checkpoint

    def results(self) -> dict[str, int]:
        saved, in_layers = sum(self.saved.values()), sum(self.saved[key] for key in self.in_layers)
        recomputed = sum(self.recomputed.values())
        return {"saved_bytes": saved, "saved_in_layers_bytes": in_layers, "recomputed_layer_bytes": recomputed,
                "logits_bytes": self.logits_bytes, "loss_backward_bytes": max(self.loss_backward_bytes, 0),
                "activation_peak_bytes": max(saved + max(self.loss_backward_bytes, 0),
                                             in_layers + recomputed if recomputed else 0)}


class ActivationReport(TrainerCallback):
    """ActivationCounter over training step `measure_step`, its results written into `record` (a ModelStateReport's,
    to share its file)."""

    def __init__(self, record: dict, measure_step: int = 2):
        self.record = record
        self.measure_step = measure_step
        self.counter = None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step + 1 == self.measure_step:
            self.counter = ActivationCounter(model).__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self.counter is not None:
            self.counter.__exit__(None, None, None)
            self.record.update(self.counter.results())
            self.counter = None
