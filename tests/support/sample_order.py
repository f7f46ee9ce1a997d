"""tests/scripts/record_order.py's runs: a tiny model on a dataset that records the sample indices each rank loads,
on 1 rank (plain python) or N (torchrun), the indices read back, and the uninterrupted 2-rank run the resume tests
compare with (once across the xdist workers)."""

import shutil

from .environment import BIN, PYTHON, REPO, free_port
from .processes import run
from .shared import shared_once

RECORD_ORDER = REPO / "tests" / "scripts" / "record_order.py"
# A constant rate: a run stopped early by --max_steps then continued equals one run (the schedule does not depend
# on the total), which lets the remote-checkpoint test stop a run without a signal.
ORDER_COMMON = ["--report_to", "none", "--disable_tqdm", "true", "--seed", "5", "--logging_steps", "1",
                "--learning_rate", "1e-3", "--lr_scheduler_type", "constant", "--save_strategy", "steps",
                "--save_steps", 4]


def train(output_dir, record_dir, batch_size, ranks=1, *flags, env=None, check=True):
    """Run record_order.py on 1 rank (plain python) or N (torchrun)."""
    launcher = [PYTHON] if ranks == 1 else [BIN / "torchrun", "--nproc_per_node", ranks, "--master_port", free_port()]
    out = run([*launcher, RECORD_ORDER, "--output_dir", output_dir, *ORDER_COMMON, "--per_device_train_batch_size",
               batch_size, *flags], env={"RECORD_DIR": str(record_dir), **(env or {})})
    if check:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out


def loaded(record_dir, rank):
    return [int(line) for line in (record_dir / f"rank{rank}.txt").read_text().split()]


def uninterrupted_run():
    """2 ranks x 8 = 16 per step, 14 steps over a 100-sample set: 7 steps per epoch, checkpoints every 4 steps;
    its folder holds run/ and indices/."""
    with shared_once("order") as root:  # once across workers (see references.SharedRuns)
        if not (root / "done").exists():
            shutil.rmtree(root, ignore_errors=True)
            train(root / "run", root / "indices", 8, 2, "--max_steps", 14)
            (root / "done").touch()
    return root
