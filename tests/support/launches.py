"""The examples and the test scripts under the real launchers: examples/run_glue.py (or tests/scripts/tiny_train.py,
a BERT built from a config, no model package) single-process, under torchrun, torch.distributed.launch or the
deepspeed launcher, with the small deterministic flags every such run shares; launch() fails with the log."""

from .environment import PYTHON, REPO, free_port, launcher
from .processes import run

# tests/scripts/tiny_train.py: a BERT built from a config on random ids; GPU tests use it (no 83 MB model package).
TINY_TRAIN = REPO / "tests" / "scripts" / "tiny_train.py"
TINY_COMMON = ["--logging_steps", "1", "--report_to", "none", "--disable_tqdm", "true", "--seed", "7"]

GLUE = REPO / "examples" / "run_glue.py"
# Small, deterministic runs: dropout off, fp32, a fixed slice of the shipped set.
GLUE_COMMON = ["--max_seq_length", "32", "--logging_steps", "1", "--dropout", "0", "--max_train_samples", "320",
               "--report_to", "none", "--disable_tqdm", "true", "--seed", "7"]


def launch(kind, output_dir, *flags, ranks=2, timeout=900, env=None, script=GLUE):
    """Run examples/run_glue.py (or `script`, e.g. TINY_TRAIN) single-process or under a real launcher; fail with the
    log on error."""
    flags = [str(f) for f in flags]
    if kind == "single":
        cmd = [PYTHON, script]
    elif kind == "torchrun":
        cmd = [*launcher("torchrun"), "--nproc_per_node", ranks, "--master_port", free_port(), script]
    elif kind == "launch":
        cmd = [PYTHON, "-m", "torch.distributed.launch", "--nproc_per_node", ranks, "--master_port", free_port(),
               script]
    elif kind == "deepspeed":
        cmd = [*launcher("deepspeed"), "--num_gpus", ranks, "--master_port", free_port(), script]
    else:
        raise ValueError(kind)
    common = GLUE_COMMON if script == GLUE else TINY_COMMON
    out = run([*cmd, "--output_dir", output_dir, *common, *flags], timeout=timeout, env=env)
    assert out.returncode == 0, f"{kind} failed:\n{out.stdout[-4000:]}\n{out.stderr[-6000:]}"
    return out
