"""The stock Trainer's promises that concern ranks, kept by ExtTrainer on 2 CPU ranks under the real launchers:
streaming datasets (true loss, exact resume from the dataset's own position or by reading past what was trained),
the best checkpoint on every backend, and a user error printed once. ZeRO-2's best checkpoint runs under the deepspeed
launcher; the other DeepSpeed runs under torchrun (~3 s of CPU less per run; the launcher is not their point)."""

import json

import pytest

from conftest import (PYTHON, RECORD_ORDER, REPO, TINY_TRAIN, free_port, launcher, loaded,
                      max_weight_difference, run, scratch)

pytestmark = [pytest.mark.launch, pytest.mark.deepspeed]

# A constant rate: a run stopped by --max_steps and continued equals one run. 100 samples, global batch 16: passes
# of the stream end inside a batch, and step 7 stops 112 items in, 12 into the second pass.
STREAM = ["--report_to", "none", "--disable_tqdm", "true", "--seed", "5", "--logging_steps", "1", "--learning_rate",
          "1e-3", "--lr_scheduler_type", "constant", "--save_strategy", "steps", "--save_steps", 4]
LAUNCHERS = {
    "single": lambda: [PYTHON],
    "torchrun": lambda: [*launcher("torchrun"), "--nproc_per_node", 2, "--master_port", free_port()],
    "deepspeed": lambda: [*launcher("deepspeed"), "--num_gpus", 2, "--master_port", free_port()],
    "launch": lambda: [PYTHON, "-m", "torch.distributed.launch", "--nproc_per_node", 2, "--master_port", free_port()],
}


def stream_run(kind, output_dir, record_dir, *flags, batch_size=8):
    out = run([*LAUNCHERS[kind](), RECORD_ORDER, "--output_dir", output_dir, *STREAM, "--per_device_train_batch_size",
               batch_size, *flags], env={"RECORD_DIR": str(record_dir)})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out.stdout + out.stderr


def losses(output_dir, step):
    history = json.loads((output_dir / f"checkpoint-{step}" / "trainer_state.json").read_text())["log_history"]
    return {row["step"]: row["loss"] for row in history if "loss" in row}


@pytest.fixture(scope="module")
def one_process_stream(request):
    """10 steps of the stream in one process, global batch 16: what every rank count and backend must train."""
    root = scratch(request, "stream")
    stream_run("single", root / "run", root / "records", "--stream", "torch", "--max_steps", 10, batch_size=16)
    return root / "run"


def assert_same(reference, output_dir):
    ours, theirs = losses(reference, 10), losses(output_dir, 10)
    assert sorted(ours) == sorted(theirs) == list(range(1, 11))
    assert max(abs(ours[step] - theirs[step]) for step in ours) < 1e-5
    assert max_weight_difference(reference, output_dir) < 1e-5


@pytest.mark.parametrize("kind,stream,flags,how", [
    ("torchrun", "torch", [], "by reading and discarding the 12 items before it in its pass"),
    ("torchrun", "datasets", ["--deepspeed", "zero2_minimal"], "from the dataset's saved position (exact)"),
])
def test_a_stream_on_2_ranks_resumes_exactly(one_process_stream, tmp_path, kind, stream, flags, how):
    """Fails when an iterable dataset cannot be trained, trains another loss on 2 ranks than in one process, or
    resumes anywhere but where it stopped: from the dataset's saved position when it has one, else by reading past
    the items already trained on (the log says which)."""
    stream_run(kind, tmp_path / "run", tmp_path / "first", "--stream", stream, "--max_steps", 7, *flags)
    said = stream_run(kind, tmp_path / "run", tmp_path / "again", "--stream", stream, "--max_steps", 10, *flags)
    assert f"the training stream continues at item 112 {how}" in said
    assert_same(one_process_stream, tmp_path / "run")
    # The second pass began at item 100 (sample 0): read again from there, or not at all from the saved position.
    assert loaded(tmp_path / "again", 0)[0] == (12 if stream == "datasets" else 0)


def test_a_stream_under_sharded_ddp_trains_the_same(one_process_stream, tmp_path):
    """Fails when FairScale's `simple` trains a stream differently from one process."""
    stream_run("launch", tmp_path / "run", tmp_path / "records", "--stream", "datasets", "--max_steps", 10,
               "--sharded_ddp", "simple")
    assert_same(one_process_stream, tmp_path / "run")


BEST = ["--max_steps", 6, "--eval_samples", 16, "--eval_strategy", "steps", "--eval_steps", 2, "--save_steps", 2,
        "--metric_for_best_model", "loss", "--greater_is_better", "true", "--load_best_model_at_end", "true",
        "--save_total_limit", 1, "--per_device_train_batch_size", 8, "--learning_rate", "1e-3", "--use_cpu"]


@pytest.mark.parametrize("kind,flags", [("torchrun", []), ("deepspeed", ["--deepspeed", "zero2_minimal"]),
                                        ("torchrun", ["--deepspeed", "zero3"]),
                                        ("launch", ["--sharded_ddp", "simple"])],
                         ids=["ddp", "zero2", "zero3", "simple"])
def test_the_best_checkpoint_is_kept_and_loaded_at_the_end(tmp_path, kind, flags):
    """Fails when the best checkpoint is recorded under the staging folder (or not at all), rotated away by
    save_total_limit, or not the one loaded at the end, on a backend (ZeRO-2/3 restore it through their engine)."""
    out = run([*LAUNCHERS[kind](), TINY_TRAIN, "--output_dir", tmp_path, "--report_to", "none", "--disable_tqdm",
               "true", "--seed", 7, "--logging_steps", 1, *BEST, *flags])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    evaluations = {row["step"]: row["eval_loss"] for row in state["log_history"] if "eval_loss" in row}
    best = max(evaluations, key=evaluations.get)  # --greater_is_better: the highest loss is the "best"
    assert best < 6  # an earlier checkpoint: loading it changes the final weights
    assert state["best_model_checkpoint"] == str(tmp_path / f"checkpoint-{best}")
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == [f"checkpoint-{best}"]  # limit 1: the best
    assert max_weight_difference(tmp_path, tmp_path / f"checkpoint-{best}") < 1e-6  # the final model is the best
    final = json.loads((tmp_path / "eval_results.json").read_text())["eval_loss"]
    assert abs(final - evaluations[best]) < 1e-6  # on every rank: each loaded the best checkpoint


@pytest.mark.parametrize("flags,message", [
    (["--resume_from_checkpoint", "true"], "No valid checkpoint found in output directory"),
    (["--resume_from_checkpoint", "/nonexistent/checkpoint-3"], "--resume_from_checkpoint /nonexistent/checkpoint-3: "
                                                               "no such folder"),
], ids=["at train()", "when parsed"])
def test_a_user_error_on_2_ranks_is_one_line_once_and_exit_2(tmp_path, flags, message):
    """Fails when a user's mistake on N ranks prints N times, prints a traceback, or exits with another status than 2
    (at the argument parser, and uncaught from ExtTrainer.train() in a script)."""
    out = run([*LAUNCHERS["torchrun"](), TINY_TRAIN, "--output_dir", tmp_path, "--use_cpu", "--max_steps", 2,
               "--report_to", "none", *flags])
    assert out.returncode != 0
    assert (out.stdout + out.stderr).count(message) == 1, out.stderr[-3000:]
    assert "exitcode  : 2" in out.stderr  # torchrun's summary of the ranks' exit status
    assert f'File "{REPO / "trainer_ext"}' not in out.stderr  # no traceback through our code
