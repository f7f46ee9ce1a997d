"""examples/run_clm.py as a user runs it, on the shipped chat data and the default tiny Llama (fp32, no dropout, the
same global batch of 8): LoRA under DeepSpeed ZeRO-3 (stopped by SIGTERM on one rank, then the same command again) and
torchrun DDP, and a full fine-tune with --packing under FSDP2 (its decoder layer found by itself) and --sharded_ddp
simple, each equal to one process step by step, in its weights (or adapter) and its evaluation; a LoRA checkpoint of 2
ranks resumed on 1 equal to the uninterrupted run; `trainer-ext merge` folding the adapter into weights that predict
what base + adapter predicted; the tokenized data cache built by one rank of a fresh machine and reused by the next
runs' ranks (their tokenizer calls counted); --streaming with packing stopped by SIGTERM on one of 2 ranks and continued
by the same command, equal to one uninterrupted process."""

import importlib.util
import json
import shutil
import signal
import subprocess
import time

import pytest

from conftest import (BIN, EXAMPLES, PYTHON, REPO, TINY_COMMON, clean_env, free_port, launch, launcher, logged,
                      rank_process, run, run_forked, scratch)
from support.environment import count_tokenized, signal_at_step, tokenized_per_rank

pytestmark = [pytest.mark.launch, pytest.mark.deepspeed,
              pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft (pip install -e '.[test]')")]

CLM = EXAMPLES / "run_clm.py"
STEPS = 6
COMMON = ["--do_train", "--do_eval", "--max_steps", STEPS, "--learning_rate", "3e-3", "--logging_steps", 1,
          "--report_to", "none", "--max_train_samples", 48, "--max_eval_samples", 21, "--per_device_eval_batch_size",
          4, "--max_seq_length", 192, "--save_steps", 2, "--disable_tqdm", "true", "--seed", 7]
LORA = [*COMMON, "--lora_r", 4]
PACKED = [*COMMON, "--packing", "--max_seq_length", 256]
STREAMED = [*PACKED, "--streaming"]  # 48 rows pack into fewer rows than the 6 steps take: the stream's passes repeat


def adapter(output_dir):
    from safetensors.torch import load_file

    return load_file(str(output_dir / "adapter_model.safetensors"))


def model_weights(output_dir):
    from safetensors.torch import load_file

    return load_file(str(output_dir / "model.safetensors"))


def largest_difference(first, second):
    assert first.keys() == second.keys()
    return max((first[k].float() - second[k].float()).abs().max().item() for k in first)


def results(output_dir, name="eval"):
    return json.loads((output_dir / f"{name}_results.json").read_text())


@pytest.fixture(scope="module")
def runs(request):
    root = scratch(request, "clm")
    env = {"TRAINER_EXT_CACHE": str(root / "cache"), "OMP_NUM_THREADS": "1"}
    singles = {name: ([PYTHON, CLM, "--output_dir", root / name, *flags, "--per_device_train_batch_size", 8], env)
               for name, flags in (("single_lora", LORA), ("single_packed", PACKED), ("single_streamed", STREAMED))}
    for name, done in run_forked(singles, timeout=600).items():
        assert done.returncode == 0, f"{name}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    preempted_then_again(root / "zero3_lora", [*LORA, "--per_device_train_batch_size", 4, "--deepspeed", "zero3"], env)
    launch("torchrun", root / "ddp_lora", *LORA, "--per_device_train_batch_size", 4, script=CLM, env=env)
    for name in ("warm", "fresh"):
        (root / "tokenized" / name).mkdir(parents=True)
    # single_packed built this tokenized data: every rank reads it; a machine of its own (a fresh cache) builds it once
    launch("torchrun", root / "fsdp2_packed", *PACKED, "--per_device_train_batch_size", 4, "--fsdp",
           "full_shard auto_wrap", script=CLM, env={**count_tokenized(root / "tokenized" / "warm"), **env})
    launch("launch", root / "simple_packed", *PACKED, "--per_device_train_batch_size", 4, "--sharded_ddp", "simple",
           script=CLM, env={**count_tokenized(root / "tokenized" / "fresh"), **env,
                            "TRAINER_EXT_CACHE": str(root / "fresh_cache")})
    streamed = [*launcher("torchrun"), "--nproc_per_node", 2, "--master_port", free_port(), CLM, "--output_dir",
                root / "streamed", *TINY_COMMON, *STREAMED, "--per_device_train_batch_size", 4]
    for attempt, hooks in (("first", signal_at_step(3, rank=1)), ("again", clean_env())):
        out = run([str(c) for c in streamed], env={**hooks, **env})
        (root / f"streamed.{attempt}.log").write_text(out.stdout + out.stderr)
        assert attempt == "first" or out.returncode == 0, out.stderr[-3000:]
    # 2 ranks -> 1: the DDP run's step-2 adapter checkpoint, continued by one process to step 4
    (root / "resumed_on_1").mkdir()
    shutil.copytree(root / "ddp_lora" / "checkpoint-2", root / "resumed_on_1" / "checkpoint-2")
    again = run_forked({"resume": ([PYTHON, CLM, "--output_dir", root / "resumed_on_1", *LORA,
                                    "--per_device_train_batch_size", 8], env)})["resume"]
    assert again.returncode == 0 and "resuming from" in again.stdout + again.stderr, again.stderr[-3000:]
    return root


def preempted_then_again(output_dir, flags, env):
    """A 2-rank DeepSpeed run whose rank 1 gets SIGTERM once the first step is logged, then the same command again;
    both logs are kept beside output_dir (<name>.first.log, <name>.again.log)."""
    cmd = [str(c) for c in [*launcher("deepspeed"), "--num_gpus", 2, "--master_port", free_port(), CLM, "--output_dir",
                            output_dir, *TINY_COMMON, *flags]]
    first_log = output_dir.parent / f"{output_dir.name}.first.log"
    with open(first_log, "w") as log:
        first = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                 env={**clean_env(), "PYTHONUNBUFFERED": "1", **env})
        target = rank_process(first, rank=1, script="run_clm.py")
        deadline = time.time() + 600
        while "'loss'" not in first_log.read_text() and first.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        target.send_signal(signal.SIGTERM)
        first.wait(timeout=600)
    again = run(cmd, env=env)
    (output_dir.parent / f"{output_dir.name}.again.log").write_text(again.stdout + again.stderr)
    assert again.returncode == 0, again.stderr[-3000:]


def test_a_sigterm_on_one_zero3_rank_checkpoints_the_adapter_and_the_same_command_continues(runs):
    """The first run stops with a complete checkpoint mid-training; the second resumes it (and the LoRA test below
    finds the finished run equal to one uninterrupted process)."""
    first, again = (runs / "zero3_lora.first.log").read_text(), (runs / "zero3_lora.again.log").read_text()
    assert "received SIGTERM" in first and "preempted: checkpoint" in first, first[-3000:]
    stopped = int(first.split("preempted: checkpoint ")[1].split("checkpoint-")[1].split()[0])
    assert 1 <= stopped < STEPS, "the signal must arrive mid-training for this test to mean anything"
    assert f"resuming from {runs / 'zero3_lora' / f'checkpoint-{stopped}'}" in again
    assert len(adapter(runs / "zero3_lora" / f"checkpoint-{stopped}")) == 8  # gathered from both ranks


@pytest.mark.parametrize("backend", ["zero3_lora", "ddp_lora"])
def test_lora_on_2_ranks_trains_like_one_process_and_writes_the_whole_adapter(runs, backend):
    """ZeRO-3 partitions the adapters too: a save that does not gather them wrote an empty adapter (trl #4416,
    peft #2892). Here every checkpoint's adapter and the output's hold all 8 tensors (q_proj/v_proj A and B of 2
    layers) with the single process's values."""
    single, launched = logged(runs / "single_lora"), logged(runs / backend)
    assert sorted(single) == sorted(launched) == list(range(1, STEPS + 1))
    assert max(abs(single[s] - launched[s]) for s in single) < 1e-5
    for where in ("", f"checkpoint-{STEPS}"):
        ours, theirs = adapter(runs / "single_lora" / where), adapter(runs / backend / where)
        assert len(theirs) == 8 and all(t.numel() > 0 for t in theirs.values())
        assert largest_difference(ours, theirs) < 1e-5
    assert not (runs / backend / "model.safetensors").exists()  # the adapter only, not the frozen base
    for key in ("eval_loss", "eval_token_accuracy"):
        assert results(runs / backend)[key] == pytest.approx(results(runs / "single_lora")[key], abs=1e-5)


def test_a_2_rank_lora_checkpoint_resumed_on_1_process_finishes_the_same_run(runs):
    """(Steps 1-2 of its log come with the checkpoint: the 2 ranks logged them; 3-4 are the one process's.)"""
    single, resumed = logged(runs / "single_lora"), logged(runs / "resumed_on_1")
    assert sorted(resumed) == list(range(1, STEPS + 1)) and max(abs(single[s] - resumed[s]) for s in resumed) < 1e-5
    assert len(adapter(runs / "ddp_lora" / "checkpoint-2")) == 8
    assert largest_difference(adapter(runs / "single_lora"), adapter(runs / "resumed_on_1")) < 1e-5


@pytest.mark.parametrize("backend", ["fsdp2_packed", "simple_packed"])
def test_packed_full_fine_tune_on_2_ranks_trains_like_one_process(runs, backend):
    single, launched = logged(runs / "single_packed"), logged(runs / backend)
    assert sorted(single) == sorted(launched) == list(range(1, STEPS + 1))
    assert max(abs(single[s] - launched[s]) for s in single) < 1e-5
    assert largest_difference(model_weights(runs / "single_packed"), model_weights(runs / backend)) < 1e-5
    assert results(runs / backend)["eval_loss"] == pytest.approx(results(runs / "single_packed")["eval_loss"],
                                                                 abs=1e-5)


def test_merge_folds_the_adapter_into_weights_that_predict_the_same(runs, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = run([BIN / "trainer-ext", "merge", runs / "zero3_lora", "--output_dir", tmp_path / "merged"],
              env={"TRAINER_EXT_CACHE": str(runs / "cache")})
    assert out.returncode == 0, out.stderr[-3000:]
    base = json.loads((runs / "zero3_lora" / "adapter_config.json").read_text())["base_model_name_or_path"]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "merged")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What colour is the sky?"}],
                                        add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(ids).logits
        unmerged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base),
                                             str(runs / "zero3_lora"))(ids).logits
        bare = AutoModelForCausalLM.from_pretrained(base)(ids).logits
    assert (merged - unmerged).abs().max().item() < 1e-5
    assert (merged - bare).abs().max().item() > 1e-4  # the adapter changed something


def test_the_tokenized_data_is_built_by_one_rank_of_a_machine_and_reused_by_every_later_run(runs):
    """On a machine with a fresh cache, rank 0 tokenizes the 48 training and 21 validation rows once and rank 1
    nothing; on a machine whose cache an earlier run filled (the one-process run of the same flags), no rank of the
    next run tokenizes anything; both train exactly as one process."""
    assert tokenized_per_rank(runs / "tokenized" / "fresh") == {0: 48 + 21}
    assert tokenized_per_rank(runs / "tokenized" / "warm") == {}
    folders = lambda cache: {path.name for path in (runs / cache / "data").iterdir() if path.is_dir()}  # noqa: E731
    assert len(folders("fresh_cache")) == 2 and folders("fresh_cache") <= folders("cache")  # named by content alone


def test_a_stream_stopped_by_sigterm_on_one_rank_continues_exactly_with_the_same_command(runs):
    """--streaming --packing on 2 ranks, rank 1 signalled at the end of step 3: checkpoint-3 holds the stream's
    position, the same command continues from it (not from the file's start), and steps 1-6 and the weights equal
    one uninterrupted process."""
    first, again = (runs / "streamed.first.log").read_text(), (runs / "streamed.again.log").read_text()
    assert "preempted: checkpoint" in first and "checkpoint-3" in first, first[-3000:]
    assert "resuming from" in again and "from the dataset's saved position (exact)" in again, again[-3000:]
    single, resumed = logged(runs / "single_streamed"), logged(runs / "streamed")
    assert sorted(single) == sorted(resumed) == list(range(1, STEPS + 1))
    assert max(abs(single[s] - resumed[s]) for s in single) < 1e-5
    assert largest_difference(model_weights(runs / "single_streamed"), model_weights(runs / "streamed")) < 1e-5
