"""A user's first week (issue 35): flags from transformers 4 tutorials, --report_to and --config_overrides typos, their
own script's data, a full disk, the CLI's --version and plan, data files and commands that did nothing. Each case runs
in this process (the examples' main, ExtTrainer on a tiny model, trainer_ext.cli.main) and expects what a user sees:
one line naming the field, the value and the fix, exit status 2, before any work where the mistake allows."""

import ctypes
import dataclasses
import json
import os
import re
from pathlib import Path

import pytest
import torch

from conftest import REPO, tiny_bart_config, tiny_bert, user_error, write_lines
from trainer_ext import ExtArgumentParser, ExtTrainer, ExtTrainingArguments
from trainer_ext.errors import ArgumentsError, UserError

FAST = ["--max_steps", "2", "--report_to", "none", "--disable_tqdm", "true"]
SHORT = ["--max_seq_length", "32"]


def parse_error(capsys, tmp_path, *argv):
    """The parser's message for training flags that must be refused at parsing (exit 2)."""
    with pytest.raises(SystemExit) as stopped:
        ExtArgumentParser(ExtTrainingArguments, prog="train.py").parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path / "out"), *map(str, argv)])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "Traceback" not in err, err
    return err


def sentences(n, labels=(0, 1)):
    return [{"sentence": f"the movie was good number {i}", "label": labels[i % len(labels)]} for i in range(n)]


# -- --report_to -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, read", [("non_padding", "non_padding"), ("all", "all"), ("no", "no"),
                                         ("true", "non_padding"), ("false", "no")])
def test_tokens_seen_takes_its_words_from_the_command_line(tmp_path, value, read):
    """--include_num_input_tokens_seen non_padding (or all) was refused at parsing, "Truthy value expected":
    HfArgumentParser reads a `str | bool` field as a bool. Its words and true/false both parse now."""
    (args,) = ExtArgumentParser(ExtTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path / "out"), "--use_cpu", "true", "--include_num_input_tokens_seen", value])
    assert args.include_num_input_tokens_seen == read


def test_a_misspelled_tokens_seen_word_is_refused(tmp_path, capsys):
    """A word transformers does not know counted nothing, saying nothing."""
    err = parse_error(capsys, tmp_path, "--use_cpu", "true", "--include_num_input_tokens_seen", "nonpadding")
    assert "--include_num_input_tokens_seen nonpadding: choose non_padding" in err and "did you mean non_padding" in err


def test_report_to_names_are_checked_at_parsing(tmp_path, capsys):
    """--report_to tensorbord ended in transformers' ValueError traceback once data and model were loaded, with no
    suggestion; "tensorboard,none" and a v4-style "--report_to tensorboard wandb" too."""
    err = parse_error(capsys, tmp_path, "--report_to", "tensorbord")
    assert "--report_to tensorbord: not an integration transformers reports to, did you mean 'tensorboard'?" in err
    assert "(valid: all, none, azure_ml," in err
    assert "'none' stands alone" in parse_error(capsys, tmp_path, "--report_to", "tensorboard,none")
    assert "give several integrations separated by commas, e.g. --report_to tensorboard,wandb" in parse_error(
        capsys, tmp_path, "--report_to", "tensorboard", "wandb")
    with pytest.raises(ArgumentsError, match="did you mean 'none'"):
        ExtTrainingArguments(output_dir=str(tmp_path), report_to=["None"])
    # several, comma separated: the list transformers reads (the command line takes one word since transformers 5)
    args = ExtTrainingArguments(output_dir=str(tmp_path), report_to="tensorboard, kubeflow")
    assert args.report_to[:2] == ["tensorboard", "kubeflow"]
    sagemaker = ExtTrainingArguments(output_dir=str(tmp_path), report_to="['tensorboard']")  # str() of a list
    assert sagemaker.report_to[:1] == ["tensorboard"]


def test_report_to_typo_in_an_experiment_file_is_refused_by_check(tmp_path, capsys):
    """`trainer-ext train exp.yaml --check` printed report_to: [tensorbord] as valid (exit 0)."""
    from trainer_ext.cli import main

    status = main(["train", str(REPO / "experiments" / "classification.yaml"), "--report_to", "tensorbord", "--check"])
    assert status == 2 and "did you mean 'tensorboard'?" in capsys.readouterr().err


# -- --push_to_hub ------------------------------------------------------------------------------------------------------

def test_push_to_hub_where_the_hub_cannot_be_reached_is_one_line(tmp_path, capsys, monkeypatch):
    """--push_to_hub offline ended in huggingface_hub's OfflineModeIsEnabled traceback from Trainer.__init__, after data
    and model were loaded: refused at parsing when HF_HUB_OFFLINE is set (also for stock arguments, by ExtTrainer), and
    one line when the Hub cannot be reached otherwise."""
    import huggingface_hub.constants
    from transformers import TrainingArguments

    from conftest import free_port

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # what huggingface_hub read at import
    offline = "--push_to_hub: HF_HUB_OFFLINE is set, so nothing can reach the Hub: drop --push_to_hub"
    assert offline in parse_error(capsys, tmp_path, "--push_to_hub")
    stock = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, push_to_hub=True)
    with pytest.raises(UserError, match=re.escape(offline)):
        ExtTrainer(model=tiny_bert(), args=stock)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(UserError, match="--push_to_hub: the Hub repository could not be created \\(.*\\): check the "
                                        "network and your token"):
        ExtTrainer(model=tiny_bert(), args=ExtTrainingArguments(output_dir=str(tmp_path / "out"), report_to="none",
                                                                use_cpu=True, push_to_hub=True))


# -- flags transformers 5 removed --------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,phrase", [
    (["--save_safetensors", "false"], "--save_safetensors: transformers 5 removed it: checkpoints are always "
                                      "safetensors; drop it"),
    (["--evaluation_strategy", "steps"], "transformers 5 renamed it: use --eval_strategy"),
    (["--no_cuda"], "--no_cuda: transformers 5 removed it: use --use_cpu"),
    (["--overwrite_output_dir"], "pass --fresh_start to start over"),
    (["--logging_dir", "logs"], "TensorBoard writes under --output_dir/runs"),
    (["--lr", "1e-4"], "--lr: use --learning_rate"),
])
def test_flags_of_old_tutorials_say_what_to_type_instead(tmp_path, capsys, argv, phrase):
    """--save_safetensors false said "did you mean --save_steps?", --no_cuda nothing, --lr "did you mean --help?"."""
    err = parse_error(capsys, tmp_path, *argv)
    assert f"unrecognized argument {argv[0]}" in err and phrase in err and "did you mean" not in err


def test_the_removed_flags_table_holds_for_the_installed_transformers():
    """An entry for a flag transformers still has would hide it, and advice naming a flag no parser takes would send
    users to another error: every key is no example's flag (nor a field of the installed TrainingArguments), and
    every flag an entry tells users to type is one."""
    from transformers import Seq2SeqTrainingArguments, TrainingArguments

    from trainer_ext.experiment import argument_classes
    from trainer_ext.config.removed import OTHER_SPELLINGS, REMOVED_FLAGS

    fields = {f.name for cls in (TrainingArguments, Seq2SeqTrainingArguments) for f in dataclasses.fields(cls)}
    assert not set(REMOVED_FLAGS) & fields, set(REMOVED_FLAGS) & fields
    assert "fp16_full_eval" in fields  # still there in transformers 5: not in the table
    from trainer_ext.tasks import TASKS

    options = {option for task in TASKS
               for action in ExtArgumentParser(argument_classes(task))._actions for option in action.option_strings}
    for name, advice in {**REMOVED_FLAGS, **OTHER_SPELLINGS}.items():
        assert f"--{name}" not in options, name
        for flag in re.findall(r"--[a-z_0-9]+", advice):
            assert flag in options, (name, flag)


def test_an_experiment_file_key_transformers_5_removed_says_what_to_write(tmp_path):
    """`save_safetensors: false` in an experiment file said "did you mean 'save_steps'?"."""
    from trainer_ext.experiment import ExperimentError, load_experiment

    path = tmp_path / "exp.yaml"
    path.write_text("task: classification\nhyperparameters:\n  save_safetensors: false\n  evaluation_strategy: steps\n")
    with pytest.raises(ExperimentError) as refused:
        load_experiment(path)
    assert "unknown key 'save_safetensors': transformers 5 removed it" in str(refused.value)
    assert "unknown key 'evaluation_strategy': transformers 5 renamed it: use --eval_strategy" in str(refused.value)


def test_train_sampling_strategy_that_exttrainer_would_ignore_is_refused(tmp_path, capsys):
    """--train_sampling_strategy group_by_length (transformers 5's home of --group_by_length) trained in ExtTrainer's
    own order without a word."""
    err = parse_error(capsys, tmp_path, "--train_sampling_strategy", "group_by_length")
    assert "--train_sampling_strategy group_by_length: ExtTrainer trains in its own order" in err


# -- --config_overrides and --dropout ----------------------------------------------------------------------------------

def test_config_overrides_are_checked_against_the_config(tmp_path):
    """A misspelled key or a value of the wrong type ended in a ValueError traceback, a key whose value is None
    (classifier_dropout) in a TypeError one; each is named with the fix, all at once, and the config left as it was."""
    from transformers import BertConfig

    from trainer_ext.tasks.common import ModelArguments, apply_config_overrides

    config = BertConfig()
    with pytest.raises(ArgumentsError) as refused:
        apply_config_overrides(config, "hidden_dropout_prb=0.2,num_hidden_layers=two,hidden_dropout_prob=1.5,"
                                       "use_cache=maybe")
    lines = str(refused.value).splitlines()
    assert lines == [
        "--config_overrides hidden_dropout_prb=0.2: BertConfig has no field 'hidden_dropout_prb' (did you mean "
        "hidden_dropout_prob?); e.g. hidden_dropout_prob=0.2,num_hidden_layers=4",
        "--config_overrides num_hidden_layers=two: BertConfig's num_hidden_layers is 12, so 'two' must be a whole "
        "number",
        "--config_overrides hidden_dropout_prob=1.5: a dropout probability must be in [0, 1]",
        "--config_overrides use_cache=maybe: BertConfig's use_cache is True, so 'maybe' must be true or false"]
    assert config.hidden_dropout_prob == 0.1
    apply_config_overrides(config, "classifier_dropout=0.2,num_hidden_layers=4,use_cache=false")
    assert (config.classifier_dropout, config.num_hidden_layers, config.use_cache) == (0.2, 4, False)
    with pytest.raises(ArgumentsError, match=r"give key=value pairs separated by commas.*'hidden_dropout_prob' has "
                                             r"no '='"):
        ModelArguments(config_overrides="hidden_dropout_prob")  # at parse time: no config needed
    with pytest.raises(ArgumentsError, match=r"--dropout 1.5: a probability must be in \[0, 1\]"):
        ModelArguments(dropout=1.5)  # it blamed --model_name_or_path: "cannot read the model: dropout probability"


def test_config_overrides_stop_before_the_data_is_read(tmp_path, capsys, tiny_bert_dir):
    """The typo was found after the data (and, for QA and translation, the model) loaded: a training file that does not
    parse must not be reached."""
    broken = tmp_path / "train.jsonl"
    broken.write_text('{"sentence": "a",\n')
    typo = ["--config_overrides", "hidden_dropout_prb=0.2"]
    err = user_error(capsys, "run_glue", "--model_name_or_path", tiny_bert_dir, "--output_dir", tmp_path / "out",
                     "--train_file", broken, "--do_train", *FAST, *SHORT, *typo)
    assert "BertConfig has no field 'hidden_dropout_prb' (did you mean hidden_dropout_prob?)" in err
    squad = tmp_path / "train.json"
    squad.write_text("[]")
    err = user_error(capsys, "run_qa", "--model_name_or_path", tiny_bert_dir, "--output_dir", tmp_path / "out",
                     "--train_file", squad, "--do_train", "--doc_stride", 8, *FAST, *SHORT, *typo)
    assert "did you mean hidden_dropout_prob?" in err
    bart = tiny_bart_config(tmp_path / "bart.json")
    err = user_error(capsys, "run_translation", "--model_name_or_path", bart, "--output_dir", tmp_path / "out",
                     "--train_file", broken, "--do_train", *FAST, "--config_overrides", "d_modle=16")
    assert "BartConfig has no field 'd_modle' (did you mean d_model?)" in err


def test_an_encoder_only_model_for_translation_is_named(tmp_path, capsys, tiny_bert_dir):
    """A BERT folder given to run_translation said "cannot read the model: Unrecognized configuration class", after
    the data was read."""
    err = user_error(capsys, "run_translation", "--model_name_or_path", tiny_bert_dir, "--output_dir",
                     tmp_path / "out", "--do_train", *FAST)
    assert "a BertConfig (bert) is not a sequence-to-sequence model: give a Marian, T5, BART or encoder-decoder" in err


# -- a user's own script: streams and text columns ---------------------------------------------------------------------

class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        for i in range(32):
            yield {"input_ids": [1, 2, 3, i % 40 + 4], "labels": i % 2}


@pytest.mark.parametrize("arguments", ["stock", "ext"])
def test_a_stream_without_max_steps_is_named_before_transformers_refuses_it(tmp_path, arguments):
    """An IterableDataset without --max_steps ended in transformers' ValueError traceback from Trainer.__init__, with
    stock and with Ext arguments (the check existed, and nothing called it): ExtTrainer says it first."""
    from transformers import Trainer, TrainingArguments

    cls = TrainingArguments if arguments == "stock" else ExtTrainingArguments
    args = cls(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    with pytest.raises(ValueError, match="max_steps has to be specified"):  # what stock transformers does, in __init__
        Trainer(model=tiny_bert(), args=args, train_dataset=Stream())
    message = r"the training set \(Stream\) is a stream, read in order with no epoch ExtTrainer can count: give --max_steps"
    with pytest.raises(UserError, match=message):
        ExtTrainer(model=tiny_bert(), args=args, train_dataset=Stream())
    with pytest.raises(UserError, match=message):  # given by position, as Trainer's signature allows
        ExtTrainer(tiny_bert(), args, None, Stream())
    ExtTrainer(model=tiny_bert(), args=cls(output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=4),
               train_dataset=Stream())
    ExtTrainer(model=tiny_bert(), args=args, train_dataset=[{"input_ids": [1], "labels": 0}])


def test_text_columns_reaching_a_padding_collator_are_named(tmp_path, tiny_bert_dir):
    """--remove_unused_columns false with a column of strings ended in the collator's traceback at the first batch,
    suggesting padding=True and truncation=True."""
    import datasets
    from transformers import BertTokenizerFast, DataCollatorWithPadding

    tokenizer = BertTokenizerFast.from_pretrained(tiny_bert_dir)
    data = datasets.Dataset.from_list([{"input_ids": [1, 2, 3, i % 40 + 4], "labels": i % 2, "sentence": "a b",
                                        "idx": i} for i in range(32)])
    args = ExtTrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, max_steps=2,
                                per_device_train_batch_size=8, remove_unused_columns=False, disable_tqdm=True)
    trainer = ExtTrainer(model=tiny_bert(), args=args, train_dataset=data,
                         data_collator=DataCollatorWithPadding(tokenizer))
    with pytest.raises(UserError) as refused:
        trainer.train()
    assert str(refused.value) == (
        "the training data's column(s) 'sentence' hold text, which DataCollatorWithPadding cannot batch (it pads token "
        "ids into tensors): drop them (dataset.remove_columns(['sentence'])), or leave --remove_unused_columns on (it "
        "drops the columns the model's forward does not take)")
    assert not list((tmp_path / "out").glob("checkpoint-*"))


def test_the_padding_collators_named_do_fail_on_text(tiny_bert_dir):
    """The check must name only collators that fail on a text column: each one listed is held to it here."""
    import transformers
    from transformers import BertTokenizerFast

    from trainer_ext.data.loader import PADDING_COLLATORS

    tokenizer = BertTokenizerFast.from_pretrained(tiny_bert_dir)
    features = [{"input_ids": [2, 5, 6, 3], "labels": 1, "sentence": "a b"},
                {"input_ids": [2, 5, 3], "labels": 0, "sentence": "c"}]
    for name in PADDING_COLLATORS:
        collator = getattr(transformers, name)(tokenizer)
        batch = [dict(f) for f in features] if name != "DataCollatorForMultipleChoice" else \
            [{key: value if key == "labels" else [value, value] for key, value in f.items()} for f in features]
        with pytest.raises((ValueError, TypeError)):
            collator(batch)
    assert "sentence" not in transformers.default_data_collator([dict(features[0])])  # left out, not refused


# -- a full disk -------------------------------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """mount(folder, size): a real tmpfs of `size` there (ctypes' mount(2), no process started); unmounted after the
    test. Skips where mounting needs privileges this process lacks."""
    libc = ctypes.CDLL(None, use_errno=True)
    mounted = []

    def mount(folder, size):
        folder.mkdir(parents=True, exist_ok=True)
        if libc.mount(b"tmpfs", str(folder).encode(), b"tmpfs", 0, f"size={size}".encode()) != 0:
            pytest.skip(f"cannot mount a small tmpfs here ({os.strerror(ctypes.get_errno())}): needs root")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        libc.umount2(str(folder).encode(), 2)  # MNT_DETACH


def fill(folder, leave: int) -> None:
    """Fill `folder`'s disk until `leave` bytes are free."""
    import shutil

    free = shutil.disk_usage(folder).free
    with open(folder / "filler", "wb") as stream:
        stream.write(b"\0" * max(free - leave, 0))


def tiny_args(output_dir, **kwargs):
    return ExtTrainingArguments(output_dir=str(output_dir), report_to="none", use_cpu=True, max_steps=2,
                                per_device_train_batch_size=8, save_steps=1, disable_tqdm=True, **kwargs)


DATA = [{"input_ids": [1, 2, 3, i % 40 + 4], "labels": i % 2} for i in range(32)]


def test_a_disk_without_room_for_a_checkpoint_is_named_before_training(tmp_path, small_disk):
    """--output_dir on a full disk trained until the first save, then failed with SafetensorError / torch's
    "unexpected pos" naming neither the folder nor the checkpoint."""
    from trainer_ext.checkpoints.output_lock import OutputDirError, checkpoint_bytes

    disk = small_disk(tmp_path / "disk", "64k")
    args = tiny_args(disk / "out")
    model = tiny_bert()
    weights, optimizer = checkpoint_bytes(model, args)
    assert weights == 4 * sum(p.numel() for p in model.parameters()) and optimizer == 2 * weights
    with pytest.raises(OutputDirError) as refused:
        ExtTrainer(model=model, args=args, train_dataset=DATA).train()
    assert re.fullmatch(rf"--output_dir {re.escape(str(disk / 'out'))}: 0\.1 MiB free on its disk "
                        rf"\({re.escape(str(disk))}\) and one checkpoint of "
                        r"this model needs at least 0\.\d MiB \(weights 0\.\d MiB \+ optimizer state 0\.\d MiB\): free "
                        r"space there, or give --output_dir on a disk with room, or --save_strategy no",
                        str(refused.value)), str(refused.value)
    assert not (disk / "out").exists() or not any((disk / "out").iterdir())


def test_a_save_that_finds_the_disk_full_is_one_line_and_the_rerun_says_why(tmp_path, small_disk):
    """The disk filling during training (other jobs, earlier checkpoints): the save's traceback became one line naming
    the folder, the checkpoint and the space it needs; the same command again said the same traceback, now it names
    the unfinished checkpoint before training, and with room again the run trains."""
    import transformers

    from trainer_ext.checkpoints.output_lock import OutputDirError, checkpoint_bytes
    from trainer_ext.tasks.common import train_and_save

    disk = small_disk(tmp_path / "disk", "1m")
    model = tiny_bert()
    weights, _ = checkpoint_bytes(model, tiny_args(disk / "out"))

    class FillTheDisk(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            fill(disk, weights + 32 * 1024)  # room for the weights, not for the optimizer's state

    args = tiny_args(disk / "out")
    trainer = ExtTrainer(model=model, args=args, train_dataset=DATA, callbacks=[FillTheDisk()])
    with pytest.raises(OutputDirError) as refused:
        train_and_save(trainer, args, len(DATA))
    message = str(refused.value)
    assert message.startswith(f"--output_dir {disk / 'out'}: no space left on its disk (")
    assert "free of 1.0 MiB on it" in message
    assert f"while writing checkpoint-1 ({disk / 'out' / '.staging' / 'checkpoint-1' / 'optimizer.pt'})" in message
    assert "one checkpoint of this model needs at least" in message
    assert "the same command continues from it" in refused.value.outcome
    with pytest.raises(OutputDirError, match=r"\.staging holds 0\.\d MiB of an unfinished checkpoint: delete it"):
        ExtTrainer(model=tiny_bert(), args=tiny_args(disk / "out"), train_dataset=DATA).train()
    (disk / "filler").unlink()
    ExtTrainer(model=tiny_bert(), args=tiny_args(disk / "out"), train_dataset=DATA).train()
    assert (disk / "out" / "checkpoint-2").is_dir() and not (disk / "out" / ".staging").exists()


def test_every_way_a_write_reports_a_full_disk_is_recognised(tmp_path, small_disk):
    """open() raises OSError ENOSPC, safetensors a SafetensorError without an errno, torch.save a RuntimeError
    ("unexpected pos"): each is named, an unrelated error is not; and the lock on a full disk is one line."""
    import safetensors.torch

    from trainer_ext.checkpoints.output_lock import OutputDirError, OutputDirLock, out_of_space

    disk = small_disk(tmp_path / "disk", "64k")
    args = tiny_args(disk / "out")
    model = tiny_bert()
    writes = {"open": lambda path: path.write_bytes(b"\0" * 200_000),
              "safetensors": lambda path: safetensors.torch.save_file({"w": torch.zeros(50_000)}, str(path)),
              "torch.save": lambda path: torch.save({"w": torch.zeros(50_000)}, str(path))}
    for name, write in writes.items():
        (disk / "out").mkdir(exist_ok=True)
        try:
            write(disk / "out" / "file.bin")
        except Exception as err:  # noqa: BLE001 - what each writer raises is the point
            error = out_of_space(err, args, model)
        else:
            pytest.fail(f"{name} wrote 200 kB on a 64 kB disk")
        assert error is not None and f"--output_dir {disk / 'out'}: no space left on its disk" in str(error), name
        assert "file.bin" in str(error), (name, str(error))
        (disk / "out" / "file.bin").unlink(missing_ok=True)
    assert out_of_space(ValueError("a bug"), args, model) is None
    fill(disk, 0)
    with pytest.raises(OutputDirError, match=r"no space left on its disk \(writing its lock \.trainer_ext\.lock "
                                             r"failed: No space left on device\)"):
        OutputDirLock.acquire(disk / "lock")


# -- trainer-ext -------------------------------------------------------------------------------------------------------

def test_version_names_what_a_bug_report_needs(capsys):
    """`trainer-ext --version` said "unknown command '--version'"."""
    from importlib.metadata import version

    from trainer_ext import __version__
    from trainer_ext.cli import main

    assert main(["--version"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"trainer_ext {__version__} (") and out[1].startswith("python ")
    assert f"torch {version('torch')}" in out and f"transformers {version('transformers')}" in out
    assert any(line.startswith("deepspeed ") for line in out) and any(line.startswith("fairscale ") for line in out)
    assert main(["--verison"]) == 2
    assert "unknown command '--verison', did you mean '--version'?" in capsys.readouterr().err


def test_plan_refuses_counts_and_sizes_that_plan_nothing(capsys):
    """`plan --num_parameters 0 --device_memory 0GB` exited 0 with "cheapest that fits in 0.00 MiB"; a size without a
    unit read as bytes ("80": nothing fits); a negative --num_labels passed."""
    from trainer_ext.cli import main

    assert main(["plan", "--num_parameters", "0", "--device_memory", "0GB", "--world_size", "1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "trainer-ext plan: error: --num_parameters '0': a model has at least one parameter; give its count, e.g. "
        "22713216, 350M or 7e9",
        "--device_memory '0GB': a device has more than 0 bytes; give its memory, e.g. 16GB or 80GiB"]
    assert main(["plan", "--num_parameters", "7B", "--device_memory", "80", "--world_size", "8"]) == 2
    assert "--device_memory '80' reads as 80 bytes: give the unit, e.g. 80GB or 80GiB" in capsys.readouterr().err
    assert main(["plan", "--num_parameters", "1M", "--world_size", "1", "--num_labels", "-2"]) == 2
    assert "--num_labels -2: give the classifier's number of labels" in capsys.readouterr().err
    assert main(["plan", "--num_parameters", "7B", "--device_memory", "80GB", "--world_size", "8"]) == 0


def test_a_misspelled_search_flag_suggests_the_search_flag():
    """`trainer-ext search exp.yaml --max_trial 3` said "did you mean --max_train_samples?" (the trials' flags only)."""
    from trainer_ext.cli import own_flags_misspelled, search_parser

    kept, problems = own_flags_misspelled(search_parser(), ["--max_trial", "3", "--learning_rate", "1e-4",
                                                            "--paralel_trials=2", "--max_train_samples", "8"])
    assert kept == ["--learning_rate", "1e-4", "--max_train_samples", "8"]
    assert problems == ["unrecognized argument --max_trial (did you mean --max_trials?)",
                        "unrecognized argument --paralel_trials=2 (did you mean --parallel_trials?)"]


# -- round 3's smaller cases (issue 48) -------------------------------------------------------------------------------

def test_an_output_dir_inside_a_file_says_it_is_a_file(tmp_path):
    """`--output_dir p1/README.md/run` where README.md is a file said "is not writable"."""
    (tmp_path / "README.md").write_text("a file")
    with pytest.raises(ArgumentsError, match=re.escape(f"--output_dir {tmp_path / 'README.md' / 'run'}: "
                                                       f"{tmp_path / 'README.md'} is a file, so no folder can be made")):
        ExtTrainingArguments(output_dir=str(tmp_path / "README.md" / "run"), report_to="none")


def test_plan_without_activations_calls_nothing_a_fit(capsys):
    """`plan --num_parameters 7B --world_size 8 --bf16 --device_memory 40GB` said "activations not estimated" and named
    zero1 as fitting with 1.4 GiB left."""
    code, out, _ = cli(capsys, "plan", "--num_parameters", "7B", "--world_size", "8", "--bf16", "--device_memory",
                       "40GB")
    assert code == 0 and "cheapest that fits" not in out
    assert out.splitlines()[-1] == (
        "nothing is called a fit in 37.25 GiB without the activations: the cheapest whose model states fit is zero1 "
        "(35.86 GiB per rank, 1.40 GiB left for the activations); give --model (the model's folder or config.json) "
        "to know what fits")
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("ddp ", "zero1 "))}
    assert rows["ddp"][-3] == "no" and rows["zero1"][-5] == "?"  # over the device by its states alone / unknown


def test_merge_of_a_folder_that_does_not_exist_says_so(tmp_path, capsys):
    """`trainer-ext merge out/lora_run` of a folder that does not exist said it held no adapter_config.json."""
    (tmp_path / "lora-run").mkdir()
    code, _, err = cli(capsys, "merge", tmp_path / "lora_run", "--output_dir", tmp_path / "merged")
    assert code == 2 and (f"{tmp_path / 'lora_run'} does not exist (did you mean {tmp_path / 'lora-run'}?): give a "
                          "LoRA run's output_dir or one of its checkpoint-N folders") in err


# -- suggestions ------------------------------------------------------------------------------------------------------

EXPERIMENT = str(REPO / "experiments" / "classification.yaml")
# Typos users made (issue 48's, and the first weeks' before it): (command, its words, what it must suggest). One engine
# (errors.closest) ranks the flags of every command and subcommand.
REAL_TYPOS = [
    (["train", EXPERIMENT, "--chek"], "--check"),  # said: did you mean --help?
    (["plan", "--num_paramters", "7B", "--world_size", "8"], "--num_parameters"),  # said: argparse's bare error
    (["plan", "--model", "m", "--world_size", "8", "--lora_r", "8", "--lora_alhpa", "16"], "--lora_alpha"),
    (["plan", "--num_parameters", "7B", "--worldsize", "8"], "--world_size"),
    (["build-ops", "--onlyy", "cpu_adam"], "--only"),  # said: argparse's bare error
    (["merge", "out/lora", "--ouput_dir", "out/merged"], "--output_dir"),
    # search's own flags: test_a_misspelled_search_flag_suggests_the_search_flag (its check reads the whole experiment)
    (["ds-config", "--deepspeed", "zero2", "--world-size", "2"], "--world_size"),
    (["ds-config", "--per_device_batch_size", "4"], "--per_device_train_batch_size"),  # said: ..._eval_batch_size
    (["train", EXPERIMENT, "--gradient_accumulation", "4"], "--gradient_accumulation_steps"),
    (["train", EXPERIMENT, "--learning_rat", "1e-4"], "--learning_rate"),
    (["train", EXPERIMENT, "--num_train_epoch", "2"], "--num_train_epochs"),
    (["train", EXPERIMENT, "--max_seq_len", "64"], "--max_seq_length"),
    (["train", EXPERIMENT, "--model_name", "m"], "--model_name_or_path"),
]


@pytest.mark.parametrize("argv,hint", REAL_TYPOS, ids=[" ".join(argv[:1] + argv[2 if argv[0] in ("train", "search")
                                                                                 else 1:][:2]) for argv, _ in REAL_TYPOS])
def test_every_command_suggests_the_flag_a_typo_meant(capsys, argv, hint):
    """`trainer-ext train x.yaml --chek` suggested --help, `plan --num_paramters` and `build-ops --onlyy` said argparse's
    bare "unrecognized arguments", `--per_device_batch_size` pointed at the eval batch: each typo names what it meant,
    in one line, exit 2, before any work."""
    code, out, err = cli(capsys, *argv)
    typo = next(word for word in argv if word.startswith("--") and word.split("=")[0] != hint and word not in (
        "--world_size", "--model", "--num_parameters", "--deepspeed", "--lora_r"))
    assert code == 2 and not out and "Traceback" not in err, err
    assert f"unrecognized argument {typo} (did you mean {hint}?)" in err.splitlines()[0], err


def test_lora_rank_is_lora_r_as_in_llama_factory(tmp_path, capsys):
    """`run_clm.py --lora_rank 16` said "did you mean --local_rank?" and `trainer-ext plan --lora_rank 16` argparse's bare
    error: LLaMA-Factory's (and many scripts') name is taken as --lora_r."""
    from trainer_ext.experiment import argument_classes

    model, _, _ = ExtArgumentParser(argument_classes("causal_lm")).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--lora_rank", "16"])
    assert model.lora_r == 16
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256).save_pretrained(tmp_path / "llama")
    runs = {flag: cli(capsys, "plan", "--model", tmp_path / "llama", "--world_size", "1", flag, "16", "--json")
            for flag in ("--lora_rank", "--lora_r")}
    assert runs["--lora_rank"][0] == 0 and runs["--lora_rank"] == runs["--lora_r"]


# -- data files and commands that did nothing --------------------------------------------------------------------------

GLUE_CASES = {
    # id -> (files to write: name -> text or rows, flags, phrase)
    "a CSV separated by tabs": ({"train.csv": "sentence\tlabel\n" + "".join(f"s {i}\t{i % 2}\n" for i in range(8))},
                                ["--do_train"],
                                "its header line is separated by tabs, not commas ('sentence\\tlabel'): name the file "
                                ".tsv"),
    "a CSV with a header only": ({"train.csv": "sentence,label\n"}, ["--do_train"],
                                 "has a header line ('sentence,label') but no rows"),
    "a column name in another case": ({"train.csv": "Sentence,Label\n" + "".join(f"s {i},{i % 2}\n" for i in range(8))},
                                      ["--do_train"], "(did you mean --text_column Sentence?)"),
    "other column names": ({"train.jsonl": [{"text": f"s {i}", "stars": i % 2} for i in range(8)]}, ["--do_train"],
                           "(did you mean --text_column text?)\n--label_column 'label': the training data has columns "
                           "['text', 'stars'] (did you mean --label_column stars?)"),
    "no --do_train": ({"train.jsonl": sentences(16)}, [],
                      "nothing to do: give --do_train, --do_eval, --do_predict (one or more; --do_train to train)"),
}


@pytest.mark.parametrize("case", list(GLUE_CASES))
def test_data_files_and_commands_of_the_first_week(tmp_path, capsys, tiny_bert_dir, case):
    """A .csv of tabs said "the training data has columns ['sentence\\tlabel']", a header-only CSV 'Instruction "train"
    corresponds to no data!', a 'Sentence' header no suggestion; a command without --do_train read, did nothing and
    exited 0 without a word."""
    files, flags, phrase = GLUE_CASES[case]
    given = []
    for name, content in files.items():
        path = tmp_path / name
        path.write_text(content) if isinstance(content, str) else write_lines(path, content)
        given += [f"--{name.split('.')[0]}_file", path]
    err = user_error(capsys, "run_glue", "--model_name_or_path", tiny_bert_dir, "--output_dir", tmp_path / "out",
                     *given, *FAST, *SHORT, *flags)
    assert phrase in err, err


@pytest.fixture
def unwritable_folder():
    """A folder no process can create, root included (sysfs), the way a read-only file system refuses it."""
    folder = Path("/sys/trainer-ext-test-cache")
    try:
        folder.mkdir()
    except OSError:
        return folder
    folder.rmdir()
    pytest.skip("/sys is writable here")


@pytest.mark.parametrize("variable", ["HF_DATASETS_CACHE", "HF_HOME"])
def test_a_datasets_cache_it_cannot_write_is_named_before_the_data_is_read(tmp_path, capsys, monkeypatch,
                                                                             unwritable_folder, variable):
    """A read-only HF_DATASETS_CACHE ended in filelock's `OSError: [Errno 30] Read-only file system` traceback from
    load_dataset: one line naming the variable and the fix, before the data is read."""
    import datasets.config

    monkeypatch.setenv(variable, str(unwritable_folder))  # what datasets read when it was imported:
    cache = unwritable_folder / "datasets" if variable == "HF_HOME" else unwritable_folder
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    if variable == "HF_HOME":
        monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    err = user_error(capsys, "run_glue", "--output_dir", tmp_path / "out", "--do_train", *FAST)
    named = (f"HF_DATASETS_CACHE={cache}" if variable == "HF_DATASETS_CACHE"
             else f"HF_HOME={unwritable_folder} (datasets caches in {cache})")
    assert f"error: {named}: cannot write there (" in err and "datasets writes its cache and lock files there" in err
    assert ("point HF_DATASETS_CACHE at a folder you can write, or unset it" if variable == "HF_DATASETS_CACHE"
            else "set HF_DATASETS_CACHE to a folder you can write") in err
    assert not (tmp_path / "out").exists()


def test_qa_predict_and_translation_csv_are_named(tmp_path, capsys, tiny_bert_dir):
    """run_qa --do_predict was ignored without a word (the recipe has no test split); run_translation on a CSV file
    said "JSON parse error: Invalid value. in row 0"."""
    err = user_error(capsys, "run_qa", "--model_name_or_path", tiny_bert_dir, "--output_dir", tmp_path / "out",
                     "--do_predict", *FAST)
    assert "--do_predict: this QA recipe has no test split; --do_eval writes the validation set's predictions" in err
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("en,de\na b,c d\n")
    bart = tiny_bart_config(tmp_path / "bart.json")
    err = user_error(capsys, "run_translation", "--model_name_or_path", bart, "--output_dir", tmp_path / "out",
                     "--train_file", pairs, "--do_train", *FAST)
    assert f"--train_file {pairs}: translation reads JSON lines (.jsonl), one {{\"translation\": {{\"en\": " in err


# -- DeepSpeed files: ds-config and training refuse the same ones, a machine's NVMe folder, DeepSpeed's ops -------------

def cli(capsys, *argv):
    """trainer-ext in this process: (exit status, stdout, stderr)."""
    from trainer_ext.cli import main

    try:
        code = main([str(a) for a in argv])
    except SystemExit as stopped:  # the flag parser's own exit
        code = stopped.code
    out = capsys.readouterr()
    return code, out.out, out.err


def training_refuses(tmp_path, config, **flags):
    """What building a training run's arguments with this DeepSpeed file says (they resolve it before any work)."""
    from trainer_ext.deepspeed_config import DeepSpeedConfigError

    with pytest.raises(DeepSpeedConfigError) as refused:
        ExtTrainingArguments(output_dir=str(tmp_path / "out"), deepspeed=config, use_cpu=True, report_to="none",
                             **flags)
    return str(refused.value)


def test_ds_config_and_training_refuse_the_same_file(tmp_path, capsys):
    """`"reduce_bucket_size": "huge"` rendered in ds-config (exit 0) and failed in DeepSpeed's pydantic check once
    the model was loaded; a section the translator passes through (comms_logger) is read by DeepSpeed's own parser."""
    config = {"zero_optimization": {"stage": 2, "reduce_bucket_size": "huge"}, "comms_logger": {"enabled": "maybe"}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    code, out, err = cli(capsys, "ds-config", "--deepspeed", path, "--output_dir", tmp_path / "out")
    assert code == 2 and not out and "2 problems" in err
    trained = training_refuses(tmp_path, str(path))
    for said in (err, trained):
        assert 'zero_optimization.reduce_bucket_size="huge": must be a whole number > 0, as DeepSpeed requires' in said
        assert 'comms_logger.enabled="maybe": DeepSpeed refuses it: Input should be a valid boolean' in said
    # What DeepSpeed's models accept, the translator takes: "1_000" and "yes" as pydantic reads them.
    from trainer_ext.deepspeed_config import resolve_deepspeed_config

    resolved = resolve_deepspeed_config({"bf16": True}, {"bf16": {"enabled": "yes"},
                                                         "zero_optimization": {"stage": 2, "reduce_bucket_size": "1_000"}},
                                        world_size=1, num_training_steps=4)
    assert resolved.config["bf16"]["enabled"] is True and resolved.config["zero_optimization"]["reduce_bucket_size"] == 1000


@pytest.mark.parametrize("optimizer,phrase", [
    ({"type": "AdamW", "params": {"warmup": 5}},
     'optimizer.params.warmup: not a parameter of FusedAdam, the optimizer DeepSpeed builds for optimizer.type "AdamW"; '
     'a warmup belongs to the schedule: --warmup_steps N, or "scheduler": {"type": "WarmupLR", "params": '
     '{"warmup_num_steps": N}}; it takes adam_w_mode, torch_adam, fp32_optimizer_states, lr, bias_correction, betas, '
     "eps, weight_decay, amsgrad, set_grad_none"),
    ({"type": "SGD", "params": {"momentun": 0.9}},
     "optimizer.params.momentun: not a parameter of torch.optim.SGD, the optimizer DeepSpeed builds for optimizer.type "
     "\"SGD\" (did you mean 'momentum'?)"),
    ({"type": "AdamW", "params": {"max_grad_norm": 1.0}},
     'optimizer.params.max_grad_norm: DeepSpeed refuses gradient clipping there: set "gradient_clipping"'),
])
def test_an_optimizer_parameter_the_optimizer_does_not_take_is_refused_by_ds_config_and_training(
        tmp_path, capsys, optimizer, phrase):
    """{"type": "AdamW", "params": {"warmup": 5}}: ds-config exit 0, then training loaded data and model and died on
    every rank with `TypeError: FusedAdam.__init__() got an unexpected keyword argument 'warmup'`."""
    config = {"optimizer": optimizer, "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}
    code, out, err = cli(capsys, "ds-config", "--deepspeed", json.dumps(config), "--output_dir", tmp_path / "out")
    assert code == 2 and not out and phrase in err, err
    assert phrase in training_refuses(tmp_path, config)


def test_an_optimizer_parameter_is_checked_against_the_class_deepspeed_builds():
    """The same optimizer.type builds another class with offload_optimizer or torch_adam: FusedAdam's set_grad_none
    fails CPU Adam's constructor, and torch's AdamW takes foreach."""
    from trainer_ext.deepspeed_config.passes import built_optimizer, optimizer_params_problems

    def config(params, offload=None):
        zero = {"stage": 2, **({"offload_optimizer": {"device": offload}} if offload else {})}
        return {"optimizer": {"type": "AdamW", "params": params}, "zero_optimization": zero}

    assert built_optimizer(config({}))[0] == "FusedAdam"
    assert built_optimizer(config({}, "nvme"))[0] == built_optimizer(config({}, "cpu"))[0] == "DeepSpeedCPUAdam"
    assert built_optimizer(config({"torch_adam": True}, "cpu"))[0] == "torch.optim.AdamW"
    assert optimizer_params_problems(config({"set_grad_none": True})) == []
    assert "not a parameter of DeepSpeedCPUAdam" in optimizer_params_problems(config({"set_grad_none": True}, "cpu"))[0]
    assert optimizer_params_problems(config({"torch_adam": True, "foreach": False, "fused": False})) == []
    assert built_optimizer({"optimizer": {"type": "Muon"}}) is None  # built from param groups: not checked


@pytest.mark.deepspeed
def test_a_preset_name_needs_ext_arguments_and_its_file_serves_stock_ones(tmp_path):
    """An own script with stock TrainingArguments and --deepspeed zero2_minimal died in three chained tracebacks from
    transformers' __post_init__, before ExtTrainer existed, and no page said why: README and errors.md say presets are
    ExtTrainingArguments' own and give the file instead. Fails when that stops being true, or said."""
    from transformers import TrainingArguments

    from trainer_ext.deepspeed_config.load import presets_dir

    common = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    with pytest.raises(ValueError, match="Expected a string path to an existing deepspeed config"):
        TrainingArguments(**common, deepspeed="zero2_minimal")
    assert ExtTrainingArguments(**common, deepspeed="zero2_minimal").run_settings.settled is not None
    TrainingArguments(**common, deepspeed=str(presets_dir() / "zero2_minimal.json"))  # the file the docs give
    assert (REPO / "ds_configs" / "zero2_minimal.json").is_file()
    for page in ("README.md", "docs/errors.md"):
        text = " ".join((REPO / page).read_text().split())
        assert "names are `ExtTrainingArguments`' own" in text and "`--deepspeed ds_configs/zero2_minimal.json`" in text


def test_an_empty_deepspeed_file_is_refused_and_braces_alone_are_said(tmp_path, capsys):
    """A 0-byte DeepSpeed file (and `{}`) trained ZeRO-2 with defaults without a word: 0 bytes is not JSON (refused by
    ds-config and training alike); `{}` is said once, by ds-config and with the run's settings."""
    empty, braces = tmp_path / "empty.json", tmp_path / "braces.json"
    empty.write_text("")
    braces.write_text("{}\n")
    refused = f"--deepspeed {empty}: the file is empty (0 bytes), which is not JSON: write {{}} in it"
    code, out, err = cli(capsys, "ds-config", "--deepspeed", empty, "--output_dir", tmp_path / "out")
    assert code == 2 and not out and refused in err
    assert refused in training_refuses(tmp_path, str(empty))
    said = f"the DeepSpeed file {braces} is empty ({{}}): ZeRO-2 with trainer_ext's defaults and your flags"
    code, out, err = cli(capsys, "ds-config", "--deepspeed", braces, "--output_dir", tmp_path / "out")
    assert code == 0 and json.loads(out)["zero_optimization"]["stage"] == 2 and err.count(said) == 1
    args = ExtTrainingArguments(output_dir=str(tmp_path / "out"), deepspeed=str(braces), use_cpu=True, report_to="none")
    assert args.run_settings.settled.notes.count(said) == 1  # printed with the run's settings when training starts
    code, _, err = cli(capsys, "ds-config", "--output_dir", tmp_path / "out")  # no file at all: nothing to say
    assert code == 0 and "is empty" not in err


def test_ds_config_says_the_notes_training_says(tmp_path, capsys):
    """A stage-2 file offloading the optimizer to "nvme": training noted that it trains as "cpu", ds-config printed
    nothing."""
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}}
    code, _, err = cli(capsys, "ds-config", "--deepspeed", json.dumps(config), "--output_dir", tmp_path / "out")
    notes = ExtTrainingArguments(output_dir=str(tmp_path / "out"), deepspeed=config, use_cpu=True,
                                 report_to="none").run_settings.settled.notes
    assert code == 0 and any('"nvme" at stage 2' in note and 'it trains as "cpu"' in note for note in notes)
    assert [line.removeprefix("trainer-ext ds-config: note: ") for line in err.splitlines() if " note: " in line
            and "nvme_path" not in line.split(" note: ")[0]] == notes


def test_an_nvme_folder_is_checked_by_training_on_its_machine_not_by_ds_config(tmp_path, capsys):
    """ZeRO-3 offload to an nvme_path that does not exist: ds-config exited 0, and training built the cpu_adam op for
    minutes before dying with "cpu_adam op failed to build/load". ds-config may run on a login node: it notes the folder;
    training checks it (exists, is a folder, writable) before any work."""
    def zero3(path):
        return {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(path)}}}

    code, out, err = cli(capsys, "ds-config", "--deepspeed", json.dumps(zero3(tmp_path / "absent")),
                         "--output_dir", tmp_path / "out")
    assert code == 0 and json.loads(out)["zero_optimization"]["offload_optimizer"]["device"] == "nvme"
    assert f"nvme_path {tmp_path / 'absent'} is not checked here; training checks on each machine" in err
    said = training_refuses(tmp_path, zero3(tmp_path / "absent"))
    assert f"zero_optimization.offload_optimizer.nvme_path={tmp_path / 'absent'}: no such folder on this machine" in said
    (tmp_path / "file").write_text("")
    assert "a file, not a folder" in training_refuses(tmp_path, zero3(tmp_path / "file"))
    missing = training_refuses(tmp_path, {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})
    assert 'zero_optimization.offload_param.device is "nvme" but nvme_path is not set' in missing


def test_every_flag_conflict_of_ds_config_is_said_at_once(tmp_path, capsys):
    code, out, err = cli(capsys, "ds-config", "--bf16", "--fp16", "--warmup_ratio", "0.1", "--warmup_steps", "5",
                         "--output_dir", tmp_path / "out")
    assert code == 2 and not out
    assert "--fp16 and --bf16 both set the precision: give only one" in err
    assert "--warmup_ratio 0.1 and --warmup_steps 5 both set the warmup: give only one" in err


def test_batch_fields_the_file_cannot_reconcile_say_the_fix_is_in_the_file(tmp_path, capsys):
    """{"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4} at world size 2 said "set
    --per_device_train_batch_size 5", which then conflicted with the file's micro batch."""
    code, out, err = cli(capsys, "ds-config", "--deepspeed", '{"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}',
                         "--world_size", "2", "--output_dir", tmp_path / "out")
    assert code == 2
    assert "10 is not a multiple of train_micro_batch_size_per_gpu × world size = 4 × 2" in err
    assert "in the file set train_batch_size to 8 or train_micro_batch_size_per_gpu to 5" in err
    assert "--per_device_train_batch_size" not in err.split("To make them agree")[1]


@pytest.mark.parametrize("config,builders", [
    ({"optimizer": {"type": "AdamW"}}, ["FusedAdamBuilder"]),
    ({"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}, []),
    ({"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
     ["CPUAdamBuilder"]),
    ({"optimizer": {"type": "Lion"}, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme",
                                                                                            "nvme_path": "/x"}}},
     ["CPULionBuilder", "AsyncIOBuilder"]),
])
def test_the_ops_a_config_makes_deepspeed_build(config, builders):
    """On CPU ranks as on GPUs: the shared-memory all-reduce DeepSpeed's CPU backend would load is kept from loading
    (tests/integration/test_deepspeed_ops.py runs it)."""
    from trainer_ext.backends.deepspeed.ops import needed_builders

    assert needed_builders(config) == builders


@pytest.mark.deepspeed
def test_a_run_that_would_build_an_op_says_so_and_build_ops_builds_them_ahead(tmp_path, monkeypatch, capsys):
    """The first DeepSpeed run on a machine printed nothing for minutes while DeepSpeed compiled its ops (it looked
    hung). In an environment without them (a fresh TORCH_EXTENSIONS_DIR) the notice names the op, its folder and
    `trainer-ext build-ops`, once per process (a rebuild and its reason: tests/integration/test_deepspeed_ops.py).
    Builds nothing (tests/integration/test_cli.py runs build-ops on the ops the session built)."""
    from trainer_ext.backends.deepspeed import ops

    config = {"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(ops, "_ANNOUNCED", set())
    said = ops.announce_builds(config)
    assert [line.split(" op ")[0] for line in said] == ["DeepSpeed builds its cpu_adam"]
    assert f"(into {tmp_path / 'cpu_adam'}), about 2 min on 2 busy CPU cores" in said[0]
    assert "`trainer-ext build-ops` builds DeepSpeed's ops ahead of a run" in said[0]
    assert ops.announce_builds(config) == []  # once per process
    code, _, err = cli(capsys, "build-ops", "--only", "cpu_adm")
    assert code == 2 and "--only cpu_adm (did you mean cpu_adam?): not one of this machine's ops" in err



def test_an_experiment_file_indented_with_a_tab_is_one_line_with_the_fix(tmp_path, capsys):
    """PyYAML's error spread over five lines with a caret and no fix."""
    path = tmp_path / "exp.yaml"
    path.write_text("task: classification\nhyperparameters:\n\tlearning_rate: 0.00005\n")
    code, _, err = cli(capsys, "train", path, "--check")
    assert code == 2 and err.splitlines()[0] == (
        f"trainer-ext train: error: {path}: not valid YAML at line 3, column 1: found character '\\t' that cannot "
        "start any token: YAML indents with spaces only, replace the tab")
