"""`trainer-ext search`: trials of the shipped classification task run as real `trainer-ext train` processes under
their launcher, the pruner stops weak ones after a checkpoint, the best model is kept, a killed search continues its
interrupted trial without losing or repeating one, and a broken search section is refused before anything trains."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from conftest import BIN, REPO, run, signal_at_step
from trainer_ext.checkpoints.format import newest_valid_checkpoint
from trainer_ext.experiment import argument_classes, flag_types
from trainer_ext.search import PRUNED_ATTR
from trainer_ext.search.space import read_search
from trainer_ext.search.study import retried_from

optuna = pytest.importorskip("optuna")  # trainer_ext[search], in the test extra
TRAINER_EXT = BIN / "trainer-ext"
ENV = {"HF_HUB_OFFLINE": "1"}
LEARNING_RATE = {"type": "log_float", "low": 1.0e-5, "high": 1.0e-3}
TINY = {"config": {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64},
        "model": {"ignore_mismatched_sizes": True}, "dropout": 0}  # MiniLM's tokenizer, a 0.5M-parameter model


def tiny_search(tmp_path, search, backend=None, **hyperparameters):
    """The shipped classification experiment with one transformer layer and 32 samples, evaluated and checkpointed
    every 2 steps, and the `search` section given."""
    values = yaml.safe_load((REPO / "experiments" / "classification.yaml").read_text())
    values.pop("deepspeed")
    values.update(backend or {})
    values["hyperparameters"].update({
        "config": {"num_hidden_layers": 1}, "output_dir": str(tmp_path / "out"), "max_steps": 6,
        "per_device_train_batch_size": 4, "per_device_eval_batch_size": 16, "logging_steps": 2,
        "eval_strategy": "steps", "eval_steps": 2, "save_strategy": "steps", "save_steps": 2, "disable_tqdm": True,
        **hyperparameters})
    values["data"].update(max_train_samples=32, max_eval_samples=16, max_seq_length=32)
    for split in ("train", "validation", "test"):
        values["data"][f"{split}_file"] = str(REPO / "data" / "classification" / f"{split}.jsonl")
    values["search"] = {"metric": "accuracy", "sampler": {"type": "random", "seed": 0}, **search}
    path = tmp_path / "search.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def study(tmp_path, name="search"):
    folder = tmp_path / "out" / "search"
    return optuna.load_study(study_name=name, storage=f"sqlite:///{folder}/study.db"), folder


def runs_in(log: Path) -> int:
    return log.read_text().count("=== trainer-ext search: trial")


@pytest.mark.launch
@pytest.mark.model_package
def test_six_trial_search_prunes_keeps_the_best_and_never_runs_a_trial_twice(tmp_path):
    """Each trial trains with its values; one the pruner rejects stops at that evaluation after a checkpoint; only the
    best trial keeps its model; table and plots are written; the same command again trains nothing."""
    # No accuracy reaches 1.01: a trial evaluated at step 4 (16 samples) is pruned there, one of 2 steps completes.
    path = tiny_search(tmp_path, {"max_trials": 6, "parallel_trials": 2,
                                  "pruner": {"type": "threshold", "lower": 1.01, "n_warmup_steps": 16},
                                  "space": {"learning_rate": LEARNING_RATE, "max_steps": [2, 6]}})
    out = run([TRAINER_EXT, "search", path], env=ENV, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    found, folder = study(tmp_path)
    trials = found.get_trials()
    assert [trial.number for trial in trials] == list(range(6))
    states = optuna.trial.TrialState
    for trial in trials:
        log = (folder / f"trial-{trial.number}" / "trial.log").read_text()
        assert f"--learning_rate {trial.params['learning_rate']!r} --max_steps {trial.params['max_steps']}" in log
        if trial.params["max_steps"] == 6:
            assert trial.state == states.PRUNED and sorted(trial.intermediate_values) == [8, 16], log[-2000:]
            assert f"search trial {trial.number} pruned at step 4" in log and "'epoch': '0.75'" not in log
            # it ends with its training: no final model saved, no evaluation after it
            assert not (folder / f"trial-{trial.number}" / "eval_results.json").exists(), log[-2000:]
        else:
            assert trial.state == states.COMPLETE, log[-2000:]
            results = json.loads((folder / f"trial-{trial.number}" / "eval_results.json").read_text())
            assert trial.value == results["eval_accuracy"]
    assert {trial.state for trial in trials} == {states.COMPLETE, states.PRUNED}  # the seed draws both
    best = found.best_trial
    assert (folder / "best").resolve() == folder / f"trial-{best.number}"
    assert (folder / "best" / "model.safetensors").is_file()
    for trial in trials:
        kept = list((folder / f"trial-{trial.number}").glob("checkpoint-*")) + \
            list((folder / f"trial-{trial.number}").glob("model*.safetensors"))
        assert bool(kept) == (trial.number == best.number)
    table = (folder / "search_results.md").read_text()
    assert "| trial | state" in table and f"| {best.number} " in table and "COMPLETE (best)" in table
    assert sum(line.startswith("| ") for line in table.splitlines()) == 7
    for plot in ("optimization_history.png", "param_importances.png", "intermediate_values.png"):
        assert (folder / plot).stat().st_size > 1000

    again = run([TRAINER_EXT, "search", path], env=ENV, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert " starts:" not in again.stdout and " continues:" not in again.stdout
    assert [runs_in(folder / f"trial-{n}" / "trial.log") for n in range(6)] == [1] * 6


@pytest.mark.launch
@pytest.mark.deepspeed
@pytest.mark.model_package
def test_a_killed_two_rank_search_continues_its_interrupted_trial_from_its_checkpoint(tmp_path):
    """--launcher deepspeed --num_gpus 2, then SIGKILL to the search's process group at the end of step 4 (rank 0 sends
    it, tests/scripts/hooks): both ranks still checkpoint step 4 and stop (the trial's guard gets SIGTERM;
    deepspeed's runner passes nothing on); the same command waits for Optuna to find the trial's heartbeat stale, then
    continues its retry with its values and its ZeRO stage from checkpoint-4, in its folder, and adds no other trial."""
    path = tiny_search(tmp_path, {"max_trials": 1, "metric": "loss", "heartbeat_interval": 1, "grace_period": 3,
                                  "space": {"deepspeed.zero_optimization.stage": [1, 2],
                                            "learning_rate": LEARNING_RATE}},
                       backend={"deepspeed": "zero2_minimal"}, max_steps=10, per_device_train_batch_size=2)
    command = [str(TRAINER_EXT), "search", str(path), "--launcher", "deepspeed", "--num_gpus", "2"]
    env = signal_at_step(4, 0, "SIGKILL")
    env["TRAINER_EXT_TEST_SIGNAL"] += ":outer"  # to the search's process group, which started the trial's session
    with open(tmp_path / "first.log", "w") as log:
        search = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env={**env, **ENV},
                                  start_new_session=True)
    assert search.wait(timeout=600) == -signal.SIGKILL, (tmp_path / "first.log").read_text()[-3000:]
    trial_dir = tmp_path / "out" / "search" / "trial-0"
    deadline = time.time() + 300
    while "preempted: checkpoint" not in (trial_dir / "trial.log").read_text():
        assert time.time() < deadline, (trial_dir / "trial.log").read_text()[-3000:]
        time.sleep(0.2)
    found, folder = study(tmp_path)
    values = found.trials[0].params
    assert len(found.trials) == 1 and found.trials[0].state == optuna.trial.TrialState.RUNNING
    assert newest_valid_checkpoint(trial_dir) == trial_dir / "checkpoint-4"  # rank 0 waits for its SIGTERM

    again = run(command, env=ENV, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "trial 1 (retry of trial 0): taken over from" in again.stdout  # once Optuna found its heartbeat stale
    assert "no heartbeat from its worker for 3 s: Optuna failed it as stale" in again.stdout
    assert "trial 1 (retry of trial 0) continues" in again.stdout
    assert f"continues from {trial_dir / 'checkpoint-4'}" in again.stdout
    found, _ = study(tmp_path)
    failed, retry = found.trials
    assert failed.state == optuna.trial.TrialState.FAIL and retry.state == optuna.trial.TrialState.COMPLETE
    assert retried_from(retry) == 0
    assert found.direction == optuna.study.StudyDirection.MINIMIZE
    assert retry.params == values and retry.user_attrs["runs"] == 2 and retry.user_attrs["steps"] == 10
    log = (trial_dir / "trial.log").read_text()
    assert runs_in(trial_dir / "trial.log") == 2 and f"resuming from {trial_dir / 'checkpoint-4'}" in log
    assert json.loads((trial_dir / "trainer_state.json").read_text())["global_step"] == 10
    stage = json.loads((trial_dir / "ds_config.resolved.json").read_text())["zero_optimization"]["stage"]
    assert stage == values["deepspeed.zero_optimization.stage"] and f"ZeRO-{stage} on 2 rank(s)" in log
    assert not (folder / "trial-1").exists()


@pytest.mark.launch
@pytest.mark.model_package
def test_successive_halving_compares_two_batch_sizes_at_equal_samples(tmp_path):
    """The pruner's budget is training samples: a batch-4 and a batch-8 trial (one epoch of 32 samples each) are both
    evaluated at the rung's 16 samples (steps 4 and 2) and compared there, and the one behind stops at that rung (with
    steps, batch 8 was judged after twice the data of batch 4)."""
    path = tiny_search(tmp_path, {"max_trials": 2, "metric": "loss", "sampler": {"type": "random", "seed": 2},
                                  "pruner": {"type": "successive_halving", "min_resource": 16, "reduction_factor": 2},
                                  "space": {"per_device_train_batch_size": [4, 8]}},
                       max_steps=-1, num_train_epochs=1, eval_steps=100, save_steps=100, **TINY)
    out = run([TRAINER_EXT, "search", path], env=ENV, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    first, second = study(tmp_path)[0].get_trials()
    assert [trial.params["per_device_train_batch_size"] for trial in (first, second)] == [4, 8]  # the seed's draws
    for trial in (first, second):  # the rung's value is the evaluation at 16 samples, whatever the batch size
        assert trial.system_attrs["completed_rung_0"] == trial.intermediate_values[16]
    assert first.state.name == "COMPLETE" and sorted(first.intermediate_values) == [16, 32]
    assert first.user_attrs["steps"] == 8  # 32 samples at 4 a step
    # At 16 samples batch 4 has taken 4 optimizer steps and batch 8 two: the batch-8 trial is behind and stops there.
    assert second.intermediate_values[16] > first.intermediate_values[16]
    assert second.state.name == "PRUNED" and sorted(second.intermediate_values) == [16]
    assert second.user_attrs[PRUNED_ATTR] == 2  # 16 samples at 8 a step


def test_the_shipped_search_section_is_valid():
    """`trainer-ext search experiments/classification.yaml` must work on first try."""
    values = yaml.safe_load((REPO / "experiments" / "classification.yaml").read_text())
    problems = []
    settings = read_search(values["search"], "classification.yaml: search",
                           flag_types(argument_classes("classification")), metrics=("loss", "accuracy"),
                           configs=("deepspeed",), problems=problems)
    assert problems == [] and settings.metric == "eval_accuracy" and settings.direction == "maximize"
    assert settings.pruner == {"type": "hyperband"} and "deepspeed.zero_optimization.stage" in settings.space


def test_a_bad_search_section_is_named_line_by_line():
    """Each mistake in a search section is one line with the closest valid key or value (was: none of it checked)."""
    section = {"metrc": "accuracy", "metric": "acuracy", "direction": "maximise", "max_trials": 0,
               "heartbeat_interval": 10, "grace_period": 5,
               "sampler": {"type": "tpee"}, "pruner": {"type": "hyperband", "min_resourse": 2},
               "space": {"learnin_rate": LEARNING_RATE, "lr": LEARNING_RATE,
                         "warmup_steps": {"type": "log_float", "low": 0, "high": 3},
                         "per_device_train_batch_size": {"type": "float", "low": 4, "high": 16},
                         "deepspeed.zero_optimisation.stage": [1, 2],
                         "max_grad_norm": {"typ": "float", "low": 1, "high": 2},
                         "adam_beta1": {"type": "float", "low": 0.9, "high": 0.8, "chioces": [1]},
                         "lr_scheduler_type": ["linear", "cosinus"], "output_dir": ["a", "b"]}}
    problems = []
    read_search(section, "exp.yaml: search", flag_types(argument_classes("classification")),
                metrics=("loss", "accuracy"), configs=("deepspeed",), problems=problems)
    where = "exp.yaml: search.space:"
    assert problems[:10] == [
        "exp.yaml: search: unknown key 'metrc' (did you mean 'metric'?)",
        f"{where} learnin_rate: not a flag of the task's model, data or training arguments (did you mean "
        "'learning_rate'?)",
        f"{where} lr: not a flag of the task's model, data or training arguments (did you mean 'learning_rate'?)",
        f"{where} warmup_steps: low 0.0: a log_float range starts above 0",
        f"{where} per_device_train_batch_size: type float, but the flag takes an integer; use type int",
        f"{where} deepspeed.zero_optimisation.stage: 'zero_optimisation' is not a DeepSpeed config key (did you mean "
        "'zero_optimization'?)",
        f"{where} max_grad_norm: unknown key 'typ' (did you mean 'type'?)",
        f"{where} max_grad_norm: no type (one of float, log_float, int, categorical)",
        f"{where} adam_beta1: unknown key 'chioces' (did you mean 'choices'?)",
        f"{where} adam_beta1: low 0.9 must be below high 0.8"]
    assert problems[10].startswith(f"{where} lr_scheduler_type: choices: expected one of linear, cosine")
    assert problems[10].endswith("got 'cosinus' (did you mean 'cosine'?)")
    assert problems[11:] == [
        f"{where} output_dir: not searchable: each trial trains in <study_dir>/trial-N",
        "exp.yaml: search: metric: 'acuracy' is not a metric the task evaluates (loss, accuracy) (did you mean "
        "'accuracy'?)",
        "exp.yaml: search: direction: expected one of maximize, minimize, got 'maximise' (did you mean 'maximize'?)",
        "exp.yaml: search: max_trials: 0 must be at least 1",
        "exp.yaml: search: grace_period 5 must exceed heartbeat_interval 10 (a few heartbeats, e.g. 6x), or live "
        "workers look dead",
        "exp.yaml: search: sampler: type: expected one of tpe, random, got 'tpee' (did you mean 'tpe'?)",
        "exp.yaml: search: pruner: hyperband: unknown key 'min_resourse' (did you mean 'min_resource'?)"]


@pytest.mark.launch
def test_a_broken_search_exits_2_before_anything_trains(tmp_path):
    """File, section, flag, launcher and value problems (batch 0, ZeRO stage 4) and a storage without its database
    driver, at once, exit 2, before any study."""
    path = tiny_search(tmp_path, {"pruner": "hyperband", "space": {
        "per_device_train_batch_size": {"type": "int", "low": 0, "high": 16},
        "deepspeed.zero_optimization.stage": [2, 4], "learning_rate": LEARNING_RATE}},
        backend={"deepspeed": "zero2_minimal"}, eval_strategy="no")
    out = run([TRAINER_EXT, "search", path, "--learning_rate", "1e-4", "--max_step", "3", "--launcher", "torchrn"],
              env=ENV)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = out.stderr.splitlines()
    assert lines[0] == "trainer-ext search: error: unrecognized argument --max_step (did you mean --max_steps?)"
    assert lines[1:] == [
        f"{path}: search: pruner: hyperband stops weak trials on evaluations during training, and "
        "hyperparameters.eval_strategy is no: set eval_strategy: steps and eval_steps (or epoch)",
        f"{path}: search.space: learning_rate: searched, and also given as --learning_rate on the command line: "
        "drop one",
        "--launcher torchrn: expected one of python, torchrun, deepspeed, torch.distributed.launch (did you mean "
        "'torchrun'?)",
        "nothing was trained"]
    assert not (tmp_path / "out").exists()

    # A storage whose driver is missing (psycopg made unimportable): one line with the package to install.
    blocked = tmp_path / "no-psycopg" / "psycopg"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('psycopg is blocked by the test')\n")
    path = tiny_search(tmp_path, {"storage": "postgresql://search:secret@127.0.0.1:1/optuna",
                                  "space": {"per_device_train_batch_size": {"type": "int", "low": 0, "high": 16},
                                            "deepspeed.zero_optimization.stage": [2, 4]}},
                       backend={"deepspeed": "zero2_minimal"})
    out = run([TRAINER_EXT, "search", path], env={
        **ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(blocked.parent), os.environ.get("PYTHONPATH")]))})
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = out.stderr.replace("trainer-ext search: error: ", "").splitlines()
    assert f"{path}: search: storage: postgresql://search:***@127.0.0.1:1/optuna: postgresql:// needs the psycopg " \
           "driver, which is not installed: pip install 'psycopg[binary]' (or pip install " \
           "'trainer_ext[search-postgres]'); postgresql+psycopg2:// selects psycopg2" in lines
    assert f"{path}: search.space: per_device_train_batch_size = 0: --per_device_train_batch_size 0: must be a " \
           "positive integer" in lines
    assert f"{path}: search.space: deepspeed.zero_optimization.stage = 4: zero_optimization.stage=4: must be 0, 1, " \
           "2 or 3, as DeepSpeed requires: fix the value, or remove the key for DeepSpeed's default" in lines
    assert not (tmp_path / "out").exists()


def test_rung_pruners_evaluate_at_their_sample_counts():
    """Successive halving and Hyperband given min_resource get an evaluation at each rung's sample count (min_resource x
    reduction_factor^k, from min_early_stopping_rate on); other pruners, and these without min_resource, add none."""
    from types import SimpleNamespace

    from trainer_ext.search.callback import rungs, samples_per_step

    assert rungs({"type": "hyperband", "min_resource": 16, "reduction_factor": 2})(100) == [16, 32, 64]
    assert rungs({"type": "hyperband", "min_resource": 1})(30) == [1, 3, 9, 27]  # Optuna's factor 3
    assert rungs({"type": "successive_halving", "min_resource": 8, "reduction_factor": 4,
                  "min_early_stopping_rate": 1})(600) == [32, 128, 512]
    # Without min_resource (Hyperband's 1 sample would evaluate after one step) the regular evaluations decide.
    assert rungs({"type": "hyperband"}) is None and rungs({"type": "successive_halving", "min_resource": "auto"}) is None
    assert rungs({"type": "median", "min_resource": 16}) is None
    args = SimpleNamespace(train_batch_size=4, gradient_accumulation_steps=3, world_size=2)
    assert samples_per_step(args) == 24
