"""A spot interruption of the SageMaker walkthrough job (examples/run_qa.py, pretrained MiniLM, 2 ranks), run by AWS's
own toolkits under a temporary /opt/ml as tests/integration/test_sagemaker.py does: an uninterrupted job; the same job stopped by
SIGTERM to its torchrun a few steps after its first checkpoint; a restart on a new root holding only the synced
checkpoint folder. Per backend: how long the preemption checkpoint took after the signal, its size, the steps trained
before and after the stop, and the restart's eval loss against the uninterrupted job's.

    python benchmarks/sagemaker_spot.py [--backends ddp zero2 --steps 30 --save_steps 10]

Writes benchmarks/results/sagemaker_spot.md and prints one JSON line per backend (RESULT ...)."""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "integration")]
from test_sagemaker import QA, TRAIN, clean_env, eval_loss, losses_printed, run_job, write_job  # noqa: E402

from trainer_ext.checkpoints.format import MARKER, checkpoint_step, newest_valid_checkpoint  # noqa: E402

BACKENDS = {"ddp": {}, "zero2": {"deepspeed": "zero2_minimal"}}


def hyperparameters(steps: int, save_steps: int, backend: str) -> dict:
    """The walkthrough's (seq 384, stride 128, 4 per device; fp16 left out on CPU), `steps` steps."""
    return {"do_train": True, "do_eval": True, "per_device_train_batch_size": 4, "per_device_eval_batch_size": 8,
            "max_steps": steps, "save_steps": save_steps, "max_seq_length": 384, "doc_stride": 128,
            "max_train_samples": steps * 8, "max_eval_samples": 32, "dropout": 0, "seed": 7, "logging_steps": 1,
            "report_to": "none", "disable_tqdm": True, "learning_rate": 5e-5, **BACKENDS[backend]}


def stopped_job(root: Path, values: dict, save_steps: int, extra_steps: int = 2) -> tuple[float, float]:
    """Start the job, SIGTERM its torchrun once `extra_steps` steps followed the first checkpoint; (signal sent, toolkit
    ended) as wall-clock times."""
    import psutil

    env = write_job(root, QA, values)
    log = open(root / "job.log", "w")
    job = subprocess.Popen([TRAIN], env={**clean_env(), "PYTHONUNBUFFERED": "1", **env}, cwd=root, stdout=log,
                           stderr=subprocess.STDOUT, start_new_session=True)
    marker = root / "checkpoints" / f"checkpoint-{save_steps}" / MARKER
    while job.poll() is None and not marker.is_file():
        time.sleep(0.2)
    while job.poll() is None and (root / "job.log").read_text().count("'loss':") < save_steps + extra_steps:
        time.sleep(0.1)
    launcher = next(child for child in psutil.Process(job.pid).children(recursive=True)
                    if "torchrun" in " ".join(child.cmdline()))
    sent = time.time()
    launcher.send_signal(signal.SIGTERM)
    job.wait()
    return sent, time.time()


def measure(backend: str, steps: int, save_steps: int, scratch: Path) -> dict:
    values = hyperparameters(steps, save_steps, backend)
    run_job(scratch / "uninterrupted", QA, values)
    first = scratch / "stopped"
    sent, ended = stopped_job(first, values, save_steps)
    saved = newest_valid_checkpoint(first / "checkpoints")
    marker = json.loads((saved / MARKER).read_text())
    second = scratch / "restarted"
    shutil.copytree(first / "checkpoints", second / "checkpoints")
    out = run_job(second, QA, values)
    stopped_at = checkpoint_step(saved)
    return {"backend": backend, "steps": steps, "stopped_at": stopped_at, "trained_after": losses_printed(out),
            "checkpoint_s": round(marker["saved_at"] - sent, 2), "job_end_s": round(ended - sent, 2),
            "checkpoint_mb": round(sum(size for size, _ in marker["files"].values()) / 2**20, 1),
            "eval_loss": eval_loss(second / "model"), "uninterrupted_eval_loss": eval_loss(scratch / "uninterrupted"
                                                                                         / "model")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save_steps", type=int, default=10)
    options = parser.parse_args()
    rows = []
    for backend in options.backends:
        with tempfile.TemporaryDirectory(prefix=f"spot-{backend}-") as scratch:
            rows.append(measure(backend, options.steps, options.save_steps, Path(scratch)))
        print("RESULT", json.dumps(rows[-1]), flush=True)
    lines = ["# A spot stop of the SageMaker walkthrough job (run_qa.py, MiniLM, 2 CPU ranks)", "",
             f"`python benchmarks/sagemaker_spot.py --steps {options.steps} --save_steps {options.save_steps}`: "
             "AWS's toolkits run each job under a temporary /opt/ml; SIGTERM goes to the job's torchrun two steps "
             "after its first checkpoint; the restart runs on a new root holding only the synced checkpoint folder. "
             "The preemption checkpoint's time counts from the signal to its marker: the rest of the step under way, "
             "then the save.", "",
             "| backend | stopped at step | steps after restart | preemption checkpoint after SIGTERM | job ended "
             "after SIGTERM | checkpoint size | eval loss restarted | eval loss uninterrupted |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['backend']} | {r['stopped_at']} of {r['steps']} | {r['trained_after']} | {r['checkpoint_s']} s | "
              f"{r['job_end_s']} s | {r['checkpoint_mb']} MB | {r['eval_loss']:.6f} | "
              f"{r['uninterrupted_eval_loss']:.6f} |" for r in rows]
    (REPO / "benchmarks" / "results" / "sagemaker_spot.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
