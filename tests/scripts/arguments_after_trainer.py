"""Parse the arguments of one backend (ExtTrainingArguments, then stock TrainingArguments with the same stock flags),
build ExtTrainer on a tiny BERT, and print as JSON, for each kind, the fields whose value building ExtTrainer changed
and the attributes it added: what config/settings.py wrote after parsing.

usage: python arguments_after_trainer.py ddp|zero2|fsdp|simple OUTPUT_DIR"""

import copy
import dataclasses
import json
import sys
import warnings

from transformers import BertConfig, BertForSequenceClassification, TrainingArguments

from trainer_ext import ExtTrainer, ExtTrainingArguments

warnings.filterwarnings("ignore")
backend, output_dir = sys.argv[1:]
FLAGS = {"ddp": {}, "zero2": {"deepspeed": "ds_configs/zero2_minimal.json"}, "fsdp": {"fsdp": "full_shard"},
         "simple": {"sharded_ddp": "simple"}}[backend]


def snapshot(args):
    fields = {}
    for field in dataclasses.fields(args):
        value = getattr(args, field.name)
        try:
            fields[field.name] = repr(copy.deepcopy(value))
        except Exception:  # noqa: BLE001 (an object that cannot be copied: its rendering now)
            fields[field.name] = repr(value)
    return fields, set(vars(args)) - set(fields)


found = {}
for kind, cls in (("ext", ExtTrainingArguments), ("stock", TrainingArguments)):
    if kind == "stock" and backend == "simple":  # --sharded_ddp is not a flag of transformers 5
        continue
    args = cls(output_dir=output_dir, report_to="none", use_cpu=True, **FLAGS)
    fields, attributes = snapshot(args)
    model = BertForSequenceClassification(BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=16))
    ExtTrainer(model=model, args=args)
    after, attributes_after = snapshot(args)
    found[kind] = {"changed": sorted(name for name in fields if fields[name] != after[name]),
                   "added": sorted(attributes_after - attributes)}
print(json.dumps(found))
