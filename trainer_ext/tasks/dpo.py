"""Preference tuning (DPO) of a causal LM, typically the SFT recipe's output: JSON lines of {"prompt", "chosen",
"rejected"} (TRL's preference format: conversational lists of {"role", "content"} turns, or plain text) -> TRL's
DPOTrainer combined with ExtTrainer (trainer_ext.trl.ExtDPOTrainer), full (the reference a second copy of the starting
model, or its log-probs computed before training) or LoRA (the reference the adapter-disabled base), on any backend.
Evaluation reports TRL's loss, rewards, margins and reward accuracy on held-out pairs. With no --model_name_or_path:
the causal-LM recipe's tiny Llama; with no data files, data/preference/ (the causal-LM set's facts world)."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ArgumentsError
from .causal_lm import ModelArguments
from .common import REPO, check_data_files, check_sample_limits, train_and_validation_files, with_channels
from .data_checks import DataError, first_problem, row
from .driver import run_task

SHIPPED_DATA = REPO / "data" / "preference"
# What evaluation reports (eval_ prefixed), for --metric_for_best_model.
EVAL_METRICS = ("loss", "rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected",
                "logps/chosen", "logps/rejected")
ROLES = ("system", "user", "assistant", "tool")

__all__ = ["ModelArguments", "DataArguments", "run"]


@dataclass
class DataArguments:
    train_file: str | None = field(default=None, metadata={
        "help": "JSON lines of {\"prompt\", \"chosen\", \"rejected\"}: lists of {\"role\", \"content\"} turns (chosen "
                "and rejected: the assistant's answers) or text; default: data/preference/train.jsonl."})
    validation_file: str | None = field(default=None, metadata={
        "help": "Held-out pairs in the same format; default: data/preference/validation.jsonl."})
    max_train_samples: int | None = field(default=None)
    max_eval_samples: int | None = field(default=None)
    evaluate_before_training: bool = field(default=False, metadata={"help": "Report validation metrics first."})

    def __post_init__(self):
        check_sample_limits(self)
        check_data_files(self.given())

    def given(self) -> dict:
        return with_channels({"train": self.train_file, "validation": self.validation_file}, (".jsonl", ".json"))

    def files(self, training_args) -> dict[str, str]:
        """The files this run reads: the user's, or the shipped ones when none is given."""
        return train_and_validation_files(self, training_args, SHIPPED_DATA)


# -- data ------------------------------------------------------------------------------------------------------------
def read_pairs(path: str) -> list[dict]:
    """Every line of a preference file checked (the three fields, one format, roles, non-empty answers that differ);
    the first problem raises DataError naming the file, the line and the fix."""
    if problem := first_problem(path):
        raise DataError(problem)
    text = Path(path).read_text(encoding="utf-8-sig")
    values = (list(enumerate(json.loads(text))) if text.lstrip().startswith("[") else
              [(number, json.loads(line)) for number, line in enumerate(text.splitlines()) if line.strip()])
    if not values:
        raise DataError(f"{path} has no rows: give a file with at least one preference pair")
    pairs = [checked_pair(path, number, value) for number, value in values]
    kinds = [isinstance(pair["prompt"], list) for pair in pairs]
    if len(set(kinds)) > 1:
        other = next(number for (number, _), kind in zip(values, kinds) if kind != kinds[0])
        raise DataError(f"{row(path, other)}: a {'conversational' if kinds[0] else 'text'} file's row in the other "
                        "format (lists of turns / text): give each format in its own file")
    return pairs


def checked_pair(path, number: int, value) -> dict:
    where = row(path, number)
    if not isinstance(value, dict) or not {"prompt", "chosen", "rejected"} <= set(value):
        fields = sorted(value) if isinstance(value, dict) else type(value).__name__
        hint = ("; 'messages' rows are SFT data: give them to examples/run_clm.py" if isinstance(value, dict)
                and "messages" in value else "")
        raise DataError(f"{where}: fields {fields}; each line needs 'prompt', 'chosen' and 'rejected' (TRL's "
                        f"preference format){hint}")
    conversational = isinstance(value["prompt"], list)
    for name in ("prompt", "chosen", "rejected"):
        if isinstance(value[name], list) != conversational or not isinstance(value[name], (list, str)):
            raise DataError(f"{where}: '{name}' is {json.dumps(value[name])[:40]}; give 'prompt', 'chosen' and "
                            "'rejected' all as lists of {\"role\", \"content\"} turns or all as text")
        if conversational:
            turns(where, name, value[name])
        elif name != "prompt" and not value[name].strip():
            raise DataError(f"{where}: '{name}' is empty: a pair needs two answers to compare")
    if value["chosen"] == value["rejected"]:
        raise DataError(f"{where}: 'chosen' and 'rejected' are the same answer: the pair teaches nothing (fix or "
                        "remove the line)")
    return {name: value[name] for name in ("prompt", "chosen", "rejected")}


def turns(where: str, name: str, value: list) -> None:
    if not value:
        raise DataError(f"{where}: '{name}' is an empty list of turns")
    for turn, message in enumerate(value, 1):
        if not isinstance(message, dict) or not {"role", "content"} <= set(message):
            raise DataError(f"{where}: {name} turn {turn} needs 'role' and 'content'")
        if message["role"] not in ROLES:
            raise DataError(f"{where}: {name} turn {turn} has role {message['role']!r}, not one of {', '.join(ROLES)}")
        if not isinstance(message["content"], str):
            raise DataError(f"{where}: {name} turn {turn}: 'content' is not text")
    if name != "prompt" and (value[-1]["role"] != "assistant" or not value[-1]["content"].strip()):
        raise DataError(f"{where}: '{name}' must end with a non-empty assistant turn (the answer being compared)")


# -- entry point -----------------------------------------------------------------------------------------------------
STEPS = ("do_train", "do_eval")


def check(model_args: ModelArguments, data_args: DataArguments, training_args) -> None:
    from ..trl import ExtDPOConfig

    if not isinstance(training_args, ExtDPOConfig):
        raise ArgumentsError(f"the dpo task reads trainer_ext.trl.ExtDPOConfig, not {type(training_args).__name__}")


def setup(model_args: ModelArguments, data_args: DataArguments, training_args):
    """A causal LM DPO-trained and/or evaluated with ExtDPOTrainer (trainer_ext.tasks.driver runs the steps). Writes
    {train,eval,eval_before}_results.json; the output holds the model (with LoRA the adapter). `training_args`:
    trainer_ext.trl.ExtDPOConfig."""
    import datasets
    from transformers import set_seed

    from ..trl import ExtDPOTrainer
    from .causal_lm import (adapter_modules, check_model_flags, check_tokenizer, default_model, evaluates,
                            fit_vocabulary, load_model, load_model_config, lora_config, skeleton_of)
    from .chat_data import DEFAULT_CHAT_TEMPLATE
    from .common import check_sequence_length, load_tokenizer
    from .data_checks import say_once
    from .driver import Prepared

    limits = {"train": data_args.max_train_samples, "validation": data_args.max_eval_samples}
    files = data_args.files(training_args)
    pairs = {split: read_pairs(path)[:limits[split]] for split, path in files.items()}  # every line checked
    model_path = model_args.model_name_or_path or default_model()
    check_model_flags(model_path, model_args, training_args, evaluates(data_args, training_args))
    reference = not model_args.lora_r and not training_args.precompute_ref_log_probs
    check_reference(training_args, reference)
    config = load_model_config(model_path, model_args)
    skeleton = skeleton_of(config)
    targets, saved = adapter_modules(model_args, skeleton) if skeleton is not None else (None, None)
    tokenizer = load_tokenizer(model_path, model_args)
    check_tokenizer(tokenizer, "--tokenizer_name" if model_args.tokenizer_name else "--model_name_or_path")
    if training_args.max_length is not None:
        check_sequence_length("--max_length", training_args.max_length, config, tokenizer)
    if any(isinstance(pair["prompt"], list) for split in pairs.values() for pair in split) \
            and not getattr(tokenizer, "chat_template", None):
        say_once("the tokenizer has no chat template: using ChatML's (<|im_start|>role ... <|im_end|>, each assistant "
                 "turn ending with the eos token)")
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE

    set_seed(training_args.seed)
    model = load_model(model_path, config, model_args, training_args)
    if skeleton is None:
        targets, saved = adapter_modules(model_args, model)
    fit_vocabulary(model, tokenizer, model_args, saved)
    # The reference: the starting model, a second copy (partitioned as it loads under ZeRO-3); none with the reference
    # log-probs computed before training, nor with LoRA: TRL adds the adapters (peft_config) and disables them for the
    # reference (given a PeftModel, it would train against a copy of its adapter instead).
    ref_model = None
    if reference:
        ref_model = load_model(model_path, config, model_args, training_args)
        fit_vocabulary(ref_model, tokenizer, model_args, saved)
    Path(training_args.output_dir).mkdir(parents=True, exist_ok=True)
    # From the files, as datasets reads them (memory-mapped; TRL's tokenized and reference caches beside them, which
    # every rank of the machine reads): the rows checked above, the first --max_*_samples of each split.
    sets = {split: datasets.load_dataset("json", data_files=path, split="train") for split, path in files.items()}
    sets = {split: data if limits[split] is None else data.select(range(len(pairs[split])))
            for split, data in sets.items()}
    trainer = ExtDPOTrainer(model=model, ref_model=ref_model, args=training_args, train_dataset=sets.get("train"),
                            eval_dataset=sets.get("validation"), processing_class=tokenizer,
                            peft_config=lora_config(model_args, targets, saved))
    return Prepared(trainer, len(pairs.get("train", [])))


def check_reference(training_args, reference: bool) -> None:
    """A full fine-tune's reference model under FSDP2's partitioned loading: its copy would be empty on every rank but
    the first (only the trained model is filled from rank 0's)."""
    from ..backends.fsdp.backend import partitioned_loading

    if reference and partitioned_loading(training_args):
        raise ArgumentsError("--fsdp_config cpu_ram_efficient_loading with a full DPO fine-tune: the reference model "
                             "would load on the first rank only; add --precompute_ref_log_probs true (its log-probs "
                             "computed once, before training) or train LoRA adapters (--lora_r)")


# The whole recipe, as the examples and experiment files run it (run(model_args, data_args, training_args) -> metrics).
run = functools.partial(run_task, "dpo")
