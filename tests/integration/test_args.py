"""ExtTrainingArguments: v4 flags, validation at parse time, and parsing under the real launchers."""

import importlib.util
import json
import os
from pathlib import Path

import pytest

from conftest import BIN, PYTHON, REPO, free_port, run, run_forked, run_many, scratch, selected, tiny_bert
from trainer_ext import ArgumentsError, ExtTrainingArguments
from trainer_ext import ExtArgumentParser
from trainer_ext.backends.fairscale import parse_options as parse_sharded_ddp

SCRIPT = REPO / "tests" / "scripts" / "parse_args.py"


def parsed(output_dir):
    """What every rank parsed, by rank (each rank writes its own file)."""
    rows = [json.loads(p.read_text()) for p in sorted(Path(output_dir).glob("args_rank*.json"))]
    return {row["rank"]: row for row in rows}


@pytest.mark.parametrize("value,expected", [("simple", ["simple"]), ("zero_dp_2", ["zero_dp_2"]),
                                            ("zero_dp_3 offload", ["zero_dp_3", "offload"]),
                                            (["zero_dp_2", "offload"], ["zero_dp_2", "offload"]),
                                            (["zero_dp_2 offload"], ["zero_dp_2", "offload"])])
def test_sharded_ddp_valid_options(value, expected):
    """Every v4 spelling parses (whether this machine can run it is checked separately)."""
    assert parse_sharded_ddp(value) == expected


@pytest.mark.fairscale
def test_sharded_ddp_simple_in_arguments(tmp_path):
    """The commonest v4 flag, --sharded_ddp simple, must parse to the option list the FairScale backend reads."""
    assert ExtTrainingArguments(output_dir=str(tmp_path), sharded_ddp="simple").sharded_ddp == ["simple"]


@pytest.mark.parametrize("value,message", [
    ("simpel", "unknown option 'simpel', did you mean 'simple'?"),
    ("simple zero_dp_2", "'simple' takes no other option"),
    ("offload", "--sharded_ddp offload needs 'zero_dp_2' or 'zero_dp_3'"),
    ("zero_dp_2 zero_dp_3", "'zero_dp_2' and 'zero_dp_3' exclude each other"),
    ("zero_dp_2 zero_dp_2", "repeated"),
])
def test_sharded_ddp_invalid_options_name_the_option(tmp_path, value, message):
    """A typo or an impossible mix in --sharded_ddp must be refused at parse time, naming the option and the fix."""
    with pytest.raises(ArgumentsError, match=message.replace("?", r"\?")):
        ExtTrainingArguments(output_dir=str(tmp_path), sharded_ddp=value)


def test_sharded_ddp_with_deepspeed_is_rejected(tmp_path):
    """--sharded_ddp with --deepspeed asks for two backends; the run must refuse rather than quietly pick one."""
    with pytest.raises(ArgumentsError, match="--sharded_ddp simple and --deepspeed"):
        ExtTrainingArguments(output_dir=str(tmp_path), sharded_ddp="simple", deepspeed="zero2_minimal")


@pytest.mark.fairscale
def test_flag_checks_read_the_flags_and_change_nothing(tmp_path):
    """ExtTrainingArguments and `trainer-ext ds-config` share the flag checks (each backend's among them): a check that
    rewrote the flags (--class_weights into numbers, --warmup_ratio into --warmup_steps, --sharded_ddp into a list,
    --fsdp_config read from its file) would change what the caller sees; the arguments still get the values."""
    from trainer_ext.args import flag_problems

    (tmp_path / "fsdp.json").write_text('{"transformer_layer_cls_to_wrap": ["BertLayer"]}')
    common = ["--output_dir", str(tmp_path), "--class_weights", "1,3", "--warmup_ratio", "0.1",
              "--checkpoint_storage_options", "{}"]
    for backend in (["--sharded_ddp", "simple"], ["--fsdp", "full_shard", "--fsdp_config", str(tmp_path / "fsdp.json")]):
        flags = ExtArgumentParser(ExtTrainingArguments).parse_args([*common, *backend])
        before = dict(vars(flags))
        assert flag_problems(flags) == [] and vars(flags) == before, backend
    args = ExtTrainingArguments(output_dir=str(tmp_path), class_weights="1,3", warmup_ratio=0.1, sharded_ddp="simple",
                                checkpoint_storage_options="{}")
    assert (args.class_weights, args.warmup_steps, args.sharded_ddp, args.checkpoint_storage_options) == \
        ([1.0, 3.0], 0.1, ["simple"], {})


def test_apex_backend_needs_apex(tmp_path):
    """--fp16_backend apex without apex installed must stop at parse time with the install hint, not mid-setup."""
    with pytest.raises(ArgumentsError, match="apex is not installed"):
        ExtTrainingArguments(output_dir=str(tmp_path), fp16_backend="apex")


# Packages absent from this environment (checked, never mocked): each flag's value needs one of them.
NEEDS_A_MISSING_PACKAGE = [
    (["--use_liger_kernel"], "liger_kernel",
     "--use_liger_kernel true: needs liger_kernel, which is not installed: pip install liger-kernel"),
    (["--optim", "adamw_bnb_8bit"], "bitsandbytes",
     "--optim adamw_bnb_8bit: needs bitsandbytes, which is not installed: pip install bitsandbytes"),
    (["--report_to", "wandb"], "wandb", "--report_to wandb: needs wandb, which is not installed: pip install wandb"),
]


def absent(*modules):
    for module in modules:
        if importlib.util.find_spec(module) is not None:
            pytest.skip(f"{module} is installed here: the check needs it absent")


@pytest.mark.parametrize("argv,module,message", NEEDS_A_MISSING_PACKAGE,
                         ids=[module for _, module, _ in NEEDS_A_MISSING_PACKAGE])
def test_a_flag_whose_package_is_missing_stops_at_parsing_in_one_line(tmp_path, capsys, argv, module, message):
    """--use_liger_kernel, an --optim or a --report_to whose package is not installed would end in transformers'
    ImportError traceback once the data and model are loaded; it must be one line with the pip command, exit 2."""
    absent(module)
    with pytest.raises(SystemExit) as stopped:
        ExtArgumentParser(ExtTrainingArguments, prog="train.py").parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), *argv])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines()[0] == f"train.py: error: {message}"


def test_every_missing_package_is_named_at_once_in_training_not_in_ds_config(tmp_path, capsys):
    """Each missing package found by its own failed run; and `trainer-ext ds-config`, which renders a GPU cluster's
    config on a login node, refusing flags for packages only the training machines need."""
    from trainer_ext import cli

    absent(*(module for _, module, _ in NEEDS_A_MISSING_PACKAGE))
    argv = [word for flags, _, _ in NEEDS_A_MISSING_PACKAGE for word in flags]
    with pytest.raises(ArgumentsError) as refused:
        ExtTrainingArguments(output_dir=str(tmp_path), use_liger_kernel=True, optim="adamw_bnb_8bit",
                             report_to=["wandb"])
    assert str(refused.value).splitlines() == [message for _, _, message in NEEDS_A_MISSING_PACKAGE]
    assert cli.main(["ds-config", "--deepspeed", "zero2_minimal", *argv]) in (0, None)
    assert json.loads(capsys.readouterr().out)["zero_optimization"]["stage"] == 2


def test_the_optim_table_knows_every_transformers_optimizer_and_its_package(tmp_path):
    """A transformers release adding an --optim that needs a package (or moving one) would slip past the check: every
    OptimizerNames value is in the table or needs nothing (transformers builds it here), and each one the table says
    needs a package that is absent here fails in transformers itself, naming that package."""
    from transformers import Trainer, TrainingArguments
    from transformers.training_args import OptimizerNames

    from trainer_ext.config.checks import OPTIM_IN_TORCH, OPTIM_PACKAGES

    names = {name.value for name in OptimizerNames}
    assert not set(OPTIM_PACKAGES) & set(OPTIM_IN_TORCH)
    assert names == set(OPTIM_PACKAGES) | set(OPTIM_IN_TORCH), names ^ (set(OPTIM_PACKAGES) | set(OPTIM_IN_TORCH))
    model = tiny_bert()
    for name in sorted(names):
        args = TrainingArguments(output_dir=str(tmp_path), optim=name, use_cpu=True, report_to="none")
        package = OPTIM_PACKAGES.get(name)
        if package is None:
            Trainer.get_optimizer_cls_and_kwargs(args, model)  # torch's or transformers' own: builds here
        elif package.missing():
            with pytest.raises((ImportError, ValueError)) as failed:
                Trainer.get_optimizer_cls_and_kwargs(args, model)
            assert any(word in str(failed.value) for word in (*package.modules, package.install.split()[-1])), name


def test_the_report_to_table_knows_every_transformers_integration():
    """A transformers release adding a --report_to integration would leave its package unchecked."""
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    from trainer_ext.config.checks import REPORT_TO_PACKAGES

    assert set(INTEGRATION_TO_CALLBACK) - {"kubeflow"} == set(REPORT_TO_PACKAGES)  # kubeflow: a variable, not a package


def test_warmup_ratio_is_the_transformers_5_float_warmup(tmp_path):
    """Classic v4 commands pass --warmup_ratio; transformers 5 only knows a float --warmup_steps."""
    args = ExtTrainingArguments(output_dir=str(tmp_path), warmup_ratio=0.1)
    assert args.warmup_steps == 0.1 and args.get_warmup_steps(200) == 20
    with pytest.raises(ArgumentsError, match="--warmup_ratio 0.1 and --warmup_steps 5"):
        ExtTrainingArguments(output_dir=str(tmp_path), warmup_ratio=0.1, warmup_steps=5)
    with pytest.raises(ArgumentsError, match="--warmup_ratio 0.1 and --warmup_steps 0 both set"):  # 0 typed too
        ExtTrainingArguments(output_dir=str(tmp_path), warmup_ratio=0.1, warmup_steps=0)
    with pytest.raises(SystemExit):  # the same on the command line
        ExtArgumentParser(ExtTrainingArguments).parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--warmup_steps", "0", "--warmup_ratio", "0.1"])
    with pytest.raises(ArgumentsError, match=r"\[0, 1\)"):
        ExtTrainingArguments(output_dir=str(tmp_path), warmup_ratio=1.5)


def test_a_parse_that_passes_every_field_keeps_the_differs_from_default_rule(tmp_path):
    """Plain HfArgumentParser (or a rebuild from to_dict()) passes every field: taking all as typed would turn every
    flag a DeepSpeed file also sets into a conflict; ExtArgumentParser knows the command line."""
    from transformers import HfArgumentParser

    from trainer_ext import ExtArgumentParser

    argv = ["--output_dir", str(tmp_path), "--learning_rate", "5e-5"]
    (plain,) = HfArgumentParser(ExtTrainingArguments).parse_args_into_dataclasses(argv)
    assert plain.flags_given is None
    (ours,) = ExtArgumentParser(ExtTrainingArguments).parse_args_into_dataclasses(argv)
    assert {"output_dir", "learning_rate"} <= ours.flags_given and "adam_beta1" not in ours.flags_given
    assert ExtTrainingArguments(output_dir=str(tmp_path)).flags_given == {"output_dir"}


@pytest.fixture(scope="module")
def parse_failures(request):
    """parse_args.py on the selected cases of the two tests below, forked from one process that loaded its modules:
    " ".join(argv) -> CompletedProcess."""
    root = scratch(request, "parse")
    cases = [*selected(request, "test_bad_flags_fail_at_parsing_with_exit_2", "argv"),
             *selected(request, "test_fp16_without_cuda_fails_before_work_suggesting_bf16", "argv")]
    return run_forked({" ".join(argv): ([PYTHON, SCRIPT, "--output_dir", root / str(number), *argv], None)
                       for number, argv in enumerate(cases)})


@pytest.mark.deepspeed
@pytest.mark.launch
@pytest.mark.parametrize("argv,message", [
    (["--sharded_ddp", "simple", "zero_dp_2"], "--sharded_ddp"),
    (["--sharded_ddp", "zero_dp_3", "--deepspeed", "zero2"], "--deepspeed"),
    (["--shardedddp", "simple"], "did you mean --sharded_ddp?"),
    (["--fp16_backend", "amq"], "--fp16_backend"),
    (["--deepspeed", '{"zero_optimisation": {"stage": 2}}'], "did you mean 'zero_optimization'?"),
    (["--deepspeed", "zero2", "--learning_rate", "1e-4"], "--learning_rate 0.0001"),
])
def test_bad_flags_fail_at_parsing_with_exit_2(parse_failures, argv, message):
    """Bad flags must stop the script before any work, with the option named."""
    out = parse_failures[" ".join(argv)]
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr
    assert "ARGS" not in out.stdout


@pytest.mark.deepspeed
@pytest.mark.launch
def test_classic_config_values_reach_the_arguments(tmp_path):
    """The classic file's lr, betas, weight decay and warmup must reach the arguments (fp16 made "auto" on CPU)."""
    classic = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    classic["fp16"]["enabled"] = "auto"
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(classic))
    inline = json.dumps({"zero_optimization": {"stage": 2}, "train_batch_size": "auto"})
    run_many({"a": ([PYTHON, SCRIPT, "--output_dir", tmp_path / "a", "--deepspeed", path], None),
              "b": ([PYTHON, SCRIPT, "--output_dir", tmp_path / "b", "--deepspeed", inline,
                     "--per_device_train_batch_size", "3"], None)})
    args = parsed(tmp_path / "a")[0]
    assert (args["fp16"], args["learning_rate"], args["adam_beta1"], args["weight_decay"],
            args["warmup_steps"]) == (False, 3e-5, 0.8, 3e-7, 500)
    assert args["deepspeed"]["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    args = parsed(tmp_path / "b")[0]
    assert args["deepspeed"]["train_batch_size"] == 3


@pytest.mark.launch
@pytest.mark.deepspeed
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the machine without CUDA")
@pytest.mark.parametrize("argv,extra", [(["--fp16"], None),
                                        (["--deepspeed", "zero2"], "the DeepSpeed file's fp16.enabled")])
def test_fp16_without_cuda_fails_before_work_suggesting_bf16(parse_failures, argv, extra):
    """fp16 on a CPU machine would crash deep inside training; say so at parse time and name the way out."""
    out = parse_failures[" ".join(argv)]
    assert out.returncode == 2 and "ARGS" not in out.stdout
    assert "fp16 needs a CUDA device" in out.stderr and "--bf16" in out.stderr
    if extra:
        assert extra in out.stderr


@pytest.mark.launch
def test_torch_distributed_launch_passes_local_rank(tmp_path):
    """The classic launcher passes --local-rank=N; a parser that rejects it breaks every v4 command."""
    out = run([PYTHON, "-m", "torch.distributed.launch", "--nproc_per_node", "2", "--master_port", free_port(),
               SCRIPT, "--output_dir", tmp_path, "--sharded_ddp", "simple"])
    ranks = parsed(tmp_path)
    assert sorted(ranks) == [0, 1], out.stderr[-3000:]
    assert [ranks[r]["local_rank"] for r in (0, 1)] == [0, 1]
    assert all(ranks[r]["world_size"] == 2 and ranks[r]["sharded_ddp"] == ["simple"] for r in (0, 1))


@pytest.mark.launch
def test_torchrun_forms_one_group_on_cpu(tmp_path):
    """Stock transformers leaves each CPU rank alone under torchrun: N independent runs, silently."""
    out = run([BIN / "torchrun", "--nproc_per_node", "2", "--master_port", free_port(), SCRIPT,
               "--output_dir", tmp_path])
    ranks = parsed(tmp_path)
    assert sorted(ranks) == [0, 1], out.stderr[-3000:]
    assert all(ranks[r]["world_size"] == 2 for r in (0, 1))
    assert all(ranks[r]["threads"] == 1 for r in (0, 1))  # torchrun's OMP_NUM_THREADS=1, left as it is


@pytest.mark.deepspeed
@pytest.mark.launch
def test_deepspeed_launcher_local_rank_and_batch_fields(tmp_path):
    """The deepspeed launcher passes --local_rank=N; the batch fields must use its world size."""
    out = run([BIN / "deepspeed", "--num_gpus", "2", "--master_port", free_port(), SCRIPT,
               "--output_dir", tmp_path, "--deepspeed", "zero2_minimal", "--per_device_train_batch_size", "4",
               "--gradient_accumulation_steps", "3"])
    ranks = parsed(tmp_path)
    assert sorted(ranks) == [0, 1], out.stderr[-3000:]
    for rank in (0, 1):
        assert ranks[rank]["local_rank"] == rank and ranks[rank]["world_size"] == 2
        assert ranks[rank]["deepspeed"]["train_batch_size"] == 24
        # The deepspeed launcher sets no OMP_NUM_THREADS: each CPU rank gets its share of the cores, not all.
        assert ranks[rank]["threads"] == max(1, len(os.sched_getaffinity(0)) // 2)


def test_cpu_ranks_share_the_cores_unless_the_user_chose(monkeypatch):
    """N ranks each running one thread per core oversubscribe the machine N times."""
    import torch

    from trainer_ext.environment.launcher import share_cores_between_cpu_ranks

    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        monkeypatch.setenv("LOCAL_SIZE", "2")  # the deepspeed launcher's name for it
        cores = len(os.sched_getaffinity(0))
        assert share_cores_between_cpu_ranks() == max(1, cores // 2) == torch.get_num_threads()
        assert os.environ["OMP_NUM_THREADS"] == str(max(1, cores // 2))
        assert share_cores_between_cpu_ranks() is None  # a number the user (or torchrun) set is kept
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setenv("LOCAL_SIZE", "1")
        assert share_cores_between_cpu_ranks() is None  # one rank keeps every core
    finally:
        torch.set_num_threads(before)


@pytest.mark.launch
@pytest.mark.deepspeed
@pytest.mark.fairscale
def test_building_the_arguments_touches_nothing_stock_arguments_do_not(tmp_path):
    """ExtTrainingArguments(...) in a notebook must be a value: for DDP, a ZeRO-2 and a ZeRO-3 file, --sharded_ddp
    simple, --fsdp full_shard, --checkpoint_uri and inside a SageMaker job, building it in a fresh process changes no
    environment variable, file (a watched folder, a stale op-build lock and /dev/shm buffer) or process group beyond
    what stock TrainingArguments with the same stock flags change; prepare_process does the set-up, once a process
    (also for the same arguments loaded back from training_args.bin)."""
    out = run([PYTHON, REPO / "tests" / "scripts" / "args_side_effects.py", tmp_path], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("REPORT "))[7:])
    assert report["ext"].keys() == {"ddp", "deepspeed zero2 file", "deepspeed zero3 file", "sharded_ddp simple",
                                    "fsdp full_shard", "checkpoint_uri", "sagemaker job"}
    for case, changed in report["ext"].items():
        assert changed == {"env": {}, "files": []}, (case, changed)
    # what stock TrainingArguments itself changes in a fresh process (docs/configuration.md says so)
    assert set(report["stock"]["fsdp full_shard"]["env"]) == {"FSDP_CPU_RAM_EFFICIENT_LOADING"}
    assert not any("group" in changed or changed["files"] for changed in report["stock"].values())
    ddp, zero2, again, loaded = report["prepare_process"]
    cores = len(os.sched_getaffinity(0))
    # A DDP run's set-up: only each CPU rank's share of the cores (LOCAL_SIZE=2 above). DeepSpeed is installed but
    # does not train: neither its accelerator choice nor what its import sets (PYTORCH_NVML_BASED_CUDA_CHECK: the
    # config checks of the ZeRO arguments built above imported it and took it back).
    assert ddp["env"] == {"OMP_NUM_THREADS": [None, str(max(1, cores // 2))]}
    # A ZeRO-2 run's: DeepSpeed's CPU accelerator, what its import set given back (a test worker that imported
    # DeepSpeed itself passes PYTORCH_NVML_BASED_CUDA_CHECK on already set: then it does not change), a 1-rank group.
    assert {"RANK", "WORLD_SIZE", "MASTER_PORT"} <= zero2["env"].keys() and zero2["group"] == [False, True]
    assert zero2["env"]["DS_ACCELERATOR"] == [None, "cpu"]
    assert zero2["env"].get("PYTORCH_NVML_BASED_CUDA_CHECK", [None, "1"])[1] == "1"
    assert report["world_size"] == 1 and again == {"env": {}, "files": []}
    # the same settings loaded back in the process that prepared them: nothing again (RunSettings.prepared_in)
    prepared, loaded_prepared = report["prepared_in"]
    assert loaded == {"env": {}, "files": []} and prepared == loaded_prepared and prepared is not None


def test_the_old_module_paths_still_load_saved_arguments_and_scripts():
    """Every training_args.bin names the class's module when it was saved: trainer_ext.args (before 2026-11-24 and
    since 2026-11-28) or trainer_ext.config.flags (in between); the docs told users to import
    trainer_ext.experiment.run_experiment: without them a saved run's arguments no longer load (torch.load) and such a
    script stops at its import."""
    import pickle

    from trainer_ext.experiment import run_experiment
    from trainer_ext.experiment import run_experiment as old_run_experiment

    assert pickle.loads(b"ctrainer_ext.args\nExtTrainingArguments\n.") is ExtTrainingArguments
    assert pickle.loads(b"ctrainer_ext.config.flags\nExtTrainingArguments\n.") is ExtTrainingArguments
    assert ExtTrainingArguments.__module__ == "trainer_ext.args"  # what a run saves now
    assert old_run_experiment is run_experiment


def test_storage_credentials_are_hidden_wherever_the_arguments_are_shown(tmp_path):
    """--checkpoint_storage_options may hold keys: every rendering of the arguments (logs, to_json_string, TensorBoard's
    hparams, W&B/MLflow's to_dict, --check, a command line, an error) shows "<hidden>" instead, keeps what helps debug
    (endpoint, signature version), and the run itself gets the real values. Otherwise transformers' own rendering:
    hub_token hidden, and str() the same as TrainingArguments' when there is nothing to hide."""
    from transformers import TrainingArguments

    from trainer_ext.config.checks import parse_storage_options, shown_flags

    secrets = ["AKIA-key-1", "s3cr3t-2", "nested-3", "url-pw-4", "hf-token-5"]
    options = {"key": secrets[0], "secret": secrets[1], "config_kwargs": {"signature_version": "s3v4"},
               "client_kwargs": {"aws_secret_access_key": secrets[2], "endpoint_url": f"http://me:{secrets[3]}@h:9000"}}
    args = ExtTrainingArguments(output_dir=str(tmp_path), report_to="none", hub_token=secrets[4],
                                checkpoint_storage_options=json.dumps(options))
    assert args.checkpoint_storage_options == options
    for text in (str(args), repr(args), f"{args}", json.dumps(args.to_dict()), args.to_json_string(),
                 str(args.to_sanitized_dict()), " ".join(shown_flags(["--checkpoint_storage_options",
                                                                      json.dumps(options)]))):
        assert not [secret for secret in secrets[:4] if secret in text], text
        assert "http://me:<hidden>@h:9000" in text and "s3v4" in text
    assert secrets[4] not in str(args) and args.to_dict()["hub_token"] == "<HUB_TOKEN>"
    for text in ('{"secret": "s3cr3t-2",', '["s3cr3t-2"]'):
        with pytest.raises(ArgumentsError, match="--checkpoint_storage_options") as raised:
            parse_storage_options(text)
        assert "s3cr3t-2" not in str(raised.value)
    plain = ExtTrainingArguments(output_dir=str(tmp_path), report_to="none")
    assert str(plain) == TrainingArguments.__str__(plain)
