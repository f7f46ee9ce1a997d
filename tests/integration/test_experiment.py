"""Experiment files (`trainer-ext train experiment.yaml`): the whole file validates before anything is built, every
mistake is named with the closest valid key or the type expected, relative paths are relative to the file, flags
override the file, and the shipped experiments train under every launcher."""

import json
import os
import shutil
import typing
from pathlib import Path

import pytest
import yaml

from conftest import BIN, PYTHON, REPO, free_port, run
from trainer_ext.experiment import (NAME_OR_PATH_FIELDS, PATH_FIELDS, TASKS, ExperimentError,
                                                argument_classes, load_experiment)

EXPERIMENTS = REPO / "experiments"
SHIPPED = sorted(EXPERIMENTS.glob("*.yaml"))
TRAINER_EXT = BIN / "trainer-ext"
DATA_FILES = ("train_file", "validation_file", "test_file")


def shipped(name):
    return yaml.safe_load((EXPERIMENTS / f"{name}.yaml").read_text())


def copied_experiment(tmp_path, values, name="copy"):
    """`values` as <tmp>/project/experiments/NAME.yaml, beside a copy of the classification data (../data/...)."""
    project = tmp_path / "project"
    shutil.copytree(REPO / "data" / "classification", project / "data" / "classification")
    (project / "experiments").mkdir()
    path = project / "experiments" / f"{name}.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


@pytest.mark.deepspeed
@pytest.mark.oldest
def test_every_shipped_experiment_validates_and_every_task_has_one():
    """A shipped example that no longer validates (renamed flag, moved data) would fail users on first try."""
    assert {path.stem for path in SHIPPED} >= set(TASKS)
    for path in SHIPPED:
        experiment = load_experiment(path)
        assert experiment.task in TASKS


def test_misspelled_keys_get_the_closest_valid_key_all_at_once():
    """Each misspelled key in an experiment file must be named with its fix in one go, not one relaunch per typo."""
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
    """A misspelled task or a wrong data path must be named before anything is built, not fail deep in loading."""
    values = shipped("classification")
    values["task"] = "clasification"
    with pytest.raises(ExperimentError, match="task: 'clasification' is not one of .*did you mean 'classification'"):
        load_experiment(values)
    values = shipped("classification")
    values["data"]["train_file"] = str(tmp_path / "nope.jsonl")
    with pytest.raises(ExperimentError, match=r"data: no such data file: --train_file .*nope\.jsonl"):
        load_experiment(values)


@pytest.mark.deepspeed
def test_hyperparameter_sections_reach_the_training_arguments():
    """optimizer/scheduler sections become the flags ExtTrainer builds them from; config kwargs reach the model."""
    experiment = load_experiment(REPO / "experiments" / "classification.yaml")
    args = experiment.training_args
    assert (args.learning_rate, args.adam_beta1, args.adam_beta2, args.adam_epsilon, args.weight_decay) == \
        (5e-5, 0.9, 0.999, 1e-8, 0.01)
    assert str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)) == "linear"
    assert args.warmup_steps == 0.1
    assert experiment.model_args.config_kwargs == {"hidden_dropout_prob": 0.1}
    assert args.run_settings.settled is not None  # the backend file, named relative to the experiment file


def test_two_backends_are_refused_before_training():
    """A file (or file plus flags) naming both DeepSpeed and FairScale must not start either."""
    values = shipped("classification")
    values["sharded_ddp"] = "simple"  # and deepspeed: two backends
    with pytest.raises(ExperimentError, match="--sharded_ddp simple and --deepspeed both choose a backend"):
        load_experiment(values, folder=EXPERIMENTS)


@pytest.mark.deepspeed
def test_values_are_read_as_the_types_their_fields_have():
    """PyYAML reads `lr: 5e-5` (no dot) as a string: it would pass validation and crash at the optimizer."""
    assert yaml.safe_load("lr: 5e-5") == {"lr": "5e-5"}
    values = shipped("classification")
    values["hyperparameters"]["optimizer"].update(lr="5e-5", betas=["0.8", 0.99])
    values["hyperparameters"].update(max_steps="1e3", save_strategy=False, logging_steps=5)  # false: YAML's `no`
    values["data"]["max_seq_length"] = "64"
    experiment = load_experiment(values, folder=EXPERIMENTS)
    args = experiment.training_args
    assert (args.learning_rate, args.adam_beta1, args.max_steps, args.logging_steps) == (5e-5, 0.8, 1000, 5.0)
    assert type(args.learning_rate) is float and type(args.max_steps) is int
    assert str(getattr(args.save_strategy, "value", args.save_strategy)) == "no"
    assert experiment.data_args.max_seq_length == 64


def test_wrong_types_in_the_file_and_the_flags_are_named_all_at_once():
    """Each bad value gets one line naming its key, value and the type expected (was: a TypeError naming no key)."""
    values = shipped("classification")
    values["hyperparameters"]["max_steps"] = "six"
    values["hyperparameters"]["optimizer"].update(lr="fast", betas=0.9)
    values["hyperparameters"]["scheduler"]["type"] = "linaer"
    values["data"]["max_seq_length"] = 2.5
    flags = ["--max_step", "3", "--warmup_steps", "abc", "--do_eval", "maybe"]
    with pytest.raises(ExperimentError) as caught:
        load_experiment(values, flags, folder=EXPERIMENTS)
    lines = str(caught.value).splitlines()
    assert lines[:3] == ["experiment: hyperparameters: max_steps: expected an integer, got 'six'",
                         "experiment: hyperparameters.optimizer: lr: expected a number, got 'fast'",
                         "experiment: hyperparameters.optimizer: betas: expected a list of 2 values, each a number, "
                         "got 0.9"]
    assert lines[3].startswith("experiment: hyperparameters.scheduler: type: expected one of linear, cosine")
    assert lines[3].endswith("got 'linaer' (did you mean 'linear'?)")
    assert lines[4:] == ["experiment: data: max_seq_length: expected an integer, got 2.5",
                         "unrecognized argument --max_step (did you mean --max_steps?)",
                         "--warmup_steps: expected a number, got 'abc'",
                         "--do_eval: expected true or false, got 'maybe'"]


@pytest.mark.fairscale
def test_flags_override_the_file():
    """`trainer-ext train exp.yaml --max_steps 5 ...` must train what the flags say, keeping the file's other values."""
    flags = ["--max_steps", "5", "--learning_rate", "1e-4", "--output_dir", "elsewhere", "--sharded_ddp", "simple",
             "--max_seq_length", "32", "--tokenizer_name", "my-tokenizer"]
    experiment = load_experiment(EXPERIMENTS / "classification.yaml", flags)
    args = experiment.training_args
    assert (args.max_steps, args.learning_rate, args.weight_decay) == (5, 1e-4, 0.01)
    assert args.output_dir == "elsewhere"  # a flag's path: relative to the current directory
    assert args.sharded_ddp == ["simple"] and not args.deepspeed  # a backend flag replaces the file's backend
    assert experiment.data_args.max_seq_length == 32 and experiment.model_args.tokenizer_name == "my-tokenizer"
    assert experiment.resolved()["training"]["learning_rate"] == 1e-4


@pytest.mark.deepspeed
def test_relative_paths_are_relative_to_the_experiment_file(tmp_path, monkeypatch):
    """A copied experiment file (and the shipped ones) must work from any current directory."""
    values = shipped("classification")
    values["hyperparameters"].update(model_name_or_path="../models/tiny", tokenizer_name="bert-base-uncased",
                                     model={"cache_dir": "../cache"})
    path = copied_experiment(tmp_path, values)
    project = path.parent.parent
    shutil.copytree(REPO / "ds_configs", project / "ds_configs")
    (project / "models" / "tiny").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")

    experiment = load_experiment(path)
    assert experiment.data_args.data_files() == {
        split: str(project / "data" / "classification" / f"{split}.jsonl") for split in ("train", "validation", "test")}
    assert experiment.training_args.output_dir == str(project / "output" / "classification")
    assert experiment.given["deepspeed"] == str(project / "ds_configs" / "zero2_minimal.json")
    assert experiment.model_args.model_name_or_path == str(project / "models" / "tiny")
    assert experiment.model_args.tokenizer_name == "bert-base-uncased"  # no such path beside the file: a Hub name
    assert experiment.model_args.model_kwargs == {"cache_dir": str(project / "cache")}

    experiment = load_experiment(os.path.relpath(EXPERIMENTS / "classification.yaml"))  # the shipped file
    assert experiment.data_args.train_file == str(REPO / "data" / "classification" / "train.jsonl")
    assert experiment.training_args.output_dir == str(REPO / "output" / "classification")


def test_every_path_field_of_the_tasks_is_resolved():
    """A path field missed by the rule (a new *_file, *_dir, *_config) would be read from the current directory."""
    for task in TASKS:
        for cls in argument_classes(task):
            for field, hint in typing.get_type_hints(cls).items():
                takes_text = hint is str or str in typing.get_args(hint)
                if takes_text and field.endswith(("_file", "_dir", "_path", "_uri", "_config")):
                    assert field in PATH_FIELDS + NAME_OR_PATH_FIELDS, f"{cls.__name__}.{field}"


def small_experiment(tmp_path, name="classification", max_steps=3, **backend):
    values = shipped(name)
    values.pop("deepspeed", None)
    values.update(backend)
    values["hyperparameters"].update(output_dir=str(tmp_path / "out"), max_steps=max_steps, logging_steps=1,
                                     eval_strategy="no", save_strategy="no", num_train_epochs=1)
    values["data"].update(max_train_samples=64, max_eval_samples=32, max_seq_length=32)
    values["data"].update({key: str(EXPERIMENTS / values["data"][key]) for key in DATA_FILES if key in values["data"]})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def cache_files(cache):
    return {p: p.stat().st_mtime_ns for p in Path(cache).rglob("cache-*.arrow")}


@pytest.mark.model_package
@pytest.mark.launch
def test_a_second_run_reuses_the_tokenized_cache(tmp_path):
    """datasets.map must fingerprint the tokenizer function: a second run tokenizes nothing again."""
    path = small_experiment(tmp_path)
    env = {"HF_DATASETS_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    first = run([TRAINER_EXT, "train", path], env=env)
    assert first.returncode == 0, first.stderr[-4000:]
    # the recipe's last line, as its example script prints it
    assert first.stdout.strip().splitlines()[-1] == f"model saved to {(tmp_path / 'out').resolve()}"
    tokenized = cache_files(tmp_path / "cache")
    assert tokenized
    second = run([TRAINER_EXT, "train", path], env=env)
    assert second.returncode == 0, second.stderr[-4000:]
    assert cache_files(tmp_path / "cache") == tokenized
    metrics = json.loads((tmp_path / "out" / "train_results.json").read_text())
    assert metrics["train_samples"] == 64


@pytest.mark.model_package
@pytest.mark.deepspeed
@pytest.mark.launch
@pytest.mark.parametrize("launcher", ["deepspeed", "launch"])
def test_an_experiment_trains_on_two_ranks(tmp_path, launcher):
    """The same file under `deepspeed --module` (ZeRO-2) and `torch.distributed.launch -m` (sharded DDP); the flag
    after the file overrides it although the launcher puts --local_rank among the arguments."""
    if launcher == "deepspeed":
        path = small_experiment(tmp_path, max_steps=6, deepspeed="zero2_minimal")
        cmd = [BIN / "deepspeed", "--num_gpus", 2, "--master_port", free_port(), "--module", "trainer_ext"]
    else:
        path = small_experiment(tmp_path, max_steps=6, sharded_ddp="simple")
        cmd = [PYTHON, "-m", "torch.distributed.launch", "--nproc_per_node", 2, "--master_port", free_port(),
               "-m", "trainer_ext"]
    out = run([*cmd, "train", path, "--max_steps", 3], env={"HF_HUB_OFFLINE": "1"}, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-4000:]
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    assert (tmp_path / "out" / "model.safetensors").is_file()


@pytest.mark.model_package
@pytest.mark.launch
def test_a_broken_experiment_exits_2_and_trains_nothing(tmp_path):
    """Bad keys, values and flags: exit 2 with one line each and no traceback, before anything is built."""
    values = shipped("classification")
    values.pop("deepspeed")
    values["hyperparameters"].update(output_dir=str(tmp_path / "out"), per_device_train_bach_size=8, max_steps="six")
    values["hyperparameters"]["optimizer"]["lr"] = "fast"
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(values))
    out = run([TRAINER_EXT, "train", path, "--warmup_steps", "abc", "--num_train_epoch", "1"])
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = out.stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("trainer-ext train: error: "))
    assert lines[start:start + 6] == [
        f"trainer-ext train: error: {path}: hyperparameters: unknown key 'per_device_train_bach_size' (did you mean "
        "'per_device_train_batch_size'?)",
        f"{path}: hyperparameters: max_steps: expected an integer, got 'six'",
        f"{path}: hyperparameters.optimizer: lr: expected a number, got 'fast'",
        "unrecognized argument --num_train_epoch (did you mean --num_train_epochs?)",
        "--warmup_steps: expected a number, got 'abc'",
        "nothing was trained"]
    assert not (tmp_path / "out").exists()


@pytest.mark.model_package
@pytest.mark.launch
def test_a_copied_experiment_trains_from_another_folder_with_flags(tmp_path):
    """Paths in the file follow the file, flags (before or after it) override it and their paths follow the current
    directory."""
    import torch

    values = shipped("classification")
    values.pop("deepspeed")
    values["hyperparameters"].update(output_dir="../output", max_steps=50, logging_steps=1, eval_strategy="no",
                                     save_strategy="no")
    values["data"].update(max_train_samples=64, max_eval_samples=32, max_seq_length=32)
    project = copied_experiment(tmp_path, values, "small").parent.parent
    cwd = tmp_path / "run"
    cwd.mkdir()
    # flags before the file: argparse read the 2 of --max_steps as the experiment file
    command = [TRAINER_EXT, "train", "--max_steps", "2", "--learning_rate", "1e-4", "../project/experiments/small.yaml",
               "--output_dir", "out"]
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "cache")}

    storage = ["--checkpoint_storage_options", '{"endpoint_url": "http://minio:9000", "secret": "s3cr3t"}']
    check = run([*command, "--check", *storage], cwd=cwd, env=env)
    assert check.returncode == 0, check.stderr[-3000:]
    resolved = yaml.safe_load(check.stdout)
    assert resolved["training"]["checkpoint_storage_options"] == {"endpoint_url": "http://minio:9000",
                                                                  "secret": "<hidden>"}  # --check is pasted in issues
    assert resolved["data"]["train_file"] == str(project / "data" / "classification" / "train.jsonl")
    assert [resolved["training"][key] for key in ("max_steps", "learning_rate", "output_dir")] == [2, 1e-4, "out"]

    out = run(command, cwd=cwd, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    assert json.loads((cwd / "out" / "trainer_state.json").read_text())["global_step"] == 2
    assert torch.load(cwd / "out" / "training_args.bin", weights_only=False).learning_rate == 1e-4
    assert not (project / "output").exists()  # the file's output_dir, overridden


@pytest.mark.deepspeed
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


@pytest.mark.parametrize("section", [{"zero_optimization": {"stage": 7}}, '{"zero_optimization": {"stage": 7}}'])
def test_a_bad_deepspeed_section_is_named_as_such(tmp_path, section):
    """A DeepSpeed problem in the file's deepspeed section was reported under 'hyperparameters' and headed '(dict)'."""
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({"task": "classification", "deepspeed": section}))
    with pytest.raises(ExperimentError) as raised:
        load_experiment(path)
    message = str(raised.value)
    assert message.startswith(f"{path}: deepspeed: ") and "hyperparameters" not in message and "(dict)" not in message
    assert "zero_optimization.stage=7: must be 0, 1, 2 or 3, as DeepSpeed requires" in message


def test_nvme_paths_in_a_deepspeed_section_follow_the_experiment_file(tmp_path):
    """A relative nvme_path in the file's deepspeed section was left relative to wherever the command ran."""
    from trainer_ext.experiment import with_paths

    section = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "swap"},
                                     "offload_param": {"device": "nvme", "nvme_path": "/abs/swap"}}}
    resolved = with_paths({"deepspeed": section}, tmp_path)["deepspeed"]["zero_optimization"]
    assert resolved["offload_optimizer"]["nvme_path"] == str(tmp_path / "swap")
    assert resolved["offload_param"]["nvme_path"] == "/abs/swap"
    assert section["zero_optimization"]["offload_optimizer"]["nvme_path"] == "swap"  # the caller's dict untouched
