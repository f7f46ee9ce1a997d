"""`trainer-ext ds-config` renders, explains, and rejects bad input with exit status 2 (real processes)."""

import json

import pytest

from conftest import BIN, run_forked, scratch

CLI = BIN / "trainer-ext"


# Each test's `trainer-ext` commands (after the program's name), by key: the selected tests' commands all run in one
# fixture, forked from one process that loaded the CLI's modules (each ends after parsing: start-up was most of its
# time). BAD_FILE: a file holding cut JSON.
BAD_FILE = "{bad.json}"
COMMANDS = {
    "test_prints_complete_config_for_target_cluster": {
        "cluster": ["ds-config", "--deepspeed", "ds_configs/zero2.json", "--world_size", "8", "--num_training_steps",
                    "1000", "--per_device_train_batch_size", "4"]},
    "test_fp16_renders_on_a_cpu_only_machine": {
        "fp16": ["ds-config", "--deepspeed", "zero2_minimal", "--fp16", "--world_size", "16", "--max_steps", "5000",
                 "--warmup_ratio", "0.1"]},
    "test_explain_names_the_source_of_each_field": {
        "explain conflict": ["ds-config", "--deepspeed", "zero2", "--bf16", "--world_size", "2",
                             "--num_training_steps", "10", "--explain"],
        "explain zero2": ["ds-config", "--deepspeed", "zero2", "--per_device_train_batch_size", "4", "--world_size",
                          "2", "--num_training_steps", "10", "--explain"],
        "explain minimal": ["ds-config", "--deepspeed", "zero2_minimal", "--world_size", "2", "--num_training_steps",
                            "10", "--explain"]},
    "test_bad_input_exits_2_with_message_on_stderr": {
        "line 1, column": ["ds-config", "--deepspeed", BAD_FILE],
        "--learning_rate 0.001": ["ds-config", "--deepspeed", "zero2", "--learning_rate", "1e-3", "--world_size", "2",
                                  "--num_training_steps", "9"],
        "did you mean --learning_rate?": ["ds-config", "--deepspeed", "zero2_minimal", "--learning_rat", "1e-3"],
        "presets": ["ds-config", "--deepspeed", "nope"],
        "--num_training_steps": ["ds-config", "--deepspeed", "zero2_minimal", "--warmup_steps", "10"],
        "--fp16_backend apex": ["ds-config", "--deepspeed", "zero2_minimal", "--fp16_backend", "apex", "--fp16"]},
    "test_flags_training_refuses_are_refused": {
        " ".join(argv): ["ds-config", "--deepspeed", "zero2_minimal", "--num_training_steps", "10", *argv]
        for argv in (["--world_size", "0"], ["--world_size", "-3"], ["--sharded_ddp", "simple"])},
    "test_every_refused_flag_is_one_line": {
        "refused": ["ds-config", "--deepspeed", "zero2_minimal", "--world_size", "0", "--learning_rate", "-1",
                    "--sharded_ddp", "simple"]},
    "test_a_flag_typed_at_its_default_conflicts_with_the_file": {
        "typed default": ["ds-config", "--deepspeed", "zero2", "--learning_rate", "5e-5", "--world_size", "2",
                          "--num_training_steps", "10"]},
    "test_unknown_command_suggests_the_closest": {"ds-conifg": ["ds-conifg"]},
}


@pytest.fixture(scope="module")
def ran(request):
    """key -> CompletedProcess of the COMMANDS of this module's selected tests."""
    bad = scratch(request, "cli") / "bad.json"
    bad.write_text('{"zero_optimization": {"stage": 2}')
    names = {item.originalname for item in request.session.items if item.module is request.module}
    return run_forked({key: ([CLI, *[bad if word == BAD_FILE else word for word in argv]], None)
                       for name in sorted(names & set(COMMANDS)) for key, argv in COMMANDS[name].items()},
                      preload=["trainer_ext.args", "trainer_ext.deepspeed_config"])


@pytest.mark.launch
def test_prints_complete_config_for_target_cluster(ran):
    """ds-config on a login node must print the whole config the 8-rank cluster will run, no "auto" left."""
    out = ran["cluster"]
    assert out.returncode == 0, out.stderr
    config = json.loads(out.stdout)
    assert config["train_batch_size"] == 32 and config["fp16"]["enabled"] is True
    assert "auto" not in out.stdout


@pytest.mark.launch
def test_fp16_renders_on_a_cpu_only_machine(ran):
    """Rendering for a GPU cluster from a CPU login node must not need the cluster's devices."""
    out = ran["fp16"]
    assert out.returncode == 0, out.stderr
    config = json.loads(out.stdout)
    assert config["fp16"]["enabled"] is True and config["train_batch_size"] == 128
    assert config["scheduler"]["params"]["warmup_num_steps"] == 500


@pytest.mark.launch
def test_explain_names_the_source_of_each_field(ran):
    """--explain must say where each value came from (file, flag, default, derived), or a surprise cannot be traced."""
    assert ran["explain conflict"].returncode == 2  # the classic file enables fp16, --bf16 conflicts
    out = ran["explain zero2"]
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line and not line.startswith(("note", "flags"))}
    assert "file" in lines["optimizer.params.lr"] and "--learning_rate" in lines["optimizer.params.lr"]
    assert "flag --per_device_train_batch_size" in lines["train_micro_batch_size_per_gpu"]
    assert "derived" in lines["train_batch_size"]
    assert lines["zero_optimization.stage"].split()[-1] == "file"  # zero2.json writes the stage
    assert "file (--fp16 left at default" in lines["fp16.enabled"] and "default --bf16" in lines["bf16.enabled"]
    assert "note: legacy zero_optimization.cpu_offload" in out.stdout
    assert "--learning_rate 3e-05" in out.stdout  # flags taken from the file
    out = ran["explain minimal"]
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line and not line.startswith(("note", "flags"))}
    assert "default --fp16" in lines["fp16.enabled"], lines["fp16.enabled"]  # it said "file" for a file without fp16


@pytest.mark.launch
def test_bad_input_exits_2_with_message_on_stderr(ran):
    """`ds-config > ds.json` with bad input must leave stdout empty and say why on stderr, with exit status 2."""
    for expected in COMMANDS["test_bad_input_exits_2_with_message_on_stderr"]:  # each key is what stderr must hold
        out = ran[expected]
        assert out.returncode == 2, (out.args, out.stdout)
        assert expected in out.stderr, (out.args, out.stderr)
        assert out.stdout == ""


@pytest.mark.launch
@pytest.mark.parametrize("argv,expected", [
    (["--world_size", "0"], "--world_size 0: must be at least 1"),
    (["--world_size", "-3"], "--world_size -3: must be at least 1"),
    (["--sharded_ddp", "simple"], "--sharded_ddp simple and --deepspeed both choose a backend"),
])
def test_flags_training_refuses_are_refused(ran, argv, expected):
    """ds-config printed train_batch_size 0 / -24, or a config for two backends, where training stops with exit 2."""
    out = ran[" ".join(argv)]
    assert out.returncode == 2 and out.stdout == "", out.stdout
    assert expected in out.stderr and "Traceback" not in out.stderr


@pytest.mark.launch
def test_every_refused_flag_is_one_line(ran):
    """One problem per run would cost a relaunch per flag."""
    out = ran["refused"]
    assert out.returncode == 2
    lines = out.stderr.splitlines()
    for expected in ("--world_size 0", "--learning_rate -1.0: must be >= 0", "--sharded_ddp simple and --deepspeed"):
        assert len([line for line in lines if expected in line]) == 1, out.stderr


@pytest.mark.launch
def test_a_flag_typed_at_its_default_conflicts_with_the_file(ran):
    """ds-config must render what training would run: a typed --learning_rate 5e-5 is not the file's 3e-5."""
    out = ran["typed default"]
    assert out.returncode == 2 and out.stdout == ""
    assert "optimizer.params.lr=3e-05 in the file disagrees with --learning_rate 5e-05" in out.stderr


@pytest.mark.launch
def test_unknown_command_suggests_the_closest(ran):
    """A mistyped subcommand (ds-conifg) must exit 2 suggesting the right one."""
    out = ran["ds-conifg"]
    assert out.returncode == 2 and "unknown command 'ds-conifg', did you mean 'ds-config'?" in out.stderr


def test_the_experiment_file_is_found_among_flags_before_it():
    """`trainer-ext train --max_steps 5 exp.yaml` read 5 as the experiment file."""
    from trainer_ext.cli import experiment_first

    assert experiment_first(["--max_steps", "5", "exp.yaml", "--check"]) == ["exp.yaml", "--max_steps", "5", "--check"]
    assert experiment_first(["a.yml", "--max_steps", "5"]) == ["a.yml", "--max_steps", "5"]
    assert experiment_first(["--max_steps", "5", "a.yaml", "b.yaml"]) == ["--max_steps", "5", "a.yaml", "b.yaml"]


def test_search_check_prints_the_storage_url_without_its_password():
    """`trainer-ext search --check` printed the study storage URL with its password."""
    from trainer_ext.cli import search_as_checked
    from trainer_ext.search.space import SearchSettings

    settings = SearchSettings(space={}, metric="eval_accuracy", direction="maximize", study_name="s", study_dir="s",
                              storage="postgresql+psycopg://tuner:s3cret@db:5432/studies")
    printed = search_as_checked(settings)
    assert "s3cret" not in printed and "storage: postgresql+psycopg://tuner:***@db:5432/studies" in printed
    assert settings.storage.endswith("tuner:s3cret@db:5432/studies")  # what the workers use keeps it


@pytest.mark.launch  # loads the ops the session's `trainer-ext build-ops` built (compiles them where it could not)
@pytest.mark.deepspeed
def test_build_ops_only_loads_ops_already_built(capsys):
    """`trainer-ext build-ops` run again (README says to run it once per environment) must load, not rebuild, and
    build only the ops named with --only."""
    from trainer_ext.cli import main

    assert main(["build-ops", "--only", "cpu_adam"]) == 0
    out = capsys.readouterr().out
    assert "cpu_adam: built already, loading" in out
    assert "the ops named are built" in out and "fused_adam" not in out and "deepspeed_shm_comm" not in out
