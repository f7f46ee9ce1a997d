"""A user's own script (stock TrainingArguments, own model and loss, only ExtTrainer from us) under the real
launchers, with the classic published DeepSpeed config pasted as it is."""

import json

import pytest
from conftest import BIN, PYTHON, REPO, free_port, run

pytestmark = [pytest.mark.launch, pytest.mark.deepspeed]

SCRIPT = REPO / "tests" / "scripts" / "own_script.py"
FLAGS = ["--max_steps", 6, "--logging_steps", 1, "--report_to", "none", "--save_strategy", "no",
         "--disable_tqdm", "true"]


def results(output_dir):
    return json.loads((output_dir / "results.json").read_text())


def test_classic_config_pasted_into_own_script_trains_under_deepspeed(tmp_path):
    """The classic file (fp16 made "auto" on this CPU machine) runs with its own lr, betas and warmup."""
    classic = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    classic["fp16"]["enabled"] = "auto"
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(classic))
    out = run([BIN / "deepspeed", "--num_gpus", 2, "--master_port", free_port(), SCRIPT, "--output_dir",
               tmp_path / "out", "--per_device_train_batch_size", 8, "--use_cpu", "--deepspeed", config, *FLAGS])
    assert out.returncode == 0, out.stderr[-4000:]
    assert results(tmp_path / "out")["lr"] == 3e-5  # the file's value, written back to the arguments
    assert len(results(tmp_path / "out")["losses"]) == 6
    resolved = json.loads((tmp_path / "out" / "ds_config.resolved.json").read_text())
    assert resolved["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}


def test_classic_fp16_config_on_cpu_says_what_to_change(tmp_path):
    """The published fp16 config pasted into a CPU run must say to change fp16.enabled or use --bf16, not crash."""
    out = run([BIN / "deepspeed", "--num_gpus", 2, "--master_port", free_port(), SCRIPT, "--output_dir",
               tmp_path / "out", "--use_cpu", "--deepspeed", REPO / "ds_configs" / "zero2.json", *FLAGS])
    assert out.returncode != 0
    assert "fp16 needs a CUDA device" in out.stderr and "fp16.enabled" in out.stderr and "--bf16" in out.stderr


def test_ranks_that_would_train_alone_are_stopped(tmp_path):
    """Stock TrainingArguments on CPU under torchrun: N independent runs; ExtTrainer refuses that loudly."""
    out = run([BIN / "torchrun", "--nproc_per_node", 2, "--master_port", free_port(), SCRIPT, "--output_dir",
               tmp_path / "out", *FLAGS])
    assert out.returncode != 0
    assert "ranks were launched but this one trains alone" in out.stderr and "--use_cpu" in out.stderr
    ok = run([BIN / "torchrun", "--nproc_per_node", 2, "--master_port", free_port(), SCRIPT, "--output_dir",
              tmp_path / "ok", "--use_cpu", "--per_device_train_batch_size", 8, *FLAGS])
    assert ok.returncode == 0, ok.stderr[-3000:]
    single = run([PYTHON, SCRIPT, "--output_dir", tmp_path / "single", "--per_device_train_batch_size", 16, *FLAGS])
    assert single.returncode == 0, single.stderr[-3000:]
    ours, theirs = results(tmp_path / "ok")["losses"], results(tmp_path / "single")["losses"]
    assert len(ours) == len(theirs) == 6 and max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-5
