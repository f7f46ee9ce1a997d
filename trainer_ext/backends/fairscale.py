"""FairScale sharded data parallelism (--sharded_ddp): `simple` shards the optimizer state (OSS) and reduces each
gradient to the rank that owns it (ShardedDataParallel); `zero_dp_2` / `zero_dp_3` shard parameters too
(FullyShardedDataParallel, CUDA only), `offload` keeps them on the CPU."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..config.values import option_words
from ..errors import ArgumentsError, closest
from ..integrations import internals
from .base import Backend, BackendFormula, ResolvedSettings, RunSettings

logger = logging.getLogger(__name__)

INSTALL = "pip install fairscale==0.4.13 (or pip install 'trainer_ext[fairscale]')"
OPTIONS = ("simple", "zero_dp_2", "zero_dp_3", "offload")
# ShardedDataParallel's default reduce_buffer_size (elements): small gradients destined for another rank are reduced
# through a bucket of this size, which stays allocated (fairscale/nn/data_parallel/sharded_ddp.py).
SHARDED_DDP_BUCKET = 2 ** 23


@dataclass
class FairScaleFlags:
    """This backend's own flag, composed into ExtTrainingArguments by the registry (backends.flag_classes)."""
    sharded_ddp: list[str] | None = field(
        default=None,
        metadata={"help": "FairScale sharded DDP: 'simple', or 'zero_dp_2'/'zero_dp_3' optionally with 'offload' "
                          f"(space separated). Options: {', '.join(OPTIONS)}."},
    )


class FairScaleBackend(Backend):
    name = "fairscale"
    flag = "sharded_ddp"
    flags = FairScaleFlags
    library = "fairscale"
    install = INSTALL
    needs_process_group = True  # `python script.py --sharded_ddp simple`: OSS on one rank, as --deepspeed does
    flag_takes_options = True

    @classmethod
    def owned_flag_problems(cls, args) -> list[str]:
        try:
            parse_options(args.sharded_ddp)
        except ArgumentsError as err:
            return [str(err)]
        return []

    @classmethod
    def settle(cls, args, batch) -> tuple[dict, RunSettings]:
        import torch

        options = parse_options(args.sharded_ddp)  # the option list the backend reads
        check_machine(options, torch.cuda.is_available(), bool(args.fp16 or args.bf16))
        # The flag's own field holds what it settled. FSDP with offload keeps the fp32 shards where it finds the
        # model and asserts they are on the CPU: the Trainer must not move it.
        return {"sharded_ddp": options}, RunSettings(place_model_on_device=False if "offload" in options else None)

    memory_formulas = (
        # OSS shards Adam's moments, ShardedDataParallel reduces each gradient to its owner; weights stay fp32.
        # A rank also keeps one fp32 gradient bucket per other rank between steps.
        BackendFormula("simple", "--sharded_ddp simple", (4, False), (4, True), (8, True), 1.0, preference=30,
                       autocast=True,
                       extra=lambda n, world, _, __: {"grads": 4 * min(SHARDED_DDP_BUCKET, n / world) * (world - 1)},
                       note="OSS places whole tensors: a rank's share is 1/N up to the largest tensor; grads "
                            "include ShardedDDP's buckets for the other ranks, up to min(2^23, Ψ/N) fp32 elements "
                            "each (the most loaded rank)"),
        # FullyShardedDataParallel keeps an fp32 shard; without resharding after forward the full (compute-dtype)
        # parameters stay gathered through backward.
        BackendFormula("zero_dp_2", "--sharded_ddp zero_dp_2", (4, True), (4, True), (8, True), 1.0,
                       cuda_only=True, preference=40, frozen_sharded=True,
                       extra=lambda _, world, everything, weight: {"params": everything * weight},
                       note="params include the full {weight}-byte parameters, gathered through forward and "
                            "backward"),
        BackendFormula("zero_dp_3", "--sharded_ddp zero_dp_3", (4, True), (4, True), (8, True), 1.5,
                       cuda_only=True, preference=60, frozen_sharded=True,
                       note="plus one layer's gathered parameters at a time"),
    )

    def __init__(self, args=None):
        super().__init__(args)
        self.options = list(getattr(args, "sharded_ddp", None) or [])
        self.fully_sharded = "zero_dp_2" in self.options or "zero_dp_3" in self.options
        self.offload = "offload" in self.options

    def settings(self) -> ResolvedSettings:
        return ResolvedSettings(f"fairscale --sharded_ddp {' '.join(self.options)}")

    # -- model and optimizer -----------------------------------------------------------------------------
    def setup_model_and_optimizer(self, trainer, model, optimizer):
        """`simple`: OSS (the optimizer state sharded) built first, which ShardedDataParallel takes. zero_dp_2/3:
        FullyShardedDataParallel first, the optimizer built on its flat shards."""
        if trainer.args.fp16:
            from fairscale.optim.grad_scaler import ShardedGradScaler

            # inf checks and unscaling must see every shard, not only this rank's (before accelerate takes the scaler)
            internals.set_grad_scaler(trainer, ShardedGradScaler())
        if self.fully_sharded:
            wrapped = self.wrap(trainer, model)
            groups, optimizer_cls, kwargs = optimizer.parts(wrapped)
            built = optimizer_cls(groups, **optimizer_kwargs_for_scaler(kwargs, trainer.args, self.options))
            if trainer.args.fp16 or trainer.args.bf16:
                built.register_step_pre_hook(grads_in_parameter_dtype)
            return wrapped, built
        from fairscale.optim import OSS

        # Prepared here, without device placement: accelerate moves an optimizer's state by reading state_dict(),
        # which OSS refuses before consolidation; transformers' own prepare call then leaves it as it is.
        groups, optimizer_cls, kwargs = optimizer.parts(model)
        built = trainer.accelerator.prepare(OSS(params=groups, optim=optimizer_cls, **kwargs), device_placement=[False])
        return self.wrap(trainer, model, built), built

    def wrap(self, trainer, model, oss=None):
        """The model in ShardedDataParallel over the OSS optimizer `oss` (`simple`), else in FullyShardedDataParallel
        (once: a later train() finds it wrapped)."""
        from fairscale.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel

        if isinstance(model, (ShardedDataParallel, FullyShardedDataParallel)):
            return model
        # The Trainer's model never passes through accelerate's prepare once we wrap it: without this its forward
        # would run in fp32 under --fp16/--bf16 (measured: `simple --fp16` at 0.17x the plain run on an H100). Only
        # autocast (and --torch_compile) is applied; accelerate wraps nothing in evaluation mode.
        model = trainer.accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
        if not self.fully_sharded:
            return ShardedDataParallel(model, sharded_optimizer=sharded_optimizer(oss))
        if self.offload and any(p.device.type != "cpu" for p in model.parameters()):
            model = model.to("cpu")  # FSDP keeps the fp32 shards where it finds them; offload asserts the CPU
        return FullyShardedDataParallel(model, **fsdp_settings(self.options, trainer.args))

    # -- steps and checkpoints -------------------------------------------------------------------------
    def clip_grad_norm(self, trainer, model, max_norm: float):
        """A norm over all shards: every rank gets the same total norm and the same clipping factor. Under --fp16 the
        gradients are unscaled first, as accelerate does before it clips (else the loss scale would be clipped)."""
        trainer.accelerator.unscale_gradients()
        if self.fully_sharded:
            return model.clip_grad_norm_(max_norm)
        return sharded_optimizer(trainer.optimizer).clip_grad_norm(max_norm)

    def save(self, trainer, folder):
        """OSS: into a checkpoint, the sharded optimizer state gathered on rank 0 (a collective: every rank takes part)
        so that transformers saves one plain optimizer state dict, which resumes on any number of ranks. FSDP: the
        unsharded weights, gathered from every rank (collective)."""
        if not self.fully_sharded:
            if folder is not None:
                sharded_optimizer(trainer.optimizer).consolidate_state_dict(recipient_rank=0)
            return None
        return {k: v.cpu() for k, v in trainer.model_wrapped.state_dict().items()}


def parse_options(value) -> list[str]:
    """`--sharded_ddp "zero_dp_2 offload"` (or a list) -> ["zero_dp_2", "offload"], with transformers v4 rules."""
    words = option_words(value)
    problems = []
    for word in words:
        if word not in OPTIONS:
            hint = closest(word, OPTIONS)
            problems.append(f"--sharded_ddp: unknown option {word!r}" + (f", did you mean {hint!r}?" if hint else "")
                            + f" (valid: {', '.join(OPTIONS)})")
    if problems:
        raise ArgumentsError("\n".join(problems))
    if len(set(words)) != len(words):
        raise ArgumentsError(f"--sharded_ddp {' '.join(words)!r}: an option is repeated")
    if "simple" in words and len(words) > 1:
        raise ArgumentsError(f"--sharded_ddp {' '.join(words)!r}: 'simple' takes no other option; "
                             "use 'simple' alone, or 'zero_dp_2'/'zero_dp_3' [offload]")
    if "zero_dp_2" in words and "zero_dp_3" in words:
        raise ArgumentsError("--sharded_ddp: 'zero_dp_2' and 'zero_dp_3' exclude each other; choose one")
    if "offload" in words and not ({"zero_dp_2", "zero_dp_3"} & set(words)):
        raise ArgumentsError("--sharded_ddp offload needs 'zero_dp_2' or 'zero_dp_3' "
                             "(e.g. --sharded_ddp \"zero_dp_2 offload\")")
    return words


def check_machine(options: list[str], cuda_available: bool, mixed_precision: bool) -> None:
    """The FullyShardedDataParallel options need CUDA, and FairScale offloads only in mixed precision."""
    flag = f"--sharded_ddp {' '.join(options)}"
    if ({"zero_dp_2", "zero_dp_3"} & set(options)) and not cuda_available:
        raise ArgumentsError(f"{flag}: FairScale's FullyShardedDataParallel needs CUDA and this machine has none; "
                             "use --sharded_ddp simple (optimizer state sharded, works on CPU)")
    if "offload" in options and not mixed_precision:
        raise ArgumentsError(f"{flag}: FairScale offloads parameters to the CPU only in mixed precision (its FP32 "
                             "master shard lives there); add --fp16 or --bf16")


def fsdp_settings(options: list[str], args) -> dict:
    """FullyShardedDataParallel's arguments for these --sharded_ddp options and precision flags."""
    import torch

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
