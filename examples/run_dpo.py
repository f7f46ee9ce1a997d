"""Preference-tune a causal LM (DPO) with ExtTrainer and TRL's DPOTrainer (trainer_ext.trl.ExtDPOTrainer): JSON lines
of {"prompt", "chosen", "rejected"}; full (the reference a copy of the starting model, or --precompute_ref_log_probs
true) or LoRA (--lora_r: the reference the adapter-disabled base); one process, torchrun DDP, deepspeed ZeRO-2/3,
FSDP2 (--fsdp) or --sharded_ddp simple, unchanged. Every DPOConfig flag works (--beta, --loss_type, --max_length, ...).

Start from the SFT recipe's output (examples/run_clm.py; a LoRA one folded first with `trainer-ext merge`):
    python examples/run_dpo.py --model_name_or_path out/chat --output_dir out/dpo --do_train --do_eval
With no --model_name_or_path: the causal-LM recipe's tiny Llama; with no data files, the pairs shipped in
data/preference/. The recipe itself is trainer_ext.tasks.dpo (also behind `trainer-ext train experiments/dpo.yaml`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout without installing
from trainer_ext.tasks.driver import script  # noqa: E402

# main(argv=None): the task's flags, its recipe (trainer_ext.tasks.dpo), its report; a user's mistake is one line
# and exit status 2. Run as a script (python, torchrun, deepspeed, SageMaker), it runs here.
main = script("dpo", __name__)
