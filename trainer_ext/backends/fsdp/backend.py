"""PyTorch FSDP2 (`--fsdp full_shard|shard_grad_op [offload] [auto_wrap]` with transformers' `--fsdp_config` keys):
parameters, gradients and optimizer state sharded over the ranks by torch's `fully_shard`, applied by this backend
itself on CPU ranks (gloo) and GPUs alike; every checkpoint holds the consolidated Hugging Face model and the
optimizer's shards (torch.distributed.checkpoint), which resume on any number of ranks."""

from __future__ import annotations

import functools
import json
import logging
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from ...errors import ArgumentsError, UserError
from ...integrations import internals
from ..base import Backend, BackendFormula, ResolvedSettings
from ..spec import RunSettings, given_as, settled_for
from .settings import SHARDS, FSDPSettings, resolve_settings

logger = logging.getLogger(__name__)


class FSDPBackend(Backend):
    name = "fsdp"
    flag = "fsdp"
    owned_flags = ("fsdp", "fsdp_config")
    needs_process_group = True  # fully_shard needs a process group, also for one process
    checkpoint_state = (SHARDS,)
    optimizer_state = checkpoint_state
    rank_written_state = "each rank's optimizer shard"
    flag_takes_options = True  # fully_shard is public from torch 2.6, setup.py's floor: no library to check

    @classmethod
    def owned_flag_problems(cls, args) -> list[str]:
        fsdp, fsdp_config = getattr(args, "fsdp", None), getattr(args, "fsdp_config", None)
        if given_as(cls, args) is None:
            return ["--fsdp_config is read only with --fsdp: add --fsdp full_shard, or drop --fsdp_config"] \
                if fsdp_config else []
        return resolve_settings(fsdp, fsdp_config)[2]

    @classmethod
    def settle(cls, args, batch) -> tuple[dict, RunSettings]:
        from ...environment.launcher import cpu_ranks

        settings, config, problems = resolve_settings(args.fsdp, args.fsdp_config)
        if problems:  # stock TrainingArguments (ExtTrainingArguments said them before settling)
            raise ArgumentsError("\n".join(problems))
        if settings.offload and cpu_ranks(args):
            raise ArgumentsError(f"{given_as(cls, args)}: offload moves the shards from the GPU to CPU memory, and on "
                                 "CPU ranks they are there already: drop offload (and cpu_offload/offload_params)")
        # fsdp_config read once (a file or inline JSON), as transformers then reads it. fully_shard moves each rank's
        # shards to the device (as transformers leaves an FSDP model where it was built); an empty model (partitioned
        # loading) cannot be moved at all.
        return {"fsdp_config": config}, RunSettings(settled=settings, place_model_on_device=False)

    @classmethod
    def arguments_ready(cls, args) -> dict:
        # accelerate turns FSDP on for GPUs only, and would then shard the model itself; this backend wraps it on
        # every device, so accelerate is given no FSDP plugin.
        return {"fsdp_plugin_args": None}

    @classmethod
    def prepare_process(cls, args) -> dict:
        """What transformers must see for training: no FSDP plugin for stock TrainingArguments too, and on one process
        its --fsdp hidden."""
        from transformers.training_args import ParallelMode

        values = {} if args.run_settings.parsed else cls.arguments_ready(args)
        if args.parallel_mode != ParallelMode.DISTRIBUTED and args.fsdp:
            # transformers refuses --fsdp on one process ("only works in distributed training"); fully_shard on a
            # mesh of one rank trains as one process and writes checkpoints any number of ranks resume. The flag is
            # hidden from that check; the settings (run_settings) select this backend.
            values["fsdp"] = False
        return values

    @classmethod
    @contextmanager
    def model_sharded_context(cls, args):
        """With `--fsdp_config cpu_ram_efficient_loading true` on N ranks, rank 0 builds and loads the model as the
        script asks; every other rank builds it empty (torch's meta device: shapes, no data) and receives only its
        shards from rank 0 once fully_shard has split the model (shard()). Otherwise, nothing changes."""
        if partitioned_loading(args) and getattr(args, "place_model_on_device", None) is not False:
            # stock TrainingArguments leave placement to transformers' Trainer, which moves the model to the device
            # before it is sharded: an empty model cannot be moved.
            raise ArgumentsError("--fsdp_config cpu_ram_efficient_loading needs trainer_ext's ExtTrainingArguments: "
                                 "with stock TrainingArguments the Trainer moves the model to the device before it "
                                 "is sharded, which the other ranks' empty models cannot be; parse the flags with "
                                 "ExtArgumentParser(ExtTrainingArguments), or drop cpu_ram_efficient_loading")
        if not partitioned_loading(args) or args.process_index == 0:
            yield
            return
        with built_empty():
            yield

    # fp32 shards of the parameters (the master weights under --bf16/--fp16), their gradients and Adam's moments;
    # only the layer being computed is gathered, in the compute dtype.
    memory_formulas = (
        BackendFormula("fsdp", "--fsdp full_shard", (4, True), (4, True), (8, True), 1.5, preference=55,
                       frozen_sharded=True,
                       note="plus one layer's {compute} parameters gathered at a time (transient)"),
        BackendFormula("fsdp_shard_grad_op", "--fsdp shard_grad_op", (4, True), (4, True), (8, True), 1.0,
                       preference=35, frozen_sharded=True,
                       extra=lambda _, world, everything, weight: {"params": everything * weight},
                       note="params include the whole model's {compute} parameters, gathered through forward "
                            "and backward"),
    )

    def __init__(self, args=None):
        super().__init__(args)  # the library (stock TrainingArguments did not ask)
        self.resolved: FSDPSettings | None = self.settled
        self.model = None  # the model fully_shard was applied to (the root)
        self.optimizer = None  # the torch optimizer over its shards
        self.optimizer_file = None  # what transformers' optimizer file holds (OptimizerFile)

    # -- model and optimizer ---------------------------------------------------------------------------------------
    def setup_model_and_optimizer(self, trainer, model, optimizer):
        """The model sharded first; the optimizer built on the shards fully_shard made (DTensor parameters)."""
        from torch.distributed.tensor import DTensor

        wrapper = self.shard_model(trainer, model)
        groups, optimizer_cls, kwargs = optimizer.parts(wrapper)
        if not all(isinstance(p, DTensor) for group in groups for p in group["params"]):
            raise RuntimeError("FSDP2: the optimizer would step gathered parameters, not the shards fully_shard made")
        self.optimizer = optimizer_cls(groups, **kwargs)
        self.optimizer_file = OptimizerFile(self.optimizer)
        return wrapper, self.optimizer

    def shard_model(self, trainer, model):
        """fully_shard applied to the model (once: a later train() finds it sharded), and the object to train
        through."""
        from torch.distributed.fsdp import FSDPModule

        if getattr(model, "wraps_fully_sharded", False):
            return model
        if not isinstance(model, FSDPModule):
            shard(model, self.resolved, trainer.args)
            # autocast under --bf16/--fp16 as DDP runs it (softmax, norms, losses in fp32), over the policy's
            # 16-bit parameters; accelerate wraps nothing in evaluation mode.
            trainer.accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
        self.model = model
        # A distinct object: transformers trains through it and prepares only the optimizer (accelerate would
        # wrap the sharded model in DDP); evaluation and generation run the model itself.
        return wrapper_class()(model)

    @contextmanager
    def evaluating(self, trainer):
        # Evaluating before training under partitioned loading: the other ranks' models are still empty, so the model
        # is sharded (and filled from rank 0) now; training then finds it sharded.
        if self.model is None and partitioned_loading(trainer.args):
            self.shard_model(trainer, trainer.model)
        try:
            yield None
        finally:
            if self.model is not None:
                reshard(self.model)

    # -- steps -----------------------------------------------------------------------------------------------------
    def clip_grad_norm(self, trainer, model, max_norm: float):
        """One norm over every rank's gradient shards (a plain tensor, as transformers logs it); every rank clips its
        shard by the same factor. Under --fp16 the loss scale comes out first, as accelerate does."""
        from torch.distributed.tensor import DTensor
        from torch.nn.utils import clip_grads_with_norm_, get_total_norm

        trainer.accelerator.unscale_gradients()
        parameters = [p for p in self.model.parameters() if p.grad is not None]
        norm = get_total_norm([p.grad for p in parameters])
        total = norm.full_tensor() if isinstance(norm, DTensor) else norm
        if isinstance(norm, DTensor):
            clip_grads_with_norm_(parameters, max_norm, DTensor.from_local(total, norm.device_mesh))
        else:
            clip_grads_with_norm_(parameters, max_norm, total)
        return total

    # -- checkpoints -----------------------------------------------------------------------------------------------
    def save(self, trainer, folder):
        """Into a checkpoint, every rank writes its optimizer shard into `<checkpoint>/optimizer_shards`
        (torch.distributed.checkpoint: one file per rank and the layout, which any number of ranks can read back);
        transformers' optimizer file then says where the state is. Returns the whole model (full_state_dict)."""
        if folder is not None and self.model is not None and self.optimizer is not None \
                and not trainer.args.save_only_model:
            self.save_optimizer_shards(folder)
        return self.full_state_dict()

    def save_optimizer_shards(self, folder) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        self.optimizer_file.stub_next = False
        state = {"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
        dcp.save(state, checkpoint_id=str(Path(folder) / SHARDS))
        self.optimizer_file.stub_next = True

    def callbacks(self, trainer) -> list:
        from transformers import TrainerCallback

        backend = self

        class ResumeShards(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                backend.load_optimizer_shards(trainer, trainer.resumed_checkpoint)

        return [ResumeShards()]

    def load_optimizer_shards(self, trainer, checkpoint) -> None:
        """Resuming (`checkpoint`; None: nothing), once transformers prepared the optimizer: its shards, re-sharded
        by torch.distributed.checkpoint for this run's ranks (the weights came from the checkpoint's consolidated
        model, loaded by transformers before wrapping)."""
        if checkpoint is None:
            return
        folder = Path(checkpoint) / SHARDS
        if not folder.is_dir():
            if trainer._resume and trainer._resume.get("weights_only"):  # said by RunCheckpoints.check_training_state
                return
            raise UserError(f"checkpoint {checkpoint} has no {SHARDS}/ (written by another backend): resume it with "
                            "the backend that wrote it, or pass --fresh_start")
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        self.optimizer_file.stub_next = False
        state = {"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
        dcp.load(state, checkpoint_id=str(folder))
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])

    def full_state_dict(self):
        """The whole model, gathered tensor by tensor into the main process's CPU memory (every rank takes part)."""
        if self.model is None:  # not wrapped yet (evaluation only): every rank holds the whole model
            return None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    @classmethod
    def fingerprint(cls, module) -> dict:
        fingerprint = super().fingerprint(module)  # a DTensor's numel is the whole parameter's
        fingerprint["model_class"] = fingerprint["model_class"].removeprefix("FSDP")  # fully_shard's class, as
        return fingerprint  # transformers names it in config.json

    # -- what it tells ---------------------------------------------------------------------------------------------
    def settings(self) -> ResolvedSettings:
        if self.resolved is None:
            return ResolvedSettings("fsdp2")
        import torch.distributed as dist

        # the mesh is this device type's; its collectives run on the process group accelerate made (nccl, gloo)
        group = f" (process group: {dist.get_backend()})" if dist.is_initialized() else ""
        lines = [f"fully_shard on a {self.args.device.type} mesh of {self.args.world_size} rank(s){group} "
                 f"{json.dumps(asdict(self.resolved))}"]
        compute = "bf16" if self.args.bf16 else "fp16" if self.args.fp16 else None
        if compute:  # what MixedPrecisionPolicy does (shard): users check that the upcast is applied
            lines.append(f"mixed precision: {compute} parameters gathered for forward and backward, gradients reduced "
                         "in fp32, the fp32 shards (master weights) stepped and saved")
        if partitioned_loading(self.args):
            lines.append("partitioned loading (cpu_ram_efficient_loading): rank 0 loads the model, the other ranks "
                         "build it empty and receive only their shards from rank 0 after fully_shard")
        return ResolvedSettings(f"fsdp2 {self.resolved.describe()}", tuple(lines),
                                {"fsdp_settings.resolved.json": asdict(self.resolved)})


def reshard(model) -> None:
    """Every group back to its shards. Under shard_grad_op a forward without backward (evaluation) leaves the gathered
    parameters registered on the modules: an optimizer built then would step copies FSDP frees, and they would hold
    the whole model's memory until the next backward."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def partitioned_loading(args) -> bool:
    """Whether rank 0 alone loads the model (cpu_ram_efficient_loading on more than one rank)."""
    settings = settled_for(FSDPBackend, args)
    if settings is None and given_as(FSDPBackend, args) is not None:  # stock TrainingArguments not prepared yet
        settings = resolve_settings(args.fsdp, args.fsdp_config)[0]
    return settings is not None and settings.cpu_ram_efficient_loading and args.world_size > 1


@contextmanager
def built_empty():
    """Models built in this block hold no data (torch's meta device): a model class called directly or from_config
    through torch's default device, from_pretrained through `device_map="meta"` (transformers refuses the default
    device there), which reads each tensor and keeps none."""
    import torch

    def from_pretrained(load, model_class, *args, **kwargs):
        model = load(model_class, *args, **{**kwargs, "device_map": "meta"})
        # the map is ours, not the user's: transformers' Trainer would take the model as placed by hand
        model.__dict__.pop("hf_device_map", None)
        return model

    with internals.from_pretrained_replaced(from_pretrained), torch.device("meta"):
        yield


def sharding_choices(device_type: str, bf16: bool, fp16: bool, offload: bool) -> dict:
    """What fully_shard is given on this device, by name (pure, so each choice is pinned by a unit test): the mesh's
    device type (the rank's own: cuda on GPUs, cpu on CPU ranks), MixedPrecisionPolicy's dtypes and the offload
    policy."""
    compute = "bfloat16" if bf16 else "float16" if fp16 else None
    return {
        "mesh_device_type": device_type,
        # 16-bit copies for forward and backward, fp32 shards (the master weights), gradients reduced in fp32.
        "param_dtype": compute,
        "reduce_dtype": "float32" if compute else None,
        "offload_policy": "CPUOffloadPolicy" if offload else "OffloadPolicy",
    }


def shard(model, settings: FSDPSettings, args) -> None:
    """fully_shard on each wrap unit (transformer layers, or modules of at least min_num_params), then on the model
    itself, which keeps every parameter left over; on a mesh of all ranks of this device type (gloo on CPU). Under
    partitioned loading the other ranks' empty models are then filled from rank 0's, shard by shard."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    choices = sharding_choices(args.device.type, args.bf16, args.fp16, settings.offload)
    mesh = init_device_mesh(choices["mesh_device_type"], (args.world_size,))
    policy = MixedPrecisionPolicy(**{key: getattr(torch, choices[key]) if choices[key] else None
                                     for key in ("param_dtype", "reduce_dtype")})
    options = dict(mesh=mesh, reshard_after_forward=settings.reshard_after_forward, mp_policy=policy,
                   offload_policy=CPUOffloadPolicy() if choices["offload_policy"] == "CPUOffloadPolicy"
                   else OffloadPolicy())
    if settings.activation_checkpointing:
        # transformers' own: each layer recomputed in backward, parameter names unchanged (named activation_
        # checkpointing from transformers 5.23, gradient_checkpointing before)
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        elif hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    partitioned = partitioned_loading(args)
    # Rank 0's whole model, referenced before fully_shard frees it (rank 0 holds it and its shards until filled).
    whole = {**model.state_dict(), **non_persistent_buffers(model)} if partitioned and args.process_index == 0 \
        else None
    for module in wrap_units(model, settings):
        fully_shard(module, **options)
    fully_shard(model, **options)
    if partitioned:
        fill_from_rank0(model, whole, args.device, args.process_index)
    if hasattr(model, "generate"):
        from torch.distributed.fsdp import register_fsdp_forward_method

        register_fsdp_forward_method(model, "generate")  # gathered for generation as for forward
        # transformers' mark of an FSDP2 model: generation keeps the ranks in step (synced_gpus), as every rank
        # must join each layer's all-gather.
        internals.mark_fsdp_managed(model)


def fill_from_rank0(model, whole: dict | None, device, rank: int) -> None:
    """Partitioned loading's second half, on every rank once fully_shard has split the model: the other ranks allocate
    their shards (empty), then rank 0 broadcasts its tensors one at a time and each rank copies in its slice; buffers
    outside the state dict (non-persistent ones, as BERT's position_ids) whole. A rank holds its shards plus one whole
    tensor at a time (as torch's set_model_state_dict(broadcast_from_rank0) and accelerate's FSDP2 loading do)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    if rank != 0:
        if rank == 1 and any(not p.is_meta for p in model.parameters()):
            logger.warning("--fsdp_config cpu_ram_efficient_loading: rank 1 built the model whole; build it inside "
                           "`with trainer_ext.sharded_loading(args):` so that only rank 0 loads it")
        model.to_empty(device=device)  # this rank's shards only; a tied parameter stays one tensor
    with torch.no_grad():
        for name, target in {**model.state_dict(), **non_persistent_buffers(model)}.items():
            if rank == 0:
                received = whole[name].detach().to(device).contiguous()
            else:
                received = torch.empty(target.shape, dtype=target.dtype, device=device)
            dist.broadcast(received, src=0)
            if rank == 0:  # its shards were cut from these very tensors
                continue
            if isinstance(target, DTensor):  # this rank's slice, as fully_shard cut it
                received = distribute_tensor(received, target.device_mesh, target.placements,
                                             src_data_rank=None).to_local()
                target = target.to_local()
            target.copy_(received)


def non_persistent_buffers(model) -> dict:
    """Buffers a module keeps out of its state dict, by their full names."""
    return {f"{prefix}.{name}" if prefix else name: buffer for prefix, module in model.named_modules()
            for name, buffer in module.named_buffers(recurse=False)
            if name in internals.non_persistent_buffer_names(module)}


def wrap_units(model, settings: FSDPSettings) -> list:
    """The submodules sharded on their own, innermost first. A module holding a parameter it shares with another
    module (tied embeddings) stays in the model's own group."""
    from collections import Counter

    import torch

    # containers (ModuleList, ModuleDict) run no forward of their own, so fully_shard cannot hook them
    modules = [(name, module) for name, module in model.named_modules()
               if module is not model and type(module).forward is not torch.nn.Module.forward]
    if settings.auto_wrap_policy == "NO_WRAP":
        return []
    uses = Counter(id(p) for _, m in model.named_modules(remove_duplicate=False)
                   for p in m.parameters(recurse=False))

    def shared(module) -> bool:
        inside = Counter(id(p) for m in module.modules() for p in m.parameters(recurse=False))
        return any(uses[key] > count for key, count in inside.items())

    units = []
    if settings.auto_wrap_policy == "SIZE_BASED_WRAP":
        claimed = set()
        for _, module in reversed(modules):
            own = [p for p in module.parameters() if id(p) not in claimed]
            if own and sum(p.numel() for p in own) >= max(settings.min_num_params, 1) and not shared(module):
                units.append(module)
                claimed.update(id(p) for p in own)
        return units
    names = set(settings.layer_classes)
    if not names:  # transformers' fallback: the classes the model says must not be split
        names = {name for module in model.modules() for name in internals.no_split_modules(module)}
    present = {type(module).__name__ for _, module in modules}
    missing = sorted(set(settings.layer_classes) - present)
    if missing:
        candidates = sorted(name for name, count in Counter(type(m).__name__ for _, m in modules).items() if count > 1)
        raise UserError(f"--fsdp_config transformer_layer_cls_to_wrap: {', '.join(missing)} is not a module class of "
                        f"{type(model).__name__} (its repeated classes: {', '.join(candidates)})")
    return [module for _, module in reversed(modules) if type(module).__name__ in names and not shared(module)]


@functools.cache
def wrapper_class():
    """The class below, built on first use (it subclasses torch's Module: no torch at import)."""
    import torch

    class FullyShardedModel(torch.nn.Module):
        """What transformers trains through: the sharded model itself runs (its own hooks gather and free each
        group); this object only makes it a model transformers does not prepare again."""

        wraps_fully_sharded = True

        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    return FullyShardedModel


class OptimizerFile:
    """transformers saves the optimizer as rank 0's `torch.save(optimizer.state_dict())` and loads it back on every
    rank; under FSDP the state is in the checkpoint's shards instead. Once save_checkpoint wrote them, the next
    state_dict() is a stub saying so (no parameter groups: loading it into any other optimizer fails loudly instead of
    training on empty moments), and loading the stub changes nothing (load_checkpoint reads the shards). Through the
    optimizer's public state-dict hooks."""

    def __init__(self, optimizer):
        self.stub_next = False
        optimizer.register_state_dict_post_hook(self.after_state_dict)
        optimizer.register_load_state_dict_pre_hook(self.before_load)

    def after_state_dict(self, optimizer, state_dict):
        if not self.stub_next:
            return None
        self.stub_next = False
        return {"state": {}, "param_groups": [], "trainer_ext": f"the state is in {SHARDS}/ "
                                                                "(torch.distributed.checkpoint, one file per rank)"}

    def before_load(self, optimizer, state_dict):
        return optimizer.state_dict() if "trainer_ext" in state_dict else None
