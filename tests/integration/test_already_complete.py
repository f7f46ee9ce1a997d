"""A re-run of a finished command (job schedulers and spot restarts do this) trains nothing: no extra step, no
checkpoint or results file changed, one line saying training is complete at step N and where the model is; the
requested evaluation still runs, on the finished weights; exit status 0. Also when the only copy is remote."""

import hashlib
import json
import shutil

import pytest

from conftest import launch

pytestmark = [pytest.mark.launch, pytest.mark.deepspeed]

FLAGS = ["--do_train", "--do_eval", "--max_eval_samples", 32, "--max_steps", 6, "--save_steps", 3,
         "--save_total_limit", 2, "--per_device_train_batch_size", 8]
REWRITTEN = {"eval_results.json", "all_results.json"}  # the evaluation asked for runs again


def contents(output_dir):
    return {str(path.relative_to(output_dir)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(output_dir.rglob("*")) if path.is_file() and path.name not in REWRITTEN}


def finished_then_rerun(output_dir, kind, *flags):
    """Stock transformers trains step 7, writes checkpoint-7, rotates checkpoint-3 away and overwrites the metrics;
    ours trains nothing, changes nothing, says so and evaluates the finished weights. Returns the first evaluation."""
    launch(kind, output_dir, *FLAGS, *flags)
    before, eval_before = contents(output_dir), json.loads((output_dir / "eval_results.json").read_text())
    assert sorted(p.name for p in output_dir.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
    again = launch(kind, output_dir, *FLAGS, *flags)
    said = again.stdout + again.stderr
    assert f"training already complete at step 6 ({output_dir / 'checkpoint-6'}): nothing to train; the model is " \
           f"in {output_dir}" in said
    assert "resuming from" not in said
    assert contents(output_dir) == before
    eval_after = json.loads((output_dir / "eval_results.json").read_text())
    assert abs(eval_after["eval_loss"] - eval_before["eval_loss"]) < 1e-6  # the finished weights were evaluated
    assert eval_after["eval_accuracy"] == eval_before["eval_accuracy"]
    return eval_before


@pytest.mark.model_package
def test_rerun_of_a_finished_zero2_command_trains_nothing(tmp_path):
    """A finished ZeRO-2 run started again trains no step, rewrites no file and evaluates its finished weights."""
    finished_then_rerun(tmp_path / "run", "deepspeed", "--deepspeed", "zero2_minimal")


@pytest.mark.model_package
def test_rerun_trains_nothing_and_finds_the_finished_run_at_the_checkpoint_uri(tmp_path):
    """Rerun in place, nothing trains or changes; output_dir lost (a new machine): the finished checkpoint is
    downloaded, nothing trains, nothing is uploaded."""
    remote = tmp_path / "remote"
    output_dir = tmp_path / "run"
    eval_before = finished_then_rerun(output_dir, "single", "--checkpoint_uri", remote)
    uploaded = contents(remote)
    shutil.rmtree(output_dir)
    again = launch("single", output_dir, *FLAGS, "--checkpoint_uri", remote)
    assert f"training already complete at step 6 ({output_dir / 'checkpoint-6'})" in again.stdout
    assert contents(remote) == uploaded
    assert not (output_dir / "checkpoint-7").exists()
    eval_after = json.loads((output_dir / "eval_results.json").read_text())
    assert abs(eval_after["eval_loss"] - eval_before["eval_loss"]) < 1e-6


@pytest.mark.model_package
def test_rerun_of_a_finished_fsdp_command_with_rank_0_loading_trains_nothing(tmp_path):
    """FSDP2 whose other ranks build the model empty (cpu_ram_efficient_loading): the finished weights are loaded on
    rank 0 and reach the others when the model is sharded for the evaluation; nothing trains or changes."""
    finished_then_rerun(tmp_path / "run", "torchrun", "--fsdp", "full_shard", "--fsdp_config",
                        '{"cpu_ram_efficient_loading": true}')
