"""Preference tuning with TRL's DPOTrainer combined with ExtTrainer (trainer_ext.trl.ExtDPOTrainer; `class (ExtTrainer,
DPOTrainer)` failed at construction before) on 2 CPU ranks gives stock DPOTrainer's numbers on one process (a tiny
Llama, seeded preference pairs, fp32, the same global batch of 8 pairs): per-step loss, rewards, margins, reward
accuracy and log-probs, the weights or adapter, and the evaluation loss. Under DeepSpeed ZeRO-3 a full fine-tune
against a reference copy (TRL's partitioned inference engine), stopped by SIGTERM on one rank and run again; under
FSDP2 LoRA against the adapter-disabled base. DDP, ZeRO-2, `simple` and precomputed reference log-probs measured by
hand (docs/llm.md). The recipe, examples/run_dpo.py, on the shipped pairs."""

import importlib.util
import json
import subprocess

import pytest

from conftest import (EXAMPLES, PYTHON, REPO, TINY_COMMON, TINY_LLM, free_port, launcher, logged, run, run_forked,
                      run_many, scratch, signal_at_step)

pytestmark = [pytest.mark.launch, pytest.mark.deepspeed,
              pytest.mark.skipif(importlib.util.find_spec("trl") is None or importlib.util.find_spec("peft") is None,
                                 reason="needs peft and trl (pip install -e '.[test]')")]

STEPS = 4
# 4 steps of 8 pairs at a rate that moves the rewards; evaluation on 21 pairs (the last global batch padded on 2 ranks).
# Adam's epsilon 1e-6: DPO's first gradients are tiny (the loss starts at ln 2), and Adam divides each by its own
# magnitude plus epsilon, so a 1e-7 difference in summation order moved single weights by 1.8e-5 at the default 1e-8.
DPO = ["--dpo", "--do_train", "--max_steps", STEPS, "--learning_rate", "1e-2", "--adam_epsilon", "1e-6", "--bf16",
       "false", "--eval_samples", 21, "--save_strategy", "no"]
# What DPOTrainer logs each step, compared as numbers.
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


def on_ranks(output_dir, *flags):
    return [*launcher("torchrun"), "--nproc_per_node", 2, "--master_port", free_port(), TINY_LLM, "--output_dir",
            output_dir, *TINY_COMMON, *DPO, "--per_device_train_batch_size", 4, "--per_device_eval_batch_size", 3,
            *flags]


@pytest.fixture(scope="module")
def runs(request):
    """Stock DPOTrainer on one process (full, LoRA); ExtDPOTrainer on 2 ranks: ZeRO-3 full (rank 1 signalled at the
    end of step 2, then the same command again) and FSDP2 LoRA."""
    root = scratch(request, "dpo")
    single = [PYTHON, TINY_LLM, *TINY_COMMON, *DPO, "--stock", "--per_device_train_batch_size", 8,
              "--per_device_eval_batch_size", 8]
    done = run_many({name: ([*single, "--output_dir", root / name, *flags], None)
                     for name, flags in (("stock", []), ("stock_lora", ["--lora"]))}, timeout=900)
    for name, out in done.items():
        assert out.returncode == 0, f"{name}:\n{out.stderr[-4000:]}"
    zero3 = [str(c) for c in on_ranks(root / "zero3", "--deepspeed", "zero3")]
    with open(root / "zero3.first.log", "w") as log:
        first = subprocess.run(zero3, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=signal_at_step(2, rank=1),
                               timeout=900)
    assert first.returncode == 1, (root / "zero3.first.log").read_text()[-3000:]  # torchrun's 1; its ranks' 143
    again = run(zero3, timeout=900)
    (root / "zero3.again.log").write_text(again.stdout + again.stderr)
    assert again.returncode == 0, again.stderr[-4000:]
    fsdp = run(on_ranks(root / "fsdp2_lora", "--lora", "--fsdp", "full_shard auto_wrap"), timeout=900)
    assert fsdp.returncode == 0, fsdp.stderr[-4000:]
    return root


def step_metrics(output_dir):
    return {key: logged(output_dir, key) for key in METRICS}


def largest_difference(first, second):
    from safetensors.torch import load_file

    ours, theirs = (load_file(str(path)) for path in (first, second))
    assert ours.keys() == theirs.keys()
    return max((ours[k] - theirs[k]).abs().max().item() for k in ours)


def test_a_sigterm_on_one_zero3_rank_checkpoints_and_the_same_command_finishes_the_run(runs):
    """The first run stops at step 2 with a complete checkpoint; the second resumes it to step 4."""
    first, again = (runs / "zero3.first.log").read_text(), (runs / "zero3.again.log").read_text()
    assert "received SIGTERM" in first and "exitcode  : 143" in first, first[-3000:]
    assert f"resuming from {runs / 'zero3' / 'checkpoint-2'}" in again


@pytest.mark.parametrize("ours, stock, weights", [("zero3", "stock", "model.safetensors"),
                                                  ("fsdp2_lora", "stock_lora", "adapter_model.safetensors")])
def test_ext_dpo_trainer_on_2_ranks_logs_stock_dpo_trainers_numbers(runs, ours, stock, weights):
    """Every step's loss, rewards, margins, reward accuracy and log-probs (sequence-level: each rank's mean over its
    pairs, averaged over ranks = the mean over the global batch's pairs) and the final weights equal stock
    DPOTrainer's on one process within 1e-5 (log-probs of ~-27: 1e-5 relative), across a resume too; the
    evaluation loss is every evaluation pair's mean."""
    theirs, mine = step_metrics(runs / stock), step_metrics(runs / ours)
    for key in METRICS:
        assert sorted(mine[key]) == sorted(theirs[key]) == list(range(1, STEPS + 1)), key
        scale = 1 + max(abs(value) for value in theirs[key].values())
        assert max(abs(theirs[key][step] - mine[key][step]) for step in theirs[key]) < 1e-5 * scale, key
    assert max(theirs["rewards/margins"].values()) > 1e-3  # the rewards moved: the comparison means something
    assert largest_difference(runs / stock / weights, runs / ours / weights) < 1e-5
    evaluation = [json.loads((runs / name / "eval_results.json").read_text())["eval_loss"] for name in (stock, ours)]
    assert abs(evaluation[0] - evaluation[1]) < 1e-6


def test_the_recipe_learns_preferences_on_the_shipped_pairs(tmp_path):
    """examples/run_dpo.py as documented, on the shipped pairs and the default tiny Llama with LoRA: it trains, saves
    the adapter and reports reward accuracy on the held-out pairs (5 steps: a smoke test; the measured run from
    the SFT recipe's output is in docs/llm.md)."""
    output = tmp_path / "dpo"
    out = run_forked({"dpo": ([PYTHON, EXAMPLES / "run_dpo.py", "--output_dir", output, "--do_train", "--do_eval",
                               "--max_steps", 5, "--learning_rate", "5e-4", "--lora_r", 8, "--max_train_samples", 40,
                               "--max_eval_samples", 16, "--per_device_train_batch_size", 8, "--bf16", "false",
                               "--report_to", "none", "--disable_tqdm", "true", "--use_cpu", "true"],
                              {"TRAINER_EXT_CACHE": str(tmp_path / "cache")})}, timeout=600)["dpo"]
    assert out.returncode == 0, out.stderr[-4000:]
    metrics = json.loads((output / "eval_results.json").read_text())
    assert {"eval_loss", "eval_rewards/accuracies", "eval_rewards/margins"} <= set(metrics)
    assert (output / "adapter_model.safetensors").exists() and not (output / "ref").exists()
