"""Under torchrun (2 ranks, gloo): ExtTrainer's preemption callback driven through optimizer steps as transformers
drives it, rank 1 sending itself a real SIGTERM at the end of a step; each rank writes <out>/<case>-rank<R>.json with
the step it stopped after and the collectives each step made (benchmarks/step_overhead.py's dispatch counter). With
--train, first benchmarks/step_overhead.py's counted runs of the stock Trainer and ExtTrainer under DDP in the same
process (<out>/rank<R>.json), then an ExtTrainer run (DDP, --logging_steps 50, an asynchronous agreement at every
step) whose rank 1 gets SIGTERM during step 6 (<out>/preempted-rank<R>.json): one launch for all.

    torchrun --nproc_per_node 2 tests/scripts/stop_agreement.py OUT [--train]

Cases (name, agree_every_s, seconds a step takes, the step rank 1 is signalled at, logging_steps):
every_step (an asynchronous agreement each step), logs_only (only at the steps that log), timed (about every 0.2 s
of 0.02 and 0.04 s steps: the smaller K the ranks propose), before_a_log (signalled at the step before one that logs)."""

import json
import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from step_overhead import build_trainer, samples, sync_counter, worker  # noqa: E402
from transformers import TrainerCallback, TrainerControl, TrainerState  # noqa: E402

from trainer_ext.checkpoints.preemption import Preempted, PreemptionCallback  # noqa: E402

CASES = [("every_step", 0.0, 0.0, 4, 10), ("logs_only", float("inf"), 0.0, 4, 10),
         ("timed", 0.2, 0.02, 7, 100), ("before_a_log", 0.0, 0.0, 9, 10)]


def drive(rank: int, agree_every_s: float, step_seconds: float, signal_step: int, logging_steps: int) -> dict:
    callback = PreemptionCallback(agree_every_s=agree_every_s)
    callback.install()
    args, state = SimpleNamespace(device=torch.device("cpu")), TrainerState()
    callback.on_train_begin(args, state, TrainerControl())
    collectives, stopped = [], None
    try:
        for step in range(1, 41):
            time.sleep(step_seconds * (1 + rank))  # the ranks' own step times differ: K must still be one
            state.global_step = step
            control = TrainerControl(should_log=step % logging_steps == 0)
            if rank == 1 and step == signal_step:
                os.kill(os.getpid(), signal.SIGTERM)
            with sync_counter() as counter:
                control = callback.on_step_end(args, state, control)
            collectives.append(sum(n for (what, _, _), n in counter.counts.items() if what == "collective"))
            if control.should_training_stop:
                stopped = step
                assert control.should_save
                break
        callback.on_train_end(args, state, control)
    finally:
        callback.uninstall()
    return {"stopped": stopped, "signum": callback.signum, "collectives": collectives}


class SignalDuring(TrainerCallback):
    """Rank 1 sends itself SIGTERM at the end of step `step`, before ExtTrainer's callbacks see that step end."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and args.process_index == 1:
            os.kill(os.getpid(), signal.SIGTERM)


def preempted(out: Path) -> dict:
    trainer = build_trainer("ext", ["--logging_steps", "50"], out / "preempted", samples(400), 20)
    trainer.preemption.agree_every_s = 0.0  # an asynchronous agreement at every step, read at the next one's end
    trainer.callback_handler.callbacks.insert(0, SignalDuring(6))
    try:
        trainer.train()
        return {"preempted": None}
    except Preempted as stopped:
        return {"preempted": stopped.code, "checkpoint": Path(stopped.checkpoint).name,
                "step": trainer.state.global_step}


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    if "--train" in sys.argv:
        options = SimpleNamespace(report_dir=str(out), trainers="stock,ext", steps=0, count_steps=14,
                                  timed_repeats=0, profile=None)
        report = worker(options, [])
        (out / f"rank{report['rank']}.json").write_text(json.dumps(report))
        (out / f"preempted-rank{report['rank']}.json").write_text(json.dumps(preempted(out)))
    formed = not torch.distributed.is_initialized()  # else the trainers formed it, and release it at exit
    if formed:
        torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    for name, *case in CASES:
        (out / f"{name}-rank{rank}.json").write_text(json.dumps(drive(rank, *case)))
    torch.distributed.barrier()
    if formed:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
