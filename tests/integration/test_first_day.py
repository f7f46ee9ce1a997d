"""A new user's own data, folders and mistakes (issue 20): nothing of theirs overwritten or silently replaced, data
checked as it is read, launch leftovers, one validation for preview and training, values transformers would coerce,
compute_metrics' answer. Most cases run the example scripts' main() in this process on a tiny model of the user's
(tests/conftest.py build_tiny_bert) and expect what a user sees: one line, exit status 2, nothing written; the launch
cases start real processes."""

import hashlib
import json
import os
import signal
import subprocess
import time

import pytest

from conftest import PYTHON, TINY_TRAIN, clean_env, example, run, user_error, write_lines
from trainer_ext.tasks import TASKS

FAST = ["--max_steps", "2", "--report_to", "none", "--disable_tqdm", "true"]
SHORT = ["--max_seq_length", "32"]  # classification and QA


def sentences(n, labels=(0, 1), start=0):
    return [{"sentence": f"the movie was good number {start + i}", "label": labels[i % len(labels)]} for i in range(n)]


def digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


# -- nothing the user owns is overwritten or silently replaced -------------------------------------------------------

def test_output_dir_that_is_or_holds_the_model_is_refused(tmp_path, capsys, tiny_bert_dir):
    """--output_dir equal to --model_name_or_path trained and overwrote the user's pretrained weights (exit 0)."""
    import shutil

    model = tmp_path / "mine"
    shutil.copytree(tiny_bert_dir, model)
    before = digests(model)
    err = user_error(capsys, "run_glue", "--model_name_or_path", model, "--output_dir", model, "--do_train", *FAST,
                     *SHORT)
    assert f"--output_dir {model} is the folder of the model this run starts from" in err
    assert "config.json, model.safetensors" in err and digests(model) == before
    # a model inside output_dir (a checkpoint of an earlier run): rotation could delete it
    checkpoint = tmp_path / "run" / "checkpoint-500"
    shutil.copytree(tiny_bert_dir, checkpoint)
    err = user_error(capsys, "run_glue", "--model_name_or_path", checkpoint, "--output_dir", tmp_path / "run",
                     "--do_train", *FAST, *SHORT)
    assert "holds the model this run starts from" in err


def test_shipped_data_never_fills_a_split_of_the_users_data(tmp_path, capsys, tiny_bert_dir):
    """--train_file mine.jsonl --do_predict scored our data/classification/test.jsonl and called it the user's."""
    mine = write_lines(tmp_path / "mine.jsonl", sentences(16, labels=("pos", "neg")))
    out = tmp_path / "out"
    err = user_error(capsys, "run_glue", "--model_name_or_path", tiny_bert_dir, "--output_dir", out,
                     "--train_file", mine, "--do_train", "--do_predict", *FAST, *SHORT)
    assert f"--do_predict needs --test_file: your data is --train_file {mine}" in err
    assert not out.exists()
    for script, flags, phrase in (
            ("run_qa", ["--train_file", mine, "--do_train", "--do_eval", *SHORT, "--doc_stride", "8"],
             "--do_eval needs --validation_file"),
            ("run_translation", ["--validation_file", mine, "--do_train"], "--do_train needs --train_file")):
        err = user_error(capsys, script, "--model_name_or_path", tiny_bert_dir, "--output_dir", out, *flags, *FAST)
        assert phrase in err and "the shipped sets are used only when no data file is given" in err


def test_string_labels_map_the_same_in_every_split_and_are_saved(tmp_path, capsys, tiny_bert_dir):
    """String labels crashed in tokenization, and a trained model's predictions were indices with no names."""
    files = {split: write_lines(tmp_path / f"{split}.jsonl", sentences(n, labels=("pos", "neg", "meh"), start=s))
             for split, n, s in (("train", 24, 0), ("validation", 9, 100), ("test", 6, 200))}
    test_without_labels = write_lines(tmp_path / "unlabelled.jsonl", [{"sentence": "a new one", "label": -1}] * 3)
    out = tmp_path / "out"
    example("run_glue")([str(a) for a in ["--model_name_or_path", tiny_bert_dir, "--output_dir", out,
                                          "--train_file", files["train"], "--validation_file", files["validation"],
                                          "--test_file", files["test"], "--do_train", "--do_eval", "--do_predict",
                                          *FAST, *SHORT]])
    config = json.loads((out / "config.json").read_text())
    assert config["id2label"] == {"0": "meh", "1": "neg", "2": "pos"}
    predictions = json.loads((out / "predictions.json").read_text())
    assert [config["id2label"][str(i)] for i in predictions["predictions"]] == predictions["labels"]
    assert "eval_accuracy" in json.loads((out / "eval_results.json").read_text())
    # the trained model evaluated on a test file without labels (GLUE's -1): predictions, no accuracy, no error
    again = tmp_path / "again"
    example("run_glue")([str(a) for a in ["--model_name_or_path", out, "--output_dir", again,
                                          "--test_file", test_without_labels, "--do_predict", *FAST, *SHORT]])
    assert "predict_accuracy" not in json.loads((again / "predict_results.json").read_text())
    assert len(json.loads((again / "predictions.json").read_text())["labels"]) == 3
    capsys.readouterr()


# -- data checked when read, before training --------------------------------------------------------------------------

GLUE_DATA_CASES = {
    # id -> (files to write: name -> rows or raw text, flags, phrase)
    "one class only": ({"train.jsonl": sentences(32, labels=(1,))}, ["--do_train"],
                       "every row has the label '1' in column 'label': a classifier needs at least two classes"),
    "empty training file": ({"train.jsonl": ""}, ["--do_train"], "train.jsonl is empty"),
    "null text": ({"train.jsonl": sentences(4) + [{"sentence": None, "label": 0}]}, ["--do_train"],
                  "train.jsonl line 5: 'sentence' is null"),
    "unseen validation label": ({"train.jsonl": sentences(16), "validation.jsonl": sentences(3, labels=(0, 2))},
                                ["--do_train", "--do_eval"],
                                "validation.jsonl line 2 (validation) has the label 2, which the training data never "
                                "uses"),
    "a line that is not JSON": ({"train.jsonl": '{"sentence": "a", "label": 1}\n{"sentence": "b",\n'}, ["--do_train"],
                                "train.jsonl line 2 is not JSON"),
    "regression targets": ({"train.jsonl": [{"sentence": "a", "label": 0.25}, {"sentence": "b", "label": 3.5}]},
                           ["--do_train"], "labels must be class names or whole numbers"),
    "null label": ({"train.jsonl": sentences(3) + [{"sentence": "d", "label": None}]}, ["--do_train"],
                   "train.jsonl line 4: 'label' is empty"),
    "numbers as text column": ({"train.jsonl": sentences(8)}, ["--do_train", "--text_column", "label"],
                               "'label' is 0, not a text"),
    "CSV beside JSON lines": ({"train.csv": "sentence,label\na,0\nb,1\n", "validation.jsonl": sentences(2)},
                              ["--do_train", "--do_eval"], "the data files mix CSV and JSON lines"),
    "not UTF-8": ({"train.jsonl": b'{"sentence": "caf\xe9", "label": 1}\n'}, ["--do_train"], "not UTF-8 text"),
    "plain text file": ({"train.txt": "a sentence\nanother\n"}, ["--do_train"], "train.txt: give JSON lines"),
    "validation without labels": ({"train.jsonl": sentences(16), "validation.jsonl": [{"sentence": "x"}]},
                                  ["--do_train", "--do_eval"], "validation.jsonl line 1 (validation) has no label"),
    "global batch larger than the data": ({"train.jsonl": sentences(32)},
                                          ["--do_train", "--gradient_accumulation_steps", "1000"],
                                          "a global batch of 8000 samples (--per_device_train_batch_size 8 x "
                                          "--gradient_accumulation_steps 1000 x 1 rank(s)) is larger than the 32"),
    "longer than the model's positions": ({"train.jsonl": sentences(32)}, ["--do_train", "--max_seq_length", "1024"],
                                          "--max_seq_length 1024 is longer than the model accepts (512 positions)"),
    "label column is the text column": ({"train.jsonl": sentences(32)}, ["--do_train", "--label_column", "sentence"],
                                        "column 'sentence' has 32 different values in 32 rows"),
    "no evaluation sample": ({"train.jsonl": sentences(16), "validation.jsonl": sentences(4)},
                             ["--do_train", "--do_eval", "--max_eval_samples", "0"],
                             "--max_eval_samples 0: must be at least 1 (leave it unset for every sample)"),
    "metric for the best model misspelled": ({"train.jsonl": sentences(32)},
                                             ["--do_train", "--metric_for_best_model", "acuracy"],
                                             "--metric_for_best_model acuracy: this task's evaluation reports loss, "
                                             "accuracy (did you mean accuracy?)"),
}


@pytest.mark.parametrize("case", list(GLUE_DATA_CASES))
def test_classification_data_is_checked_before_training(tmp_path, capsys, tiny_bert_dir, case):
    """Each defect reached datasets/tokenizers as a traceback, trained as something else, or crashed mid-training."""
    files, flags, phrase = GLUE_DATA_CASES[case]
    given = []
    for name, content in files.items():
        path = tmp_path / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif isinstance(content, str):
            path.write_text(content)
        else:
            write_lines(path, content)
        given += [f"--{name.split('.')[0]}_file", path]
    out = tmp_path / "out"
    err = user_error(capsys, "run_glue", "--model_name_or_path", tiny_bert_dir, "--output_dir", out, *given, *FAST,
                     *SHORT, *flags)
    assert phrase in err, err
    assert not out.exists() or not any(out.iterdir())  # the Trainer creates it; nothing is written there


def test_a_classifier_head_for_other_classes_is_named(tmp_path, capsys, tiny_bert_dir):
    """A fine-tuned 2-class model on 3-class data ended in transformers' mismatched-sizes traceback."""
    from transformers import BertForSequenceClassification

    model = tmp_path / "classifier"
    BertForSequenceClassification.from_pretrained(tiny_bert_dir, num_labels=2).save_pretrained(model)
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json"):
        (model / name).write_bytes((tiny_bert_dir / name).read_bytes())
    train = write_lines(tmp_path / "train.jsonl", sentences(24, labels=("a", "b", "c")))
    err = user_error(capsys, "run_glue", "--model_name_or_path", model, "--output_dir", tmp_path / "out",
                     "--train_file", train, "--do_train", *FAST, *SHORT)
    assert "is a classifier for 2 classes but the data has 3 (a, b, c)" in err and "ignore_mismatched_sizes" in err


def test_model_folders_and_files_a_user_gets_wrong(tmp_path, capsys, tiny_bert_dir):
    """A model folder without tokenizer files trained on [UNK] only (exit 0: transformers 5 builds a tokenizer of
    special tokens); damaged weights or tokenizer files, or a folder given as a data file, ended in tracebacks."""
    import shutil

    train = write_lines(tmp_path / "train.jsonl", sentences(16))
    cases = {"no tokenizer": ("no tokenizer files there", lambda m: [(m / n).unlink() for n in
                                                                     ("vocab.txt", "tokenizer.json",
                                                                      "tokenizer_config.json")]),
             "damaged weights": ("cannot read the model: Error while deserializing header",
                                 lambda m: (m / "model.safetensors").write_bytes(b"\x10" * 100)),
             "damaged tokenizer": ("cannot read the tokenizer", lambda m: (m / "tokenizer.json").write_text("{\"v")),
             "data folder": ("a folder, not a file", None)}
    for case, (phrase, damage) in cases.items():
        model = tmp_path / case
        shutil.copytree(tiny_bert_dir, model)
        if damage:
            damage(model)
        err = user_error(capsys, "run_glue", "--model_name_or_path", model, "--output_dir", tmp_path / "out",
                         "--train_file", tmp_path if damage is None else train, "--do_train", *FAST, *SHORT)
        assert phrase in err, case


def test_files_datasets_reads_pass_the_checks(tmp_path):
    """The file checks must not refuse what datasets reads: a BOM, Windows line ends, blank lines, a JSON array."""
    from trainer_ext.tasks.data_checks import first_problem

    line = json.dumps({"sentence": "a", "label": 1})
    (tmp_path / "bom.jsonl").write_text(f"{line}\n{line}\n", encoding="utf-8-sig")
    (tmp_path / "crlf.jsonl").write_bytes(f"{line}\r\n\r\n{line}\r\n".encode())
    (tmp_path / "array.json").write_text(f"[{line}, {line}]")
    assert [first_problem(tmp_path / name) for name in ("bom.jsonl", "crlf.jsonl", "array.json")] == [None] * 3


def squad(contexts_and_answers, impossible=0):
    """A SQuAD file: (context, answer text, answer_start) per question, plus `impossible` unanswerable ones."""
    qas = [{"id": f"q{i}", "question": "what is it?", "answers": [{"text": text, "answer_start": start}]}
           for i, (_, text, start) in enumerate(contexts_and_answers)]
    qas += [{"id": f"n{i}", "question": "and this?", "answers": [], "is_impossible": True} for i in range(impossible)]
    context = contexts_and_answers[0][0]
    return {"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": context, "qas": qas}]}]}


CONTEXT = "the movie was good and the actor was great"
RIGHT = (CONTEXT, "good", CONTEXT.index("good"))
WRONG = (CONTEXT, "good", 2)


@pytest.mark.parametrize("case,document,phrase", [
    ("a list at the top", [{"context": CONTEXT}], "is a list at the top: a SQuAD file is one JSON object"),
    ("answers not where answer_start points", squad([WRONG] * 3 + [RIGHT]),
     "3 of 4 answers (75.0%) are not where their answer_start points (first: "),
    ("unanswerable questions without --version_2_with_negative", squad([RIGHT] * 2, impossible=2),
     "2 of 4 questions have no answer (SQuAD v2's is_impossible): pass --version_2_with_negative"),
    ("a question without text", {"version": "1.1", "data": [{"paragraphs": [{"context": CONTEXT, "qas": [
        {"id": "x", "answers": []}]}]}]}, "question id 'x' (data[0].paragraphs[0].qas[0]) has no \"question\" text"),
])
def test_squad_files_are_checked_before_training(tmp_path, capsys, tiny_bert_dir, case, document, phrase):
    """A SQuAD list, a wrong answer_start or v2 questions in a v1 run: a datasets traceback or wrong spans, no word."""
    path = tmp_path / "train.json"
    path.write_text(json.dumps(document))
    err = user_error(capsys, "run_qa", "--model_name_or_path", tiny_bert_dir, "--output_dir", tmp_path / "out",
                     "--train_file", path, "--do_train", "--doc_stride", 8, *FAST, *SHORT)
    assert phrase in err


def test_a_few_misplaced_answers_are_left_out_and_said(tmp_path):
    """Below --max_misplaced_answers the questions with a wrong answer_start must not train on the wrong span."""
    from trainer_ext.tasks.data_checks import DataError, check_squad

    path = tmp_path / "train.json"
    path.write_text(json.dumps(squad([RIGHT] * 199 + [WRONG])))
    assert check_squad(path, version_2=False, max_misplaced=0.01) == {"q199"}
    with pytest.raises(DataError, match=r"1 of 200 answers \(0\.5%\).*--max_misplaced_answers 0\.01"):
        check_squad(path, version_2=False, max_misplaced=0.0)


@pytest.mark.parametrize("case,rows,flags,phrase", [
    ("a null target text", [{"translation": {"en": "a b", "de": "c d"}}, {"translation": {"en": "e f", "de": None}}],
     [], "line 2: the 'de' text is missing (null)"),
    ("a language missing from a later line", [{"translation": {"en": "a", "de": "b"}}] * 3 +
     [{"translation": {"en": "a", "fr": "b"}}], [], "line 4: no 'de' text (--target_lang de)"),
    ("source longer than the encoder's positions", [{"translation": {"en": "a b", "de": "c d"}}] * 8,
     ["--max_source_length", "128"], "--max_source_length 128 is longer than the encoder accepts (64 positions)"),
])
def test_translation_pairs_are_checked_before_training(tmp_path, capsys, tiny_bert_dir, case, rows, flags, phrase):
    """A null or missing text in any line (only the first was checked) and a source longer than a BART's positions
    ended in tokenizer / embedding tracebacks."""
    from conftest import tiny_bart_config

    model = tmp_path / "bart"  # a config without weights (64 positions) and a tokenizer of the user's
    model.mkdir()
    tiny_bart_config(model / "config.json")
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json"):
        (model / name).write_bytes((tiny_bert_dir / name).read_bytes())
    train = write_lines(tmp_path / "train.jsonl", rows)
    err = user_error(capsys, "run_translation", "--model_name_or_path", model, "--output_dir", tmp_path / "out",
                     "--train_file", train, "--do_train", "--per_device_train_batch_size", 2, *FAST, *flags)
    assert phrase in err


def test_global_batch_against_the_data_on_any_world_size():
    """3 rows on 2 ranks with batch 8 trained 16 samples a step and called it an epoch, with no word."""
    from types import SimpleNamespace

    from trainer_ext.data.samplers import global_batch_problem

    args = SimpleNamespace(per_device_train_batch_size=8, gradient_accumulation_steps=1, process_index=0)
    assert "a global batch of 16 samples" in global_batch_problem(args, 3, world_size=2, repeat=False)
    assert "--per_device_train_batch_size 1 and --gradient_accumulation_steps 1" in global_batch_problem(args, 3, 2,
                                                                                                         False)
    assert global_batch_problem(args, 16, world_size=2, repeat=False) is None
    assert global_batch_problem(args, 3, world_size=2, repeat=True) is None  # the user's choice: trained repeated, said


@pytest.mark.launch
def test_three_rows_on_two_ranks_with_batch_eight(tmp_path):
    """torchrun with 2 ranks, batch 8 and 3 training rows trained 16 samples a step and called it an epoch, exit 0."""
    from conftest import free_port, launcher

    out = run([*launcher("torchrun"), "--nproc_per_node", 2, "--master_port", free_port(), TINY_TRAIN, "--output_dir",
               tmp_path / "out", "--num_samples", 3, "--per_device_train_batch_size", 8, "--num_train_epochs", 1,
               "--report_to", "none"], timeout=300)
    assert out.returncode != 0, out.stderr[-3000:]  # torchrun's own ChildFailedError traceback follows the line
    assert "tiny_train.py: error: a global batch of 16 samples (--per_device_train_batch_size 8 x --gradient_accumulation_steps 1 x 2 " \
           "rank(s)) is larger than the 3 training sample(s)" in out.stderr
    assert not (tmp_path / "out" / "train_results.json").exists()


# -- values transformers would coerce silently, and one validation for preview and training --------------------------

@pytest.mark.parametrize("flags,phrase", [
    (["--eval_strategy", "steps", "--eval_steps", "0"], "--eval_steps 0: must be > 0"),
    (["--logging_steps", "-1"], "--logging_steps -1: must be > 0"),
    (["--save_total_limit", "0"], "--save_total_limit 0: must be at least 1; transformers would keep every checkpoint"),
    (["--save_steps", "0"], "--save_steps 0: must be > 0"),
    (["--max_steps", "0"], "--max_steps 0: must be a positive number of steps, or -1"),
    (["--seed", "-1"], "--seed -1: must be in [0, 2**32)"),
    (["--dataloader_num_workers", "-2"], "--dataloader_num_workers -2: must be >= 0"),
    (["--label_smoothing_factor", "1.5"], "--label_smoothing_factor 1.5: must be in [0, 1)"),
    (["--eval_delay", "-1"], "--eval_delay -1: must be >= 0"),
    (["--use_cpu", "--fp16"], "--fp16 with --use_cpu: fp16 needs a CUDA device"),
])
def test_values_transformers_would_coerce_are_refused_with_the_range(tmp_path, flags, phrase, capsys):
    """transformers turned --eval_steps 0 into 500, stored --logging_steps -1 as -2, kept every checkpoint for
    --save_total_limit 0, never saved for --save_steps 0 and trained epochs for --max_steps 0."""
    from trainer_ext import ExtArgumentParser, ExtTrainingArguments

    with pytest.raises(SystemExit) as stopped:
        ExtArgumentParser(ExtTrainingArguments).parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--report_to", "none", *flags])
    assert stopped.value.code == 2 and phrase in capsys.readouterr().err


@pytest.mark.parametrize("deepspeed,flags,phrase", [
    ('{"optimizer": {"type": "AdamWW", "params": {}}}', [],
     "optimizer.type \"AdamWW\" is not an optimizer DeepSpeed builds: did you mean 'AdamW'?"),
    ('{"optimizer": {"type": "SGD", "params": {}}}', [], "\"zero_allow_untested_optimizer\": true"),
    ('{"scheduler": {"type": "WarmupLRR", "params": {}}}', [], "did you mean 'WarmupLR'"),
    ("zero2", ["--use_cpu"], "fp16 needs a CUDA device and --use_cpu trains on the CPU — fp16 comes from the "
                             "DeepSpeed file's fp16.enabled"),
    ("zero2_minimal", ["--use_cpu", "--fp16"], "--fp16 with --use_cpu: fp16 needs a CUDA device"),
])
def test_preview_refuses_what_training_refuses(tmp_path, capsys, deepspeed, flags, phrase):
    """`trainer-ext ds-config` rendered AdamWW (a DeepSpeed assertion at train time) and an fp16 config for
    --use_cpu: the preview and the training arguments must give the same line."""
    from trainer_ext import ExtArgumentParser, ExtTrainingArguments
    from trainer_ext.cli import main

    try:
        status = main(["ds-config", "--deepspeed", deepspeed, *flags])
    except SystemExit as stopped:  # a flag's problem: the parser's exit
        status = stopped.code
    assert status == 2 and phrase in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:
        ExtArgumentParser(ExtTrainingArguments).parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--report_to", "none", "--deepspeed", deepspeed, *flags])
    assert stopped.value.code == 2 and phrase in capsys.readouterr().err


# -- compute_metrics' answer ------------------------------------------------------------------------------------------

def test_compute_metrics_returning_a_float_keeps_the_training_done(tmp_path, capsys):
    """A compute_metrics returning a float crashed at the first evaluation and the steps trained were lost."""
    from conftest import tiny_bert

    from trainer_ext import ExtTrainer, ExtTrainingArguments
    from trainer_ext.checkpoints.format import problem_with

    def float_accuracy(prediction):
        return 0.5

    data = [{"input_ids": [1, 2, 3, i % 40 + 4], "labels": i % 2} for i in range(32)]
    args = ExtTrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, max_steps=6,
                                per_device_train_batch_size=8, eval_strategy="steps", eval_steps=2,
                                save_strategy="steps", save_steps=100, disable_tqdm=True)
    trainer = ExtTrainer(model=tiny_bert(), args=args, train_dataset=data, eval_dataset=data[:8],
                         compute_metrics=float_accuracy)
    from trainer_ext.errors import report
    from trainer_ext.training.metrics_check import MetricsError

    with pytest.raises(MetricsError) as raised:  # catchable; uncaught, the process boundary prints it as one line
        trainer.train()
    report(raised.value)
    err = capsys.readouterr().err
    assert "compute_metrics test_first_day.test_compute_metrics_returning_a_float_keeps_the_training_done." \
           "<locals>.float_accuracy (" in err and "returned a float (0.5)" in err
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert f"the training so far is saved in {checkpoint}" in err and problem_with(checkpoint) is None


@pytest.mark.parametrize("answer,phrase", [
    ({"accuracy": "high"}, "a dict whose 'accuracy' is a str ('high')"),
    ({"accuracy": None}, "a dict whose 'accuracy' is a NoneType (None)"),
    ([0.5], "a list ([0.5])"),
    ({0: 0.5}, "a dict with the key 0"),
])
def test_metrics_that_are_not_a_dict_of_numbers(answer, phrase):
    """Numbers of any kind pass (numpy scalars, one-element arrays); anything else is named."""
    import numpy as np

    from trainer_ext.training.metrics_check import metrics_problem

    assert phrase in metrics_problem(answer)
    assert metrics_problem({"a": 1, "b": np.float32(0.5), "c": np.array([2.0]), "d": True}) is None


# -- the output_dir lock ---------------------------------------------------------------------------------------------

def lock_record(**fields):
    import socket

    return {"host": socket.gethostname(), "pid": 0, "started": 0.0, "locked_at": time.time(), "command": "train.py",
            **fields}


def test_a_live_lock_is_named_and_a_stale_one_taken_over(tmp_path):
    """Two runs in one output_dir interleaved their checkpoints; a run killed with SIGKILL must not block the next."""
    import psutil

    from trainer_ext.checkpoints.output_lock import LOCK, OutputDirError, OutputDirLock, holder_problem

    parent = psutil.Process(os.getppid())
    (tmp_path / LOCK).write_text(json.dumps(lock_record(pid=parent.pid, started=parent.create_time())))
    with pytest.raises(OutputDirError, match=rf"being written by another run: pid {parent.pid} on host"):
        OutputDirLock.acquire(tmp_path)
    (tmp_path / LOCK).write_text(json.dumps(lock_record(pid=parent.pid, started=1.0)))  # that pid, reused
    assert holder_problem(tmp_path) is None
    lock = OutputDirLock.acquire(tmp_path)
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    assert OutputDirLock.acquire(tmp_path) is lock  # this process again: its own lock
    lock.release()
    assert not (tmp_path / LOCK).exists()
    # another host: alive while its heartbeat is fresh
    (tmp_path / LOCK).write_text(json.dumps(lock_record(host="elsewhere", pid=7)))
    assert "pid 7 on host elsewhere" in holder_problem(tmp_path)
    os.utime(tmp_path / LOCK, (time.time() - 3600, time.time() - 3600))
    assert holder_problem(tmp_path) is None


@pytest.mark.launch
def test_two_launches_on_one_output_dir(tmp_path):
    """The second launch must say who is writing there (pid and command) and train nothing; after the first is
    killed (its lock left behind) the next run takes the stale lock over and trains."""
    output_dir = tmp_path / "out"
    flags = ["--output_dir", output_dir, "--report_to", "none", "--save_steps", 1, "--disable_tqdm", "true",
             "--per_device_train_batch_size", 8]
    first = subprocess.Popen([str(a) for a in (PYTHON, TINY_TRAIN, *flags, "--max_steps", 100000)], env={**clean_env(),
                             "PYTHONUNBUFFERED": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        deadline = time.time() + 240
        while not (output_dir / "checkpoint-1").is_dir() and time.time() < deadline and first.poll() is None:
            time.sleep(0.5)
        assert (output_dir / "checkpoint-1").is_dir(), "the first run did not start training"
        second = run([PYTHON, TINY_TRAIN, *flags, "--max_steps", 2], timeout=300)
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-3000:]
        assert f"--output_dir {output_dir} is being written by another run: pid {first.pid} on host" in second.stderr
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert (output_dir / ".trainer_ext.lock").is_file()  # killed: nothing removed it
    third = run([PYTHON, TINY_TRAIN, *flags, "--max_steps", 2, "--fresh_start"], timeout=300)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "taking over the lock of a run that is gone" in third.stderr
    assert not (output_dir / ".trainer_ext.lock").exists()


# -- the launch environment ------------------------------------------------------------------------------------------

@pytest.mark.launch
def test_leftover_rank_variables_fail_in_seconds(tmp_path):
    """WORLD_SIZE=2 RANK=0 left in a shell made a plain `python` run wait forever for a peer, printing nothing."""
    from conftest import free_port

    out = run([PYTHON, TINY_TRAIN, "--output_dir", tmp_path / "out", "--max_steps", 2, "--report_to", "none"],
              env={"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())},
              timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "WORLD_SIZE=2 RANK=0" in out.stderr and "no launcher started this process" in out.stderr
    assert "unset WORLD_SIZE RANK MASTER_ADDR MASTER_PORT" in out.stderr


def test_rank_variables_under_a_launcher_or_a_scheduler_are_the_jobs(monkeypatch):
    """torchrun, the deepspeed launcher, MPI, Slurm and Kubernetes pods set the variables themselves: never refused."""
    from trainer_ext.environment.launcher import LAUNCHER_VARIABLES, rank_variables_problem

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert "WORLD_SIZE=2 RANK=1" in rank_variables_problem()
    for name in LAUNCHER_VARIABLES:
        monkeypatch.setenv(name, "1")
        assert rank_variables_problem() is None, name
        monkeypatch.delenv(name)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert rank_variables_problem() is None


@pytest.mark.launch
def test_sharded_ddp_simple_without_a_launcher_runs_as_one_rank(tmp_path):
    """`python script.py --sharded_ddp simple` died with "Default process group has not been initialized", while
    --deepspeed without a launcher ran as one rank."""
    out = run([PYTHON, TINY_TRAIN, "--output_dir", tmp_path / "out", "--max_steps", 2, "--report_to", "none",
               "--sharded_ddp", "simple", "--per_device_train_batch_size", 8], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "backend fairscale --sharded_ddp simple on 1 rank" in out.stdout + out.stderr
    assert json.loads((tmp_path / "out" / "train_results.json").read_text())["train_loss"] > 0


def test_batch_eval_metrics_may_return_nothing_until_the_last_batch():
    """With --batch_eval_metrics transformers calls compute_metrics per batch with compute_result=False, where None is
    the protocol's answer (its own tests do this): it was refused as not a dict."""
    import inspect
    from types import SimpleNamespace

    from trainer_ext.training.metrics_check import checked_compute_metrics

    def batched(prediction, compute_result):
        return {"accuracy": 1.0} if compute_result else None

    checked = checked_compute_metrics(SimpleNamespace(compute_metrics=batched))
    assert "compute_result" in inspect.signature(checked).parameters  # transformers checks this at init
    assert checked(None, compute_result=False) is None
    assert checked(None, compute_result=True) == {"accuracy": 1.0}


@pytest.mark.parametrize("task", sorted(TASKS))
def test_a_mistyped_data_file_names_the_file_it_likely_meant(tmp_path, task):
    """`--train_file data/trian.jsonl` said only that no such file exists, beside a data/train.jsonl."""
    from types import SimpleNamespace

    from trainer_ext.errors import ArgumentsError
    from trainer_ext.experiment import argument_classes
    from trainer_ext.tasks import translation

    (tmp_path / "train.jsonl").write_text("{}\n")
    typo = tmp_path / "trian.jsonl"
    _, data_cls, _ = argument_classes(task)
    with pytest.raises(ArgumentsError, match=r"did you mean .*train\.jsonl\?"):
        data = data_cls(train_file=str(typo))
        if task == "translation":  # its files are checked when the run reads them
            translation.data_files(data, SimpleNamespace(do_train=True, do_eval=False, do_predict=False))
