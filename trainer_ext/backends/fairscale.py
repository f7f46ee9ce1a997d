"""FairScale sharded data parallelism (--sharded_ddp): `simple` shards the optimizer state (OSS) and reduces each
gradient to the rank that owns it (ShardedDataParallel); `zero_dp_2` / `zero_dp_3` shard parameters too
(FullyShardedDataParallel, CUDA only), `offload` keeps them on the CPU."""

from __future__ import annotations

import importlib.util
import logging

import torch

from .base import Backend

logger = logging.getLogger(__name__)

INSTALL = "pip install fairscale==0.4.13 (or pip install 'trainer_ext[fairscale]')"


class FairScaleBackend(Backend):
    name = "fairscale"

    def __init__(self, options: list[str]):
        self.options = list(options)
        self.fully_sharded = "zero_dp_2" in options or "zero_dp_3" in options
        self.offload = "offload" in options

    def describe(self) -> str:
        return f"fairscale --sharded_ddp {' '.join(self.options)}"

    def check(self, args) -> None:
        """Machine and precision were checked at argument parsing (options.check_sharded_ddp_machine)."""
        if importlib.util.find_spec("fairscale") is None:
            raise ImportError(f"--sharded_ddp {' '.join(self.options)} needs FairScale, which is not installed: "
                              f"{INSTALL}")

    # -- optimizer -------------------------------------------------------------------------------------
    def build_optimizer(self, trainer, param_groups, optimizer_cls, kwargs):
        if self.fully_sharded:
            kwargs = optimizer_kwargs_for_scaler(kwargs, trainer.args, self.options)
            optimizer = optimizer_cls(param_groups, **kwargs)
            if trainer.args.fp16 or trainer.args.bf16:
                optimizer.register_step_pre_hook(grads_in_parameter_dtype)
            return optimizer
        from fairscale.optim import OSS

        return OSS(params=param_groups, optim=optimizer_cls, **kwargs)

    def wraps_before_optimizer(self) -> bool:
        return self.fully_sharded

    # -- model -----------------------------------------------------------------------------------------
    def wrap_model(self, trainer, model):
        from fairscale.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel

        if isinstance(model, (ShardedDataParallel, FullyShardedDataParallel)):
            return model
        # The Trainer's model never passes through accelerate's prepare once we wrap it: without this its forward
        # would run in fp32 under --fp16/--bf16 (measured: `simple --fp16` at 0.17x the plain run on an H100). Only
        # autocast (and --torch_compile) is applied; accelerate wraps nothing in evaluation mode.
        model = trainer.accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
        if not self.fully_sharded:
            return ShardedDataParallel(model, sharded_optimizer=sharded_optimizer(trainer.optimizer))
        if self.offload and any(p.device.type != "cpu" for p in model.parameters()):
            model = model.to("cpu")  # FSDP keeps the fp32 shards where it finds them; offload asserts the CPU
        return FullyShardedDataParallel(model, **fsdp_settings(self.options, trainer.args))

    def unwrap(self, model):
        from fairscale.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel

        model = model.module if isinstance(model, (ShardedDataParallel, FullyShardedDataParallel)) else model
        return getattr(model, "_orig_mod", model)  # --torch_compile

    def before_prepare(self, trainer, num_training_steps: int, resume_from_checkpoint=None) -> None:
        if trainer.args.fp16:
            from fairscale.optim.grad_scaler import ShardedGradScaler

            # inf checks and unscaling must see every shard, not only this rank's
            trainer.accelerator.scaler = ShardedGradScaler()
        # accelerate moves an optimizer's state by reading state_dict(), which OSS refuses before consolidation
        self._device_placement = trainer.accelerator.device_placement
        trainer.accelerator.device_placement = False

    def after_prepare(self, trainer) -> None:
        trainer.accelerator.device_placement = self._device_placement

    # -- steps and checkpoints -------------------------------------------------------------------------
    def clip_grad_norm(self, trainer, model, max_norm: float):
        """A norm over all shards: every rank gets the same total norm and the same clipping factor. Under --fp16 the
        gradients are unscaled first, as accelerate does before it clips (else the loss scale would be clipped)."""
        trainer.accelerator.unscale_gradients()
        if self.fully_sharded:
            return model.clip_grad_norm_(max_norm)
        return sharded_optimizer(trainer.optimizer).clip_grad_norm(max_norm)

    def before_optimizer_save(self, trainer) -> None:
        """Gather the sharded state on rank 0 (a collective: every rank takes part) so it saves one plain
        optimizer state dict, which resumes on any number of ranks."""
        if not self.fully_sharded:
            sharded_optimizer(trainer.optimizer).consolidate_state_dict(recipient_rank=0)

    def full_state_dict(self, trainer):
        """FSDP: the unsharded weights, gathered from every rank (collective); None when nothing is sharded."""
        if not self.fully_sharded:
            return None
        return {k: v.cpu() for k, v in trainer.model_wrapped.state_dict().items()}

    def optimizer_state_bytes(self, trainer) -> int:
        """Bytes of optimizer state (Adam moments) this rank holds."""
        optimizer = sharded_optimizer(trainer.optimizer)
        inner = getattr(optimizer, "optim", optimizer)
        return state_bytes(inner)


def fsdp_settings(options: list[str], args) -> dict:
    """FullyShardedDataParallel's arguments for these --sharded_ddp options and precision flags."""
    mixed = bool(args.fp16 or args.bf16)
    return {"reshard_after_forward": "zero_dp_3" in options, "mixed_precision": mixed,
            "compute_dtype": torch.bfloat16 if args.bf16 else torch.float16 if mixed else torch.float32,
            "move_params_to_cpu": "offload" in options,
            "compute_device": args.device if args.device.type == "cuda" else None,
            "flatten_parameters": False}  # keeps parameter names, so biases and LayerNorm get no weight decay


def optimizer_kwargs_for_scaler(kwargs: dict, args, options: list[str]) -> dict:
    """FairScale's ShardedGradScaler (FSDP under --fp16) calls `step(grad_scaler=...)` on any optimizer that unscales
    for itself, which torch's fused Adam/AdamW (--optim adamw_torch_fused, transformers 5's default) does and then
    rejects the keyword (TypeError at the first step, measured on an H100). Its foreach implementation runs the same
    update without that contract."""
    if not (args.fp16 and kwargs.get("fused")):
        return kwargs
    logger.info("--sharded_ddp %s with --fp16: torch's fused AdamW cannot run under FairScale's ShardedGradScaler; "
                "using its foreach implementation (same update)", " ".join(options))
    return {**kwargs, "fused": False, "foreach": True}


def grads_in_parameter_dtype(optimizer, args, kwargs) -> None:
    """Optimizer pre-step hook: FSDP in mixed precision leaves the gradients of parameters it does not shard (every
    parameter on one rank) in the compute dtype, beside fp32 parameters; fused and foreach Adam refuse the mix ("Tensors
    of the same index must be on the same device and the same dtype", measured on an H100 with --bf16)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None and param.grad.dtype != param.dtype:
                param.grad = param.grad.to(param.dtype)


def sharded_optimizer(optimizer):
    """The FairScale optimizer under accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def state_bytes(optimizer) -> int:
    return sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
               if torch.is_tensor(t) and t.dim() > 0)
