"""Overflow detection under DeepSpeed ZeRO-2: the gradient norm alone decides (DeepSpeed's per-parameter inf/NaN scan
is dropped: 50 ms of a 66 ms bf16 step on an H100), a non-finite gradient still skips the step with weights and
optimizer state untouched, the step is named, and a bf16 run whose every step is non-finite stops cleanly."""

import glob
import json

import pytest
import torch

from conftest import BIN, TINY_TRAIN, free_port, logged, run

BATCH = {"input_ids": torch.randint(1, 64, (4, 8), generator=torch.Generator().manual_seed(0)),
         "labels": torch.tensor([0, 1, 0, 1])}


def engine(**config_change):
    """A real ZeRO-2 engine on this process (one gloo rank), with the config ExtTrainer would hand DeepSpeed."""
    import deepspeed
    from transformers import BertConfig, BertForSequenceClassification

    from trainer_ext.deepspeed_config import build_deepspeed_config

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=64, num_labels=2,
                                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    flags = {"per_device_train_batch_size": 4, "bf16": True, "learning_rate": 1e-3}
    # torch's AdamW inside ZeRO-2's optimizer (DeepSpeed's own AdamW is a JIT op: minutes of compiling in the unit
    # subset); the overflow check under test is the ZeRO-2 optimizer's, around whichever Adam steps
    config = build_deepspeed_config(flags, world_size=1, num_training_steps=10, cpu_ranks=True,
                                    config={"zero_optimization": {"stage": 2},
                                            "optimizer": {"type": "AdamW", "params": {"torch_adam": True}},
                                            **config_change})
    result, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return result


def train_step(model, inf=False):
    loss = model(**BATCH).loss
    model.backward(loss * float("inf") if inf else loss)
    model.step()
    return model.was_step_applied()


@pytest.fixture
def one_rank(monkeypatch, deepspeed_accepts):
    """This process as rank 0 of a 1-rank gloo group (deepspeed_accepts made it); DeepSpeed reads LOCAL_RANK."""
    monkeypatch.setenv("LOCAL_RANK", "0")


@pytest.fixture
def scans(monkeypatch, one_rank):
    """Counts calls of DeepSpeed's per-tensor inf/NaN test in the ZeRO-1/2 optimizer (the scan)."""
    from deepspeed.runtime.zero import stage_1_and_2

    calls = []
    original = stage_1_and_2.has_inf_or_nan
    monkeypatch.setattr(stage_1_and_2, "has_inf_or_nan", lambda x: calls.append(1) or original(x))
    return calls


def snapshot(model):
    fp32 = [p.detach().clone() for p in model.optimizer.single_partition_of_fp32_groups]
    state = model.optimizer.optimizer.state
    moments = [state[p][key].detach().clone() for p in state for key in ("exp_avg", "exp_avg_sq")]
    return fp32 + moments + [p.detach().clone() for p in model.module.parameters()]


@pytest.mark.deepspeed
def test_norm_decides_overflow_and_the_scan_is_gone(scans):
    """bf16: a non-finite gradient skips the step, leaving weights, masters and Adam moments as they were, and no
    per-parameter scan runs. Fails if DeepSpeed renames check_overflow or stops testing the norm in step()."""
    from trainer_ext.backends.deepspeed.backend import check_overflow_by_norm

    model = engine()
    assert check_overflow_by_norm(model.optimizer).startswith("gradient norm")
    assert train_step(model)  # the first step creates Adam's moments
    before = snapshot(model)
    assert not train_step(model, inf=True)
    assert model.get_global_grad_norm() == float("inf")
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(model)))
    assert train_step(model)
    assert all(torch.isfinite(p).all() for p in model.module.parameters())
    assert scans == []


@pytest.mark.deepspeed
def test_deepspeed_scans_every_parameter_without_us(scans):
    """The control: DeepSpeed's own bf16 default does scan (one call per gradient per step), so the test above
    measures a real removal; if DeepSpeed stops scanning, this fails and the replacement can go."""
    model = engine()
    assert train_step(model)
    parameters = sum(1 for p in model.module.parameters() if p.requires_grad)
    assert len(scans) == parameters


@pytest.mark.deepspeed
def test_check_grad_overflow_false_in_the_file_is_kept_and_reported(one_rank):
    """A value the user wrote is kept, and its consequence (no detection at all under bf16) is said."""
    from trainer_ext.backends.deepspeed.backend import check_overflow_by_norm

    model = engine(bf16={"enabled": True, "check_grad_overflow": False})  # as written in a user's file
    assert model.optimizer.check_grad_overflow is False
    assert check_overflow_by_norm(model.optimizer).startswith("none")


def deepspeed_tiny(output_dir, *flags, nonfinite, launcher=("torchrun", "--nproc_per_node")):
    """ZeRO-2 on 2 ranks, under torchrun where the engine's check is the point (~3 s of CPU less than the deepspeed
    launcher; torchrun prints its own traceback when a rank fails, so a failing run uses the deepspeed launcher)."""
    return run([BIN / launcher[0], launcher[1], 2, "--master_port", free_port(), TINY_TRAIN, "--output_dir",
                output_dir, "--per_device_train_batch_size", 8, "--bf16", "--deepspeed", "zero2_minimal",
                "--report_to", "none", "--logging_steps", 1, "--disable_tqdm", "true", *flags],
               env={"TINY_TRAIN_NONFINITE_STEPS": nonfinite})


@pytest.mark.deepspeed
@pytest.mark.launch
def test_nonfinite_bf16_step_is_skipped_and_named_on_2_ranks(tmp_path):
    """2 ranks, bf16: step 3's gradients are inf; step 3 is named with its norm, checkpoint-3 equals checkpoint-2
    (weights, fp32 masters, Adam moments on both ranks), and training goes on to finite weights."""
    from safetensors.torch import load_file

    out = deepspeed_tiny(tmp_path, "--max_steps", 5, "--save_strategy", "steps", "--save_steps", 1, nonfinite="3")
    assert out.returncode == 0, out.stderr[-4000:]
    assert "overflow check: gradient norm (a non-finite norm skips the step" in out.stdout  # ExtTrainer installed it
    assert "step 3 skipped: gradient norm inf is not finite" in out.stdout + out.stderr
    assert logged(tmp_path / "checkpoint-5", "grad_norm")[3] == float("inf")
    first, second = (load_file(str(tmp_path / f"checkpoint-{s}" / "model.safetensors")) for s in (2, 3))
    assert all(torch.equal(first[k], second[k]) for k in first)
    for rank in (0, 1):
        before, after = (torch.load(glob.glob(str(tmp_path / f"checkpoint-{s}" / f"global_step{s}" /
                                                  f"*rank_{rank}_*optim_states.pt"))[0],
                                    weights_only=False)["optimizer_state_dict"] for s in (2, 3))
        assert all(torch.equal(a, b) for a, b in zip(before["single_partition_of_fp32_groups"],
                                                      after["single_partition_of_fp32_groups"]))
        moments = [(before["base_optimizer_state"]["state"][i][k], after["base_optimizer_state"]["state"][i][k])
                   for i in before["base_optimizer_state"]["state"] for k in ("exp_avg", "exp_avg_sq")]
        assert moments and all(torch.equal(a, b) for a, b in moments)
    final = load_file(str(tmp_path / "model.safetensors"))
    assert all(torch.isfinite(t.float()).all() for t in final.values())
    assert not torch.equal(final["classifier.weight"], second["classifier.weight"])  # steps 4 and 5 trained


@pytest.mark.deepspeed
@pytest.mark.launch
def test_bf16_run_stops_after_10_nonfinite_steps_in_a_row(tmp_path):
    """Every step from 3 on is non-finite: the run stops after step 12 with one message and exit status 1,
    no traceback, and the last checkpoint (step 2) is intact."""
    out = deepspeed_tiny(tmp_path, "--max_steps", 30, "--save_strategy", "steps", "--save_steps", 2, nonfinite="3-",
                         launcher=("deepspeed", "--num_gpus"))
    assert out.returncode != 0
    log = out.stdout + out.stderr
    assert "steps 3-12: the gradient norm was not finite 10 times in a row under bf16" in log
    assert "Traceback" not in log
    saved = sorted(p.name for p in tmp_path.glob("checkpoint-*"))
    assert "checkpoint-2" in saved
    assert json.loads((tmp_path / "checkpoint-2" / "checkpoint_complete.json").read_text())["step"] == 2
