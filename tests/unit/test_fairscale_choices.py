"""FairScale's CUDA-only modes (FSDP: zero_dp_2/zero_dp_3, offload) pinned on a CPU machine: the arguments FSDP gets,
the optimizer it steps under fp16, the gradient dtypes that optimizer sees, and where the Trainer leaves the model.
Each choice fixes a failure measured on an H100; tests/integration/test_cuda.py runs them for real where a GPU is present."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainingArguments

from trainer_ext import ExtTrainingArguments
from trainer_ext.backends.fairscale import (FairScaleBackend, check_machine, fsdp_settings,
                                           grads_in_parameter_dtype, optimizer_kwargs_for_scaler)
from trainer_ext.errors import ArgumentsError


def flags(fp16=False, bf16=False, device="cuda:0"):
    return SimpleNamespace(fp16=fp16, bf16=bf16, device=torch.device(device))


@pytest.fixture(scope="module")
def world_of_one():
    """A gloo process group of one rank in this process: FairScale's FSDP can then be built (not run) on a CPU."""
    import torch.distributed as dist

    from conftest import free_port

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


# What each --sharded_ddp mode means (transformers 4.x's Trainer, which introduced the flags): zero_dp_2 keeps the
# parameters gathered from forward to backward, zero_dp_3 reshards them; fp16/bf16 compute in that dtype over fp32
# shards; offload keeps the parameters in CPU memory.
@pytest.mark.fairscale
@pytest.mark.parametrize("options,precision,expected", [
    (["zero_dp_2"], {}, dict(reshard_after_forward=False, mixed_precision=False, compute_dtype=torch.float32,
                             move_params_to_cpu=False)),
    (["zero_dp_3"], {"fp16": True}, dict(reshard_after_forward=True, mixed_precision=True, compute_dtype=torch.float16,
                                         move_params_to_cpu=False)),
    (["zero_dp_3", "offload"], {"bf16": True}, dict(reshard_after_forward=True, mixed_precision=True,
                                                    compute_dtype=torch.bfloat16, move_params_to_cpu=True)),
])
def test_fsdp_gets_the_options_and_precision_asked_for(world_of_one, options, precision, expected):
    """A wrong compute dtype or a lost offload would train in another precision or run out of GPU memory; a keyword
    FairScale does not read, or flattened parameters, would lose them silently. Read back from FairScale's own FSDP."""
    from fairscale.nn.data_parallel import FullyShardedDataParallel

    settings = fsdp_settings(options, flags(**precision))
    assert settings["compute_device"] == torch.device("cuda:0")
    wrapped = FullyShardedDataParallel(torch.nn.Linear(4, 4), **{**settings, "compute_device": torch.device("cpu")})
    assert {key: getattr(wrapped, key) for key in expected} == expected
    # names kept (no flattening): the optimizer's no-decay group still finds the biases and LayerNorm weights
    assert sorted(name.rsplit(".", 1)[-1] for name, _ in wrapped.named_parameters()) == ["bias", "weight"]


def test_fused_adamw_is_swapped_for_foreach_only_under_fsdp_fp16():
    """FairScale's ShardedGradScaler calls step(grad_scaler=...) on torch's fused AdamW, which rejects it (TypeError)."""
    fused = {"lr": 1e-3, "fused": True}
    assert optimizer_kwargs_for_scaler(fused, flags(fp16=True), ["zero_dp_2"]) == {"lr": 1e-3, "fused": False,
                                                                                     "foreach": True}
    assert optimizer_kwargs_for_scaler(fused, flags(bf16=True), ["zero_dp_2"]) is fused  # no scaler under bf16
    assert optimizer_kwargs_for_scaler({"lr": 1e-3}, flags(fp16=True), ["zero_dp_3"]) == {"lr": 1e-3}
    # the contract the swap relies on: fused AdamW unscales for itself, foreach AdamW leaves it to the scaler
    parameter = [torch.nn.Parameter(torch.zeros(2))]
    assert getattr(torch.optim.AdamW(parameter, fused=True), "_step_supports_amp_scaling", False)
    assert not getattr(torch.optim.AdamW(parameter, foreach=True), "_step_supports_amp_scaling", False)


@pytest.mark.parametrize("implementation", [{"foreach": True}, {"fused": True}])
def test_bf16_gradients_of_fp32_parameters_are_cast_before_the_step(implementation):
    """FSDP on one rank leaves gradients in the compute dtype; foreach/fused AdamW refuse a bf16 grad on an fp32
    parameter. With the hook the step equals the step on the fp32 gradient."""
    master = torch.arange(4, dtype=torch.float32)
    gradient = torch.tensor([0.5, -1.0, 2.0, 0.25])
    # as FSDP leaves it: backward on the bf16 copy, then the parameter's data swapped back to the fp32 shard
    weights = torch.nn.Parameter(master.to(torch.bfloat16))
    weights.grad = gradient.to(torch.bfloat16)
    weights.data = master.clone()
    assert (weights.dtype, weights.grad.dtype) == (torch.float32, torch.bfloat16)
    reference = torch.nn.Parameter(master.clone())
    reference.grad = gradient.to(torch.bfloat16).float()
    optimizer = torch.optim.AdamW([weights], lr=0.1, **implementation)
    optimizer.register_step_pre_hook(grads_in_parameter_dtype)
    optimizer.step()
    torch.optim.AdamW([reference], lr=0.1, **implementation).step()
    assert weights.grad.dtype == torch.float32
    assert torch.equal(weights, reference)


def test_offload_keeps_the_model_where_fsdp_wants_it(monkeypatch):
    """FSDP with move_params_to_cpu asserts the fp32 shards are on the CPU: the Trainer must not move the model to the
    GPU first (transformers' place_model_on_device hook, which a rename in transformers would silently bypass)."""
    assert isinstance(TrainingArguments.__dict__["place_model_on_device"], property)
    args = ExtTrainingArguments(output_dir="unused", use_cpu=True, report_to="none")
    assert args.place_model_on_device is None  # transformers decides, as before
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # only CUDA machines accept it, settling it so
    fields, run = FairScaleBackend.settle(SimpleNamespace(sharded_ddp="zero_dp_2 offload", fp16=True, bf16=False),
                                          batch=None)
    assert fields == {"sharded_ddp": ["zero_dp_2", "offload"]} and run.place_model_on_device is False
    args.sharded_ddp, args.run_settings = fields["sharded_ddp"], replace(run, backend="fairscale")
    assert args.place_model_on_device is False


def test_offload_requires_mixed_precision():
    """FairScale offloads only in mixed precision: "zero_dp_2 offload" without --fp16/--bf16 must say to add one."""
    with pytest.raises(ArgumentsError, match="offload.*mixed precision.*--fp16 or --bf16"):
        check_machine(["zero_dp_2", "offload"], cuda_available=True, mixed_precision=False)
    check_machine(["zero_dp_2", "offload"], cuda_available=True, mixed_precision=True)
