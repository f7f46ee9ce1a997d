"""The global batch is the user's whatever the world size: --global_batch_size, or a resumed run's own, split over this
start's ranks before anything reads the accumulation (ExtTrainingArguments, DeepSpeed's translator, ds-config); what
cannot be split is refused in one line; a resumed start says what it continued from and what it redid."""

import json

import pytest

from trainer_ext.backends import RunSettings
from trainer_ext.checkpoints.format import DATA_STATE, publish
from trainer_ext.checkpoints.restarts import STOPPED, continuation, save_steps_advice
from trainer_ext.config.batch import GlobalBatch, settle
from trainer_ext.deepspeed_config import DeepSpeedConfigError, resolve_deepspeed_config
from trainer_ext.errors import ArgumentsError

SAME_COMMAND = {"global_batch_size": 16, "world_size": 2,
                "batch_given": {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1}}


@pytest.mark.parametrize("world_size,per_device,accumulation", [(1, 8, 2), (2, 8, 1), (4, 4, 1), (8, 2, 1)])
def test_the_flag_splits_by_accumulation_and_lowers_the_per_device_batch_only_when_it_must(world_size, per_device,
                                                                                            accumulation):
    """Fails when another world size trains another global batch, or a rank is given a larger batch than the user's."""
    batch = settle(8, 1, world_size, global_batch_size=16)
    assert (batch.per_device, batch.accumulation, batch.size) == (per_device, accumulation, 16)


def test_a_resumed_run_keeps_its_global_batch_when_the_command_is_the_same():
    """Fails when an elastic restart on fewer ranks trains smaller batches (the schedule then counts other steps), or
    when a command that changed its batch flags on purpose is overridden."""
    assert (settle(8, 1, 1, resumed=SAME_COMMAND).accumulation, settle(8, 1, 1, resumed=SAME_COMMAND).size) == (2, 16)
    # written before batch_given existed: the command's product on the checkpoint's own world size
    assert settle(8, 1, 1, resumed={"global_batch_size": 16, "world_size": 2}).size == 16
    # after a shrink the checkpoint records 8 x 2 on 1 rank, given 8 x 1: the group growing back trains 8 x 1 x 2
    shrunk = {**SAME_COMMAND, "world_size": 1}
    assert (settle(8, 1, 2, resumed=shrunk).per_device, settle(8, 1, 2, resumed=shrunk).accumulation) == (8, 1)
    changed = settle(16, 1, 1, resumed=SAME_COMMAND)  # --per_device_train_batch_size changed: the user's new batch
    assert (changed.size, changed.kept_from) == (16, None)
    assert settle(8, 2, 2, resumed=SAME_COMMAND).size == 32  # --gradient_accumulation_steps changed


def test_a_global_batch_the_ranks_cannot_share_is_refused_with_what_would_work():
    """Fails when 16 samples on 3 ranks train silently as 15 or 18, or the refusal does not name the sizes that work."""
    with pytest.raises(ArgumentsError) as refused:
        settle(8, 1, 3, resumed=SAME_COMMAND, resumed_from="checkpoint-4")
    assert str(refused.value) == (
        "the global batch of 16 samples (the run's, from checkpoint-4) cannot be shared evenly by 3 ranks: run on 1, "
        "2, 4 or 8 ranks (an elastic torchrun's --nnodes MIN:MAX x --nproc_per_node only among them), or give "
        "--global_batch_size 15 or 18 (another global batch from here on)")


def test_deepspeed_takes_the_split_and_a_file_that_pins_another_is_refused():
    """Fails when DeepSpeed's file overrides the kept split (a silently different global batch), or its fields
    disagree with what the sampler and accelerate use."""
    flags, kept = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2}, \
        GlobalBatch(8, 2, 1, 8, 1, "--global_batch_size")
    config = resolve_deepspeed_config(flags, {"zero_optimization": {"stage": 2}}, world_size=1,
                                      global_batch=kept).config
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config["train_batch_size"]) == (8, 2, 16)
    with pytest.raises(DeepSpeedConfigError, match=r"gradient_accumulation_steps=1 in the file cannot keep the global "
                                                   r"batch of 16 \(--global_batch_size\) on 1 rank"):
        resolve_deepspeed_config(flags, {"gradient_accumulation_steps": 1}, world_size=1, global_batch=kept)


def checkpoint(folder, step, world_size, saved_for):
    staged = folder / ".staging" / f"checkpoint-{step}"
    staged.mkdir(parents=True)
    (staged / DATA_STATE).write_text(json.dumps({**SAME_COMMAND, "global_step": step, "world_size": world_size}))
    (staged / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (staged / "model.safetensors").write_bytes(b"weights")
    return publish(staged, folder, {"step": step, "world_size": world_size, "saved_for": saved_for})


def test_parsing_settles_the_accumulation_from_the_checkpoint_the_run_resumes(tmp_path):
    """Fails when the arguments (which accelerate and DeepSpeed read) keep the command's accumulation on a world size
    other than the resumed checkpoint's, or when --fresh_start still follows the checkpoint."""
    from trainer_ext import ExtTrainingArguments

    checkpoint(tmp_path, 4, 2, "--save_steps 4")  # 8 x 1 on 2 ranks; this process is 1 rank
    resumed = ExtTrainingArguments(tmp_path, per_device_train_batch_size=8, report_to="none")
    assert (resumed.per_device_train_batch_size, resumed.gradient_accumulation_steps) == (8, 2)
    fresh = ExtTrainingArguments(tmp_path, per_device_train_batch_size=8, report_to="none", fresh_start=True)
    assert (fresh.per_device_train_batch_size, fresh.gradient_accumulation_steps) == (8, 1)


def test_a_resumed_start_says_which_checkpoint_why_and_how_many_steps_it_redoes(tmp_path):
    """Fails when a restart after a lost node does not say the checkpoint, its reason, the steps redone, the world size
    and global batch, or counts the redone steps from a stop older than the checkpoint."""
    from transformers import TrainingArguments

    saved = checkpoint(tmp_path, 4, 2, "--save_steps 4")
    (tmp_path / STOPPED).write_text(json.dumps({"step": 6, "stopped_at": 1000.0, "step_seconds": 0.5,
                                                "save_seconds": 2.0, "why": "failed: RuntimeError: Connection closed"}))
    args = TrainingArguments(tmp_path, save_strategy="steps", save_steps=4, report_to="none")
    args.run_settings = RunSettings(global_batch=settle(8, 1, 1, resumed=SAME_COMMAND, resumed_from="checkpoint-4"))
    line, advice = continuation(saved, args, 1030.0)
    assert line.startswith("continuing on 1 rank (was 2) from checkpoint-4, written every --save_steps 4: 2 steps redone "
                           "(it reached step 6, then failed: RuntimeError: Connection closed); global batch 16 (the "
                           "run's, from checkpoint-4) on 1 rank(s): 8 per device x 2 accumulation (the command gives 8 "
                           "x 1); the restart took 30.0 s"), line
    assert "--save_steps 60 would redo" in advice  # 30 s of restart at 0.5 s a step (a 2 s save is 6.7% of 60 steps)
    signalled = checkpoint(tmp_path, 7, 1, "SIGTERM")
    line, _ = continuation(signalled, args, 1030.0)  # the stop at step 6 is older than checkpoint-7
    assert "from checkpoint-7, written for SIGTERM: no step redone;" in line


def test_saving_is_kept_under_a_tenth_of_the_training_time():
    """Fails when the suggested interval would spend more than 10% of the run saving, or ignores the restart cost."""
    args = type("Args", (), {"save_strategy": "steps", "save_steps": 500})()
    assert "--save_steps 40 " in save_steps_advice(args, 20.0, {"step_seconds": 0.5, "save_seconds": 0.1})
    assert "--save_steps 200 " in save_steps_advice(args, 20.0, {"step_seconds": 0.5, "save_seconds": 10.0})
    assert save_steps_advice(args, None, {"step_seconds": 0.5}) is None


def test_ds_config_splits_the_global_batch_for_the_target_world_size_as_training_does(capsys):
    """Fails when `trainer-ext ds-config` renders another split than training would make on that many ranks, or
    renders a global batch those ranks cannot share instead of refusing it."""
    from trainer_ext.cli import main

    flags = ["ds-config", "--deepspeed", "zero2", "--global_batch_size", "16", "--per_device_train_batch_size", "8"]
    assert main([*flags, "--world_size", "4"]) == 0
    config = json.loads(capsys.readouterr().out)
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config["train_batch_size"]) == (4, 1, 16)
    with pytest.raises(SystemExit) as refused:
        main([*flags, "--world_size", "3"])
    assert refused.value.code == 2
    assert "the global batch of 16 samples (--global_batch_size) cannot be shared evenly by 3 ranks" in \
        capsys.readouterr().err


@pytest.mark.parametrize("variables,told", [
    ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "job", "WORLD_SIZE": "16",
      "LOCAL_WORLD_SIZE": "8"}, True),
    ({"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_RUN_ID": "job", "WORLD_SIZE": "16",
      "LOCAL_WORLD_SIZE": "8"}, False),  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "job", "WORLD_SIZE": "8",
      "LOCAL_WORLD_SIZE": "8"}, False),  # one node: no other node can join
    ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "16",
      "LOCAL_WORLD_SIZE": "8"}, False),  # --master_addr's static rendezvous keeps one store
])
def test_a_restartable_multi_node_torchrun_sharing_its_first_store_is_told_once(monkeypatch, variables, told):
    """Fails when a job whose later rounds torch 2.13 cannot form (a node joining waits 60 s, the group fails) starts
    without the line that says which variable avoids it, or when a job it cannot happen to is told."""
    from trainer_ext.environment.launcher import rendezvous_store_problem

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    for key, value in variables.items():
        monkeypatch.setenv(key, value)
    assert (rendezvous_store_problem() is not None) == told
