"""Fine-tune a tiny decoder LLM as our users do, under any launcher and backend: a LlamaForCausalLM built from a config
(grouped-query attention: 4 query heads, 2 key/value heads; SwiGLU; untied embeddings; no dropout) on seeded
"chat-like" samples of 10 to 49 tokens whose first 2-8 tokens are a prompt without labels (completion-only loss),
padded per batch, fp32. No model package, no network.

  --lora              LoRA adapters (peft) on q_proj/v_proj, the base frozen; with --dora / --rslora (peft's use_dora,
                      use_rslora) and --modules_to_save embed_tokens,lm_head (trained whole, saved with the adapter)
  --new_tokens N      N tokens the model's vocabulary lacks (as a grown tokenizer's), in the samples: the embeddings
                      resized to them (transformers' mean resizing)
  --trl               TRL's SFTTrainer combined with ExtTrainer (`trainer_ext.trl.ExtSFTTrainer`, ExtSFTConfig)
  --dpo               TRL's DPOTrainer combined with ExtTrainer (`trainer_ext.trl.ExtDPOTrainer`, ExtDPOConfig) on
                      seeded preference pairs (a prompt of 2-8 tokens, chosen and rejected completions of 2-12); the
                      reference model a copy of the initial model (with --lora: the adapter-disabled base)
  --stock             the stock transformers Trainer (or stock SFTTrainer with --trl, DPOTrainer with --dpo): the
                      oracle
  --eval_samples N    an evaluation set of N other samples; eval_results.json after training (or alone without
                      --do_train); a 1-process run adds `reference_token_loss`: sum of the token losses / target
                      tokens, computed directly from the model
  --flatten           padding-free batches (transformers' DataCollatorWithFlattening)
  --loss_chunk_tokens N   ExtTrainer's chunked loss takes N target tokens a chunk (default: one chunk of the whole
                      batch at this vocabulary)

Every other flag is an ExtTrainingArguments (or ExtSFTConfig) flag. output_dir gets the model (or adapter),
train_results.json and trainer_state.json."""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

VOCAB = 96
PAD, EOS = 0, 1

own = argparse.ArgumentParser(add_help=False)
own.add_argument("--lora", action="store_true")
own.add_argument("--dora", action="store_true")
own.add_argument("--rslora", action="store_true")
own.add_argument("--modules_to_save")
own.add_argument("--new_tokens", type=int, default=0)
own.add_argument("--trl", action="store_true")
own.add_argument("--dpo", action="store_true")
own.add_argument("--stock", action="store_true")
own.add_argument("--flatten", action="store_true")
own.add_argument("--num_samples", type=int, default=96)
own.add_argument("--eval_samples", type=int, default=0)
own.add_argument("--loss_chunk_tokens", type=int, default=0)
own.add_argument("--report_dir")  # each rank's model-state and activation bytes (benchmarks/memory.py)
own.add_argument("--packed_length", type=int, default=0)  # with --report_dir: samples packed into rows this long
mine, rest = own.parse_known_args()

from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

from trainer_ext import (ExtArgumentParser, ExtTrainer, ExtTrainingArguments, exit_process,  # noqa: E402
                         one_line_errors, sharded_loading)

if mine.loss_chunk_tokens:
    import trainer_ext.training.chunked_loss

    trainer_ext.training.chunked_loss.CHUNK_BYTES = 4 * VOCAB * mine.loss_chunk_tokens
one_line_errors()  # a user's mistake uncaught: its one line and exit status 2, not a traceback on every rank
if mine.trl:
    from trl import SFTConfig, SFTTrainer

    from trainer_ext.trl import ExtSFTConfig, ExtSFTTrainer
    arguments_class, trainer_class = (SFTConfig, SFTTrainer) if mine.stock else (ExtSFTConfig, ExtSFTTrainer)
elif mine.dpo:
    from trl import DPOConfig, DPOTrainer

    from trainer_ext.trl import ExtDPOConfig, ExtDPOTrainer
    arguments_class, trainer_class = (DPOConfig, DPOTrainer) if mine.stock else (ExtDPOConfig, ExtDPOTrainer)
else:
    arguments_class, trainer_class = (TrainingArguments, Trainer) if mine.stock else (ExtTrainingArguments, ExtTrainer)
parser = HfArgumentParser(arguments_class) if mine.stock else ExtArgumentParser(arguments_class)
(args,) = parser.parse_args_into_dataclasses(rest)


def samples(count, generator):
    """Token ids of 10-49 tokens ending in EOS; the first 2-8 are the prompt (no label)."""
    rows = []
    for _ in range(count):
        length = int(torch.randint(10, 50, (1,), generator=generator))
        ids = torch.randint(2, VOCAB + mine.new_tokens, (length,), generator=generator)
        ids[-1] = EOS
        prompt = int(torch.randint(2, 9, (1,), generator=generator))
        rows.append({"input_ids": ids.tolist(), "completion_mask": [0] * prompt + [1] * (length - prompt)})
    return rows


def pairs(count, generator):
    """Preference pairs as TRL reads them: a prompt of 2-8 tokens, chosen and rejected completions of 2-12 tokens
    ending in the eos token, as text of the tokenizer's words."""
    def words(low, high):
        length = int(torch.randint(low, high + 1, (1,), generator=generator))
        return " ".join(f"t{i}" for i in torch.randint(2, VOCAB, (length,), generator=generator).tolist())

    return [{"prompt": words(2, 8) + " ", "chosen": words(1, 11) + " <eos>", "rejected": words(1, 11) + " <eos>"}
            for _ in range(count)]


generator = torch.Generator().manual_seed(1)
rows = pairs if mine.dpo else samples
train_rows, eval_rows = rows(mine.num_samples, generator), rows(mine.eval_samples, generator)


def with_labels(row):
    return {"input_ids": row["input_ids"],
            "labels": [t if m else -100 for t, m in zip(row["input_ids"], row["completion_mask"])]}


def pad_batch(features):
    """Right-padded to the longest sample of the batch: ids PAD, labels -100."""
    longest = max(len(f["input_ids"]) for f in features)
    batch = {"input_ids": [], "attention_mask": [], "labels": []}
    for f in features:
        missing = longest - len(f["input_ids"])
        batch["input_ids"].append(f["input_ids"] + [PAD] * missing)
        batch["attention_mask"].append([1] * len(f["input_ids"]) + [0] * missing)
        batch["labels"].append(f["labels"] + [-100] * missing)
    return {key: torch.tensor(value) for key, value in batch.items()}


def tokenizer():
    """A word-level tokenizer over the ids' own names (TRL wants a processing class with a pad token)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<eos>": EOS, **{f"t{i}": i for i in range(2, VOCAB)}}
    core = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = WhitespaceSplit()  # TRL's DPOTrainer tokenizes text: "t5 t17 <eos>"
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


torch.manual_seed(0)
config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=PAD,
                     eos_token_id=EOS, bos_token_id=EOS)


def built():
    """The model, always the same initial weights (seed 0)."""
    torch.manual_seed(0)
    if mine.stock:
        return LlamaForCausalLM(config)
    with sharded_loading(args):  # partitioned as it is built under ZeRO-3, as a user's script
        return LlamaForCausalLM(config)


model = built()
if mine.new_tokens:  # seeded: transformers draws the new rows around the mean of the others
    torch.manual_seed(0)
    model.resize_token_embeddings(VOCAB + mine.new_tokens)
# DPO's reference: a copy of the initial model (TRL would load one from the model's path, which a model built from a
# config lacks); none with LoRA (the adapter-disabled base) or precomputed reference log-probs.
reference = built() if mine.dpo and not mine.lora and not args.precompute_ref_log_probs else None
lora = None
if mine.lora:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
                      use_dora=mine.dora, use_rslora=mine.rslora,
                      modules_to_save=mine.modules_to_save.split(",") if mine.modules_to_save else None)
    if not mine.dpo:  # DPOTrainer adds the adapters itself, its reference the adapter-disabled base
        model = get_peft_model(model, lora)

if mine.trl or mine.dpo:
    import datasets

    train = datasets.Dataset.from_list(train_rows)
    evaluation = datasets.Dataset.from_list(eval_rows) if eval_rows else None
    extra = {"ref_model": reference, "peft_config": lora} if mine.dpo else {}
    trainer = trainer_class(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                            processing_class=tokenizer(), **extra)
else:
    if mine.flatten:
        from transformers import DataCollatorWithFlattening

        collator = DataCollatorWithFlattening()
    else:
        collator = pad_batch
    train = [with_labels(row) for row in train_rows]
    evaluation = [with_labels(row) for row in eval_rows] or None
    trainer = trainer_class(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                            data_collator=collator)

if mine.report_dir:  # bytes measured at step 2 (benchmarks/memory.py), written to <report_dir>/rank<R>.json
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from memory import ActivationReport, ModelStateReport

    report = ModelStateReport(mine.report_dir)
    trainer.add_callback(report)
    trainer.add_callback(ActivationReport(report.record))
    if mine.packed_length:  # the samples concatenated and cut into rows of one length, as packing does: no padding
        ids, length = [token for row in train_rows for token in row["input_ids"]], mine.packed_length
        trainer.train_dataset = [{"input_ids": ids[start:start + length], "labels": ids[start:start + length]}
                                 for start in range(0, len(ids) - length + 1, length)]
output = Path(args.output_dir)
if args.do_train:
    outcome = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model()
    trainer.save_state()
    if trainer.is_world_process_zero():
        (output / "train_results.json").write_text(json.dumps(outcome.metrics, indent=2))
if evaluation is not None:
    metrics = trainer.evaluate()
    if args.world_size == 1 and not mine.flatten and not mine.dpo:  # the oracle: every target token's loss, summed, over their count
        module = trainer.accelerator.unwrap_model(trainer.model)
        total, count = 0.0, 0
        with torch.no_grad():
            for row in (with_labels(r) for r in eval_rows):
                ids, labels = torch.tensor([row["input_ids"]]), torch.tensor([row["labels"]])
                logits = module(input_ids=ids).logits[0, :-1].float()
                targets = labels[0, 1:]
                total += torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100, reduction="sum").item()
                count += int((targets != -100).sum())
        metrics["reference_token_loss"] = total / count
    if trainer.is_world_process_zero():
        output.mkdir(parents=True, exist_ok=True)
        (output / "eval_results.json").write_text(json.dumps(metrics, indent=2))
if not mine.stock:
    exit_process(0)
