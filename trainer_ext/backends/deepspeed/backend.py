"""DeepSpeed ZeRO: transformers' integration runs the engine; we hand it the translator's complete config (resolved
when the arguments are parsed, finished with the real step count, world size and hidden size when training starts)
and align its scheduler and overflow check with transformers'."""

from __future__ import annotations

import copy
import functools
import json
import logging
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from ...deepspeed_config import finish_deepspeed_config, resolve_deepspeed_config
from ...deepspeed_config.keys import HIDDEN_SIZE_AUTO, ZERO3_COST
from ...integrations import internals
from ..base import Backend, BackendFormula, ResolvedSettings
from ..spec import COMPUTE, RunSettings, settled_for
from .leaves import check_granularity
from .search import CONFIG_KEYS

logger = logging.getLogger(__name__)

INSTALL = "pip install 'deepspeed>=0.19,<0.20' (or pip install 'trainer_ext[deepspeed]')"
# Consecutive bf16 steps with a non-finite gradient norm after which the run stops: there is no loss scale to lower,
# so the same failure on every batch means the weights or the data, not one unlucky batch, produce inf/NaN.
MAX_CONSECUTIVE_NONFINITE = 10
PERSISTENCE = HIDDEN_SIZE_AUTO["stage3_param_persistence_threshold"][0]  # the "auto" the presets resolve to


class DeepSpeedBackend(Backend):
    name = "deepspeed"
    flag = "deepspeed"
    library = "deepspeed"
    install = INSTALL
    needs_process_group = True  # without a launcher DeepSpeed looks for MPI and dies importing mpi4py
    checkpoint_state = ("global_step*",)  # the engine's own checkpoint: ZeRO shards, also without consolidated weights
    optimizer_state = checkpoint_state
    rank_written_state = "each rank's optimizer partition"
    resumes_weights_only = False  # transformers resumes the engine from its own files only
    steps_in_backward = True  # accelerate runs engine.step() (optimizer and scheduler) inside backward
    config_keys = CONFIG_KEYS  # deepspeed.<path> in a search space

    @classmethod
    def settle(cls, args, batch) -> tuple[dict, RunSettings]:
        """Phase 1 of the translation (with DeepSpeed's own check of the file), before transformers builds its own
        DeepSpeed config from `args.deepspeed`: the flags the file decided and the config, and the resolution."""
        from .cuda_arch import check_for_deepspeed
        from ...environment.launcher import cpu_ranks

        if not cpu_ranks(args):
            check_for_deepspeed()  # a TORCH_CUDA_ARCH_LIST its op builder cannot read: refused before any work
        resolution = resolve_checked(args, args.deepspeed, this_machine=True, final=False,
                                     world_size=batch.world_size, cpu_ranks=cpu_ranks(args), global_batch=batch)
        return resolution_fields(resolution), RunSettings(settled=resolution)

    @classmethod
    def arguments_ready(cls, args) -> dict:
        """Under a launcher transformers' device set-up has just formed the process group (and on GPUs had DeepSpeed
        join it): under ZeRO-3 DeepSpeed joins it on CPU ranks too, so a model the script loads before ExtTrainer
        works as on GPUs. Without a launcher there is no group, and nothing is formed here."""
        import torch.distributed

        if zero_stage(settled_for(cls, args)) == 3 and torch.distributed.is_initialized():
            join_deepspeed_group()
        return {}

    @classmethod
    def prepare_process(cls, args) -> dict:
        """Before DeepSpeed loads an op: no stale build locks or shared-memory buffers of killed jobs, a
        TORCH_CUDA_ARCH_LIST its op builder can read, the ops it will build said, and under ZeRO-3 DeepSpeed in the
        process group. On a machine without a GPU, DS_ACCELERATOR=cpu: DeepSpeed's own override for the choice it would
        make anyway, without its "unable to detect" warning; TORCH_EXTENSIONS_DIR this environment's own folder for the
        ops, unless set; and what DeepSpeed's import set, where a config check imported it first and took it back.
        Stock TrainingArguments, settled only now: what transformers built from the unresolved file at its own
        __post_init__, rebuilt from the resolution first (its config is the one zero.Init reads)."""
        fields = {} if args.run_settings.parsed else transformers_objects(args)
        from .cuda_arch import prepare_for_deepspeed
        from .leftovers import clear_leftovers
        from .ops import announce_builds, restore_import_environment, use_environment_folder
        from ...environment.launcher import accelerator_available, cpu_ranks
        from ...environment.variables import set_variables

        if not accelerator_available():
            set_variables({"DS_ACCELERATOR": "cpu"}, keep_set=True)
        use_environment_folder()
        quiet_deprecated_collectives()
        restore_import_environment()
        clear_leftovers()
        if not cpu_ranks(args):
            prepare_for_deepspeed()
        resolution = settled_for(cls, args)  # prepare_process settled stock TrainingArguments first
        announce_builds(resolution.config)  # DeepSpeed compiles in silence: minutes that look like a hang
        if zero_stage(resolution) == 3:  # the group is formed (needs_process_group)
            join_deepspeed_group()
        return fields

    @classmethod
    @contextmanager
    def model_sharded_context(cls, args):
        """Under ZeRO-3 the model is built and loaded partitioned (DeepSpeed's zero.Init, as transformers does it), so
        no rank ever holds all of it; at any other stage nothing changes. prepare_process resolved stock
        TrainingArguments (their unresolved DeepSpeed file is what zero.Init would read) and joined the group."""
        if zero_stage(settled_for(cls, args)) == 3:
            from transformers.integrations import is_deepspeed_zero3_enabled

            if not is_deepspeed_zero3_enabled():  # transformers follows the config the arguments hold, weakly
                raise RuntimeError("ZeRO-3 is resolved but transformers does not see it: the arguments' "
                                   "hf_deepspeed_config is gone")
        yield

    # 16-bit params/grads in mixed precision (COMPUTE); DeepSpeed keeps an fp32 master partition even in fp32 training,
    # so its sharded optimizer state is 12 bytes per parameter either way (4 master + 8 for Adam's moments).
    memory_formulas = (
        BackendFormula("zero1", '--deepspeed \'{"zero_optimization": {"stage": 1}}\'', (COMPUTE, False),
                       (COMPUTE, False), (12, True), 1.0, preference=10),
        BackendFormula("zero2", "--deepspeed zero2_minimal", (COMPUTE, False), (COMPUTE, True), (12, True), 1.0,
                       preference=20),
        # Parameters are partitioned too (a layer is gathered whole for its forward and backward, then freed), but
        # those under stage3_param_persistence_threshold (10·h, our "auto") stay whole as well (counted where the
        # model's shape is known: <0.2% of a BERT). zero.Init replaces F.linear with DeepSpeed's, which keeps every
        # Linear's input for backward, a LoRA's frozen ones too.
        BackendFormula("zero3", "--deepspeed zero3", (COMPUTE, True), (COMPUTE, True), (12, True), 1.5,
                       preference=50, frozen_sharded=True, whole_below=PERSISTENCE, linears_keep_inputs=True,
                       note=ZERO3_COST),
        # The optimizer step runs on the CPU: fp32 gradient partition, master and moments in host memory.
        BackendFormula("zero2_offload", "--deepspeed zero2_offload", (COMPUTE, False), (4, True), (12, True), 1.0,
                       host_optimizer=True, preference=70, note="optimizer step on the CPU: slowest per step"),
        # Parameter partitions in host memory too: the device holds only the layer being computed.
        BackendFormula("zero3_offload", "--deepspeed zero3_offload", (COMPUTE, True), (4, True), (12, True), 1.5,
                       host_optimizer=True, host_params=True, preference=80, frozen_sharded=True,
                       whole_below=PERSISTENCE, linears_keep_inputs=True,
                       note="parameters and optimizer step on the CPU: every layer crosses to the device in each "
                            "forward and backward; the last resort"),
    )

    def __init__(self, args=None):
        super().__init__(args)
        self.resolution = self.settled  # phase 1 (prepare_process's on stock arguments)
        self.overflow_check = None  # how a ZeRO step detects a non-finite gradient, once the engine exists
        self._evaluation_engine = None  # ZeRO-3 before training: see evaluating
        self._load_universal = False  # resuming a checkpoint saved on another world size (see before_train)
        self._said_partitioned_save = False  # the final model saved as ZeRO shards only: said once

    def callbacks(self, trainer) -> list:
        return [engine_callback(self, trainer)]

    def before_train(self, trainer, checkpoint) -> None:
        """Phase 2 of the translation runs where transformers runs its own: its config object's
        trainer_config_finalize, which deepspeed_init calls once the model and the step count are known."""
        self.release_evaluation_engine()
        keep_used_weight_conversions(trainer.accelerator.unwrap_model(trainer.model))
        self._load_universal = bool(checkpoint) and self._reshard_if_world_size_changed(trainer, Path(checkpoint))
        plugin = trainer.accelerator.state.deepspeed_plugin
        if not isinstance(plugin.hf_ds_config, finished_by_backend()):
            internals.wrap_hf_ds_config(plugin, finished_by_backend())
        plugin.hf_ds_config.finish = lambda args, model, steps: self.finish(trainer, model, steps)

    def finish(self, trainer, model, num_training_steps: int) -> dict:
        """The complete config for this run: phase 1's, with the step count, world size and hidden size."""
        args = trainer.args
        model = trainer.accelerator.unwrap_model(model)
        self.resolution = finish_deepspeed_config(self.resolution, args, args.world_size, num_training_steps,
                                                  model_hidden_size(model))
        check_granularity(model, self.resolution.config)
        # Only for this load: with it on, a later ordinary resume would look for latest_universal.
        if self._load_universal:
            self.resolution.config.setdefault("checkpoint", {})["load_universal"] = True
        elif "load_universal" in self.resolution.config.get("checkpoint", {}):
            del self.resolution.config["checkpoint"]["load_universal"]
        if trainer.is_world_process_zero():  # its notes are said once, with the run's settings (settings_lines)
            logger.warning("DeepSpeed config (resolved for %d rank%s, %d steps):\n%s", args.world_size,
                           "" if args.world_size == 1 else "s", num_training_steps,
                           json.dumps(self.resolution.config, indent=2))
        return self.resolution.config

    def _reshard_if_world_size_changed(self, trainer, checkpoint: Path) -> bool:
        """DeepSpeed cannot load ZeRO optimizer shards saved by another number of ranks; its universal
        checkpoint format can. Convert once (main process); True when this run must load it."""
        saved = saved_world_size(checkpoint)
        world_size = trainer.args.world_size
        if saved is None or saved == world_size:
            return False
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
        self.resolution.notes.append(f"resuming a {saved}-rank ZeRO checkpoint on {world_size} ranks (universal)")
        return True

    def engine_ready(self, trainer) -> None:
        """Once transformers built the engine (and loaded a resumed checkpoint into it), before the first step."""
        from deepspeed.runtime.lr_schedules import WarmupCosineLR, WarmupLR

        engine = trainer.model_wrapped
        scheduler = getattr(engine, "lr_scheduler", None)
        # DeepSpeed builds its scheduler at iteration -1 and applies that value to the first step; transformers'
        # step k uses iteration k. One step here aligns them (a resumed checkpoint already set its own iteration).
        if isinstance(scheduler, (WarmupLR, WarmupCosineLR)) and scheduler.last_batch_iteration == -1:
            scheduler.step()
        self.overflow_check = check_overflow_by_norm(getattr(engine, "optimizer", None))

    @contextmanager
    def evaluating(self, trainer):
        """Before training (--evaluate_before_training, an evaluation-only run, a finished run's evaluation) no
        engine exists yet. Below ZeRO-3 every rank holds all parameters: the plain model is evaluated as data
        parallelism does (stock transformers insists on an engine and fails: "ZeRO inference only makes sense with
        ZeRO Stage 3"). Under ZeRO-3 each rank holds a partition of every parameter: an engine of our own, without
        optimizer or scheduler, gathers them layer by layer. transformers' inference engine cannot be used: it checks
        a step count of 0 against the scheduler, and deletes the optimizer from the config that training then uses.
        Kept for later evaluations; released before training builds its engine on the same model."""
        if trainer.deepspeed is not None:  # the training engine: transformers evaluates through it
            yield None
            return
        if zero_stage(self.resolution) == 3:
            engine = self.evaluation_engine(trainer)
            internals.set_deepspeed_engine(trainer, engine)  # transformers builds and prepares nothing then
            internals.set_wrapped_model(trainer, engine)
            try:
                yield engine
            finally:
                internals.set_deepspeed_engine(trainer, None)
                internals.set_wrapped_model(trainer, trainer.model)
            return
        internals.set_deepspeed_enabled(trainer, False)
        try:
            yield None
        finally:
            internals.set_deepspeed_enabled(trainer, True)

    def evaluation_engine(self, trainer):
        """The ZeRO-3 engine an evaluation before training runs through (see evaluating)."""
        if self._evaluation_engine is None:
            import deepspeed

            model = trainer.accelerator.unwrap_model(trainer.model)
            finished = finish_deepspeed_config(self.resolution, trainer.args, trainer.args.world_size, 1,
                                               model_hidden_size(model))
            check_granularity(model, finished.config)
            config = {key: value for key, value in finished.config.items() if key not in ("optimizer", "scheduler")}
            self._evaluation_engine = deepspeed.initialize(model=model, config=config)[0]
        return self._evaluation_engine

    def release_evaluation_engine(self) -> None:
        """Remove the evaluation engine's parameter hooks from the model (the training engine adds its own)."""
        if self._evaluation_engine is not None:
            self._evaluation_engine.destroy()
            self._evaluation_engine = None

    def save(self, trainer, folder):
        """The final model under ZeRO-3 with stage3_gather_16bit_weights_on_model_save false: transformers writes
        DeepSpeed's partitioned checkpoint instead of weights (and the examples said "model saved to"): what is
        saved and how to get a model, said once by the main process."""
        zero = self.resolution.config.get("zero_optimization", {}) if self.resolution is not None else {}
        if (folder is None and zero.get("stage") == 3 and zero.get("stage3_gather_16bit_weights_on_model_save") is False
                and trainer.is_world_process_zero() and not self._said_partitioned_save):
            self._said_partitioned_save = True
            out = trainer.args.output_dir
            logger.warning("%s gets DeepSpeed's partitioned ZeRO-3 checkpoint (global_step%d/), not a model "
                           "from_pretrained loads (stage3_gather_16bit_weights_on_model_save is false): `python "
                           "%s/zero_to_fp32.py %s %s --safe_serialization` writes the whole model there (DeepSpeed's "
                           "script), or set stage3_gather_16bit_weights_on_model_save true (trainer_ext's default) to "
                           "save it whole", out, trainer.state.global_step, out, out, out)
        return None

    def load_weights(self, trainer, checkpoint) -> None:
        if zero_stage(self.resolution) == 3:  # the model was partitioned as it was built (zero.Init)
            model = trainer.accelerator.unwrap_model(trainer.model)
            load_consolidated_weights(model, Path(checkpoint), trainer.is_world_process_zero())
            return
        internals.set_deepspeed_enabled(trainer, False)  # below ZeRO-3 every checkpoint holds the whole model
        try:
            super().load_weights(trainer, checkpoint)
        finally:
            internals.set_deepspeed_enabled(trainer, True)

    def settings(self) -> ResolvedSettings:
        if self.resolution is None:
            return ResolvedSettings("deepspeed ZeRO-?")
        config = self.resolution.config  # the parts of the translated config that decide memory and speed
        lines = [f"zero_optimization {json.dumps(config.get('zero_optimization', {}))}"]
        lines += [f"{section} {config[section]['type']} {json.dumps(config[section].get('params', {}))}"
                  for section in ("optimizer", "scheduler") if section in config]
        lines += [f"note: {note}" for note in self.resolution.notes]
        lines += [f"overflow check: {self.overflow_check}"] if self.overflow_check else []
        # The optimizer section of the config that ran (the flags, translated) is what a resume puts back.
        params = dict(config.get("optimizer", {}).get("params", {}))
        optimizer = {key: params[key] for key in ("lr", "betas", "eps", "weight_decay") if key in params} or None
        return ResolvedSettings(f"deepspeed ZeRO-{config['zero_optimization'].get('stage')}", tuple(lines),
                                {"ds_config.resolved.json": config}, optimizer, optimizer_state(config))

    @classmethod
    def fingerprint(cls, module) -> dict:
        # Under ZeRO-3 a parameter's numel is its gathered size only while gathered; ds_numel is always the whole.
        fingerprint = super().fingerprint(module)
        fingerprint["num_parameters"] = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())
        return fingerprint

    def teardown(self, trainer):
        from .leftovers import remove_own_shm_buffer

        self.release_evaluation_engine()
        internals.set_deepspeed_engine(trainer, None)  # transformers' own reference to the training engine
        return remove_own_shm_buffer  # DeepSpeed's CPU all-reduce never unlinks its /dev/shm buffer


@functools.cache
def finished_by_backend():
    """The class below, built on first use (it subclasses a transformers class: no torch at import)."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    class FinishedByBackend(HfTrainerDeepSpeedConfig):
        """transformers' DeepSpeed config object (accelerate's plugin holds it and reads its config dict), whose
        phase 2 (trainer_config_finalize: the model and step count known) is the backend's own translation instead
        of transformers' "auto" filling. Shares the dict of the object it replaces, so every holder sees one config."""

        def __init__(self, replaced):
            self.__dict__.update(replaced.__dict__)
            self.finish = None

        def trainer_config_finalize(self, args, model, num_training_steps):
            finished = self.finish(args, model, num_training_steps)
            self.config.clear()
            self.config.update(finished)

        def __reduce__(self):  # training_args.bin pickles the arguments, which hold this object
            return plain_deepspeed_config, ({key: value for key, value in self.__dict__.items() if key != "finish"},)

    return FinishedByBackend


def plain_deepspeed_config(state: dict):
    """What a pickled FinishedByBackend loads as: transformers' own class with the same values (no trainer_ext class
    or trainer reference in a saved training_args.bin)."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    config = HfTrainerDeepSpeedConfig.__new__(HfTrainerDeepSpeedConfig)
    config.__dict__.update(state)
    return config


def keep_used_weight_conversions(model) -> None:
    """transformers 5.23 loading under ZeRO-3 keeps every key renaming it tried (integrations/deepspeed.py), where its
    other loader keeps those that matched the checkpoint; saving then reverts renamings that never happened
    (MiniLM's LayerNorm.weight written as the legacy LayerNorm.gamma). A private attribute: the only record of them;
    tests/integration/test_zero3.py compares a ZeRO-3 checkpoint's keys with one process's."""
    internals.keep_used_weight_conversions(model)


# DeepSpeed's optimizer types that build one optimizer, whose state reads the same (its FusedAdam / CPU Adam in either
# mode: adam_w_mode is a setting, not another state).
SAME_STATE = {"adamw": "adam"}


def optimizer_state(config: dict) -> dict:
    """Which optimizer state the engine's checkpoints hold: the file's optimizer.type (Adam and AdamW alike); none
    known when the file names none (transformers' optimizer, handed to the engine)."""
    kind = (config.get("optimizer") or {}).get("type")
    if not kind:
        return {"state": None}
    return {"state": f"deepspeed:{SAME_STATE.get(str(kind).lower(), str(kind).lower())}", "name": f"DeepSpeed's {kind}",
            "given": f"optimizer.type {kind}", "type": kind,
            "back": f"set the DeepSpeed file's optimizer.type back to {kind}"}


def load_consolidated_weights(model, folder: Path, main_process: bool) -> None:
    """A checkpoint's consolidated model.safetensors (one file, or shards and their index) into a model whose parameters
    ZeRO-3 partitioned: module by module, its parameters gathered, filled by the main process, partitioned again
    (DeepSpeed's documented pattern for GatheredParameters), so no rank holds more than one module whole. Parameters
    and buffers that are not partitioned are filled on every rank."""
    from contextlib import ExitStack

    import deepspeed
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    with ExitStack() as stack:
        if index.is_file():
            names = json.loads(index.read_text())["weight_map"]
            opened = {name: stack.enter_context(safe_open(folder / name, "pt")) for name in set(names.values())}
            source = {key: opened[name] for key, name in names.items()}
        else:
            single = stack.enter_context(safe_open(folder / "model.safetensors", "pt"))
            source = dict.fromkeys(single.keys(), single)
        aliases = {}  # a tied parameter answers to every name it has; the file keeps one of them
        for name, parameter in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(parameter), []).append(name)
        missing = [names[0] for names in aliases.values() if not any(name in source for name in names)]
        if missing:  # checked on every rank alike, before any collective
            raise RuntimeError(f"{folder}: the saved weights have no {missing[0]} ({len(missing)} parameter(s) missing)")

        def fill(tensor, names):
            key = next(name for name in names if name in source)
            tensor.data.copy_(source[key].get_tensor(key))

        for module in model.modules():
            own = list(module.parameters(recurse=False))
            partitioned = [p for p in own if hasattr(p, "ds_id")]
            with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0):
                for parameter in own:
                    if main_process or not hasattr(parameter, "ds_id"):
                        fill(parameter, aliases[id(parameter)])
        for name, buffer in model.named_buffers():
            if name in source:
                fill(buffer, [name])


def model_hidden_size(model) -> int | None:
    """The hidden size the "auto" ZeRO sizes follow: transformers' rule (hidden_size, else the largest of
    hidden_sizes, also in text_config), and an encoder-decoder's encoder's."""
    config = getattr(model, "config", None)
    for candidate in (config, getattr(config, "text_config", None), getattr(config, "encoder", None)):
        if candidate is None:
            continue
        if getattr(candidate, "hidden_size", None):
            return candidate.hidden_size
        if getattr(candidate, "hidden_sizes", None):
            return max(candidate.hidden_sizes)
    return None


# torch 2.13 deprecates collectives DeepSpeed's ZeRO calls at every step; their FutureWarning came again after every
# change of the warning filters, which something does at every step ("once" filters included: a 2-step ZeRO-3 run on 2
# ranks printed it 398 times).
DEPRECATED_COLLECTIVES = ("reduce_scatter_tensor", "all_gather_into_tensor")
_QUIETED: list[bool] = []  # this process's filter is in place (and the deprecation said)


def quiet_deprecated_collectives() -> None:
    """For a DeepSpeed run: torch's deprecation of the collectives DeepSpeed calls, said once by the main process
    instead of at every step on every rank (a filter after any the user set, which still wins)."""
    import warnings

    import torch
    import torch.distributed as dist

    from ...errors import main_process

    deprecated = [name for name in DEPRECATED_COLLECTIVES if getattr(getattr(dist, name, None), "__deprecated__", None)]
    if not deprecated or _QUIETED:
        return
    _QUIETED.append(True)
    warnings.filterwarnings("ignore", message=rf"`torch\.distributed\.({'|'.join(deprecated)})` is deprecated",
                            category=FutureWarning, append=True)
    if main_process():
        logger.warning("torch %s deprecates torch.distributed.%s, which DeepSpeed calls at every ZeRO step: its "
                       "FutureWarning is said once, here", torch.__version__, " and ".join(deprecated))


def zero_stage(resolution) -> int:
    """The ZeRO stage a resolved config runs (0 without a resolution)."""
    config = resolution.config if resolution is not None else {}
    return int(config.get("zero_optimization", {}).get("stage", 0))


def transformers_objects(args) -> dict:
    """For stock TrainingArguments settled late (the resolved config and flags written on them): transformers' DeepSpeed
    config and accelerate's plugin rebuilt from the resolution exactly as transformers rebuilds them itself
    (Trainer._hp_search_setup)."""
    from accelerate.utils import DeepSpeedPlugin
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    hf_config = HfTrainerDeepSpeedConfig(args.deepspeed)
    hf_config.trainer_config_process(args)
    return {"hf_deepspeed_config": hf_config, "deepspeed_plugin": DeepSpeedPlugin(hf_ds_config=hf_config)}


def resolve_checked(args, config=None, this_machine: bool = False, **kwargs):
    """Phase 1 of the translation and, where DeepSpeed is installed, what DeepSpeed's own config parser refuses in the
    same file: every problem in one DeepSpeedConfigError (training and `trainer-ext ds-config` both call this). The
    sections the translator reads itself it checks as DeepSpeed's models do (FIELD_TYPES); DeepSpeed's parser adds the
    sections passed through (monitors, comms_logger, compile, ...) and rules across fields. `this_machine`: the run
    trains here, so what the file needs of this machine is checked too (ZeRO-3's NVMe folder); ds-config renders for
    other machines and does not."""
    from ...deepspeed_config import DeepSpeedConfigError, load_deepspeed_config
    from ...deepspeed_config.fields import numbers_from_strings
    from ...deepspeed_config.keys import FIELD_TYPES, KNOWN_TOP_LEVEL_KEYS

    config = (args.get("deepspeed") if isinstance(args, dict) else getattr(args, "deepspeed", None)) \
        if config is None else config
    try:
        resolution = resolve_deepspeed_config(args, config or {}, **kwargs)
    except DeepSpeedConfigError as err:
        try:
            loaded = numbers_from_strings(load_deepspeed_config(config or {})[0])
        except DeepSpeedConfigError:  # the file itself cannot be read: nothing more to check
            raise err from None
        passed_through = {key: value for key, value in loaded.items()
                          if key in KNOWN_TOP_LEVEL_KEYS and key not in FIELD_TYPES and key != "bfloat16"}
        more = deepspeed_refusals(passed_through) + (nvme_problems(loaded) if this_machine else [])
        if more:
            raise DeepSpeedConfigError(err.problems + more, err.origin) from None
        raise
    problems = deepspeed_refusals(resolution.config) + (nvme_problems(resolution.config) if this_machine else [])
    if problems:
        raise DeepSpeedConfigError(problems, resolution.origin)
    return resolution


def nvme_problems(config: dict) -> list[str]:
    """ZeRO-3's NVMe offload on this machine (each rank checks its own): every nvme_path an existing folder this user
    can write, and DeepSpeed's async_io op, which swaps through it, buildable here. DeepSpeed would find out once the
    model is loaded and its optimizer ops built (minutes), or create the folder on whatever disk holds a mistyped
    path."""
    import os
    import socket

    from ...deepspeed_config.passes import nvme_offloads
    from .ops import op_buildable

    offloads = [(field, path) for field, path in nvme_offloads(config) if isinstance(path, str) and path]
    problems = []
    for field, path in offloads:
        folder = Path(os.path.expanduser(path))
        if not folder.exists():
            why = f"no such folder on this machine ({socket.gethostname()}): create it on the NVMe drive, or fix it"
        elif not folder.is_dir():
            why = "a file, not a folder: give the folder on the NVMe drive"
        elif not os.access(folder, os.W_OK | os.X_OK):
            why = f"this user (uid {os.getuid()}) cannot write there: give a folder it can write, or fix its modes"
        else:
            continue
        problems.append(f"{field}={path}: {why}; or offload to \"cpu\"")
    if offloads and not op_buildable("AsyncIOBuilder"):
        block = offloads[0][0].rpartition(".")[0]
        problems.append(f"{block}.device \"nvme\": ZeRO-3 swaps through DeepSpeed's async_io op, which "
                        "cannot be built on this machine (libaio is missing: apt install libaio-dev, or "
                        "yum install libaio-devel): install it, or offload to \"cpu\"")
    return problems


def deepspeed_refusals(config: dict) -> list[str]:
    """What DeepSpeed's config parser refuses in each top-level section of `config`, one line per problem ([] where
    DeepSpeed is not installed). Each section is read alone by the code DeepSpeedConfig runs on the whole file
    (_initialize_params, its pydantic models among it), so one section's problem does not hide another's."""
    import importlib.util

    from .ops import deepspeed_imported

    if importlib.util.find_spec("deepspeed") is None:
        return []
    with deepspeed_imported():
        import deepspeed.runtime.config  # noqa: F401 (imported quietly here; internals.deepspeed_config_reader reads it)
        from pydantic import ValidationError
    from ...deepspeed_config.fields import read_field, requirement
    from ...deepspeed_config.keys import TOP_LEVEL_TYPES

    problems = []
    for section, value in config.items():
        spec = TOP_LEVEL_TYPES.get(section)
        if spec is not None and value != "auto" and not read_field(spec, value)[0]:
            problems.append(f"{section}={json.dumps(value)}: must be {requirement(spec)}, as DeepSpeed uses it (its "
                            "parser passes it, its engine fails on it or reads it otherwise)")
            continue
        # The parser's field readers without its batch checks (private: tests/unit/test_deepspeed_accepts.py checks it).
        try:
            internals.deepspeed_config_reader(section, copy.deepcopy(value))
        except ValidationError as err:
            for error in err.errors():
                where = ".".join([section, *(str(part) for part in error["loc"] if part != section)])
                message = error["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
                shown = f"={json.dumps(error['input'], default=str)}" if error["loc"] else ""
                problems.append(f"{where}{shown}: DeepSpeed refuses it: {message}")
        except Exception as err:  # noqa: BLE001 (DeepSpeed's readers raise assertions, ValueErrors, TypeErrors)
            shown = json.dumps(value, default=str)
            problems.append(f"{section}={shown if len(shown) <= 80 else shown[:77] + '...'}: DeepSpeed refuses it: "
                            f"{err}")
    return problems


def join_deepspeed_group() -> None:
    """For ZeRO-3: transformers builds every model loaded from now on inside DeepSpeed's zero.Init, which checks the
    batch fields against DeepSpeed's view of the process group; without joining it a 2-rank config fails there as a
    1-rank one ("train_batch_size ... 4 != 2 * 1 * 1"). Joining again changes nothing."""
    import deepspeed

    deepspeed.init_distributed()


def resolution_fields(resolution) -> dict:
    """What the translation sets on the arguments (config.settings writes it): the flags the file decided (so the
    sampler, the logs and transformers use the same batch and rates) and the complete config as `deepspeed` (the
    resolution, for phase 2, is RunSettings'). A file that enables fp16 needs CUDA as --fp16 does."""
    import torch

    from ...environment.launcher import check_fp16_device

    from_file = "fp16" in resolution.effective_flags
    check_fp16_device(resolution.config.get("fp16", {}).get("enabled") is True, torch.cuda.is_available(),
                      "fp16 comes from the DeepSpeed file's fp16.enabled: set it to \"auto\" (or use --deepspeed "
                      "zero2_minimal)" if from_file else "")
    return {**resolution.effective_flags, "deepspeed": resolution.config}


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
    import torch

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


def engine_callback(backend, trainer):
    """The backend's steps at transformers' events (built here: transformers imports torch): the engine aligned with
    transformers' schedule once it exists (DeepSpeedBackend.engine_ready), and each optimizer step DeepSpeed skipped
    for a non-finite gradient norm under bf16 named, the run stopped after MAX_CONSECUTIVE_NONFINITE in a row."""
    from transformers import TrainerCallback

    class EngineSteps(TrainerCallback):
        """Under fp16 skips are the loss scale's normal search (DeepSpeed logs them); under bf16 each is named, and
        after MAX_CONSECUTIVE_NONFINITE in a row every further step would be skipped too: the weights are still those of
        the last good step."""

        def __init__(self, trainer):
            self.trainer = trainer
            self.consecutive = []

        def on_train_begin(self, args, state, control, **kwargs):
            backend.engine_ready(self.trainer)

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
                logger.warning("step %d skipped: gradient norm %s is not finite (bf16; a gradient holds inf or "
                               "NaN); weights and optimizer state are unchanged", step, norm)
            if len(self.consecutive) >= MAX_CONSECUTIVE_NONFINITE:
                raise NonFiniteGradients(
                    f"steps {self.consecutive[0]}-{step}: the gradient norm was not finite {len(self.consecutive)} "
                    f"times in a row under bf16, so training stopped; the weights are those after step "
                    f"{self.consecutive[0] - 1} (finite, not saved again). Lower --learning_rate, raise --warmup_steps "
                    "or check the data for inf/NaN, then resume from the last checkpoint", main)

    return EngineSteps(trainer)


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
