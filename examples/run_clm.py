"""Fine-tune a causal LM (SFT) with ExtTrainer: chat `messages` (or ShareGPT, Alpaca), `prompt`/`completion` or plain
`text` JSON lines of any size (tokenized once per machine, or --streaming); full or LoRA (--lora_r); --packing; one process, torchrun DDP, deepspeed ZeRO-2/3, FSDP2 (--fsdp) or --sharded_ddp
simple, unchanged.

With no --model_name_or_path it builds a tiny Llama from a config with a byte-level tokenizer (offline); with no data
files, the chat set shipped in data/causal_lm/. The recipe itself is trainer_ext.tasks.causal_lm (also behind
`trainer-ext train experiments/causal_lm.yaml`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout without installing
from trainer_ext.tasks.driver import script  # noqa: E402

# main(argv=None): the task's flags, its recipe (trainer_ext.tasks.causal_lm), its report; a user's mistake is one line
# and exit status 2. Run as a script (python, torchrun, deepspeed, SageMaker), it runs here.
main = script("causal_lm", __name__)
