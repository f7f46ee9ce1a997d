"""`trainer-ext merge`: a LoRA adapter (a run's output or one of its checkpoints) folded into its base model's weights,
saved as a plain model folder (weights, config, tokenizer, chat template) that loads without peft."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ArgumentsError, MissingLibraryError, UserFileNotFoundError, closest

DTYPES = ("float32", "bfloat16", "float16")


def merge_adapter(adapter_dir, output_dir, base_model: str | None = None, dtype: str = "float32") -> Path:
    """Load the base (adapter_config.json's base_model_name_or_path, or `base_model`), apply the adapter, merge it
    and save the merged model and the tokenizer to `output_dir`; returns it. Raises ArgumentsError for a folder
    without an adapter, a base that cannot be found, or an output folder that already holds a model."""
    adapter_dir, output_dir = Path(adapter_dir), Path(output_dir)
    config_file = adapter_dir / "adapter_config.json"
    if not adapter_dir.is_dir():
        siblings = [p.name for p in adapter_dir.parent.iterdir() if p.is_dir()] if adapter_dir.parent.is_dir() else []
        hint = closest(adapter_dir.name, siblings)
        what = "is a file" if adapter_dir.exists() else "does not exist" + (
            f" (did you mean {adapter_dir.parent / hint}?)" if hint else "")
        raise UserFileNotFoundError(f"{adapter_dir} {what}: give a LoRA run's output_dir or one of its checkpoint-N "
                                    "folders (they hold adapter_config.json)")
    if not config_file.is_file():
        inside = sorted(p.parent.name for p in adapter_dir.glob("checkpoint-*/adapter_config.json"))
        raise ArgumentsError(f"{adapter_dir}: no adapter_config.json there (a LoRA run's output_dir or checkpoint)"
                             + (f"; its checkpoints with one: {', '.join(inside)}" if inside else ""))
    if dtype not in DTYPES:
        raise ArgumentsError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    base = base_model or json.loads(config_file.read_text()).get("base_model_name_or_path")
    if not base:
        raise ArgumentsError(f"{config_file} names no base model: give --base_model PATH")
    if base_model is None and base.startswith(("/", ".", "~")) and not Path(base).expanduser().exists():
        raise ArgumentsError(f"{config_file}: its base model {base} is not there any more: give --base_model PATH")
    if output_dir.resolve() == adapter_dir.resolve() or (output_dir.is_dir() and any(output_dir.glob("*.safetensors"))):
        raise ArgumentsError(f"--output_dir {output_dir}: it holds a model already; give a new folder")
    try:
        import torch
        from peft import PeftModel
    except ImportError:
        raise MissingLibraryError("trainer-ext merge needs peft: pip install \"trainer_ext[llm]\"") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .common import reading

    with reading("--base_model" if base_model else f"{config_file.name}'s base_model_name_or_path", base, "model"):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, dtype))
    tokenizer_source = adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else base
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_source))
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:  # the run grew them (--lora_modules_to_save)
        model.resize_token_embeddings(len(tokenizer))
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    output_dir.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir
