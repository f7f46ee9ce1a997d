"""Trains a tiny BERT with ExtTrainer on a dataset that records every sample it is asked for: each rank appends
the indices it loads to RECORD_DIR/rank{R}.txt, so a test can compare the order a resumed run trains on with an
uninterrupted one, and see that skipped samples are never loaded. The final model goes to output_dir.
`--stream torch` trains on the same samples as a torch IterableDataset that cannot say where it stands (it records
each sample it yields), `--stream datasets` as a datasets.IterableDataset (one shard, unshuffled: it can), both
yielding the set in index order, pass after pass; `--stream` trains with max_steps (a stream has no length)."""

import argparse
import os
import sys
from pathlib import Path

import torch
from transformers import BertConfig, BertForSequenceClassification

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from trainer_ext import ExtArgumentParser, ExtTrainer, ExtTrainingArguments, exit_process  # noqa: E402

NUM_SAMPLES = 100  # not a multiple of the global batch: epochs end mid-batch


class RecordingDataset(torch.utils.data.Dataset):
    def __init__(self, path: Path):
        generator = torch.Generator().manual_seed(1)
        self.ids = torch.randint(1, 64, (NUM_SAMPLES, 8), generator=generator)
        self.labels = (self.ids[:, 0] > 32).long()
        self.log = open(path, "a")

    def __len__(self):
        return NUM_SAMPLES

    def __getitem__(self, index):
        self.log.write(f"{index}\n")
        self.log.flush()
        return {"input_ids": self.ids[index], "labels": self.labels[index]}


class RecordingStream(torch.utils.data.IterableDataset):
    """The same samples as a stream with no state_dict: a resume reads (and records) the samples it discards."""

    def __init__(self, samples: RecordingDataset):
        self.samples = samples

    def __iter__(self):
        for index in range(NUM_SAMPLES):
            yield self.samples[index]


def recording_datasets_stream(samples: RecordingDataset):
    """The same samples as a datasets.IterableDataset, recorded when datasets produces them (lazily, per sample)."""
    import datasets

    rows = [{"index": i} for i in range(NUM_SAMPLES)]
    return datasets.Dataset.from_list(rows).to_iterable_dataset(num_shards=1).map(
        lambda row: samples[row["index"]], remove_columns=["index"])


own = argparse.ArgumentParser(add_help=False)
own.add_argument("--stream", choices=("torch", "datasets"))
mine, rest = own.parse_known_args()
(args,) = ExtArgumentParser(ExtTrainingArguments).parse_args_into_dataclasses(rest)
record_dir = Path(os.environ["RECORD_DIR"])
record_dir.mkdir(parents=True, exist_ok=True)
torch.manual_seed(0)
config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                    num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
samples = RecordingDataset(record_dir / f"rank{args.process_index}.txt")
train = {None: lambda: samples, "torch": lambda: RecordingStream(samples),
         "datasets": lambda: recording_datasets_stream(samples)}[mine.stream]()
trainer = ExtTrainer(model=BertForSequenceClassification(config), args=args, train_dataset=train)
trainer.train()
trainer.save_model()
exit_process(0)  # as docs/operations.md advises a launched script: no teardown under gloo's threads
