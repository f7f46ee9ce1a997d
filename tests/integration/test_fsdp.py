"""--fsdp (PyTorch FSDP2, torch's fully_shard) on 2 real CPU ranks: it really shards (half the parameter, gradient and
optimizer bytes per rank, as `trainer-ext plan` predicts), trains, evaluates and predicts like one process, writes a
consolidated model any single process loads, survives SIGTERM, resumes on another number of ranks (the optimizer's
shards resharded by torch.distributed.checkpoint), skips damaged shard files, and refuses what FSDP2 does not have in
one line."""

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import (BIN, PYTHON, REPO, TINY_COMMON, TINY_TRAIN, clean_env, free_port, logged, max_weight_difference,
                      rank_process, run, scratch, weights)
from trainer_ext.checkpoints.format import MARKER
from trainer_ext.errors import ArgumentsError

STEPS = 10
# 16 samples a step in 2 accumulated micro-batches, clipping that bites (norms reach ~0.36), warmup then decay.
COMMON = [*TINY_COMMON, "--max_steps", STEPS, "--gradient_accumulation_steps", 2, "--max_grad_norm", "0.2",
          "--learning_rate", "1e-3", "--warmup_steps", 2, "--save_strategy", "steps", "--save_steps", 2,
          "--eval_samples", 24]
FSDP = ["--fsdp", "full_shard auto_wrap", "--fsdp_config", '{"transformer_layer_cls_to_wrap": ["BertLayer"]}']
# Rank 0 alone loads (builds) the model; rank 1 builds it empty and receives its shards after fully_shard.
PARTITIONED = ["--fsdp", "full_shard auto_wrap", "--fsdp_config",
               '{"transformer_layer_cls_to_wrap": ["BertLayer"], "cpu_ram_efficient_loading": true}']


def command(output_dir, ranks, *flags):
    launcher = [PYTHON] if ranks == 1 else [BIN / "torchrun", "--nproc_per_node", ranks, "--master_port", free_port()]
    return [str(c) for c in [*launcher, TINY_TRAIN, "--output_dir", output_dir, "--per_device_train_batch_size",
                             16 // ranks // 2, *COMMON, *flags]]


def train(output_dir, ranks, *flags):
    out = run(command(output_dir, ranks, *flags))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out.stdout + out.stderr


def assert_same_run(base, other, first_step=1):
    ours, theirs = logged(base), logged(other)
    assert sorted(ours) == sorted(theirs) == list(range(1, STEPS + 1))
    assert max(abs(ours[s] - theirs[s]) for s in range(first_step, STEPS + 1)) < 1e-5
    assert max_weight_difference(base, other) < 1e-5


@pytest.fixture(scope="module")
def runs(request):
    """One process without FSDP, and FSDP2 on 2 ranks loading partitioned with each rank's bytes reported: the same
    10 steps."""
    root = scratch(request, "fsdp")
    train(root / "single", 1, "--predict")
    train(root / "fsdp", 2, *PARTITIONED, "--predict", "--report_dir", root / "fsdp" / "report")
    return root


@pytest.mark.launch
def test_fsdp_trains_evaluates_and_predicts_like_one_process(runs):
    """Sharded training, clipping over every shard, the true train_loss, evaluation or prediction through the sharded
    model would differ from one process (fp32, no dropout), or rank 1's shards, filled from rank 0 after it built
    the model empty (partitioned loading), would not be rank 0's weights."""
    single, fsdp = runs / "single", runs / "fsdp"
    assert_same_run(single, fsdp)
    ours, theirs = logged(single, "grad_norm"), logged(fsdp, "grad_norm")
    assert max(ours.values()) > 0.2  # the clipping bites
    assert max(abs(ours[s] - theirs[s]) for s in ours) < 1e-5
    for name, key in (("train_results.json", "train_loss"), ("eval_results.json", "eval_loss")):
        assert abs(json.loads((single / name).read_text())[key] - json.loads((fsdp / name).read_text())[key]) < 1e-6
    predicted = [json.loads((folder / "predictions.json").read_text()) for folder in (single, fsdp)]
    assert len(predicted[1]) == 24
    assert max(abs(a - b) for row, other in zip(*predicted) for a, b in zip(row, other)) < 1e-5


@pytest.mark.launch
def test_every_checkpoint_and_the_output_hold_a_consolidated_model(runs):
    """A checkpoint or the final folder would hold only shards (or one rank's part) instead of the whole model that
    from_pretrained loads in one process."""
    from transformers import BertForSequenceClassification

    for step in (2, 4, 6, 8, 10):
        folder = runs / "fsdp" / f"checkpoint-{step}"
        marker = json.loads((folder / MARKER).read_text())
        assert {"optimizer_shards/.metadata", "optimizer_shards/__0_0.distcp",
                "optimizer_shards/__1_0.distcp"} <= marker["files"].keys()  # checksummed like the weights
        assert max_weight_difference(runs / "single" / folder.name, folder) < 1e-5
    model = BertForSequenceClassification.from_pretrained(runs / "fsdp")
    expected = weights(runs / "single")
    assert max((model.state_dict()[k] - expected[k]).abs().max().item() for k in expected) < 1e-5


@pytest.mark.launch
def test_each_rank_holds_half_the_model_states_as_the_planner_says(runs):
    """fully_shard would not shard on CPU ranks (accelerate turns FSDP on for GPUs only: a stock run trains plain DDP),
    `trainer-ext plan` would mispredict FSDP2's 16Ψ/N bytes of model states by more than 5%, or under
    cpu_ram_efficient_loading a rank other than 0 would hold model parameters while the script builds the model."""
    from trainer_ext.planner import ModelSize, plan

    ranks = [json.loads((runs / "fsdp" / "report" / f"rank{r}.json").read_text()) for r in (0, 1)]
    psi = ranks[0]["num_parameters"]
    # Partitioned loading: while the model was built rank 0 held all of it and rank 1 no parameter byte.
    assert [rank["load_peak_params_bytes"] for rank in ranks] == [4 * psi, 0]
    for rank in ranks:
        assert abs(rank["params_bytes"] / (4 * psi) - 0.5) < 0.02, rank
        assert abs(rank["grads_bytes"] / (4 * psi) - 0.5) < 0.02, rank
        assert abs(rank["moments_bytes"] / (8 * psi) - 0.5) < 0.02, rank
    predicted = next(e for e in plan(ModelSize(psi, "test"), 2, "fp32").estimates if e.backend == "fsdp")
    for rank in ranks:
        measured = rank["params_bytes"] + rank["grads_bytes"] + rank["moments_bytes"]
        assert abs(predicted.model_states / measured - 1) < 0.05, (predicted.model_states, measured)


@pytest.mark.launch
def test_shard_grad_op_size_based_units_and_activation_checkpointing_equal_one_process(runs, tmp_path):
    """reshard_after_forward false (shard_grad_op: parameters kept gathered until backward), units of at least
    min_num_params (SIZE_BASED_WRAP) or each layer recomputed in backward (activation_checkpointing) would change what
    is trained: fp32 and no dropout, the same function as one process without any of them."""
    config = {"reshard_after_forward": False, "auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 2000,
              "activation_checkpointing": True}
    said = train(tmp_path, 2, "--fsdp", "auto_wrap", "--fsdp_config", json.dumps(config))
    assert_same_run(runs / "single", tmp_path)
    assert "fully_shard on a cpu mesh of 2 rank(s) (process group: gloo)" in said
    assert '"reshard_after_forward": false' in said and '"activation_checkpointing": true' in said
    resolved = json.loads((tmp_path / "fsdp_settings.resolved.json").read_text())
    assert resolved["auto_wrap_policy"] == "SIZE_BASED_WRAP" and resolved["min_num_params"] == 2000


def damage(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte changed: only the checksum sees it
    path.write_bytes(bytes(data))


@pytest.mark.launch
def test_sigterm_then_resume_on_1_rank_then_on_2_skipping_a_damaged_shard(runs, tmp_path):
    """A preempted FSDP2 run would not checkpoint, its optimizer shards would not reshard from 2 ranks to 1 or 1 to 2,
    a damaged shard file would be resumed, or a resume loading partitioned would give rank 1 other weights than the
    checkpoint's: each continuation must equal the uninterrupted run."""
    output_dir = tmp_path / "run"
    log_path = tmp_path / "first.log"
    with open(log_path, "w") as log:
        first = subprocess.Popen(command(output_dir, 2, *FSDP), stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                 env=clean_env())
        target = rank_process(first, rank=1, script="tiny_train.py")
        deadline = time.time() + 300
        while "'loss'" not in log_path.read_text() and time.time() < deadline:
            time.sleep(0.1)  # the first logged step
        target.send_signal(signal.SIGTERM)
        first.wait(timeout=300)
    text = log_path.read_text()
    assert first.returncode == 1 and "exitcode  : 143" in text, text[-3000:]  # torchrun: 1 (docs/operations.md)
    saved = sorted(output_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
    interrupted_at = int(saved.name.split("-")[1])
    assert 1 <= interrupted_at < STEPS - 2 and "preempted: checkpoint" in text, text[-3000:]
    assert json.loads((saved / MARKER).read_text())["world_size"] == 2

    said = train(output_dir, 1, *FSDP)  # 2 -> 1: the same command on one process
    assert f"resuming from {saved}" in said
    assert_same_run(runs / "single", output_dir)

    # 1 -> 2, from the newest checkpoint one rank wrote before the last; the last's optimizer shard is damaged; rank 1
    # builds the model empty and takes its shards of the checkpoint's weights from rank 0 (partitioned loading).
    written = [output_dir / f"checkpoint-{step}" for step in range(interrupted_at + 1, STEPS + 1)
               if (output_dir / f"checkpoint-{step}").is_dir()]
    resumed, damaged = tmp_path / "resumed", written[-1]
    assert json.loads((damaged / MARKER).read_text())["world_size"] == 1 and len(written) >= 2
    for folder in written[-2:]:
        shutil.copytree(folder, resumed / folder.name)
    damage(resumed / damaged.name / "optimizer_shards" / "__0_0.distcp")
    said = train(resumed, 2, *PARTITIONED, "--resume_from_checkpoint", "auto")
    assert f"skipping checkpoint {resumed / damaged.name}: optimizer_shards/__0_0.distcp" in said
    assert f"resuming from {resumed / written[-2].name}" in said
    assert_same_run(runs / "single", resumed)


# bf16 against one process under bf16 autocast: both compute in bf16, but FSDP2 gathers bf16 copies of the
# parameters (MixedPrecisionPolicy) where autocast keeps fp32 ones for what it runs in fp32 (embeddings, layer norms,
# the loss), and gradients are reduced over 2 ranks: weights rounded to bf16 (relative 2^-9) move a loss of 0.69 by
# up to ~1e-3. Measured: 6.1e-5 over the 4 training losses, 1.8e-4 on the evaluation loss; training moves the
# evaluation loss by 1.1e-2, so a stale or untrained model is far outside.
BF16_TOLERANCE = 2e-3


@pytest.mark.launch
def test_an_experiment_file_selects_fsdp_a_flag_overrides_it_bf16_trains_like_one_process(tmp_path, tiny_bert_dir):
    """`fsdp:` in an experiment file with `fsdp_config` among the hyperparameters would not reach the task recipe
    (examples/run_glue.py's), `--fsdp shard_grad_op --fsdp_config ...` after the file would keep the file's
    fsdp_config, from_pretrained would load the whole model on rank 1 under cpu_ram_efficient_loading (or its
    evaluation before training would fail on the empty model, or leave shard_grad_op's gathered parameters for the
    optimizer to step: nothing trained), or --bf16 would not train like one process under bf16 autocast while keeping
    fp32 master weights (MixedPrecisionPolicy: bf16 compute, fp32 shards)."""
    import yaml

    values = yaml.safe_load((REPO / "experiments" / "classification.yaml").read_text())
    del values["deepspeed"], values["search"]
    values["fsdp"] = "full_shard auto_wrap"
    values["hyperparameters"].update(fsdp_config={"transformer_layer_cls_to_wrap": ["BertLayer"]},
                                     config={"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
                                     eval_strategy="no", save_strategy="no", max_steps=4, logging_steps=1)
    values["hyperparameters"]["optimizer"]["lr"] = 2e-3  # 4 steps that move the evaluation loss
    values["data"]["evaluate_before_training"] = True
    for key in ("train_file", "validation_file", "test_file"):
        values["data"][key] = str(REPO / "data" / "classification" / Path(values["data"][key]).name)
    path = tmp_path / "fsdp.yaml"
    path.write_text(yaml.safe_dump(values))
    command = ["-m", "trainer_ext", "train", path, "--model_name_or_path", tiny_bert_dir, "--bf16"]
    out = run([BIN / "torchrun", "--nproc_per_node", 2, "--master_port", free_port(), *command, "--fsdp",
               "shard_grad_op", "--fsdp_config", '{"cpu_ram_efficient_loading": true}', "--output_dir",
               tmp_path / "out"], env={"HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-4000:]
    settings = json.loads((tmp_path / "out" / "fsdp_settings.resolved.json").read_text())
    assert settings["reshard_after_forward"] is False and settings["layer_classes"] == []
    assert settings["cpu_ram_efficient_loading"] is True
    assert "mixed precision: bf16 parameters gathered" in out.stdout + out.stderr
    assert {tensor.dtype for tensor in weights(tmp_path / "out").values()} == {torch.float32}
    # One process, no FSDP, bf16 autocast, the same global batch of 32 (the file's 16 per rank).
    del values["fsdp"], values["hyperparameters"]["fsdp_config"]
    path.write_text(yaml.safe_dump(values))
    single = run([PYTHON, *command, "--use_cpu", "--per_device_train_batch_size", 32, "--output_dir",
                  tmp_path / "single"], env={"HF_HUB_OFFLINE": "1"})
    assert single.returncode == 0, single.stdout[-3000:] + single.stderr[-4000:]
    ours, theirs = logged(tmp_path / "single"), logged(tmp_path / "out")
    assert sorted(ours) == sorted(theirs) == [1, 2, 3, 4]
    assert max(abs(ours[step] - theirs[step]) for step in ours) < BF16_TOLERANCE
    evaluated = {}
    for name, key in (("eval_before_results.json", "eval_before_loss"), ("eval_results.json", "eval_loss")):
        evaluated[key] = [json.loads((tmp_path / folder / name).read_text())[key] for folder in ("single", "out")]
        assert abs(evaluated[key][0] - evaluated[key][1]) < BF16_TOLERANCE, evaluated
    assert evaluated["eval_before_loss"][1] - evaluated["eval_loss"][1] > 5 * BF16_TOLERANCE, evaluated  # trained


@pytest.mark.parametrize("flags,said", [
    (dict(fsdp="full_shard", deepspeed="zero2_minimal"), "--deepspeed and --fsdp full_shard both choose a backend"),
    (dict(fsdp="full_shard", sharded_ddp="simple"), "--sharded_ddp simple and --fsdp full_shard both choose a backend"),
    (dict(fsdp="hybrid_shard"), "--fsdp hybrid_shard: a sharding strategy of FSDP1 only"),
    (dict(fsdp="full_shard", fsdp_config={"sharding_strategy": "FULL_SHARD"}),
     "--fsdp_config sharding_strategy: an FSDP1 setting"),
    (dict(fsdp="full_shard", fsdp_config={"version": 1}), "--fsdp_config version=1: FSDP1 is deprecated"),
    (dict(fsdp="full_shard", fsdp_config={"transformer_layer_cls_to_wrp": ["BertLayer"]}),
     "unknown key 'transformer_layer_cls_to_wrp', did you mean 'transformer_layer_cls_to_wrap'?"),
    (dict(fsdp="ful_shard"), "--fsdp: unknown option 'ful_shard', did you mean 'full_shard'?"),
    (dict(fsdp_config={"version": 2}), "--fsdp_config is read only with --fsdp"),
    (dict(fsdp="full_shard offload", use_cpu=True), "--fsdp full_shard offload: offload moves the shards"),
])
def test_what_fsdp2_cannot_do_is_one_line(tmp_path, flags, said):
    """A combination FSDP2 cannot run, an FSDP1-only option or a misspelled key would train something else silently
    or fail deep inside torch instead of one line naming the flag."""
    from trainer_ext import ExtTrainingArguments

    with pytest.raises(ArgumentsError, match=None) as raised:
        ExtTrainingArguments(output_dir=str(tmp_path), **flags)
    assert said in str(raised.value) and "\n" not in str(raised.value)
