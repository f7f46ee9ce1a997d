"""Causal-LM fine-tuning (SFT): JSON lines of chat `messages` (ShareGPT and Alpaca rows too), `prompt`/`completion` or
plain `text`, tokenized once per machine into the data cache (or streamed) -> a fine-tuned decoder (full, or LoRA
adapters through peft), with completion-only loss, packing, and evaluation loss, perplexity and next-token accuracy on
the target tokens. With no --model_name_or_path: a tiny Llama built from a config, with a
byte-level tokenizer built offline (written once to the cache folder and loaded from there like any model folder)."""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ArgumentsError, MissingLibraryError
from ..integrations import internals
from .common import REPO
from .common import ModelArguments as CommonModelArguments
from .common import (check_data_files, check_sample_limits, nearby, train_and_validation_files,
                     with_channels)
from .driver import run_task

SHIPPED_DATA = REPO / "data" / "causal_lm"
EVAL_METRICS = ("loss", "token_accuracy")  # evaluation also reports perplexity (exp of the loss), after it
TINY_LLAMA = "tiny-llama-bytes-v1"  # the default model's cache folder name: change it whenever the model changes
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# transformers builds each packed sample's own causal mask from the position ids for these (flash attention: from
# one flattened row); any other implementation would let the samples of a row attend to each other.
PACKING_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4")

__all__ = ["ModelArguments", "DataArguments", "run"]


@dataclass
class ModelArguments(CommonModelArguments):
    model_name_or_path: str | None = field(default=None, metadata={
        "help": "A causal LM folder (or a Hub name when online); default: a tiny Llama built from a config with a "
                "byte-level tokenizer (offline)."})
    attn_implementation: str | None = field(default=None, metadata={
        "help": "sdpa, eager, flash_attention_2, flex_attention, ...; default: the model's."})
    lora_r: int | None = field(default=None, metadata={"aliases": ["--lora_rank"], "help": "Train LoRA adapters of this "
                                                                "rank (peft); the base model frozen. Unset: a full "
                                                                "fine-tune. --lora_rank: LLaMA-Factory's name."})
    lora_alpha: float | None = field(default=None, metadata={"help": "LoRA scaling numerator; default 2 x --lora_r."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the adapters' input (default 0)."})
    lora_target_modules: str | None = field(default=None, metadata={
        "help": "Comma-separated module names (q_proj,v_proj) or all-linear; default: peft's for the model family."})
    lora_dora: bool = field(default=False, metadata={"aliases": ["--use_dora"], "help": (
        "Weight-decomposed adapters (DoRA: peft's use_dora): a trained magnitude per output feature.")})
    lora_rslora: bool = field(default=False, metadata={"aliases": ["--use_rslora"], "help": (
        "Rank-stabilised scaling, lora_alpha / sqrt(r) instead of lora_alpha / r (peft's use_rslora).")})
    lora_modules_to_save: str | None = field(default=None, metadata={"help": (
        "Comma-separated modules trained whole and saved with the adapter, e.g. embed_tokens,lm_head (needed when the "
        "tokenizer has tokens the model lacks: their embeddings must train).")})
    load_in_4bit: bool = field(default=False, metadata={"help": (
        "QLoRA: the frozen base quantized to 4-bit NF4 by bitsandbytes as it loads (with --lora_r).")})

    def __post_init__(self):
        super().__post_init__()
        for name in ("lora_target_modules", "lora_modules_to_save"):  # an experiment file's YAML list
            if isinstance(getattr(self, name), (list, tuple)):
                setattr(self, name, ",".join(map(str, getattr(self, name))))
        lora = ("lora_alpha", "lora_target_modules", "lora_modules_to_save") if self.lora_r is None else ()
        given = [f"--{name}" for name in lora if getattr(self, name) is not None] + [
            f"--{name}" for name in ("lora_dropout", "lora_dora", "lora_rslora", "load_in_4bit")
            if self.lora_r is None and getattr(self, name)]
        if given:
            what = "is a setting" if len(given) == 1 else "are settings"
            raise ArgumentsError(f"{', '.join(given)} {what} of LoRA adapters, which train only with --lora_r: add "
                                 "--lora_r (e.g. 16) to train adapters, or drop "
                                 f"{'it' if len(given) == 1 else 'them'} for a full fine-tune")
        if self.lora_r is not None and self.lora_r < 1:
            raise ArgumentsError(f"--lora_r {self.lora_r}: the adapters' rank must be a positive integer, e.g. 16")
        if not 0 <= self.lora_dropout < 1:
            raise ArgumentsError(f"--lora_dropout {self.lora_dropout}: a probability from 0 to below 1, e.g. 0.05")
        if self.lora_r is not None:
            from importlib.util import find_spec

            if find_spec("peft") is None:
                raise MissingLibraryError("--lora_r needs peft, which is not installed: pip install \"trainer_ext[llm]\" "
                                          "(or pip install peft)")
            if self.load_in_4bit and find_spec("bitsandbytes") is None:
                raise MissingLibraryError("--load_in_4bit needs bitsandbytes, which is not installed: pip install "
                                          "\"trainer_ext[llm]\" (or pip install bitsandbytes)")


@dataclass
class DataArguments:
    train_file: str | None = field(default=None, metadata={
        "help": "JSON lines of {\"messages\": [{\"role\", \"content\"}, ...]}, ShareGPT {\"conversations\"}, Alpaca "
                "{\"instruction\", \"input\", \"output\"}, {\"prompt\", \"completion\"} or {\"text\"}; default: "
                "data/causal_lm/train.jsonl."})
    validation_file: str | None = field(default=None)
    dataset_text_field: str | None = field(default=None, metadata={
        "help": "The column of text rows (TRL's name); default: text."})
    dataset_columns: str | None = field(default=None, metadata={
        "help": "Other column names, as FIELD=COLUMN pairs: e.g. prompt=question,completion=answer or "
                "messages=dialog (fields: messages, conversations, instruction, input, output, system, history, "
                "prompt, completion, text)."})
    streaming: bool = field(default=False, metadata={
        "help": "Read, tokenize and pack the training file on the fly, in its order (needs --max_steps; nothing is "
                "cached); default: tokenized once per machine into the cache and memory-mapped."})
    max_seq_length: int = field(default=512, metadata={"help": "Tokens per sample (longer ones are cut, counted and "
                                                               "said once) and per packed row."})
    packing: bool = field(default=False, metadata={"help": "Pack several training samples into each row of "
                                                           "--max_seq_length (positions restart per sample)."})
    completion_only_loss: bool | None = field(default=None, metadata={
        "help": "Labels on the assistant's / completion's tokens only; default: true for messages and "
                "prompt/completion data (text rows are trained whole)."})
    chat_template: str | None = field(default=None, metadata={
        "help": "A Jinja chat template file for messages data; default: the tokenizer's (ChatML when it has none)."})
    pad_to_multiple_of: int | None = field(default=None, metadata={
        "help": "Pad each batch's length up to a multiple of this; with --torch_compile and no --packing every batch "
                "is padded to --max_seq_length unless this is given."})
    max_train_samples: int | None = field(default=None)
    max_eval_samples: int | None = field(default=None)
    preprocessing_num_workers: int | None = field(default=None, metadata={
        "help": "Processes that tokenize (each a batch of rows at a time); default: this one."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Tokenize again instead of using the cache."})
    evaluate_before_training: bool = field(default=False, metadata={"help": "Report validation metrics first."})

    def __post_init__(self):
        check_sample_limits(self)
        if self.max_seq_length < 2:
            raise ArgumentsError(f"--max_seq_length {self.max_seq_length}: a causal LM needs at least 2 tokens per "
                                 "sample (e.g. 512, 2048)")
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            raise ArgumentsError(f"--pad_to_multiple_of {self.pad_to_multiple_of}: give a positive number (e.g. 64)")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise ArgumentsError(f"--chat_template {self.chat_template}: no such file{nearby(self.chat_template)} "
                                 "(give a Jinja template file)")
        check_data_files(self.given())
        if self.preprocessing_num_workers is not None and self.preprocessing_num_workers < 1:
            raise ArgumentsError(f"--preprocessing_num_workers {self.preprocessing_num_workers}: give a number of "
                                 "processes (1 or more), or leave it out to tokenize in this one")
        self.columns()

    def columns(self):
        from .chat_data import Columns

        return Columns.from_flags(self.dataset_text_field, self.dataset_columns)

    def given(self) -> dict:
        return with_channels({"train": self.train_file, "validation": self.validation_file}, (".jsonl", ".json"))

    def files(self, training_args) -> dict[str, str]:
        """The files this run reads: the user's, or all shipped ones when none is given."""
        return train_and_validation_files(self, training_args, SHIPPED_DATA)


# -- the default model ----------------------------------------------------------------------------------------------
def cache_folder() -> Path:
    return Path(os.environ.get("TRAINER_EXT_CACHE") or Path.home() / ".cache" / "trainer_ext")


def byte_tokenizer():
    """A byte-level tokenizer built without any download: the 256 bytes, then <pad>, <s>, </s>, <|im_start|>,
    <|im_end|>; a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {**{token: i for i, token in enumerate(specials)},
             **{char: len(specials) + i for i, char in enumerate(alphabet)}}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                        additional_special_tokens=specials[3:], model_max_length=1024)
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def tiny_llama(seed: int = 0):
    """A 2-layer Llama (grouped-query attention, SwiGLU, untied embeddings, no dropout) for the byte tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = byte_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model, tokenizer


def default_model() -> str:
    """The tiny Llama's folder, written once (atomically: ranks and jobs may race; every writer writes the same)."""
    import shutil
    import tempfile

    from safetensors.torch import save_file

    folder = cache_folder() / TINY_LLAMA
    if (folder / "config.json").is_file():
        return str(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{TINY_LLAMA}-", dir=folder.parent))
    model, tokenizer = tiny_llama()
    # Written here, not by save_pretrained, which in a process group writes on rank 0 alone (transformers 5): a
    # rank 1 finishing first left a folder without weights (seen with a fresh cache on 2 ranks).
    save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items()},
              str(staging / "model.safetensors"), metadata={"format": "pt"})
    model.config.architectures, model.config.dtype = [type(model).__name__], model.dtype  # as save_pretrained writes
    model.config.save_pretrained(staging)
    model.generation_config.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        os.rename(staging, folder)
    except OSError:  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)
    return str(folder)


# -- checks before the weights load ---------------------------------------------------------------------------------
def linear_names(model) -> set[str]:
    """Module names LoRA can target (peft matches a target with a name or its last dotted parts)."""
    import torch

    return {name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"}


def lora_targets(model_args: ModelArguments, skeleton) -> list[str] | str:
    """--lora_target_modules checked against the model's layers (peft only says "Target modules ... not found")."""
    from ..errors import closest

    names = linear_names(skeleton)
    text = model_args.lora_target_modules
    if text is None:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

        return list(DEFAULTS.get(skeleton.config.model_type, ())) or "all-linear"
    if text.strip() == "all-linear":
        return "all-linear"
    wanted = [name.strip() for name in text.split(",") if name.strip()]
    leaves = sorted({name.rsplit(".", 1)[-1] for name in names} - {"lm_head"})
    unknown = [want for want in wanted if not any(name == want or name.endswith("." + want) for name in names)]
    if unknown or not wanted:
        hints = [f"{want} (did you mean {closest(want, leaves)}?)" if closest(want, leaves) else want
                 for want in unknown]
        raise ArgumentsError(f"--lora_target_modules {text}: {type(skeleton).__name__} has no module "
                             f"{', '.join(hints) or 'named'}; its linear layers are {', '.join(leaves)} (or give "
                             "all-linear)")
    return wanted


def adapter_modules(model_args: ModelArguments, model) -> tuple:
    """--lora_target_modules and --lora_modules_to_save checked against the model's modules (its skeleton before the
    weights load): (target modules, modules to save), both None for a full fine-tune."""
    if not model_args.lora_r:
        return None, None
    return lora_targets(model_args, model), modules_to_save(model_args, model)


def modules_to_save(model_args: ModelArguments, skeleton) -> list[str] | None:
    """--lora_modules_to_save checked against the model's modules (peft matches a name or its last dotted parts)."""
    from ..errors import closest

    if not model_args.lora_modules_to_save:
        return None
    wanted = [name.strip() for name in model_args.lora_modules_to_save.split(",") if name.strip()]
    names = {name for name, _ in skeleton.named_modules() if name}
    leaves = sorted({name.rsplit(".", 1)[-1] for name in names})
    unknown = [want for want in wanted if not any(name == want or name.endswith("." + want) for name in names)]
    if unknown or not wanted:
        hints = [f"{want} (did you mean {closest(want, leaves)}?)" if closest(want, leaves) else want
                 for want in unknown]
        raise ArgumentsError(f"--lora_modules_to_save {model_args.lora_modules_to_save}: {type(skeleton).__name__} "
                             f"has no module {', '.join(hints) or 'named'} (e.g. embed_tokens,lm_head)")
    return wanted


def evaluates(data_args, training_args) -> bool:
    """Whether the command evaluates (before, during or after training)."""
    return bool(training_args.do_eval or getattr(data_args, "evaluate_before_training", False)
                or str(training_args.eval_strategy) not in ("no", "IntervalStrategy.NO"))


def check_model_flags(model_path: str, model_args: ModelArguments, training_args, evaluating: bool) -> None:
    """What the model flags cannot do here, before anything loads: a LoRA adapter folder as the model (transformers
    loads one into its base itself only with peft >= 0.22, unreleased), 4-bit weights evaluated on CPU."""
    if (Path(model_path) / "adapter_config.json").is_file():
        raise ArgumentsError(f"--model_name_or_path {model_path} holds a LoRA adapter, not a model: transformers "
                             "loads an adapter into its base model itself only with peft >= 0.22 (not released); "
                             f"fold it into its base first (trainer-ext merge {model_path} --output_dir "
                             f"{Path(model_path).name}-merged) and give that folder")
    if model_args.load_in_4bit and evaluating and training_args.device.type == "cpu":
        raise ArgumentsError("--load_in_4bit on CPU with an evaluation: bitsandbytes 0.50 repacks 4-bit weights for "
                             "CPU inference at the first evaluation, and training after it no longer learns "
                             "(measured: the loss stops moving); train without --do_eval/--eval_strategy/"
                             "--evaluate_before_training and evaluate the adapter without --load_in_4bit, or train "
                             "on a CUDA GPU")


def quantization(model_args: ModelArguments, training_args):
    """--load_in_4bit: bitsandbytes' NF4 for the frozen base as it loads, computing in the training's dtype; None
    without it."""
    if not model_args.load_in_4bit:
        return None
    import torch
    from transformers import BitsAndBytesConfig

    compute = torch.bfloat16 if training_args.bf16 else torch.float16 if training_args.fp16 else torch.float32
    # The packed 4-bit values stored in the compute dtype: ZeRO-3 and FSDP shard them with the model's other tensors.
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute,
                              bnb_4bit_quant_storage=compute)


def load_model(model_path: str, config, model_args: ModelArguments, training_args):
    """The model's weights as the flags say: fp32 for a full fine-tune (the master weights), a frozen LoRA base in
    the compute dtype, 4-bit under --load_in_4bit; partitioned as they load where the backend does (ZeRO-3, FSDP2's
    partitioned loading)."""
    from transformers import AutoModelForCausalLM

    from ..training.prepare import sharded_loading
    from .common import reading

    dtype = model_args.model_kwargs.get("dtype", model_args.model_kwargs.get("torch_dtype"))
    if dtype is None:  # full fine-tunes keep fp32 master weights; a frozen LoRA base can sit in the compute dtype
        dtype = ("bfloat16" if model_args.lora_r and training_args.bf16 else
                 "float16" if model_args.lora_r and training_args.fp16 else "float32")
    kwargs = {**{k: v for k, v in model_args.model_kwargs.items() if k != "torch_dtype"}, "dtype": dtype}
    if model_args.load_in_4bit:  # quantized as it loads, on this rank's device (ZeRO-3 places it itself)
        from transformers.integrations import is_deepspeed_zero3_enabled

        kwargs["quantization_config"] = quantization(model_args, training_args)
        if not is_deepspeed_zero3_enabled():
            kwargs["device_map"] = {"": training_args.device}
    with sharded_loading(training_args), reading("--model_name_or_path", model_path, "model"):
        return AutoModelForCausalLM.from_pretrained(model_path, config=config, **kwargs)


def lora_config(model_args: ModelArguments, targets, saved):
    """peft's LoraConfig as the LoRA flags say (None without --lora_r)."""
    if not model_args.lora_r:
        return None
    from peft import LoraConfig

    return LoraConfig(r=model_args.lora_r, lora_alpha=model_args.lora_alpha or 2 * model_args.lora_r,
                      lora_dropout=model_args.lora_dropout, target_modules=targets, task_type="CAUSAL_LM",
                      use_dora=model_args.lora_dora, use_rslora=model_args.lora_rslora, modules_to_save=saved)


def adapted(model, tokenizer, model_args: ModelArguments, training_args, targets, saved):
    """The loaded model grown to the tokenizer (fit_vocabulary) and, with --lora_r, wrapped in LoRA adapters (peft)
    as the LoRA flags say, the base frozen."""
    fit_vocabulary(model, tokenizer, model_args, saved)
    if not model_args.lora_r:
        return model
    from peft import get_peft_model

    model = get_peft_model(model, lora_config(model_args, targets, saved))
    if training_args.gradient_checkpointing:
        model.enable_input_require_grads()  # the frozen embeddings' output must carry gradients through
    return model


def fit_vocabulary(model, tokenizer, model_args: ModelArguments, saved: list[str] | None) -> None:
    """A tokenizer with tokens the model's embeddings lack (added tokens): the embeddings grow to it (the new rows the
    mean of the others, transformers' resize), said once. Under LoRA the new rows would never train unless the
    embeddings and the output layer are trained whole: refused without --lora_modules_to_save naming both."""
    from .data_checks import say_once

    rows, wanted = model.get_input_embeddings().num_embeddings, len(tokenizer)
    if wanted <= rows:
        return
    layers = [model.get_input_embeddings(), model.get_output_embeddings()]
    names = [next(name.rsplit(".", 1)[-1] for name, found in model.named_modules() if found is layer)
             for layer in layers if layer is not None]
    if model_args.lora_r and not set(names) <= set(saved or ()):
        raise ArgumentsError(f"the tokenizer has {wanted - rows} tokens the model's {rows} embeddings lack (added "
                             "tokens): under LoRA their embeddings would never train; add --lora_modules_to_save "
                             f"{','.join(names)} (they then train whole and are saved with the adapter)")
    model.resize_token_embeddings(wanted)
    say_once(f"the tokenizer has {wanted - rows} tokens the model's embeddings lack: the embeddings grew from {rows} "
             f"to {wanted} rows (the output layer too), the new ones starting at the mean of the others")


def check_packing(data_args: DataArguments, training_args, config, model_class, asked: str | None = None) -> bool:
    """--packing only where each packed sample sees itself alone; returns whether rows must be flattened into one
    (flash attention reads the boundaries of a single row). `asked`: --attn_implementation as given (transformers
    reads some names as others, e.g. paged|sdpa as sdpa)."""
    import sys

    if not data_args.packing:
        return False
    if getattr(training_args, "use_cache", False):
        raise ArgumentsError("--packing with --use_cache true: in training the cache hides the packed samples' "
                             "boundaries from the attention mask, so they would attend to each other; drop "
                             "--use_cache (the Trainer's default turns the cache off)")
    implementation = asked or internals.attention_implementation(config) or "sdpa"
    masks = hasattr(sys.modules.get(model_class.__module__), "create_causal_mask")
    if implementation not in PACKING_ATTENTION or (not implementation.startswith("flash") and not masks):
        why = (f"attention implementation {implementation!r}" if implementation not in PACKING_ATTENTION else
               f"{model_class.__name__} (its attention mask is not built from position ids)")
        raise ArgumentsError(f"--packing: under {why} the samples packed into one row would attend to each other; "
                             f"use --attn_implementation sdpa (or {', '.join(PACKING_ATTENTION[1:])}) on a model "
                             "that supports it, or drop --packing")
    return implementation.startswith("flash")


def load_model_config(model_path: str, model_args: ModelArguments):
    from .common import load_config

    kwargs = {"attn_implementation": model_args.attn_implementation} if model_args.attn_implementation else {}
    config = load_config(model_path, model_args, **kwargs)
    if model_args.attn_implementation:
        internals.set_attention_implementation(config, model_args.attn_implementation)
    config.use_cache = False  # a cache in training hides packed samples' boundaries from the mask (measured)
    return config


def skeleton_of(config):
    """The model on the meta device (no memory, no weights): its module names and class, in seconds. Built by calling
    its class (from_config would partition it under ZeRO-3); None for a model class transformers does not list (a
    Hub model's own code), whose checks then wait for the loaded model."""
    import torch
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        if getattr(config, "auto_map", None):
            return None
        raise ArgumentsError(f"--model_name_or_path: a {type(config).__name__} ({config.model_type}) is not a causal "
                             "LM: give a decoder model such as Llama, Mistral, Qwen or GPT-2") from None
    with torch.device("meta"):
        return model_class(config)


# -- data ------------------------------------------------------------------------------------------------------------
def chat_template(tokenizer, data_args: DataArguments, chat: bool) -> str | None:
    """The template chat rows render with (None when no file has any)."""
    from .chat_data import DEFAULT_CHAT_TEMPLATE
    from .data_checks import say_once

    if data_args.chat_template:
        template = Path(data_args.chat_template).read_text(encoding="utf-8")
        try:
            import jinja2

            jinja2.Environment().parse(template)
        except Exception as err:  # noqa: BLE001 - jinja2's TemplateSyntaxError
            raise ArgumentsError(f"--chat_template {data_args.chat_template}: not a Jinja template ({err})") from None
        return template
    if not chat:
        return None
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.chat_template
    say_once("the tokenizer has no chat template: using ChatML's (<|im_start|>role ... <|im_end|>, each assistant "
             "turn ending with the eos token); give --chat_template FILE for another")
    return DEFAULT_CHAT_TEMPLATE


def check_tokenizer(tokenizer, flag: str) -> None:
    from .data_checks import say_once

    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ArgumentsError(f"{flag}: the tokenizer has neither a pad nor an eos token: give a tokenizer with "
                                 "one (--tokenizer_name), or --tokenizer_kwargs '{\"pad_token\": \"<pad>\"}' for a "
                                 "token it has")
        tokenizer.pad_token = tokenizer.eos_token
        say_once(f"the tokenizer has no pad token: padding with its eos token {tokenizer.eos_token!r} (padding "
                 "carries no label and no attention)")


def check_formats(sources: dict, data_args: DataArguments, training_args) -> None:
    """What the files' formats (their first rows) rule out, before the model loads."""
    texts = [source.path for source in sources.values() if source.format == "text"]
    if data_args.completion_only_loss and texts:
        raise ArgumentsError(f"--completion_only_loss true: {', '.join(texts)} holds text rows, which have no "
                             "completion to train alone (every token trains); drop the flag, or give prompt/"
                             "completion or messages rows")
    if data_args.streaming and training_args.do_train and training_args.max_steps <= 0:
        raise ArgumentsError("--streaming reads the training file as a stream with no length, so an epoch has no "
                             "end: give --max_steps (the optimizer steps to train)")


def tokenized(sources: dict, tokenizer, template, data_args: DataArguments, training_args) -> dict:
    """Each split's dataset (chat_datasets.py): from the tokenized data cache, built once per machine, or for
    --streaming's training file a stream; over-long samples cut and counted, samples that lost every target token to
    the cut left out, both said once."""
    from .chat_data import Encoder
    from .chat_datasets import ChatStream, Split, cached_split
    from .data_checks import DataError, say_once

    limits = {"train": data_args.max_train_samples, "validation": data_args.max_eval_samples}
    splits = {}
    for split, source in sources.items():
        completion_only = (data_args.completion_only_loss if data_args.completion_only_loss is not None
                           else source.format != "text")
        encoder = Encoder(tokenizer, template, completion_only, data_args.max_seq_length, source.path)
        packing = data_args.packing and split == "train"
        if split == "train" and data_args.streaming:
            splits[split] = Split(ChatStream(source, encoder, packing, limits[split]), None, {})
            say_once(f"--streaming: {source.path} is read, tokenized{' and packed' if packing else ''} as training "
                     "goes, in its order, by every rank")
            continue
        done = cached_split(split, source, encoder, cache_folder() / "data", training_args, data_args, limits[split],
                            packing)
        counts = done.manifest
        if counts["truncated"]:
            lost = counts["lost"]
            say_once(f"{split}: {counts['truncated']} of {counts['rows']} samples are longer than --max_seq_length "
                     f"{data_args.max_seq_length} tokens and were cut to it"
                     + (f"; {lost} of them lost every target token and were left out" if lost else "")
                     + " (raise --max_seq_length to keep them whole)")
        if done.samples == 0:
            raise DataError(f"{source.path}: no sample keeps a target token within --max_seq_length "
                            f"{data_args.max_seq_length}: raise it")
        if packing:
            say_once(f"packing: {done.samples} training samples in {len(done.dataset)} rows of up to "
                     f"{data_args.max_seq_length} tokens")
        splits[split] = done
    return splits


# -- metrics ---------------------------------------------------------------------------------------------------------
def predicted_tokens(logits, labels):
    """preprocess_logits_for_metrics: keep the argmax, not the vocabulary-sized logits."""
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    return logits.argmax(dim=-1)


def token_accuracy(prediction) -> dict:
    """The share of target tokens the model predicts exactly (greedy next token), over every target token."""
    predictions, labels = np.asarray(prediction.predictions), np.asarray(prediction.label_ids)
    predicted, wanted = predictions[:, :-1], labels[:, 1:]
    mask = wanted != -100
    return {"token_accuracy": float((predicted[mask] == wanted[mask]).mean()) if mask.any() else 0.0}


# -- entry point -----------------------------------------------------------------------------------------------------
STEPS = ("do_train", "do_eval")


def setup(model_args: ModelArguments, data_args: DataArguments, training_args):
    """A causal LM fine-tuned and/or evaluated with ExtTrainer (trainer_ext.tasks.driver runs the steps). Writes
    {train,eval,eval_before}_results.json; the output holds the model (or with LoRA the adapter; `trainer-ext merge`
    folds it into full weights)."""
    from transformers import set_seed

    from ..data.packing import CausalLMCollator
    from ..trainer import ExtTrainer
    from .chat_data import ChatFile
    from .common import check_sequence_length, load_tokenizer
    from .data_checks import say_once
    from .driver import Prepared

    files = data_args.files(training_args)
    columns = data_args.columns()
    sources = {split: ChatFile(path, columns) for split, path in files.items()}  # each file's format, its first row
    check_formats(sources, data_args, training_args)
    model_path = model_args.model_name_or_path or default_model()
    check_model_flags(model_path, model_args, training_args, evaluates(data_args, training_args))
    config = load_model_config(model_path, model_args)
    skeleton = skeleton_of(config)
    if skeleton is not None:
        targets, saved = adapter_modules(model_args, skeleton)
        flatten = check_packing(data_args, training_args, config, type(skeleton), model_args.attn_implementation)
    tokenizer = load_tokenizer(model_path, model_args)
    check_tokenizer(tokenizer, "--tokenizer_name" if model_args.tokenizer_name else "--model_name_or_path")
    check_sequence_length("--max_seq_length", data_args.max_seq_length, config, tokenizer)
    template = chat_template(tokenizer, data_args, any(source.chat for source in sources.values()))
    splits = tokenized(sources, tokenizer, template, data_args, training_args)  # every row checked and tokenized
    train = splits["train"].dataset if "train" in splits else None

    set_seed(training_args.seed)
    model = load_model(model_path, config, model_args, training_args)
    if skeleton is None:  # the checks on the model itself (its own code, which transformers does not list)
        targets, saved = adapter_modules(model_args, model)
        flatten = check_packing(data_args, training_args, model.config, type(model), model_args.attn_implementation)
    model = adapted(model, tokenizer, model_args, training_args, targets, saved)
    compile_length = (data_args.max_seq_length if training_args.torch_compile and not data_args.pad_to_multiple_of
                      else None)
    if compile_length and not data_args.packing:
        say_once(f"--torch_compile: every batch padded to --max_seq_length {compile_length} (one shape, compiled "
                 "once); give --pad_to_multiple_of N for fewer padding tokens and one compilation per length")
    collator = CausalLMCollator(tokenizer.pad_token_id, data_args.pad_to_multiple_of,
                                data_args.max_seq_length if data_args.packing else compile_length, flatten)
    Path(training_args.output_dir).mkdir(parents=True, exist_ok=True)
    evaluation = splits["validation"].dataset if "validation" in splits else None
    trainer = ExtTrainer(model=model, args=training_args, train_dataset=train, eval_dataset=evaluation,
                         processing_class=tokenizer, data_collator=collator, compute_metrics=token_accuracy,
                         preprocess_logits_for_metrics=predicted_tokens)

    def perplexity(prefix, metrics):
        loss = metrics.get(f"{prefix}_loss")
        return {} if loss is None else {f"{prefix}_perplexity": math.exp(loss) if loss < 700 else float("inf")}

    return Prepared(trainer, splits["train"].samples if "train" in splits else 0, more_metrics=perplexity)


# The whole recipe, as the examples and experiment files run it (run(model_args, data_args, training_args) -> metrics).
run = functools.partial(run_task, "causal_lm")
