"""Show the DeepSpeed translator on the classic published ZeRO-2 config: resolved for an 8-rank cluster with
the source of every field, then a flag that disagrees with the file, reported before anything runs."""

import subprocess
import sys
from pathlib import Path

CLI = [str(Path(sys.executable).parent / "trainer-ext"), "ds-config"]


def show(title, argv):
    print(f"\n=== {title}\n$ trainer-ext ds-config {' '.join(argv)}", flush=True)
    return subprocess.run(CLI + argv).returncode


show("the classic zero2.json for 8 ranks, 4 per rank, 1000 steps",
     ["--deepspeed", "ds_configs/zero2.json", "--world_size", "8", "--per_device_train_batch_size", "4",
      "--num_training_steps", "1000", "--explain"])
code = show("a flag that disagrees with the file (expected: exit 2, both values named)",
            ["--deepspeed", "ds_configs/zero2.json", "--learning_rate", "1e-4", "--bf16"])
sys.exit(0 if code == 2 else 1)
