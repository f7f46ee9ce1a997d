"""ExtTrainer on real launchers (2 CPU ranks): single process, DDP and ZeRO-2 train identically on the same
global batch, report true losses, resume exactly, and evaluate in dataset order."""

import json
import shutil
import subprocess
import time

import numpy as np
import pytest

from conftest import (ACCUMULATE, BIN, GLUE, GLUE_COMMON, PLAIN, PYTHON, REPO, STEPS, TINY_TRAIN,
                      assert_same_training, clean_env, free_port, launch, logged, max_weight_difference)

pytestmark = [pytest.mark.launch, pytest.mark.deepspeed, pytest.mark.model_package]

@pytest.mark.parametrize("backend", ["ddp", "zero2"])
def test_same_loss_curve_and_weights_as_one_process(plain_runs, backend):
    """DDP and ZeRO-2 on the same global batch must be the same training as one process (fp32, no dropout)."""
    assert_same_training(plain_runs / "single", plain_runs / backend, STEPS)


@pytest.mark.parametrize("backend", ["ddp", "zero2"])
def test_same_training_with_accumulation_clipping_and_warmup(accumulate_runs, backend):
    """Accumulation, clipping (a norm over all ranks) and DeepSpeed's WarmupDecayLR must change nothing."""
    assert_same_training(accumulate_runs / "single", accumulate_runs / backend, 12)
    norms = logged(accumulate_runs / "single", "grad_norm")
    assert max(norms.values()) > 0.5  # clipping really happened
    for key in ("grad_norm", "learning_rate"):
        ours, theirs = logged(accumulate_runs / "single", key), logged(accumulate_runs / backend, key)
        assert max(abs(ours[s] - theirs[s]) for s in ours) < 1e-5 * max(1.0, max(ours.values())), key


def test_deepspeed_in_one_process_without_a_launcher(plain_runs, tmp_path):
    """`python run_glue.py --deepspeed ...` with no launcher runs as a 1-rank job (DeepSpeed would look for MPI and
    die importing mpi4py) and trains exactly like the plain single process; without DeepSpeed's shared-memory all-reduce
    of CPU ranks, which its communication backend would build (minutes, once) and load though only tensor-parallel
    inference calls it (it prints "... deepspeed_shm_comm_op built successfully" when it loads it)."""
    out = launch("single", tmp_path / "zero2", *PLAIN, "--per_device_train_batch_size", 16, "--deepspeed",
                 "zero2_minimal")
    assert_same_training(plain_runs / "single", tmp_path / "zero2", STEPS)
    assert "deepspeed_shm_comm" not in out.stdout + out.stderr


def test_zero2_retried_by_auto_find_batch_size_trains_as_the_batch_it_settles_on(tmp_path):
    """--auto_find_batch_size under ZeRO-2 (transformers refuses it under ZeRO-3): after each out-of-memory failure
    transformers rebuilds the DeepSpeed config for a smaller batch (propagate_args_to_deepspeed, over the object our
    backend finished) and a new engine; the run must then train exactly as one started at the batch it settled on."""
    flags = ["--deepspeed", "zero2_minimal", "--max_steps", 3, "--logging_steps", 1, "--learning_rate", 1e-3,
             "--save_strategy", "no", "--report_to", "none"]
    launch("single", tmp_path / "retried", *flags, "--per_device_train_batch_size", 16, "--auto_find_batch_size",
           script=TINY_TRAIN, env={"TINY_TRAIN_OOM_ABOVE": "8"})
    state = json.loads((tmp_path / "retried" / "trainer_state.json").read_text())
    assert state["train_batch_size"] == 8  # accelerate halves it, or takes 10% off each time: 8 either way
    launch("single", tmp_path / "direct", *flags, "--per_device_train_batch_size", 8, script=TINY_TRAIN)
    for key in ("loss", "grad_norm", "learning_rate"):
        assert logged(tmp_path / "retried", key) == pytest.approx(logged(tmp_path / "direct", key), abs=1e-6), key


def test_losses_are_true_not_scaled_by_world_size(plain_runs):
    """Stock transformers 5.23 logs 2x the loss on 2 ranks for classification models; ours equal one process."""
    single = json.loads((plain_runs / "single" / "eval_results.json").read_text())
    for backend in ("ddp", "zero2"):
        other = json.loads((plain_runs / backend / "eval_results.json").read_text())
        assert abs(other["eval_loss"] - single["eval_loss"]) < 1e-5
        assert other["eval_accuracy"] == single["eval_accuracy"]
        assert 0.6 < logged(plain_runs / backend)[1] < 0.8  # ln 2 ≈ 0.693 for two classes at the start


@pytest.mark.parametrize("backend", ["ddp", "zero2"])
def test_predictions_on_two_ranks_equal_one_process_in_order(plain_runs, backend):
    """37 test examples over 2 ranks: padding duplicates must be dropped and the order kept."""
    single = json.loads((plain_runs / "single" / "predictions.json").read_text())
    other = json.loads((plain_runs / backend / "predictions.json").read_text())
    assert len(other["predictions"]) == len(single["predictions"]) == 37
    assert other["predictions"] == single["predictions"]
    assert np.allclose(other["logits"], single["logits"], atol=1e-4)


def test_final_output_dir_of_a_zero2_run(plain_runs):
    """The final folder must be usable without DeepSpeed and say exactly which config ran."""
    out = plain_runs / "zero2"
    for name in ("train_results.json", "eval_results.json", "all_results.json", "trainer_state.json",
                 "ds_config.resolved.json", "model.safetensors", "config.json"):
        assert (out / name).is_file(), name
    resolved = json.loads((out / "ds_config.resolved.json").read_text())
    assert resolved["train_batch_size"] == 16 and resolved["train_micro_batch_size_per_gpu"] == 8
    assert "auto" not in json.dumps(resolved)
    code = ("import sys; sys.modules['deepspeed'] = None\n"
            "from transformers import AutoModelForSequenceClassification as M\n"
            f"m = M.from_pretrained({str(out)!r}); print('loaded', sum(p.numel() for p in m.parameters()))\n")
    loaded = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True)
    assert loaded.returncode == 0 and "loaded" in loaded.stdout, loaded.stderr[-2000:]


def test_zero2_resume_equals_uninterrupted_run(accumulate_runs, tmp_path):
    """A checkpoint resumed (with --resume_from_checkpoint auto) must continue exactly the uninterrupted run."""
    uninterrupted = accumulate_runs / "zero2"
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(uninterrupted / "checkpoint-6", resumed / "checkpoint-6")
    out = launch("deepspeed", resumed, *ACCUMULATE, "--per_device_train_batch_size", 4, "--deepspeed",
                 "zero2_minimal", "--save_strategy", "no", "--resume_from_checkpoint", "auto")
    assert f"resuming from {resumed / 'checkpoint-6'}" in out.stdout + out.stderr
    ours, theirs = logged(uninterrupted), logged(resumed)
    assert sorted(theirs) == list(range(1, 13))  # steps 1-6 come from the checkpoint's trainer state
    assert max(abs(ours[s] - theirs[s]) for s in range(7, 13)) < 1e-5
    assert max_weight_difference(uninterrupted, resumed) < 1e-5


def listening(port, process, timeout=300):
    """Once something accepts connections on 127.0.0.1:port (or `process` ended, or the time is up)."""
    import socket

    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", int(port))) == 0:
                return
        time.sleep(0.05)


def test_zero2_over_two_torchrun_nodes_matches_one_launcher(plain_runs, tmp_path):
    """Beyond one machine: two torchrun launchers (one per node) rendezvous on 127.0.0.1 and train the same."""
    port = free_port()
    output = tmp_path / "nodes"
    flags = [*PLAIN, "--per_device_train_batch_size", 8, "--deepspeed", "zero2_minimal"]
    nodes = []
    for node_rank in (0, 1):
        if node_rank:
            listening(port, nodes[0])  # node 0's agent hosts the rendezvous store: node 1 starts once it is up
        cmd = [BIN / "torchrun", "--nnodes", 2, "--nproc_per_node", 1, "--node_rank", node_rank,
               "--master_addr", "127.0.0.1", "--master_port", port, GLUE, "--output_dir", output, *GLUE_COMMON,
               *flags]
        nodes.append(subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, cwd=REPO, env=clean_env()))
    try:
        logs = [node.communicate(timeout=900)[0] for node in nodes]
    except subprocess.TimeoutExpired:
        for node in nodes:
            node.kill()
        logs = [node.communicate()[0] for node in nodes]
        pytest.fail("two-node run timed out:\n" + "\n----\n".join(log[-3000:] for log in logs))
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(log[-3000:] for log in logs)
    assert_same_training(plain_runs / "zero2", output, STEPS)
