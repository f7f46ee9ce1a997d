"""A user's own training script: stock TrainingArguments and HfArgumentParser, a model built from a config,
its own loss, ExtTrainer as the only trainer_ext import. Rank 0 writes the losses it logged and its learning
rate to results.json in output_dir (a file: the launchers merge the ranks' output streams)."""

import json
from pathlib import Path

import torch
from transformers import BertConfig, BertForSequenceClassification, HfArgumentParser, TrainingArguments

from trainer_ext import ExtTrainer

(args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
torch.manual_seed(0)
config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                    num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
model = BertForSequenceClassification(config)
generator = torch.Generator().manual_seed(1)
ids = torch.randint(1, 64, (256, 12), generator=generator)
labels = (ids[:, 0] > 32).long()  # a signal the model can learn
train = [{"input_ids": ids[i], "labels": labels[i]} for i in range(len(ids))]


def focal_loss(outputs, labels, gamma=2.0):
    log_p = torch.log_softmax(outputs.logits.float(), dim=-1).gather(1, labels[:, None]).squeeze(1)
    return (-(1 - log_p.exp()) ** gamma * log_p).mean()


trainer = ExtTrainer(model=model, args=args, train_dataset=train, loss_fn=focal_loss)
trainer.train()
if trainer.is_world_process_zero():
    results = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "lr": args.learning_rate}
    (Path(args.output_dir) / "results.json").write_text(json.dumps(results))
