"""Every mistake in a user's input or environment ends with one clear message naming the flag, file or variable,
exit status 2 and no traceback, before anything is written (README: "When something is wrong"); TRAINER_EXT_DEBUG=1
shows the traceback. Each case is a real process, as a user would meet it."""

import hashlib
import shutil

import pytest

from conftest import (ACCUMULATE, GLUE_COMMON, PYTHON, REPO, TINY_TRAIN, copy_checkpoint, free_port, run, run_forked,
                      scratch, selected)

pytestmark = [pytest.mark.launch, pytest.mark.deepspeed, pytest.mark.model_package]

GLUE = REPO / "examples" / "run_glue.py"
OWN = REPO / "tests" / "scripts" / "own_script.py"
FAST = ["--max_steps", 2, "--max_train_samples", 32, "--max_seq_length", 32, "--report_to", "none"]
MISSING = "/nonexistent/trainer_ext"

# id -> (script and flags after --output_dir OUT, the phrase the message must hold, extra environment)
CASES = {
    # flags, at parse time
    "misspelled flag": (["--do_train", "--learning_rat", "1e-4"], "did you mean --learning_rate", {}),
    "misspelled --sharded_ddp option": (["--sharded_ddp", "simpel"], "did you mean 'simple'", {}),
    "two backends": (["--sharded_ddp", "simple", "--deepspeed", "zero2_minimal"], "both choose a backend", {}),
    "fully sharded on a CPU machine": (["--sharded_ddp", "zero_dp_2"], "needs CUDA", {}),
    "fp16 on a CPU machine": (["--fp16"], "fp16 needs a CUDA device", {}),
    "warmup ratio out of range": (["--warmup_ratio", "1.5"], "a ratio must be in [0, 1)", {}),
    "class weights not numbers": (["--class_weights", "1,x"], "give numbers separated by commas", {}),
    "storage options not JSON": (["--checkpoint_storage_options", "{bad"], "is not JSON", {}),
    "batch size 0": (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size 0: must be a positive", {}),
    "negative learning rate": (["--learning_rate", "-1"], "--learning_rate -1.0: must be >= 0", {}),
    "max_steps not a number": (["--max_steps", "six"], "invalid int value: 'six'", {}),
    "transformers' own check": (["--do_train", "--load_best_model_at_end", "--eval_strategy", "steps",
                                 "--save_strategy", "epoch"], "load_best_model_at_end", {}),
    "output_dir is a file": (["--output_dir", str(REPO / "README.md")], "is a file, not a folder", {}),
    # DeepSpeed files
    "DeepSpeed file missing": (["--deepspeed", "nope.json"], "no such file, and not a preset", {}),
    "DeepSpeed file not JSON": (["--deepspeed", '{"zero_optimization": '], "invalid JSON", {}),
    "DeepSpeed key misspelled": (["--deepspeed", '{"zero_optimisation": {"stage": 2}}'],
                                 "did you mean 'zero_optimization'", {}),
    "DeepSpeed batch disagrees": (["--deepspeed", '{"train_batch_size": 7}', "--per_device_train_batch_size", "4"],
                                  "train_batch_size=7 in the file cannot hold", {}),
    # paths and data, before the model is loaded
    "resume from a missing checkpoint": (["--do_train", "--resume_from_checkpoint", f"{MISSING}/checkpoint-99"],
                                         "no such folder", {}),
    "unknown remote protocol": (["--do_train", "--checkpoint_uri", "nope://bucket/run"], "Protocol not known", {}),
    "unreachable remote endpoint": (["--do_train", "--checkpoint_uri", "s3://bucket/run"], "check the endpoint",
                                    {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y",
                                     "AWS_ENDPOINT_URL": "http://127.0.0.1:{closed_port}"}),
    "training file missing": (["--do_train", "--train_file", f"{MISSING}.jsonl"], "no such data file", {}),
    "text column missing": (["--do_train", "--text_column", "nope"], "--text_column 'nope'", {}),
    "class weights per label": (["--do_train", "--class_weights", "1,2,3"], "3 values but the training data has 2",
                                {}),
    "model folder missing": (["--do_train", "--model_name_or_path", MISSING], "no such model folder", {}),
    "model from the Hub, offline": (["--do_train", "--model_name_or_path", "bert-base-uncased"], "a Hub name", {}),
    "dataset from the Hub, offline": (["--do_train", "--dataset_name", "glue"], "--dataset_name glue: cannot read", {}),
}


@pytest.fixture(scope="module")
def case_runs(request):
    """The selected cases' processes, forked from one that loaded run_glue.py's modules (each ends at parsing or at the
    data and model checks: start-up was most of its time); case -> (its output_dir, CompletedProcess)."""
    root, commands, output_dirs = scratch(request, "cases"), {}, {}
    for number, case in enumerate(selected(request, "test_user_error_is_one_line_exit_2_nothing_written", "case")):
        flags, _, env = CASES[case]
        (root / str(number)).mkdir()
        output_dirs[case] = root / str(number) / "out"
        commands[case] = ([PYTHON, GLUE, "--output_dir", output_dirs[case], *FAST, *flags],
                          {key: value.format(closed_port=free_port()) for key, value in env.items()})
    done = run_forked(commands)
    return {case: (output_dirs[case], done[case]) for case in commands}


@pytest.mark.parametrize("case", list(CASES))
def test_user_error_is_one_line_exit_2_nothing_written(case_runs, case):
    """Each common mistake must end in one error line and exit 2 before output_dir is created, not a traceback."""
    output_dir, out = case_runs[case]
    assert out.returncode == 2, out.stderr[-3000:]
    assert CASES[case][1] in out.stderr and "error:" in out.stderr
    assert "Traceback" not in out.stderr
    assert not output_dir.exists()


def test_another_backends_checkpoint_is_named_before_it_trains(accumulate_runs, tmp_path):
    """A DDP checkpoint resumed with --deepspeed died in transformers' `Can't find a valid checkpoint` traceback after
    the model was built; a ZeRO-2 one resumed without it trained on in silence with a new optimizer. One line each,
    naming the backend that wrote it and the choices (DeepSpeed cannot continue weights alone: said too); the checkpoint
    untouched."""
    ddp = copy_checkpoint(accumulate_runs / "single", 6, tmp_path / "ddp")
    zero2 = copy_checkpoint(accumulate_runs / "zero2", 3, tmp_path / "zero2")
    before = {folder: contents(folder) for folder in (ddp, zero2)}
    common = [*GLUE_COMMON, *ACCUMULATE, "--per_device_train_batch_size", 8]
    deepspeed = [PYTHON, GLUE, "--output_dir", ddp, *common, "--deepspeed", "zero2_minimal"]
    out = run_forked({"ddp": (deepspeed, None), "weights only": ([*deepspeed, "--resume_weights_only"], None),
                      "zero2": ([PYTHON, GLUE, "--output_dir", zero2, *common], None)})
    assert out["ddp"].returncode == 2 and "Traceback" not in out["ddp"].stderr
    assert f"{ddp / 'checkpoint-6'} was written by ddp, whose optimizer state deepspeed ZeRO-2 cannot read: resume it " \
           "without --deepspeed (plain DDP wrote it), pass --resume_weights_only" in out["ddp"].stderr
    assert out["weights only"].returncode == 2 and "and deepspeed ZeRO-2 resumes only from its own checkpoints: start " \
        f"a new run from its weights (--model_name_or_path {ddp / 'checkpoint-6'} in the examples" in out["weights only"].stderr
    assert out["zero2"].returncode == 2 and "Traceback" not in out["zero2"].stderr
    assert f"{zero2 / 'checkpoint-3'} was written by deepspeed ZeRO-2, whose optimizer state ddp cannot read: resume " \
           "it with --deepspeed, as it was written" in out["zero2"].stderr
    assert {folder: contents(folder) for folder in (ddp, zero2)} == before


@pytest.mark.parametrize("command,phrase", [
    (["train", f"{MISSING}.yaml"], "no such experiment file"),
    (["trian", "x.yaml"], "did you mean 'train'"),
    (["plan", "--num_parameters", "abc", "--world_size", "2"], "--num_parameters 'abc'"),
    (["ds-config", "--deepspeed", "zero2", "--learning_rate", "1e-4"], "optimizer.params.lr=3e-05 in the file disagrees"),
])
def test_cli_user_errors(command, phrase):
    """trainer-ext subcommands must answer mistakes the same way: a message naming it, exit 2, no traceback."""
    out = run([PYTHON, "-m", "trainer_ext", *command])
    assert out.returncode == 2 and phrase in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("opted_in", [False, True], ids=["as written", "with one_line_errors()"])
def test_own_script_with_stock_arguments_gets_the_same(tmp_path, opted_in):
    """A user's script with HfArgumentParser/TrainingArguments: ExtTrainer raises its one line as an exception (the
    library leaves the process's excepthook alone: Python's traceback ends with it, exit 1); with
    trainer_ext.one_line_errors() at the top the script ends with the line alone and exit 2."""
    flags = ["--output_dir", tmp_path / "out", "--max_steps", 2, "--report_to", "none", "--deepspeed",
             REPO / "ds_configs" / "zero2.json", "--use_cpu"]
    if opted_in:
        opening = ("import runpy, sys, trainer_ext; trainer_ext.one_line_errors(); sys.argv = sys.argv[1:]; "
                   "runpy.run_path(sys.argv[0], run_name='__main__')")
        out = run([PYTHON, "-c", opening, OWN, *flags])
        assert out.returncode == 2 and "fp16 needs a CUDA device" in out.stderr and "Traceback" not in out.stderr
    else:
        out = run([PYTHON, OWN, *flags])
        assert out.returncode == 1 and "Traceback" in out.stderr, out.stderr[-3000:]
        assert "DeepSpeedConfigError: " in out.stderr and "fp16 needs a CUDA device" in out.stderr


def test_debug_variable_shows_the_traceback(tmp_path):
    """With TRAINER_EXT_DEBUG=1 the full traceback must come back, for a bug report."""
    out = run([PYTHON, GLUE, "--output_dir", tmp_path / "out", *FAST, "--do_train", "--text_column", "nope"],
              env={"TRAINER_EXT_DEBUG": "1"})
    assert out.returncode != 0 and "Traceback" in out.stderr and "ArgumentsError: --text_column 'nope'" in out.stderr


# -- checkpoints the user points at ---------------------------------------------------------------------------

def contents(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def tiny_run(request):
    """A finished 2-step run of the config-built tiny BERT, a checkpoint per step."""
    output_dir = scratch(request, "tiny") / "run"
    out = run([PYTHON, TINY_TRAIN, "--output_dir", output_dir, "--max_steps", 2, "--save_steps", 1,
               "--report_to", "none", "--per_device_train_batch_size", 8])
    assert out.returncode == 0, out.stderr[-3000:]
    return output_dir


def checkpoint_case(tiny_run, tmp_path, command, phrase, prepare=None):
    run_dir = tmp_path / "run"
    shutil.copytree(tiny_run, run_dir)
    if prepare:
        prepare(run_dir)
    before = contents(run_dir)
    out = run([PYTHON, *[str(part).format(run=run_dir) for part in command]])
    assert out.returncode == 2, out.stderr[-3000:]
    assert phrase in out.stderr and "Traceback" not in out.stderr
    assert contents(run_dir) == before


def test_resume_from_a_damaged_checkpoint(tiny_run, tmp_path):
    """Resuming from a named damaged checkpoint must exit 2 naming the bad file and leave the run folder untouched."""
    def damage(run_dir):
        path = run_dir / "checkpoint-2" / "optimizer.pt"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))

    checkpoint_case(tiny_run, tmp_path, [TINY_TRAIN, "--output_dir", "{run}", "--max_steps", 4, "--report_to", "none",
                                         "--per_device_train_batch_size", 8, "--resume_from_checkpoint",
                                         "{run}/checkpoint-2"],
                    "optimizer.pt does not match the checksum", damage)


@pytest.mark.parametrize("value", ["true", "auto"])
def test_resume_from_checkpoint_true_or_auto_takes_the_newest(tiny_run, tmp_path, value):
    """`--resume_from_checkpoint true` passed the argument check, then failed at train time as a folder named 'true'."""
    run_dir = tmp_path / "run"
    shutil.copytree(tiny_run, run_dir)
    out = run([PYTHON, TINY_TRAIN, "--output_dir", run_dir, "--max_steps", 3, "--save_steps", 1, "--report_to", "none",
               "--per_device_train_batch_size", 8, "--resume_from_checkpoint", value])
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resuming from {run_dir / 'checkpoint-2'}" in out.stderr
    assert (run_dir / "checkpoint-3").is_dir()


def test_resume_with_another_model(tiny_run, tmp_path):
    """Resuming another model's checkpoint must exit 2 before training and leave the checkpoints untouched."""
    checkpoint_case(tiny_run, tmp_path, [GLUE, "--output_dir", "{run}", "--do_train", *FAST[:2], "--max_steps", 4],
                    "was written by a different model")


def test_resume_on_changed_data(tiny_run, tmp_path):
    """Resuming on a changed dataset must exit 2 naming the change, not train on wrongly skipped samples."""
    checkpoint_case(tiny_run, tmp_path, [TINY_TRAIN, "--output_dir", "{run}", "--max_steps", 4, "--report_to", "none",
                                         "--per_device_train_batch_size", 8, "--num_samples", 300],
                    "num_samples changed from 512 to 300")
