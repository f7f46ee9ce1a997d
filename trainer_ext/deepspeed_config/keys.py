"""The tables the translator works from: TrainingArguments defaults and ranges, every key DeepSpeed 0.19 reads or
removed, where misplaced keys belong, and our measured ZeRO defaults. Pure data; tests compare them with DeepSpeed's
own config models and with transformers' defaults."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# TrainingArguments defaults of the flags the translator reads; a test checks them against transformers. Arguments
# with no record of what was typed (stock TrainingArguments, a dict) count a flag as given when it differs from these.
FLAG_DEFAULTS: dict[str, Any] = {
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "learning_rate": 5e-5,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_epsilon": 1e-8,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "warmup_steps": 0,
    "lr_scheduler_type": "linear",
    "max_steps": -1,
    "fp16": False,
    "bf16": False,
    # ExtTrainingArguments' own flags
    "fp16_backend": "auto",
    "fp16_opt_level": "O1",
    "warmup_ratio": 0.0,
}

# DeepSpeed field -> the flag that fills it (transformers' fill_match lines): a file value beats a flag the user did not
# give and is written back onto it; a given flag that disagrees is a conflict. Two flags: one per element (betas) or
# either spelling (warmup), read by their own passes.
FIELD_FLAGS: dict[str, str | tuple[str, str]] = {
    "fp16.enabled": "fp16",
    "bf16.enabled": "bf16",
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "max_grad_norm",
    "optimizer.params.lr": "learning_rate",
    "optimizer.params.betas": ("adam_beta1", "adam_beta2"),
    "optimizer.params.eps": "adam_epsilon",
    "optimizer.params.weight_decay": "weight_decay",
    "scheduler.params.warmup_max_lr": "learning_rate",
    "scheduler.params.warmup_num_steps": ("warmup_steps", "warmup_ratio"),
}

# Every top-level key DeepSpeed 0.19 reads (a test records the keys DeepSpeedConfig looks up and checks this).
KNOWN_TOP_LEVEL_KEYS = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "steps_per_print",
    "optimizer", "scheduler", "fp16", "bf16", "bfloat16", "torch_autocast", "gradient_clipping",
    "prescale_gradients", "gradient_predivide_factor", "gradient_allreduce_op", "zero_optimization",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "activation_checkpointing",
    "flops_profiler", "wall_clock_breakdown", "memory_breakdown", "dump_state", "tensorboard", "wandb",
    "csv_monitor", "comet", "comms_logger", "communication_data_type", "seq_parallel_communication_data_type",
    "aio", "autotuning", "checkpoint", "data_types", "data_efficiency", "dataloader_drop_last",
    "datastates_ckpt", "disable_allgather", "disable_python_gc", "expert_parallel", "hybrid_engine",
    "log_level", "managed_gradient_accumulation", "pipeline", "tensor_parallel", "timers",
    "use_data_before_expert_parallelism", "vocabulary_size", "weight_quantization", "compile",
    "sequence_parallel_size", "monitor_config", "zero_quantized_weights", "fp32_reduce_scatter",
})

# Keys DeepSpeed 0.19 removed and rejects; a test checks this list covers DeepSpeed's own.
REMOVED_TOP_LEVEL_KEYS: dict[str, str] = {
    "amp": 'NVIDIA Apex AMP was removed from DeepSpeed 0.19; use "fp16": {"enabled": true} (--fp16) or --bf16',
    "nebula": "Nebula checkpointing was removed from DeepSpeed 0.19; delete the block",
    "compression_training": "the compression library was removed from DeepSpeed 0.19; delete the block",
    "quantize_training": "MoQ / quantize_training was removed from DeepSpeed 0.19; delete the block",
    "sparse_gradients": "sparse_gradients was removed from DeepSpeed 0.19; delete the key",
    "eigenvalue": "eigenvalue was removed from DeepSpeed 0.19; delete the block",
    "sparse_attention": "sparse attention was removed from DeepSpeed 0.19; delete the block",
    "elasticity": "elastic training was removed from DeepSpeed 0.19; set the batch fields (or flags) directly",
    "graph_harvesting": "graph_harvesting was removed from DeepSpeed 0.19; delete the key",
    "curriculum_learning": "top-level curriculum_learning was removed; use data_efficiency.data_sampling.curriculum_learning",
    "progressive_layer_drop": "progressive layer drop was removed from DeepSpeed 0.19; delete the block",
}

# Fields of DeepSpeed's ZeRO, fp16 and bf16 config models (aliases included); tests compare with DeepSpeed's.
ZERO_KEYS = frozenset({
    "allgather_bucket_size", "allgather_partitions", "allgather_sequential", "compute_grad_norm",
    "contiguous_gradients", "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory",
    "elastic_checkpoint", "enable_sanity_checks", "gather_16bit_weights_on_model_save",
    "ignore_unused_parameters", "leaf_module", "legacy_stage1", "load_from_fp32_weights",
    "log_trace_cache_warnings", "max_live_parameters", "max_reuse_distance", "memory_efficient_linear",
    "model_persistence_threshold", "module_granularity_threshold", "offload_optimizer", "offload_param",
    "overlap_comm", "override_module_apply", "param_persistence_threshold", "parameter_alignment",
    "pipeline_loading_checkpoint", "prefetch_bucket_size", "reduce_bucket_size", "reduce_scatter",
    "round_robin_gradients", "save_muon_momentum_buffer_in_memory", "stage", "stage3_allgather_sequential",
    "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
    "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_model_persistence_threshold",
    "stage3_module_granularity_threshold", "stage3_param_persistence_threshold", "stage3_prefetch_bucket_size",
    "stage3_use_all_reduce_for_fetch_params", "sub_group_size", "use_all_reduce_for_fetch_params",
    "use_multi_rank_bucket_allreduce", "zenflow", "zero_hpz_partition_size", "zero_quantized_gradients",
    "zero_quantized_nontrainable_weights", "zero_quantized_weights",
})
FP16_KEYS = frozenset({
    "enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
    "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads",
})
BF16_KEYS = frozenset({
    "enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
    "bf16_optimizer_states",
})
OFFLOAD_PARAM_KEYS = frozenset({"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"})
OFFLOAD_OPTIMIZER_KEYS = frozenset({"device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read",
                                    "pipeline_write", "fast_init", "ratio", "super_offload", "cpuadam_cores_perc"})
SECTION_KEYS = {"zero_optimization": ZERO_KEYS, "fp16": FP16_KEYS, "bf16": BF16_KEYS}
# The blocks inside a section whose keys DeepSpeed checks too (it refuses any other key there).
NESTED_SECTION_KEYS = {"zero_optimization.offload_optimizer": OFFLOAD_OPTIMIZER_KEYS,
                       "zero_optimization.offload_param": OFFLOAD_PARAM_KEYS}
OFFLOAD_DEVICES = ("none", "cpu", "nvme")


@dataclass(frozen=True)
class FieldType:
    """What DeepSpeed's config model (pydantic, lax) accepts for one field."""

    kind: str  # "bool", "int", "float", "stage" (0-3), "device" (OFFLOAD_DEVICES), "path" (text), "object"
    low: float | None = None  # lower bound, inclusive unless low_open
    low_open: bool = False
    high: float | None = None  # upper bound, inclusive
    nullable: bool = False  # null accepted (DeepSpeed then picks its default)
    bools: bool = True  # true/false read as 1/0 (pydantic's way); DeepSpeed's fp16 scale validators refuse them


BOOL, NULLABLE_BOOL, COUNT = FieldType("bool"), FieldType("bool", nullable=True), FieldType("int", low=0)
_ZERO_BOOLS = ("contiguous_gradients", "reduce_scatter", "use_multi_rank_bucket_allreduce", "allgather_partitions",
               "compute_grad_norm", "load_from_fp32_weights", "elastic_checkpoint",
               "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
               "stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params",
               "stage3_allgather_sequential", "allgather_sequential", "stage3_gather_fp16_weights_on_model_save",
               "ignore_unused_parameters", "legacy_stage1", "round_robin_gradients", "parameter_alignment",
               "zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients",
               "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply",
               "log_trace_cache_warnings", "enable_sanity_checks", "save_muon_momentum_buffer_in_memory")
_ZERO_COUNTS = ("allgather_bucket_size", "sub_group_size", "zero_hpz_partition_size",
                *(name for old in ("prefetch_bucket_size", "param_persistence_threshold",
                                   "model_persistence_threshold", "max_live_parameters", "max_reuse_distance")
                  for name in (old, f"stage3_{old}")))
# Top-level scalars DeepSpeed reads without a model (get_scalar_param, no check) and uses as numbers or flags: a wrong
# type passed its parser and failed in the engine (steps_per_print "often": a TypeError at the first step) or was
# read as true ("nope" in an `if`).
TOP_LEVEL_TYPES: dict[str, FieldType] = {
    "steps_per_print": FieldType("int", low=0, low_open=True, nullable=True, bools=False),
    "gradient_predivide_factor": FieldType("float", low=0, low_open=True, bools=False),
    **dict.fromkeys(("wall_clock_breakdown", "memory_breakdown", "prescale_gradients", "dump_state",
                     "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer"), BOOL),
}
# Every scalar field of the sections DeepSpeed 0.19 reads with its pydantic models (deepspeed/runtime/zero/config.py,
# zero/offload_config.py, precision_config.py): checked before training, as DeepSpeed would check them once the model is
# loaded. tests/unit/test_key_tables.py compares this with the models' fields, and
# tests/unit/test_deepspeed_accepts.py checks bad values per field are refused exactly when DeepSpeed's models refuse.
FIELD_TYPES: dict[str, dict[str, FieldType]] = {
    "zero_optimization": {
        "stage": FieldType("stage"),
        **dict.fromkeys(_ZERO_BOOLS, BOOL),
        **dict.fromkeys(("overlap_comm", "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory"),
                        NULLABLE_BOOL),
        "reduce_bucket_size": FieldType("int", low=0, low_open=True),
        **dict.fromkeys(_ZERO_COUNTS, COUNT),
        **dict.fromkeys(("stage3_module_granularity_threshold", "module_granularity_threshold"), FieldType("int")),
        **dict.fromkeys(("offload_optimizer", "offload_param", "zenflow", "leaf_module"),
                        FieldType("object", nullable=True)),
    },
    "zero_optimization.offload_optimizer": {
        "device": FieldType("device"),
        "nvme_path": FieldType("path", nullable=True),
        "buffer_count": COUNT,
        **dict.fromkeys(("pin_memory", "pipeline_read", "pipeline_write", "fast_init", "super_offload"), BOOL),
        **dict.fromkeys(("ratio", "cpuadam_cores_perc"), FieldType("float", low=0, high=1)),
    },
    "zero_optimization.offload_param": {
        "device": FieldType("device"),
        "nvme_path": FieldType("path", nullable=True),
        **dict.fromkeys(("buffer_count", "buffer_size", "max_in_cpu"), COUNT),
        "pin_memory": BOOL,
    },
    "fp16": {
        **dict.fromkeys(("enabled", "auto_cast", "consecutive_hysteresis", "fp16_master_weights_and_grads"), BOOL),
        "loss_scale": FieldType("float", low=0, bools=False),
        **dict.fromkeys(("initial_scale_power", "hysteresis"), FieldType("int")),
        # > 0 as well while the loss scale is dynamic (loss_scale 0): the precision pass checks that
        **dict.fromkeys(("loss_scale_window", "min_loss_scale"), FieldType("int", bools=False)),
    },
    "bf16": dict.fromkeys(BF16_KEYS, BOOL),
}

# Where a key belongs when it is found at the top level (DeepSpeed would silently ignore it there).
_OPTIMIZER_PARAM_KEYS = ("lr", "betas", "eps", "weight_decay")
_SCHEDULER_PARAM_KEYS = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps",
                         "warmup_type", "warmup_min_ratio", "cos_min_ratio")
NESTED_HOME: dict[str, str] = {
    **{key: "zero_optimization" for key in ZERO_KEYS},
    **{key: "fp16" for key in FP16_KEYS - {"enabled"}},
    **{key: "optimizer.params" for key in _OPTIMIZER_PARAM_KEYS},
    **{key: "scheduler.params" for key in _SCHEDULER_PARAM_KEYS},
}

# optimizer.type values DeepSpeed 0.19 builds: its own (any case; deepspeed/runtime/config.py DEEPSPEED_OPTIMIZERS) or a
# torch.optim class by its exact name (engine._is_supported_optimizer); tests/unit/test_key_tables.py checks both lists.
DEEPSPEED_OPTIMIZER_NAMES = ("Adagrad", "Adam", "AdamW", "Lamb", "MuAdam", "MuAdamW", "MuSGD", "Lion", "Muon")
DEEPSPEED_OPTIMIZERS = frozenset(name.lower() for name in DEEPSPEED_OPTIMIZER_NAMES)
TORCH_OPTIMIZERS = ("ASGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "LBFGS", "Muon", "NAdam",
                    "RAdam", "RMSprop", "Rprop", "SGD", "SparseAdam")
# The keyword parameters (after the model's parameters) of each optimizer class DeepSpeed 0.19 builds from
# optimizer.params (engine._configure_basic_optimizer); tests/unit/test_key_tables.py compares them with the classes.
# Parameters a torch release after the tested one added, with that release (make test-newest found torch 2.15's): a
# config may give them when the installed torch has them.
OPTIMIZER_PARAMS_SINCE = {"torch.optim.LBFGS": {"maximize": (2, 15)}}
OPTIMIZER_CLASS_PARAMS = {
    "FusedAdam": ("lr", "bias_correction", "betas", "eps", "adam_w_mode", "weight_decay", "amsgrad", "set_grad_none"),
    "DeepSpeedCPUAdam": ("lr", "bias_correction", "betas", "eps", "weight_decay", "amsgrad", "adamw_mode",
                         "fp32_optimizer_states"),
    "DeepSpeedCPUAdagrad": ("lr", "eps", "weight_decay", "amsgrad", "fp32_optimizer_states"),
    "FusedLamb": ("lr", "bias_correction", "betas", "eps", "eps_inside_sqrt", "weight_decay", "max_grad_norm",
                  "max_coeff", "min_coeff", "amsgrad"),
    "FusedLion": ("lr", "betas", "weight_decay", "set_grad_none"),
    "DeepSpeedCPULion": ("lr", "betas", "weight_decay", "fp32_optimizer_states"),
    "torch.optim.ASGD": ("lr", "lambd", "alpha", "t0", "weight_decay", "foreach", "maximize", "differentiable",
                         "capturable"),
    "torch.optim.Adadelta": ("lr", "rho", "eps", "weight_decay", "foreach", "capturable", "maximize", "differentiable"),
    "torch.optim.Adafactor": ("lr", "beta2_decay", "eps", "d", "weight_decay", "foreach", "maximize"),
    "torch.optim.Adagrad": ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps", "foreach", "maximize",
                            "differentiable", "fused"),
    "torch.optim.Adam": ("lr", "betas", "eps", "weight_decay", "amsgrad", "foreach", "maximize", "capturable",
                         "differentiable", "fused", "decoupled_weight_decay"),
    "torch.optim.AdamW": ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable",
                          "differentiable", "fused"),
    "torch.optim.Adamax": ("lr", "betas", "eps", "weight_decay", "foreach", "maximize", "differentiable", "capturable"),
    "torch.optim.LBFGS": ("lr", "max_iter", "max_eval", "tolerance_grad", "tolerance_change", "history_size",
                          "line_search_fn"),
    "torch.optim.Muon": ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps",
                         "adjust_lr_fn"),
    "torch.optim.NAdam": ("lr", "betas", "eps", "weight_decay", "momentum_decay", "decoupled_weight_decay", "foreach",
                          "maximize", "capturable", "differentiable"),
    "torch.optim.RAdam": ("lr", "betas", "eps", "weight_decay", "decoupled_weight_decay", "foreach", "maximize",
                          "capturable", "differentiable"),
    "torch.optim.RMSprop": ("lr", "alpha", "eps", "weight_decay", "momentum", "centered", "capturable", "foreach",
                            "maximize", "differentiable"),
    "torch.optim.Rprop": ("lr", "etas", "step_sizes", "capturable", "foreach", "maximize", "differentiable"),
    "torch.optim.SGD": ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach",
                        "differentiable", "fused"),
    "torch.optim.SparseAdam": ("lr", "betas", "eps", "maximize"),
}
# The Adam family's optimizer.params DeepSpeed reads itself before building (get_optimizer_configuration pops them; it
# gives FusedAdam adam_w_mode and CPU Adam adamw_mode and fp32_optimizer_states itself), and the op each class loads.
ADAM_DEEPSPEED_PARAMS = ("adam_w_mode", "torch_adam", "fp32_optimizer_states")
GIVEN_BY_DEEPSPEED = {"FusedAdam": ("adam_w_mode",), "DeepSpeedCPUAdam": ("adamw_mode", "fp32_optimizer_states")}
OPTIMIZER_OPS = {"FusedAdam": "FusedAdamBuilder", "DeepSpeedCPUAdam": "CPUAdamBuilder",
                 "DeepSpeedCPUAdagrad": "CPUAdagradBuilder", "FusedLamb": "FusedLambBuilder",
                 "FusedLion": "FusedLionBuilder", "DeepSpeedCPULion": "CPULionBuilder"}
# What ZeRO builds without zero_allow_untested_optimizer (deepspeed/runtime/zero/utils.py ZERO_SUPPORTED_OPTIMIZERS:
# torch's Adam/AdamW/Adagrad and DeepSpeed's fused/CPU versions of adam, adagrad and lion, plus MuonWithAuxAdam, which
# DeepSpeed adds to that list on its first check, and builds for "Muon").
ZERO_TESTED_OPTIMIZERS = frozenset({"adam", "adamw", "adagrad", "lion", "muon"})

DEEPSPEED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
# transformers scheduler type -> the DeepSpeed scheduler class of the same shape.
SCHEDULER_FOR_TYPE = {
    "linear": "WarmupDecayLR",
    "constant_with_warmup": "WarmupLR",
    "constant": "WarmupLR",
    "cosine": "WarmupCosineLR",
}

FP16_BLOCK_DEFAULTS = {"loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
# The ZeRO-2 section used when a config has none; "auto" fields are settled by where the ranks run (TUNED_ZERO).
ZERO2_DEFAULTS = {
    "stage": 2,
    "allgather_partitions": True,
    "allgather_bucket_size": 5e8,
    "overlap_comm": "auto",
    "reduce_scatter": "auto",
    "reduce_bucket_size": 5e8,
    "contiguous_gradients": "auto",
}
# ZeRO-1/2 fields whose best value depends on where the ranks run, measured; filled when a file leaves them out or
# says "auto" (a value the user wrote is kept). Each entry: (value, why) by "cpu" / "gpu" / "gpus" (several GPU ranks).
CPU_PROFILE_RUN = "benchmarks/profile_zero2.py, MiniLM, 2 CPU ranks"
H100_RUN = "BERT-large QA shape, bf16, 1 H100"
TUNED_ZERO = {
    "overlap_comm": {
        "cpu": (False, f"CPU ranks have no side streams to overlap with: steps 9% shorter off ({CPU_PROFILE_RUN})"),
        "gpu": (False, f"one rank has no gradient traffic to overlap; DeepSpeed's stage-2 default, the measured "
                       f"1.06x run ({H100_RUN})"),
        "gpus": (True, "gradient reduction overlaps the backward pass (DeepSpeed's recommended value for several "
                       "ranks; benchmarks/gpu.py's N-rank rows measure it)"),
    },
    "reduce_scatter": {
        "cpu": (False, f"one all-reduce beats per-rank reduce calls on gloo/shm: 9% shorter steps ({CPU_PROFILE_RUN})"),
        "gpu": (True, "DeepSpeed's default"),
        "gpus": (True, "DeepSpeed's default"),
    },
    "contiguous_gradients": {
        "cpu": (False, f"no copy of each gradient into a bucket buffer: 1.137 vs 1.164 s/step, same losses "
                       f"({CPU_PROFILE_RUN})"),
        "gpu": (False, f"no copy of each gradient into a bucket buffer, no reduce_bucket_size buffer held: 0.084 vs "
                       f"0.110 s/step ({H100_RUN})"),
        "gpus": (False, f"no copy of each gradient into a bucket buffer, no reduce_bucket_size buffer held: 0.084 vs "
                        f"0.110 s/step ({H100_RUN})"),
    },
}
# Values DeepSpeed itself uses for zero fields given as "auto" when no model is at hand.
ZERO_AUTO_FALLBACK = {"reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e7,
                      "stage3_param_persistence_threshold": 1e5, "stage3_module_granularity_threshold": 0}
# Sizes from the model's hidden size h: key -> (rule, meaning, whose). transformers' are those of
# HfTrainerDeepSpeedConfig.trainer_config_finalize.
HIDDEN_SIZE_AUTO = {
    "reduce_bucket_size": (lambda h: h * h, "h² elements", "transformers' rule"),
    "stage3_prefetch_bucket_size": (lambda h: int(0.9 * h * h), "0.9·h² elements fetched ahead of use",
                                    "transformers' rule"),
    "stage3_param_persistence_threshold": (lambda h: 10 * h, "parameters under 10·h elements stay whole on every "
                                                             "rank (no fetch per use)", "transformers' rule"),
}
# ZeRO-3's stage3_module_granularity_threshold stays DeepSpeed's 0 unless the file sets it. h² was the GPU default
# from an H200 lease (2026-11-24: 0.62-0.66x plain samples/s against 0.19x at 0), but on BERT and on most models the
# model's own granularity is under h², so DeepSpeed made the whole model one leaf and no gradient reached the optimizer
# (grad norm 0: those rows measured a run that learnt nothing; found on an H100 on 2026-11-27, reproduced on CPU).
# A value the file sets is checked against the model (backends/deepspeed/leaves.py).
ZERO3_GRANULARITY = (0, "DeepSpeed's 0 (a fetch and a hook per module): a larger value can make a leaf of a module "
                        "holding the transformer blocks, or of the whole model, and then DeepSpeed trains with wrong "
                        "or no gradients (measured; a value the file sets is checked against the model)")
# ZeRO-3 fields filled when a file leaves them out or says "auto" (a value the user wrote is kept): key -> (value,
# why); "auto" here means "from the model's hidden size" (HIDDEN_SIZE_AUTO). The rest stay DeepSpeed's own defaults
# (stage3_max_live_parameters and stage3_max_reuse_distance 1e9, sub_group_size 1e9, overlap_comm on): the same as
# transformers' documented ZeRO-3 template; on one H200 none of them changed ZeRO-3's speed (docs/gpus.md).
ZERO3_DEFAULTS = {
    **dict.fromkeys(("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"),
                    ("auto", "sized from the model's hidden size h (transformers' rule)")),
    "stage3_gather_16bit_weights_on_model_save": (True, "every checkpoint and output_dir hold the whole model as a "
                                                        "Hugging Face model, gathered layer by layer into rank 0's CPU "
                                                        "memory"),
}
# What ZeRO-3 costs where ZeRO-2 would fit, for --explain and trainer-ext plan (measured in issue 14).
ZERO3_COST = ("parameters gathered module by module for every forward and backward (1.5x DDP's communication): "
              "measured on one GPU (BERT-large, bf16) at 0.13-0.19x plain samples/s at DeepSpeed's defaults (H100, "
              "H200); choose it when ZeRO-2 does not fit (trainer-ext plan --device_memory tells)")
# Keys DeepSpeed reads only at stage 3 (at stage 0-2 it ignores them), and the unprefixed names DeepSpeed also accepts
# for stage-3 fields (renamed to the stage3_ spelling transformers and the presets use).
STAGE3_ALIASES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential": "stage3_allgather_sequential",
}
STAGE3_ONLY_KEYS = frozenset({*STAGE3_ALIASES.values(), "offload_param", "sub_group_size", "cpu_offload_param",
                              "stage3_gather_fp16_weights_on_model_save", "zero_hpz_partition_size",
                              "zero_quantized_weights", "zero_quantized_nontrainable_weights"})

# Keys whose values are names, never numbers: their strings are left alone.
STRING_KEYS = frozenset({"type", "device", "nvme_path", "output_path", "job_name", "tag", "name", "project",
                          "team", "group", "log_level", "communication_data_type", "grad_accum_dtype",
                          "warmup_type", "backend"})
NUMBER_TEXT = re.compile(r"^\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*$")
INTEGER_TEXT = re.compile(r"^\s*[+-]?\d+\s*$")
AUTO = "auto"
