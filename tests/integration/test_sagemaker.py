"""SageMaker training jobs run by AWS's own toolkits (sagemaker-training, sagemaker-pytorch-training: the code inside
the SageMaker PyTorch and Hugging Face containers) on this machine, with no docker: the job's config files as SageMaker
writes them under a temporary root that plays /opt/ml, then the toolkit's `train` command. Also the SageMaker module's
own rules, without a process."""

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (BIN, REPO, _check_markers, clean_env, free_port, logged, max_weight_difference, run, scratch,
                      tiny_bert)

from trainer_ext.checkpoints.final_model import save_final_model
from trainer_ext.checkpoints.format import MARKER, checkpoint_step, newest_valid_checkpoint
from trainer_ext.config.own_flags import CheckpointFlags, flags_of
from trainer_ext.config.settings import write
from trainer_ext.environment import sagemaker
from trainer_ext.errors import ArgumentsError

TINY_TRAIN = REPO / "tests" / "scripts" / "tiny_train.py"
OWN_SCRIPT = REPO / "tests" / "scripts" / "own_script.py"
TOOLKIT = {"SM_STUDIO_LOCAL_MODE": "true", "SAGEMAKER_TRAINING_MODULE": "sagemaker_pytorch_container.training:main",
           # as in the container: the toolkit's `train` and the launchers it starts come from this environment (make
           # test runs .venv/bin/python without activating .venv)
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
TRAIN = str(BIN / "train")  # the toolkit's entry point, as the container's CMD runs it


# -- a job on this machine, through the real toolkit ------------------------------------------------------------------
def write_job(root: Path, script: Path, hyperparameters: dict, *, channels=None, extra_files=(), processes=2,
              hosts=("algo-1",), current_host="algo-1") -> dict:
    """What SageMaker writes before it starts the container, under `root` (/opt/ml): the estimator's source_dir (the
    script and `extra_files`), input/config/hyperparameters.json (each value JSON-encoded, with the estimator's
    sagemaker_* settings for distribution={'torch_distributed': {'enabled': True}}), resourceconfig.json,
    inputdataconfig.json and each channel's files under input/data/<channel>/. Returns the variables the `train`
    process needs (a container has them from its image)."""
    source = root / "source_dir"
    source.mkdir(parents=True)
    for path in (script, *extra_files):
        shutil.copy(path, source / Path(path).name)
    config = root / "input" / "config"
    config.mkdir(parents=True)
    settings = {"sagemaker_program": script.name, "sagemaker_submit_directory": str(source),
                "sagemaker_torch_distributed_enabled": True, "sagemaker_mpi_num_of_processes_per_host": processes,
                "sagemaker_region": "us-east-1", "sagemaker_container_log_level": 20}
    encoded = {key: json.dumps(value) for key, value in {**hyperparameters, **settings}.items()}
    (config / "hyperparameters.json").write_text(json.dumps(encoded))
    (config / "resourceconfig.json").write_text(json.dumps({"current_host": current_host, "hosts": list(hosts),
                                                            "network_interface_name": "lo"}))
    (config / "inputdataconfig.json").write_text(json.dumps(
        {name: {"TrainingInputMode": "File", "S3DistributionType": "FullyReplicated"} for name in channels or {}}))
    for name, files in (channels or {}).items():
        folder = root / "input" / "data" / name
        folder.mkdir(parents=True)
        for path in files:
            shutil.copy(path, folder / Path(path).name)
    # The one check the markers need: what the toolkit will launch (train's own argv names none of it).
    _check_markers(["torchrun", script.name, *[word for key, value in hyperparameters.items()
                                               for word in (f"--{key}", str(value))]])
    return {**TOOLKIT, "SAGEMAKER_BASE_DIR": str(root), "PET_MASTER_PORT": str(free_port())}


def run_job(root: Path, script: Path, hyperparameters: dict, check=True, **job):
    """Write the job and run `train` to its end; the toolkit prints the ranks' output on its stdout."""
    env = write_job(root, script, hyperparameters, **job)
    out = run([TRAIN], env=env, cwd=root, timeout=900)
    if check:
        assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    return out


def losses_printed(out) -> int:
    """Optimizer steps this run trained itself (rank 0 prints one loss line per step with --logging_steps 1)."""
    return sum(1 for line in out.stdout.splitlines() if "'loss':" in line and "'train_loss'" not in line)


def eval_loss(folder: Path) -> float:
    return json.loads((folder / "eval_results.json").read_text())["eval_loss"]


# -- a spot job: the uninterrupted reference, shared by the tests below ------------------------------------------------
# A constant rate: the first N steps of any run of these hyperparameters are the reference's first N.
STEPS, SAVE_STEPS = 120, 40
SPOT = {"do_train": True, "eval_samples": 64, "max_steps": STEPS, "save_steps": SAVE_STEPS, "logging_steps": 1,
        "per_device_train_batch_size": 8, "learning_rate": 1e-3, "lr_scheduler_type": "constant", "seed": 7,
        "report_to": "none", "disable_tqdm": True}


@pytest.fixture(scope="module")
def uninterrupted(request):
    """The spot job's hyperparameters, never stopped: 120 steps on 2 ranks, checkpoints every 40."""
    root = scratch(request, "uninterrupted")
    run_job(root, TINY_TRAIN, SPOT)
    return root


def stop_like_spot(job: subprocess.Popen, after: Path, timeout=600) -> float:
    """Once `after` exists, SIGTERM to the job's torchrun (which forwards it to the ranks) while the toolkit goes on
    collecting their output; returns the time it was sent, when the toolkit has ended. (The toolkit itself has no
    SIGTERM handler: signalled, it dies at once, and the ranks' next print meets a closed pipe.)"""
    import psutil

    deadline = time.time() + timeout
    while not after.is_file() and job.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    launcher = next(child for child in psutil.Process(job.pid).children(recursive=True)
                    if "torchrun" in " ".join(child.cmdline()))
    sent = time.time()
    launcher.send_signal(signal.SIGTERM)
    job.wait(timeout=max(1, deadline - time.time()))
    return sent


@pytest.mark.launch
def test_spot_stop_then_restart_on_a_new_instance_finishes_the_job(uninterrupted, tmp_path):
    """A reclaimed spot job would lose its progress: the SIGTERM would not end in a complete checkpoint in the synced
    folder, or a new instance holding only S3's copy of that folder would start over instead of finishing the same
    job (same eval loss and weights as never stopped, fewer steps trained)."""
    first = tmp_path / "first"
    env = write_job(first, TINY_TRAIN, SPOT)
    with open(tmp_path / "first.log", "w") as log:
        job = subprocess.Popen([TRAIN], env={**clean_env(), "PYTHONUNBUFFERED": "1", **env}, cwd=first,
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        sent = stop_like_spot(job, first / "checkpoints" / f"checkpoint-{SAVE_STEPS}" / MARKER)
    text = (tmp_path / "first.log").read_text()
    saved = newest_valid_checkpoint(first / "checkpoints")
    assert "received SIGTERM" in text and saved is not None, text[-4000:]
    step = checkpoint_step(saved)
    assert SAVE_STEPS < step < STEPS, "the stop must land between the first checkpoint and the end"
    assert not (first / "model" / "model.safetensors").exists()  # no final model from a stopped job
    written = json.loads((saved / MARKER).read_text())["saved_at"] - sent
    print(f"spot stop: preemption checkpoint-{step} complete {written:.2f} s after SIGTERM")

    second = tmp_path / "second"  # a new instance: SageMaker copies checkpoint_s3_uri back, nothing else
    shutil.copytree(first / "checkpoints", second / "checkpoints")
    out = run_job(second, TINY_TRAIN, SPOT)
    assert f"resuming from {second / 'checkpoints' / saved.name}" in out.stdout + out.stderr
    assert losses_printed(out) == STEPS - step
    assert abs(eval_loss(second / "model") - eval_loss(uninterrupted / "model")) < 1e-6
    assert max_weight_difference(uninterrupted / "model", second / "model") < 1e-5
    print(f"spot restart: {step} steps before the stop, {STEPS - step} after; eval loss "
          f"{eval_loss(second / 'model'):.6f} vs uninterrupted {eval_loss(uninterrupted / 'model'):.6f}")


@pytest.mark.launch
def test_half_uploaded_newest_checkpoint_is_skipped_on_restart(uninterrupted, tmp_path):
    """An instance that died while S3 received its newest checkpoint leaves it half there (marker uploaded, a file
    cut short, another missing): resuming it would crash or train on garbage; the one before it is resumed."""
    root = tmp_path / "job"
    for step in (SAVE_STEPS, 2 * SAVE_STEPS):
        shutil.copytree(uninterrupted / "checkpoints" / f"checkpoint-{step}",
                        root / "checkpoints" / f"checkpoint-{step}")
    newest = root / "checkpoints" / f"checkpoint-{2 * SAVE_STEPS}"
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    (newest / "optimizer.pt").unlink()
    out = run_job(root, TINY_TRAIN, SPOT)
    assert f"skipping checkpoint {newest}" in out.stdout + out.stderr
    assert f"resuming from {root / 'checkpoints' / f'checkpoint-{SAVE_STEPS}'}" in out.stdout + out.stderr
    assert losses_printed(out) == STEPS - SAVE_STEPS
    assert abs(eval_loss(root / "model") - eval_loss(uninterrupted / "model")) < 1e-6
    assert newest_valid_checkpoint(root / "checkpoints").name == f"checkpoint-{STEPS}"  # the damaged one replaced


# -- examples/run_qa.py as in AWS's BERT-large SQuAD walkthrough, scaled down ------------------------------------------
QA = REPO / "examples" / "run_qa.py"
# The walkthrough's hyperparameters (fp16 left out: this machine has no GPU), with a MiniLM-sized run: 4 steps.
WALKTHROUGH = {"do_train": True, "do_eval": True, "per_device_train_batch_size": 4, "per_device_eval_batch_size": 4,
               "num_train_epochs": 2, "max_steps": 4, "max_seq_length": 128, "doc_stride": 48,
               "max_train_samples": 32, "max_eval_samples": 16, "dropout": 0, "seed": 7, "logging_steps": 1,
               "report_to": "none", "disable_tqdm": True}


def flags(hyperparameters: dict) -> list[str]:
    """The same hyperparameters typed on a command line."""
    return [word for key, value in hyperparameters.items() for word in (f"--{key}", str(value))]


@pytest.mark.launch
@pytest.mark.model_package
def test_walkthrough_qa_job_equals_torchrun_and_leaves_the_model_in_sm_model_dir(tmp_path):
    """The walkthrough's job (data from the train/validation channels, --output_dir /opt/ml/model) would score other
    EM/F1 than the same run under torchrun, lose the model, tar every checkpoint into model.tar.gz, or have the recipe
    write again the model train() saved there."""
    root = tmp_path / "job"
    data = {"train": [REPO / "data" / "qa" / "train.json"], "validation": [REPO / "data" / "qa" / "validation.json"]}
    # --log_level info: transformers logs each save ("Saving model checkpoint to <folder>"), so saves can be counted.
    out = run_job(root, QA, {**WALKTHROUGH, "output_dir": str(root / "model"), "log_level": "info"}, channels=data)
    direct = run([BIN / "torchrun", "--nproc_per_node", 2, "--master_port", free_port(), QA, "--output_dir",
                  tmp_path / "direct", "--train_file", data["train"][0], "--validation_file", data["validation"][0],
                  *flags(WALKTHROUGH)], timeout=900)
    assert direct.returncode == 0, direct.stderr[-4000:]
    model = root / "model"
    ours, theirs = (json.loads((folder / "eval_results.json").read_text()) for folder in (model, tmp_path / "direct"))
    assert ours["eval_exact_match"] == theirs["eval_exact_match"] and ours["eval_f1"] == theirs["eval_f1"]
    assert abs(ours["eval_loss"] - theirs["eval_loss"]) < 1e-5
    assert (model / "eval_predictions.json").read_text() == (tmp_path / "direct" / "eval_predictions.json").read_text()
    for name in ("model.safetensors", "tokenizer.json", "train_results.json"):
        assert (model / name).is_file(), name
    assert not list(model.glob("checkpoint-*")) and (root / "checkpoints" / "checkpoint-4" / MARKER).is_file()
    assert "validation after training: exact match" in out.stdout
    log = out.stdout + out.stderr
    assert f"SageMaker job: the final model is saved in {model} (uploaded as model.tar.gz" in log
    saves = [line.split("Saving model checkpoint to ")[-1] for line in log.splitlines()
             if "Saving model checkpoint to " in line]  # each save logged once per handler: checkpoint-4's is one
    assert saves.count(str(model)) == sum(save.endswith("checkpoint-4") for save in saves) > 0, "saved twice"


# -- a user's own script, DeepSpeed and several hosts inside a job -----------------------------------------------------
@pytest.mark.launch
def test_own_script_without_output_dir_leaves_its_results_where_sagemaker_uploads_them(tmp_path):
    """A script with stock TrainingArguments given no --output_dir would write into trainer_output/ in the code folder
    (never uploaded: the job's result lost), checkpoints outside the synced folder, TensorBoard outside the output;
    --save_total_limit 1 would leave S3 a moment with only an unfinished upload; a script that never calls save_model()
    would end with an empty model.tar.gz (the final weights only in checkpoints, kept only with checkpoint_s3_uri)."""
    from transformers import BertForSequenceClassification

    root = tmp_path / "job"
    out = run_job(root, OWN_SCRIPT, {"max_steps": 6, "save_steps": 3, "save_total_limit": 1, "logging_steps": 1,
                                     "per_device_train_batch_size": 8, "use_cpu": True, "report_to": "tensorboard",
                                     "disable_tqdm": True})
    assert len(json.loads((root / "model" / "results.json").read_text())["losses"]) == 6
    model = root / "model"
    assert BertForSequenceClassification.from_pretrained(model).config.num_labels == 2
    assert max_weight_difference(model, root / "checkpoints" / "checkpoint-6") == 0  # the final weights
    log = out.stdout + out.stderr
    assert f"output_dir is {model} (SM_MODEL_DIR): ExtTrainer saves the final model there when training ends" in log
    assert log.count(f"trainer_ext: SageMaker job: the final model is saved in {model} (uploaded as model.tar.gz") == 1
    assert not (root / "code" / "trainer_output").exists()
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["checkpoint-3", "checkpoint-6"]
    assert newest_valid_checkpoint(root / "checkpoints").name == "checkpoint-6"
    assert list((root / "output" / "data" / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.launch
@pytest.mark.deepspeed
def test_deepspeed_file_from_source_dir_trains_zero2_inside_a_job(uninterrupted, tmp_path):
    """--deepspeed naming a file shipped in source_dir would not be found, or ZeRO-2 inside a job would train otherwise
    than the DDP job (per-step losses) or miss the synced checkpoint folder."""
    config = tmp_path / "ds_zero2.json"
    shutil.copy(REPO / "ds_configs" / "zero2_minimal.json", config)
    root = tmp_path / "job"
    out = run_job(root, TINY_TRAIN, {**SPOT, "eval_samples": 0, "max_steps": 6, "save_steps": 3,
                                     "deepspeed": config.name}, extra_files=[config])
    assert "backend deepspeed" in out.stdout
    ours, reference = logged(root / "model"), logged(uninterrupted / "model")
    assert sorted(ours) == list(range(1, 7)) and max(abs(ours[s] - reference[s]) for s in ours) < 1e-5
    assert (root / "checkpoints" / "checkpoint-6" / "global_step6").is_dir()
    assert newest_valid_checkpoint(root / "checkpoints").name == "checkpoint-6"


@pytest.mark.launch
def test_two_hosts_train_as_one_job(uninterrupted, tmp_path):
    """On two instances (SM_HOSTS; the toolkit's torchrun makes the first the master) the hosts would not form one
    2-rank job equal to the one-host one, or the second host would write a model or checkpoints of its own."""
    import socket

    with socket.socket() as probe:  # the toolkit's torchrun always uses port 7777 across hosts
        if probe.connect_ex(("127.0.0.1", 7777)) == 0:
            pytest.skip("port 7777, which the toolkit uses between hosts, is taken on this machine")
    hosts = ("127.0.0.1", "localhost")  # names any machine resolves; SageMaker's are algo-1, algo-2
    hyperparameters = {**SPOT, "eval_samples": 0, "max_steps": 10, "save_steps": 5}
    jobs = []
    for index, host in enumerate(hosts):
        root = tmp_path / f"host{index + 1}"
        env = write_job(root, TINY_TRAIN, hyperparameters, processes=1, hosts=hosts, current_host=host)
        jobs.append(subprocess.Popen([TRAIN], env={**clean_env(), "PYTHONUNBUFFERED": "1", **env}, cwd=root,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True))
    outputs = [job.communicate(timeout=600)[0] for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    first, second = tmp_path / "host1", tmp_path / "host2"
    ours, reference = logged(first / "model"), logged(uninterrupted / "model")
    assert sorted(ours) == list(range(1, 11)) and max(abs(ours[s] - reference[s]) for s in ours) < 1e-5
    assert newest_valid_checkpoint(first / "checkpoints").name == "checkpoint-10"
    assert not (second / "model" / "model.safetensors").exists()
    assert newest_valid_checkpoint(second / "checkpoints") is None


# -- the module's rules, in this process ----------------------------------------------------------------------------
@pytest.fixture
def in_job(tmp_path, monkeypatch):
    """This process inside a job rooted at tmp_path (the variables the toolkit gives the entry point)."""
    for key in [key for key in os.environ if key.startswith("SM_")] + ["TENSORBOARD_LOGGING_DIR"]:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SAGEMAKER_BASE_DIR", str(tmp_path))
    monkeypatch.setenv("SM_MODEL_DIR", str(tmp_path / "model"))
    monkeypatch.setenv("SM_OUTPUT_DATA_DIR", str(tmp_path / "output" / "data"))
    monkeypatch.setenv("SM_INPUT_CONFIG_DIR", str(tmp_path / "input" / "config"))
    monkeypatch.setenv("SM_HOSTS", '["algo-1"]')
    monkeypatch.setenv("SM_HPS", "{}")
    (tmp_path / "input" / "config").mkdir(parents=True)
    return tmp_path


def parse(argv):
    from trainer_ext import ExtArgumentParser, ExtTrainingArguments

    return ExtArgumentParser(ExtTrainingArguments).parse_args_into_dataclasses(argv)[0]


def test_outside_a_job_nothing_changes(tmp_path, monkeypatch):
    """Detection would fire outside SageMaker (moving a user's model, checkpoints, logs) or parse lists differently."""
    for key in [key for key in os.environ if key.startswith("SM_")]:
        monkeypatch.delenv(key)
    assert sagemaker.current_job() is None
    args = parse(["--output_dir", str(tmp_path)])
    assert args.output_dir == str(tmp_path) and args.checkpoint_dir is None
    assert sagemaker.channel_files((".json",)) == {} and sagemaker.checkpoints_to_keep(1) == 1
    assert sagemaker.spread_lists(["--sharded_ddp", "['simple']"], {"--sharded_ddp"}) == ["--sharded_ddp",
                                                                                         "['simple']"]


def test_job_places_model_checkpoints_and_tensorboard(in_job, monkeypatch):
    """No --output_dir would leave the model outside SM_MODEL_DIR; checkpoints would miss the synced folder (or the
    estimator's own checkpoint_local_path, or --checkpoint_dir); an explicit --output_dir would be overridden;
    TensorBoard would log outside the job's output once the process is prepared (not before: arguments are values)."""
    from transformers import TrainingArguments

    args = TrainingArguments(report_to="none")
    def prepared(args):  # as prepare_process calls it: --checkpoint_dir read from stock arguments too
        return sagemaker.prepare_arguments(args, flags_of(CheckpointFlags, args).checkpoint_dir)

    assert prepared(args) == {"output_dir": str(in_job / "model"),
                                                 "checkpoint_dir": str(in_job / "checkpoints")}
    write(args, prepared(args))
    assert prepared(args) == {}  # once set, nothing more
    assert "TENSORBOARD_LOGGING_DIR" not in os.environ
    sagemaker.prepare_environment()  # prepare_process's part
    assert os.environ["TENSORBOARD_LOGGING_DIR"] == str(in_job / "output" / "data" / "tensorboard")
    (in_job / "input" / "config" / "checkpointconfig.json").write_text(json.dumps({"LocalPath": "/ckpt"}))
    monkeypatch.setenv("SM_HPS", json.dumps({"output_dir": "elsewhere"}))
    args = parse(["--output_dir", "elsewhere"])
    assert args.output_dir == "elsewhere" and args.checkpoint_dir == "/ckpt"
    assert parse(["--checkpoint_dir", str(in_job / "mine")]).checkpoint_dir == str(in_job / "mine")
    assert sagemaker.checkpoints_to_keep(1) == 2 and sagemaker.checkpoints_to_keep(3) == 3


def test_the_final_model_reaches_sm_model_dir_but_never_over_the_scripts(in_job, capsys):
    """A re-run of a finished job (stopped between its last step and the model's save) would leave model.tar.gz empty,
    fill it with the checkpoint's optimizer state, or write over a model the script saved (it may have changed it
    since); the end of training would not save; an output_dir of the user's elsewhere would get a save unasked."""
    from trainer_ext import ExtTrainer, ExtTrainingArguments

    trainer = ExtTrainer(model=tiny_bert(), args=ExtTrainingArguments(report_to="none", use_cpu=True))
    model, checkpoint = in_job / "model", in_job / "checkpoints" / "checkpoint-6"
    assert trainer.args.output_dir == str(model)
    trainer.save_model(str(checkpoint))
    for name in ("optimizer.pt", "scheduler.pt", "rng_state_0.pth", "trainer_state.json", "data_state.json",
                 "checkpoint_complete.json", "latest", "zero_to_fp32.py", "zero_to_torch.py"):
        (checkpoint / name).write_text("training state")
    (checkpoint / "global_step6").mkdir()
    trainer.training_already_complete = checkpoint
    assert save_final_model(trainer, finished_before=True) == model
    assert sorted(p.name for p in model.iterdir()) == ["config.json", "model.safetensors", "training_args.bin"]
    assert max_weight_difference(model, checkpoint) == 0
    assert f"the finished run's model ({checkpoint}) is copied to {model}" in capsys.readouterr().out
    (model / "model.safetensors").write_bytes(b"the script's own model")
    assert save_final_model(trainer, finished_before=True) == model
    assert (model / "model.safetensors").read_bytes() == b"the script's own model" and not capsys.readouterr().out
    assert save_final_model(trainer) == model  # training has just ended: its model is the final one
    assert max_weight_difference(model, checkpoint) == 0
    assert f"the final model is saved in {model}" in capsys.readouterr().out
    trainer.args.output_dir = str(in_job / "mine")
    assert save_final_model(trainer) is None and not (in_job / "mine").exists()


@pytest.mark.fairscale
def test_hyperparameters_as_the_toolkit_passes_them(in_job):
    """`--do_train True`, a list as str() of it (JSON for numbers, Python quotes for strings) would be misread."""
    args = parse(["--do_train", "True", "--class_weights", "[1.0, 3.0]", "--sharded_ddp", "['simple']",
                  "--max_steps", "3"])
    assert args.do_train is True and args.class_weights == [1.0, 3.0] and args.sharded_ddp == ["simple"]


@pytest.mark.parametrize("variable, value, phrase", [
    ("SM_FRAMEWORK_PARAMS", '{"sagemaker_distributed_dataparallel_enabled": true}', "smdistributed data parallelism"),
    ("SM_HP_MP_PARAMETERS", '{"partitions": 2}', "smdistributed model parallelism")])
def test_smdistributed_is_refused_before_anything_loads(in_job, monkeypatch, capsys, variable, value, phrase):
    """A job under AWS's smdistributed libraries would half-run (trainer_ext's backends cannot) instead of stopping
    at once, in one line naming the estimator setting and torch_distributed."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as stopped:
        parse(["--do_train", "True"])
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[0]
    assert phrase in error and "distribution=" in error and "torch_distributed" in error


@pytest.mark.parametrize("flags, said", [({"deepspeed": "zero2"}, "--deepspeed on 2 SageMaker hosts: each rank's "
                                         "optimizer partition"),
                                         ({"fsdp": "full_shard"}, "--fsdp full_shard on 2 SageMaker hosts: each "
                                          "rank's optimizer shard")], ids=["deepspeed", "fsdp"])
def test_a_backend_writing_per_rank_state_on_several_hosts_needs_a_shared_checkpoint_folder(in_job, monkeypatch, tmp_path,
                                                                                            flags, said):
    """ZeRO and FSDP2 on several hosts would write checkpoints no restart can resume (each rank writes its own
    optimizer partition or shard, on its own host, and only host 1 publishes); DDP and FairScale (rank 0 writes it
    all) are not refused. The backend says what its ranks write (BackendSpec.rank_written_state): the arguments hand it
    to SageMaker's step, and stock TrainingArguments meet the same refusal when the process is prepared."""
    from transformers import TrainingArguments

    from trainer_ext import ExtTrainingArguments
    from trainer_ext.backends import rank_written
    from trainer_ext.training.prepare import prepare_process

    monkeypatch.setenv("SM_HOSTS", '["algo-1", "algo-2"]')
    args = type("Args", (), {"output_dir": None, "save_strategy": "steps", "sharded_ddp": None, **flags})()
    with pytest.raises(ArgumentsError, match=f"^{re.escape(said)} would stay on its own host's .*--checkpoint_dir"):
        sagemaker.prepare_arguments(args, None, rank_written(args))
    assert sagemaker.prepare_arguments(args, "/fsx/run", rank_written(args)) == {"output_dir": str(in_job / "model")}
    for others in ({}, {"sharded_ddp": ["zero_dp_2"]}):
        plain = type("Args", (), {"output_dir": None, "save_strategy": "steps", "deepspeed": None, "fsdp": None,
                                  "sharded_ddp": None, **others})()
        assert rank_written(plain) is None
        assert "checkpoint_dir" in sagemaker.prepare_arguments(plain, None, rank_written(plain))
    with pytest.raises(ArgumentsError, match=f"^{re.escape(said)} would stay"):  # as a job's script parses them
        ExtTrainingArguments(save_strategy="steps", report_to="none", **flags)
    # a run that saves nothing writes no per-host state: not refused (save_strategy as transformers keeps it, an enum)
    args.save_strategy = TrainingArguments(output_dir=str(tmp_path), save_strategy="no").save_strategy
    assert sagemaker.prepare_arguments(args, None, rank_written(args))["checkpoint_dir"]
    if "fsdp" in flags:  # stock TrainingArguments, as a user's own script builds them: refused at prepare_process
        stock = TrainingArguments(output_dir=str(tmp_path), fsdp="full_shard", report_to="none")
        with pytest.raises(ArgumentsError, match="^--fsdp on 2 SageMaker hosts: each rank's optimizer shard"):
            prepare_process(stock)  # (transformers turned fsdp="full_shard" into fsdp=True)


def test_data_channels_fill_the_splits_no_file_names(in_job, monkeypatch):
    """The examples would ignore the job's data channels (training the shipped set), take a hidden or wrong-type file,
    let a channel override an explicit --train_file, or say nothing about an empty channel."""
    from trainer_ext.tasks.qa import DataArguments

    train = in_job / "input" / "data" / "train"
    (train / "part").mkdir(parents=True)
    shutil.copy(REPO / "data" / "qa" / "train.json", train / "part" / "b.json")
    shutil.copy(REPO / "data" / "qa" / "train.json", train / ".a.json")
    (train / "a.txt").write_text("not data")
    monkeypatch.setenv("SM_CHANNEL_TRAIN", str(train))
    files = DataArguments().data_files()
    # The channel is the user's data: the shipped validation set never fills the split it lacks (issue 20's rule).
    assert files == {"train": str(train / "part" / "b.json")}
    mine = REPO / "data" / "qa" / "train_v2.json"
    assert DataArguments(train_file=str(mine)).data_files()["train"] == str(mine)
    empty = in_job / "input" / "data" / "validation"
    empty.mkdir()
    monkeypatch.setenv("SM_CHANNEL_VALIDATION", str(empty))
    with pytest.raises(ArgumentsError, match="SageMaker channel 'validation' .* holds no .json file"):
        DataArguments()
