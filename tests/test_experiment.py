"""Experiment files (`trainer-ext train experiment.yaml`): the whole file validates before anything is built, every
mistake is named with the closest valid key, and the shipped experiments train under every launcher."""

import json
from pathlib import Path

import pytest
import yaml

from conftest import BIN, PYTHON, REPO, free_port, run
from trainer_ext.experiment import ExperimentError, TASKS, load_experiment

SHIPPED = sorted((REPO / "experiments").glob("*.yaml"))
TRAINER_EXT = BIN / "trainer-ext"


def shipped(name):
    return yaml.safe_load((REPO / "experiments" / f"{name}.yaml").read_text())


@pytest.mark.oldest
def test_every_shipped_experiment_validates_and_every_task_has_one():
    """A shipped example that no longer validates (renamed flag, moved data) would fail users on first try."""
    assert {path.stem for path in SHIPPED} >= set(TASKS)
    for path in SHIPPED:
        experiment = load_experiment(path)
        assert experiment.task in TASKS


def test_misspelled_keys_get_the_closest_valid_key_all_at_once():
    values = shipped("classification")
    values["hyperparameter"] = {}
    values["hyperparameters"]["learning_rat"] = 1e-4
    values["hyperparameters"]["optimizer"]["weight_decy"] = 0.1
    values["data"]["max_seq_lenght"] = 32
    with pytest.raises(ExperimentError) as caught:
        load_experiment(values)
    message = str(caught.value)
    assert "unknown key 'hyperparameter' (did you mean 'hyperparameters'?)" in message
    assert "hyperparameters: unknown key 'learning_rat' (did you mean 'learning_rate'?)" in message
    assert "hyperparameters.optimizer: unknown key 'weight_decy' (did you mean 'weight_decay'?)" in message
    assert "data: unknown key 'max_seq_lenght' (did you mean 'max_seq_length'?)" in message


def test_unknown_task_and_missing_data_file_are_named(tmp_path):
    values = shipped("classification")
    values["task"] = "clasification"
    with pytest.raises(ExperimentError, match="task: 'clasification' is not one of .*did you mean 'classification'"):
        load_experiment(values)
    values = shipped("classification")
    values["data"]["train_file"] = str(tmp_path / "nope.jsonl")
    with pytest.raises(ExperimentError, match=r"data: no such data file: --train_file .*nope\.jsonl"):
        load_experiment(values)


def test_hyperparameter_sections_reach_the_training_arguments():
    """optimizer/scheduler sections become the flags ExtTrainer builds them from; config kwargs reach the model."""
    experiment = load_experiment(REPO / "experiments" / "classification.yaml")
    args = experiment.training_args
    assert (args.learning_rate, args.adam_beta1, args.adam_beta2, args.adam_epsilon, args.weight_decay) == \
        (5e-5, 0.9, 0.999, 1e-8, 0.01)
    assert str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)) == "linear"
    assert args.warmup_steps == 0.1
    assert experiment.model_args.config_kwargs == {"hidden_dropout_prob": 0.1}
    assert args.deepspeed_resolution is not None  # the backend file, named relative to the experiment file


def test_bad_values_are_reported_before_training():
    values = shipped("classification")
    values["hyperparameters"]["optimizer"]["betas"] = 0.9
    values["sharded_ddp"] = "simple"  # and deepspeed: two backends
    with pytest.raises(ExperimentError) as caught:
        load_experiment(values)
    assert "betas: expected two numbers" in str(caught.value)


def small_experiment(tmp_path, name="classification", **backend):
    values = shipped(name)
    values.pop("deepspeed", None)
    values.update(backend)
    values["hyperparameters"].update(output_dir=str(tmp_path / "out"), max_steps=3, logging_steps=1,
                                     eval_strategy="no", save_strategy="no", num_train_epochs=1)
    values["data"].update(max_train_samples=64, max_eval_samples=32, max_seq_length=32)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def cache_files(cache):
    return {p: p.stat().st_mtime_ns for p in Path(cache).rglob("cache-*.arrow")}


def test_a_second_run_reuses_the_tokenized_cache(tmp_path):
    """datasets.map must fingerprint the tokenizer function: a second run tokenizes nothing again."""
    path = small_experiment(tmp_path)
    env = {"HF_DATASETS_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    first = run([TRAINER_EXT, "train", path], env=env)
    assert first.returncode == 0, first.stderr[-4000:]
    tokenized = cache_files(tmp_path / "cache")
    assert tokenized
    second = run([TRAINER_EXT, "train", path], env=env)
    assert second.returncode == 0, second.stderr[-4000:]
    assert cache_files(tmp_path / "cache") == tokenized
    metrics = json.loads((tmp_path / "out" / "train_results.json").read_text())
    assert metrics["train_samples"] == 64


@pytest.mark.parametrize("launcher", ["deepspeed", "launch"])
def test_an_experiment_trains_on_two_ranks(tmp_path, launcher):
    """The same file under `deepspeed --module` (ZeRO-2) and `torch.distributed.launch -m` (sharded DDP)."""
    if launcher == "deepspeed":
        path = small_experiment(tmp_path, deepspeed="zero2_minimal")
        cmd = [BIN / "deepspeed", "--num_gpus", 2, "--master_port", free_port(), "--module", "trainer_ext"]
    else:
        path = small_experiment(tmp_path, sharded_ddp="simple")
        cmd = [PYTHON, "-m", "torch.distributed.launch", "--nproc_per_node", 2, "--master_port", free_port(),
               "-m", "trainer_ext"]
    out = run([*cmd, "train", path], env={"HF_HUB_OFFLINE": "1"}, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-4000:]
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_a_broken_experiment_exits_2_and_trains_nothing(tmp_path):
    values = shipped("classification")
    values["hyperparameters"]["output_dir"] = str(tmp_path / "out")
    values["hyperparameters"]["per_device_train_bach_size"] = 8
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(values))
    out = run([TRAINER_EXT, "train", path])
    assert out.returncode == 2
    assert "did you mean 'per_device_train_batch_size'" in out.stderr and "nothing was trained" in out.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.oldest
def test_data_from_a_local_dataset_folder(tmp_path):
    """data.dataset_name: datasets.load_dataset on a folder of split files, instead of naming each file."""
    import shutil

    from trainer_ext.tasks.classification import load_raw

    folder = tmp_path / "my_dataset"
    shutil.copytree(REPO / "data" / "classification", folder)
    values = shipped("classification")
    for key in ("train_file", "validation_file", "test_file"):
        values["data"].pop(key)
    values["data"]["dataset_name"] = str(folder)
    experiment = load_experiment(values | {"deepspeed": "zero2_minimal"})
    raw = load_raw(experiment.data_args)
    assert {split: len(raw[split]) for split in raw} == {"train": 2400, "validation": 400, "test": 400}
