"""ExtSeq2SeqTrainer: ExtTrainer (true losses, one data order, backends, safe checkpoints) that generates
during evaluation and prediction like transformers' Seq2SeqTrainer, with predictions in dataset order."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

from .args import ExtTrainingArguments
from .trainer import ExtTrainer


@dataclass
class ExtSeq2SeqTrainingArguments(ExtTrainingArguments, Seq2SeqTrainingArguments):
    """ExtTrainingArguments plus `--predict_with_generate`, `--generation_max_length`, `--generation_num_beams`
    and `--generation_config`; validated by ExtTrainingArguments, serialised by Seq2SeqTrainingArguments."""


class ExtSeq2SeqTrainer(ExtTrainer, Seq2SeqTrainer):
    """ExtTrainer's training, losses and checkpoints; Seq2SeqTrainer's evaluate/predict/prediction_step, so
    `--predict_with_generate` evaluates generated sequences (on the plain replicated model below ZeRO-3)."""

    def evaluation_loop(self, *args, **kwargs):
        # Seq2SeqTrainer gathers with accelerator.gather, which keeps the copies accelerate pads the last
        # batch with on N ranks: predictions would come back longer than the dataset and misaligned.
        self.gather_function = self.accelerator.gather_for_metrics
        if "use_gather_object" in inspect.signature(self.gather_function).parameters:
            self.gather_function = functools.partial(self.gather_function,
                                                     use_gather_object=self.args.eval_use_gather_object)
        return super().evaluation_loop(*args, **kwargs)
