"""Train a BERT built from a config (no model package, no network) on seeded random token ids with ExtTrainer and
ExtTrainingArguments, under any launcher and backend: the model for tests that must run on a GPU machine that has
only the repository. `--model_size tiny|small` picks the shape, `--head lm` a masked-LM
head (its decoder tied to the word embeddings) trained to repeat each token, `--report_dir` writes each rank's
model-state bytes there (benchmarks/memory.py) and the parameter bytes it held at most while building the model
(inside `trainer_ext.sharded_loading(args)`, as a user's script), `--predict` the evaluation set's logits to
predictions.json, `--plain_loading` builds it through from_config without sharded_loading (a stock script);
every other flag is an ExtTrainingArguments flag.
The final model, train_results.json (train_loss, ...) and trainer_state.json (per-step losses and gradient norms) go to
output_dir.
TINY_TRAIN_NONFINITE_STEPS="3" (or "3-": from step 3 on) makes the logits of those optimizer steps infinite, so their
gradients hold inf/NaN: what a diverging run or a bad batch does to a real one. Under --fp16 each logged step also
records `loss_scale`, the scale the next step will use (DeepSpeed's loss scaler, or accelerate's GradScaler).
TINY_TRAIN_OOM_ABOVE="8": a training step with more than 8 samples per device fails as the GPU's out-of-memory does
(--auto_find_batch_size then retries with a smaller batch)."""

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

import torch
from transformers import (AutoModelForMaskedLM, AutoModelForSequenceClassification, BertConfig, BertForMaskedLM,
                          BertForSequenceClassification)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from transformers import TrainerCallback  # noqa: E402

from trainer_ext import (ExtArgumentParser, ExtTrainer, ExtTrainingArguments, exit_process,  # noqa: E402
                         one_line_errors, sharded_loading)

one_line_errors()  # a user's mistake uncaught: its one line and exit status 2, not a traceback on every rank

SHAPES = {  # dropout off: every backend and precision sees the same function
    "tiny": dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64),
    "small": dict(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024),
}

own = argparse.ArgumentParser(add_help=False)
own.add_argument("--model_size", choices=sorted(SHAPES), default="tiny")
own.add_argument("--num_samples", type=int, default=512)
own.add_argument("--seq_length", type=int, default=16)
own.add_argument("--head", choices=("classification", "lm"), default="classification")
own.add_argument("--report_dir")
own.add_argument("--eval_samples", type=int, default=0, help="an evaluation set of this many other samples")
own.add_argument("--predict", action="store_true", help="predictions.json: the evaluation set's logits")
own.add_argument("--plain_loading", action="store_true",
                 help="build through from_config outside sharded_loading, as a stock Trainer script does")
mine, rest = own.parse_known_args()
(args,) = ExtArgumentParser(ExtTrainingArguments).parse_args_into_dataclasses(rest)

if mine.report_dir:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from memory import LoadPeak, ModelStateReport  # noqa: E402

torch.manual_seed(0)
shape = SHAPES[mine.model_size]
config = BertConfig(**shape, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
model_class = BertForMaskedLM if mine.head == "lm" else BertForSequenceClassification
auto_class = AutoModelForMaskedLM if mine.head == "lm" else AutoModelForSequenceClassification
with LoadPeak() if mine.report_dir else contextlib.nullcontext() as peak, \
        contextlib.nullcontext() if mine.plain_loading else sharded_loading(args):  # as a user's script
    model = auto_class.from_config(config) if mine.plain_loading else model_class(config)
generator = torch.Generator().manual_seed(1)
ids = torch.randint(1, shape["vocab_size"], (mine.num_samples, mine.seq_length), generator=generator)
labels = ids if mine.head == "lm" else (ids[:, 0] > shape["vocab_size"] // 2).long()  # a signal the model can learn
train = [{"input_ids": ids[i], "labels": labels[i]} for i in range(len(ids))]
held_out = torch.randint(1, shape["vocab_size"], (mine.eval_samples, mine.seq_length), generator=generator)
evaluation = [{"input_ids": row, "labels": row if mine.head == "lm" else (row[0] > shape["vocab_size"] // 2).long()}
              for row in held_out] or None

class NonFiniteSteps(TrainerCallback):
    """Turns the classifier's output to inf during the optimizer steps named by TINY_TRAIN_NONFINITE_STEPS."""

    def __init__(self, spec: str):
        first, dash, last = spec.partition("-")
        self.first = int(first)
        self.last = int(last) if last else (None if dash else self.first)
        self.active = False
        model.classifier.register_forward_hook(lambda module, inputs, output: output * float("inf") if self.active
                                               else output)

    def on_step_begin(self, args, state, control, **kwargs):
        step = state.global_step + 1
        self.active = step >= self.first and (self.last is None or step <= self.last)




class LossScale(TrainerCallback):
    """Adds the fp16 loss scale to each logged step of trainer_state.json."""

    def on_log(self, args, state, control, **kwargs):
        optimizer = getattr(trainer.model_wrapped, "optimizer", None)  # a DeepSpeed engine's ZeRO optimizer
        scaler = getattr(trainer.accelerator, "scaler", None)
        scale = getattr(optimizer, "cur_scale", None) or (scaler.get_scale() if scaler is not None else None)
        if scale is not None and state.log_history and "loss" in state.log_history[-1]:
            state.log_history[-1]["loss_scale"] = float(scale)


class OutOfMemoryAbove(TrainerCallback):
    def __init__(self, most: int):
        self.most = most

    def on_step_begin(self, args, state, control, **kwargs):
        if state.train_batch_size > self.most:
            raise RuntimeError("CUDA out of memory.")  # accelerate's find_executable_batch_size reads this text


injected = os.environ.get("TINY_TRAIN_NONFINITE_STEPS")
callbacks = [NonFiniteSteps(injected)] if injected else []
if os.environ.get("TINY_TRAIN_OOM_ABOVE"):
    callbacks.append(OutOfMemoryAbove(int(os.environ["TINY_TRAIN_OOM_ABOVE"])))
if args.fp16:
    callbacks.append(LossScale())
if mine.report_dir:
    report = ModelStateReport(mine.report_dir)
    report.record["load_peak_params_bytes"] = peak.bytes  # the most parameter bytes this rank held while building
    callbacks.append(report)
trainer = ExtTrainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation, callbacks=callbacks or None)
outcome = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
trainer.save_model()
trainer.save_state()  # trainer_state.json in output_dir: every logged loss and gradient norm
if trainer.is_world_process_zero():  # as the task recipes do: train_loss and the other training metrics
    (Path(args.output_dir) / "train_results.json").write_text(json.dumps(outcome.metrics, indent=2))
if evaluation is not None:  # every rank's final weights, evaluated together
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        (Path(args.output_dir) / "eval_results.json").write_text(json.dumps(metrics, indent=2))
    if mine.predict:  # the same samples predicted: every rank's logits gathered in the samples' order
        logits = trainer.predict(evaluation).predictions
        if trainer.is_world_process_zero():
            (Path(args.output_dir) / "predictions.json").write_text(json.dumps(logits.tolist()))
exit_process(0)  # as docs/operations.md advises a launched script: no teardown under gloo's threads
