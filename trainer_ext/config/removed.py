"""The flags users type from transformers 4 tutorials and other tools that transformers 5 does not take, each with what
to type instead (a closest-spelling guess sends `--save_safetensors` to `--save_steps`). Pure: a table and a lookup."""

from __future__ import annotations

REMOVED = "transformers 5 removed it"
# TrainingArguments fields of transformers 4 that 5 no longer has (tests/unit/test_first_week.py checks each is absent
# from the installed release and that every flag an entry tells users to type exists) -> what to do instead.
REMOVED_FLAGS = {
    "evaluation_strategy": "transformers 5 renamed it: use --eval_strategy",
    "no_cuda": f"{REMOVED}: use --use_cpu",
    "overwrite_output_dir": f"{REMOVED}; a run resumes from the newest complete checkpoint in --output_dir, so pass "
                            "--fresh_start to start over (or give another --output_dir)",
    "logging_dir": f"{REMOVED}: TensorBoard writes under --output_dir/runs, or where the TENSORBOARD_LOGGING_DIR "
                   "variable points",
    "save_safetensors": f"{REMOVED}: checkpoints are always safetensors; drop it",
    "per_gpu_train_batch_size": f"{REMOVED}: use --per_device_train_batch_size",
    "per_gpu_eval_batch_size": f"{REMOVED}: use --per_device_eval_batch_size",
    "push_to_hub_token": f"{REMOVED}: use --hub_token",
    "push_to_hub_model_id": f"{REMOVED}: use --hub_model_id",
    "push_to_hub_organization": f"{REMOVED}: give --hub_model_id ORGANIZATION/NAME",
    "use_mps_device": f"{REMOVED}: an Apple GPU is used when there is one (--use_cpu to train on the CPU)",
    "half_precision_backend": f"{REMOVED}: --fp16 and --bf16 run under torch's autocast; drop it",
    "include_inputs_for_metrics": f"{REMOVED}: use --include_for_metrics inputs",
    "include_tokens_per_second": f"{REMOVED}; drop it",
    "adafactor": f"{REMOVED}: use --optim adafactor",
    "group_by_length": f"{REMOVED} (its --train_sampling_strategy group_by_length is not ExtTrainer's order, which "
                       "is seeded and resumable); drop it",
    "torchdynamo": f"{REMOVED}: use --torch_compile_backend",
    "fsdp_min_num_params": f"{REMOVED}: use --fsdp_config '{{\"min_num_params\": N}}'",
    "fsdp_transformer_layer_cls_to_wrap": f"{REMOVED}: use --fsdp_config "
                                          "'{\"transformer_layer_cls_to_wrap\": [\"BertLayer\"]}'",
    "tpu_num_cores": f"{REMOVED}; drop it",
    "tpu_metrics_debug": f"{REMOVED}; drop it",
    "jit_mode_eval": f"{REMOVED}; drop it",
    "use_ipex": f"{REMOVED}; drop it",
    "use_legacy_prediction_loop": f"{REMOVED}; drop it",
    "past_index": f"{REMOVED}; drop it",
    "mp_parameters": f"{REMOVED}; drop it",
    "ray_scope": f"{REMOVED}; drop it",
}
# Spellings of other trainers and scripts that no closest-spelling guess finds.
OTHER_SPELLINGS = {
    "lr": "use --learning_rate",
    "batch_size": "use --per_device_train_batch_size (per device; the global batch multiplies it by the ranks and "
                  "--gradient_accumulation_steps)",
    "train_batch_size": "use --per_device_train_batch_size (per device), or --global_batch_size (samples per optimizer "
                        "step on any number of ranks)",
    "eval_batch_size": "use --per_device_eval_batch_size",
    "epochs": "use --num_train_epochs",
    "num_epochs": "use --num_train_epochs",
}


def advice(name: str) -> str | None:
    """What to type instead of a flag or field (`--no_cuda`, `no-cuda`, `no_cuda`) no parser takes, or None."""
    key = str(name).split("=", 1)[0].lstrip("-").replace("-", "_")
    return REMOVED_FLAGS.get(key) or OTHER_SPELLINGS.get(key)
