"""What a stock-Trainer user relies on, kept by ExtTrainer, in one process on a tiny model (seconds each): the stock
Trainer itself is the oracle where it applies. The same promises on 2 ranks are in test_trainer_promises_ranks.py."""

import json
import logging
import math
import os
import re
import signal
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments)

from conftest import run  # a clean environment: an in-process ZeRO test leaves RANK/MASTER_PORT set
from trainer_ext import ExtTrainer, ExtTrainingArguments
from trainer_ext.checkpoints.format import CheckpointNotFoundError, damage, publish
from trainer_ext.checkpoints.preemption import Preempted
from trainer_ext.errors import UserError

pytestmark = pytest.mark.oldest

ROOT = Path(__file__).resolve().parents[2]
# what a child process needs on sys.path to import this module: the package, tests/ (conftest) and this folder
IMPORTABLE = ":".join(str(path) for path in (ROOT, ROOT / "tests", Path(__file__).resolve().parent))
ROWS = 64


def tiny_model():
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def rows():
    ids = torch.randint(1, 64, (ROWS, 8), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": ids[i], "labels": int(ids[i, 0] > 32)} for i in range(ROWS)]


def arguments(output_dir, cls=ExtTrainingArguments, **flags):
    base = dict(output_dir=str(output_dir), report_to="none", use_cpu=True, per_device_train_batch_size=8,
                disable_tqdm=True, logging_steps=1, save_strategy="steps", save_steps=2, max_steps=4)
    return cls(**{**base, **flags})


def trained(output_dir, trainer_cls=ExtTrainer, args_cls=ExtTrainingArguments, resume=None, callbacks=None, **flags):
    trainer = trainer_cls(model=tiny_model(), args=arguments(output_dir, args_cls, **flags), train_dataset=rows(),
                          eval_dataset=rows()[:16], callbacks=callbacks)
    outcome = trainer.train(resume_from_checkpoint=resume)
    return trainer, outcome


def test_best_checkpoint_is_recorded_by_its_published_path_and_survives_rotation(tmp_path):
    """Fails when the best checkpoint is recorded in the staging folder (or not at all) while checkpoints are written
    aside, or rotation deletes it: the stock Trainer, same flags, is the oracle (its folders, its best, its weights)."""
    flags = dict(max_steps=-1, num_train_epochs=2, eval_strategy="epoch", save_steps=1, save_total_limit=2,
                 metric_for_best_model="loss")
    stock, _ = trained(tmp_path / "stock", Trainer, TrainingArguments, **flags)
    ours, _ = trained(tmp_path / "ours", **flags)
    assert stock.state.best_model_checkpoint == str(tmp_path / "stock" / "checkpoint-8")
    assert ours.state.best_model_checkpoint == str(tmp_path / "ours" / "checkpoint-8")
    # the same entries as the stock Trainer's (transformers' tests count them): no lock or staging folder left
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == sorted(p.name for p in (tmp_path / "stock").iterdir())
    folders = sorted(p.name for p in (tmp_path / "ours").iterdir() if p.name.startswith("checkpoint-"))
    assert folders == sorted(p.name for p in (tmp_path / "stock").iterdir() if p.name.startswith("checkpoint-")) \
        == ["checkpoint-16", "checkpoint-8"]
    saved = json.loads((tmp_path / "ours" / "checkpoint-16" / "trainer_state.json").read_text())
    assert saved["best_model_checkpoint"] == str(tmp_path / "ours" / "checkpoint-8")
    assert damage(tmp_path / "ours" / "checkpoint-16") is None  # rewritten before its checksum was recorded

    # load_best_model_at_end (strategies matching, as transformers requires) loads that checkpoint's weights.
    flags.update(eval_strategy="steps", eval_steps=4, save_steps=4, load_best_model_at_end=True, save_total_limit=1,
                 greater_is_better=True)  # the worst loss is "best": an early checkpoint, not the last
    ours, _ = trained(tmp_path / "best", **flags)
    best = tmp_path / "best" / "checkpoint-4"
    assert ours.state.best_model_checkpoint == str(best)
    assert sorted(p.name for p in (tmp_path / "best").glob("checkpoint-*")) == ["checkpoint-4"]  # limit 1: the best
    expected = load_file(str(best / "model.safetensors"))
    assert all(torch.equal(ours.model.state_dict()[key], value) for key, value in expected.items())


def test_resume_false_starts_fresh_and_true_without_a_checkpoint_is_an_error(tmp_path):
    """Fails when train(resume_from_checkpoint=False), the stock way to force a fresh start, is refused, or when
    True (resume, as the user asked) trains from scratch silently where the stock Trainer raises."""
    trained(tmp_path / "run")
    trainer, outcome = trained(tmp_path / "run", resume=False)
    assert outcome.global_step == 4 and "already_complete" not in outcome.metrics
    with pytest.raises(CheckpointNotFoundError, match="No valid checkpoint found in output directory"):
        trained(tmp_path / "empty", resume=True)
    with pytest.raises(FileNotFoundError):  # the not-found kind is a FileNotFoundError too
        trained(tmp_path / "empty", resume=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError):  # every user error is a ValueError (UserError)
        trained(tmp_path / "empty", resume=True)


def test_a_second_train_in_the_same_process_trains_as_the_stock_trainer(tmp_path):
    """Fails when a second train() (a notebook, two phases, transformers' own tests) picks up the checkpoint this
    same process just wrote and trains nothing ("already complete") or refuses it as another model's."""
    first, _ = trained(tmp_path / "run")
    again = ExtTrainer(model=tiny_model(), args=arguments(tmp_path / "run"), train_dataset=rows())
    outcome = again.train()
    assert again.training_already_complete is None and outcome.global_step == 4
    assert [row["loss"] for row in again.state.log_history if "loss" in row] == \
        [row["loss"] for row in first.state.log_history if "loss" in row]  # trained from step 0, the same way
    wider = BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=24, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=32))
    ExtTrainer(model=wider, args=arguments(tmp_path / "run"), train_dataset=rows()).train()  # another model: fine


@pytest.mark.launch
def test_a_checkpoint_an_earlier_process_wrote_is_resumed(tmp_path, caplog):
    """Fails when the automatic resume of a restarted command stops picking up what an earlier process wrote (the
    other side of the same-process rule)."""
    code = ("import sys; sys.path[:0] = sys.argv[1].split(':'); import test_trainer_promises as t; "
            "t.trained(sys.argv[2], max_steps=2)")
    done = run([sys.executable, "-c", code, IMPORTABLE, tmp_path / "run"], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with caplog.at_level(logging.WARNING):
        trainer, outcome = trained(tmp_path / "run")
    assert f"resuming from {tmp_path / 'run' / 'checkpoint-2'}" in caplog.text and outcome.global_step == 4


def test_weights_resaved_in_another_layout_resume_and_damaged_files_do_not(tmp_path, caplog):
    """Fails when a checkpoint whose weights a user re-saved as shards + index (the stock resume test does it) is
    refused as damaged, or when a truncated or changed file stops being refused."""
    trained(tmp_path / "run")
    checkpoint = tmp_path / "run" / "checkpoint-2"
    model = BertForSequenceClassification.from_pretrained(checkpoint)
    (checkpoint / "model.safetensors").unlink()
    model.save_pretrained(checkpoint, max_shard_size="20KB")
    assert len(list(checkpoint.glob("model-*-of-*.safetensors"))) > 1
    with caplog.at_level(logging.WARNING):
        trainer, outcome = trained(tmp_path / "run", resume=str(checkpoint))
    assert outcome.global_step == 4 and f"resuming from {checkpoint}" in caplog.text
    assert "its weights are no longer the files written there" in caplog.text
    sorted(checkpoint.glob("model-*-of-*.safetensors"))[0].unlink()  # the new layout incomplete: not loadable
    with pytest.raises(UserError, match="model.safetensors is missing"):
        trained(tmp_path / "run", resume=str(checkpoint))


def test_damage_tells_a_relayout_from_a_fault(tmp_path):
    """Fails when a deliberate relayout of the weights (either direction) is called damage, or a fault is not."""
    def checkpoint(name, files):
        folder = tmp_path / "staged" / name
        folder.mkdir(parents=True)
        for relative, content in files.items():
            (folder / relative).write_bytes(content)
        (tmp_path / "out").mkdir(exist_ok=True)
        return publish(folder, tmp_path / "out", {})

    index = json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                       "b": "model-00002-of-00002.safetensors"}}).encode()
    sharded = checkpoint("checkpoint-1", {"model.safetensors.index.json": index, "optimizer.pt": b"o",
                                          "model-00001-of-00002.safetensors": b"one",
                                          "model-00002-of-00002.safetensors": b"two"})
    for name in ("model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        (sharded / name).unlink()
    (sharded / "model.safetensors").write_bytes(b"merged")
    assert damage(sharded) is None  # merged into one file
    single = checkpoint("checkpoint-2", {"model.safetensors": b"weights", "optimizer.pt": b"o"})
    (single / "model.safetensors").unlink()
    assert damage(single) == "model.safetensors is missing"  # no other layout: a fault
    (single / "model.safetensors.index.json").write_bytes(index)
    (single / "model-00001-of-00002.safetensors").write_bytes(b"1")
    assert damage(single) == "model.safetensors is missing"  # an index whose shards are not all there
    (single / "model-00002-of-00002.safetensors").write_bytes(b"2")
    assert damage(single) is None  # re-saved sharded
    (single / "optimizer.pt").write_bytes(b"x")
    assert "does not match the checksum" in damage(single)  # a file of the checkpoint changed: still refused


def test_auto_find_batch_size_survives_a_finished_run_started_again(tmp_path):
    """Fails when the batch size auto_find_batch_size settled on is lost (back to the flag's) when a finished run is
    started again and trains nothing."""
    class OutOfMemoryAt16(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.train_batch_size == 16:
                raise RuntimeError("CUDA out of memory.")

    flags = dict(auto_find_batch_size=True, per_device_train_batch_size=16)
    first, _ = trained(tmp_path / "run", callbacks=[OutOfMemoryAt16()], **flags)
    found = first.state.train_batch_size  # accelerate 1.3 halves (8), newer releases take 10% off (14)
    assert found < 16
    again, outcome = trained(tmp_path / "run", resume=True, **flags)
    assert outcome.metrics.get("already_complete") and again._train_batch_size == found


NOTEBOOK = """
import atexit, json, os, sys
live = []  # every exit handler registered from here on and not unregistered: module.qualname
register, unregister = atexit.register, atexit.unregister
def name(f):
    return f"{getattr(f, '__module__', None)}.{getattr(f, '__qualname__', f)}"
def tracked_register(f, *a, **k):
    live.append(name(f))
    return register(f, *a, **k)
def tracked_unregister(f):
    while name(f) in live:
        live.remove(name(f))
    return unregister(f)
atexit.register, atexit.unregister = tracked_register, tracked_unregister
sys.path[:0] = sys.argv[1].split(":")
import test_trainer_promises as t
from trainer_ext import ExtTrainer, ExtTrainingArguments

def state():
    return {"environ": dict(os.environ), "excepthook": repr(sys.excepthook), "atexit": sorted(live)}

args = t.arguments(sys.argv[2] + "/ours", ExtTrainingArguments)
before = state()
ours = ExtTrainer(model=t.tiny_model(), args=args, train_dataset=t.rows())
built = state()
ours.train()
trained = state()
ours.train()  # again: nothing more
json.dump(dict(before=before, built=built, trained=trained, again=state(), deepspeed="deepspeed" in sys.modules),
          sys.stdout)
"""


@pytest.mark.launch
def test_building_and_training_ext_trainer_leaves_the_process_as_it_was(tmp_path):
    """Fails when building ExtTrainer in a notebook or a single process changes sys.excepthook, the exit handlers or
    os.environ (DeepSpeed's import, installed but not training, included: the stock Trainer's build leaves
    PYTORCH_NVML_BASED_CUDA_CHECK behind), or when training leaves an exit handler of trainer_ext's behind (the output
    folder's lock unregisters its own; no process group, so none releases one)."""
    done = run([sys.executable, "-c", NOTEBOOK, IMPORTABLE, tmp_path], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["deepspeed"]  # imported while building, as accelerate would
    assert seen["built"] == seen["before"]
    assert seen["trained"]["environ"] == seen["before"]["environ"]
    assert seen["trained"]["excepthook"] == seen["before"]["excepthook"]
    for after in (seen["trained"], seen["again"]):
        assert not [name for name in after["atexit"] if name.startswith("trainer_ext")], after["atexit"]


class NonFiniteAtSomeSteps(BertForSequenceClassification):
    """A classifier whose loss reads NaN at its 3rd training forward and inf at its 6th (a constant added: the
    gradients stay finite, so only the logged loss meets it)."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        outputs = super().forward(input_ids=input_ids, labels=labels, **kwargs)
        if self.training:
            self.calls = getattr(self, "calls", 0) + 1
            outputs.loss = outputs.loss + {3: float("nan"), 6: float("inf")}.get(self.calls, 0.0)
        return outputs


def test_a_non_finite_step_loss_is_filtered_from_the_logged_loss_as_the_stock_trainer_does(tmp_path):
    """Fails when ExtTrainer's NaN/Inf filter of the logged loss (done on the device, without the stock loop's host
    read after every micro-batch) logs another loss or train_loss than transformers' own filter: the stock Trainer,
    same model and steps, is the oracle; with --logging_nan_inf_filter false both log the NaN and the inf."""
    for nan_filter in (True, False):
        logged = {}
        for trainer_cls, args_cls in ((Trainer, TrainingArguments), (ExtTrainer, ExtTrainingArguments)):
            torch.manual_seed(0)
            model = NonFiniteAtSomeSteps(tiny_model().config)
            args = arguments(tmp_path / f"{trainer_cls.__name__}-{nan_filter}", args_cls, logging_steps=2,
                             max_steps=8, save_strategy="no", logging_nan_inf_filter=nan_filter)
            trainer = trainer_cls(model=model, args=args, train_dataset=rows())
            outcome = trainer.train()
            logged[trainer_cls] = [row["loss"] for row in trainer.state.log_history if "loss" in row]
            logged[trainer_cls].append(outcome.training_loss)
        stock, ours = logged[Trainer], logged[ExtTrainer]
        assert len(ours) == len(stock) == 5
        assert all(a == b or abs(a - b) < 1e-7 or math.isnan(a) and math.isnan(b) for a, b in zip(ours, stock)), \
            (ours, stock)
        assert all(map(math.isfinite, ours)) == nan_filter


class SignalOnFirstLoad(torch.utils.data.Dataset):
    """The training set, whose first sample's loading sends this process SIGTERM (a preemption during start-up)."""

    def __init__(self, rows):
        self.rows, self.loaded = rows, 0

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        self.loaded += 1
        if self.loaded == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return self.rows[index]


def test_a_sigterm_before_the_first_optimizer_step_ends_the_run_at_once(tmp_path, caplog):
    """Fails when a SIGTERM that arrives before anything trained (here while the first batch loads; in the field
    while DeepSpeed compiled an op) waits for a step and writes a checkpoint of nothing (it came 89 s after the
    signal), instead of ending at once in one line with exit status 143; or leaves its handler installed."""
    handler = signal.getsignal(signal.SIGTERM)
    trainer = ExtTrainer(model=tiny_model(), args=arguments(tmp_path), train_dataset=SignalOnFirstLoad(rows()))
    with caplog.at_level(logging.WARNING), pytest.raises(Preempted) as stopped:
        trainer.train()
    assert stopped.value.code == 143 and stopped.value.checkpoint is None
    assert trainer.state.global_step == 0 and trainer.train_dataset.loaded == 1
    assert "received SIGTERM before the first optimizer step: nothing to save, stopping now (exit status 143)" \
        in caplog.text
    assert not list(tmp_path.glob("checkpoint-*")) and signal.getsignal(signal.SIGTERM) is handler


@pytest.mark.launch
def test_user_errors_are_catchable_and_uncaught_exit_2_in_one_line(tmp_path):
    """Fails when a user's mistake ends a script or notebook with SystemExit (uncatchable by `except Exception`), or
    when, uncaught in a script that called trainer_ext.one_line_errors(), it ends with a traceback instead of one line
    and exit status 2."""
    trainer = ExtTrainer(model=tiny_model(), args=arguments(tmp_path), train_dataset=rows())
    try:
        trainer.train(resume_from_checkpoint=str(tmp_path / "bogus"))
    except Exception as err:  # noqa: BLE001 - what a notebook user writes
        caught = err
    assert isinstance(caught, CheckpointNotFoundError) and "no such folder" in str(caught)
    script = tmp_path / "script.py"
    script.write_text("import sys; sys.path[:0] = sys.argv[1].split(':'); import test_trainer_promises as t; "
                      "import trainer_ext; trainer_ext.one_line_errors(); "
                      "t.trained(sys.argv[2], resume=sys.argv[2] + '/bogus')\n")
    done = run([sys.executable, script, IMPORTABLE, tmp_path], timeout=300)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.count(f"Can't find a valid checkpoint at {tmp_path}/bogus") == 1  # the stock Trainer's words



def test_hyperparameter_search_builds_each_trial_model_with_model_init(tmp_path):
    """Fails when transformers' hyperparameter_search (which drops the model between trials for model_init to build
    anew) breaks under ExtTrainer, or a trial resumes another trial's checkpoints."""
    pytest.importorskip("optuna")
    trainer = ExtTrainer(model_init=lambda trial=None: tiny_model(), args=arguments(tmp_path, eval_strategy="steps",
                                                                                   eval_steps=2),
                         train_dataset=rows(), eval_dataset=rows()[:16])
    best = trainer.hyperparameter_search(direction="minimize", backend="optuna", n_trials=2,
                                         hp_space=lambda trial: {"learning_rate": trial.suggest_float("lr", 1e-4, 1e-2)})
    assert best.run_id in ("0", "1")
    assert sorted(p.name for p in (tmp_path / f"run-{best.run_id}").glob("checkpoint-*")) == ["checkpoint-2",
                                                                                             "checkpoint-4"]


def rates(trainer):
    return {row["step"]: row["learning_rate"] for row in trainer.state.log_history if "learning_rate" in row}


def test_raising_max_steps_continues_on_the_new_schedule(tmp_path, caplog):
    """A finished 2-step run continued to 4 steps trained step 3 at the old linear schedule's last rate, 0, and step 4
    at 1.25e-5, saying nothing: steps 3-4 must train at the uninterrupted 4-step run's rates, said once."""
    flags = dict(learning_rate=1e-4, save_steps=1)
    trained(tmp_path / "run", max_steps=2, **flags)
    uninterrupted, _ = trained(tmp_path / "four", max_steps=4, **flags)
    with caplog.at_level(logging.WARNING):
        continued, _ = trained(tmp_path / "run", resume=str(tmp_path / "run" / "checkpoint-2"), max_steps=4, **flags)
    assert rates(continued) == {1: 1e-4, 2: 5e-5, 3: 5e-5, 4: 2.5e-5}
    assert {step: rates(uninterrupted)[step] for step in (3, 4)} == {3: 5e-5, 4: 2.5e-5}
    assert caplog.text.count("the learning-rate schedule is laid out again for 4 steps (it was written by a run of 2)"
                             ", from step 3 on: step 3 trains at 5e-05 (instead of 0)") == 1


def test_a_weights_only_checkpoint_continues_only_when_asked(tmp_path, caplog):
    """A --save_only_model checkpoint resumed with "resuming from checkpoint-2" and nothing else, while the optimizer
    state was new and the schedule restarted at step 1's rate: refused in one line naming what it lacks, and with
    --resume_weights_only its weights and step continue on the schedule, the optimizer anew, said."""
    from trainer_ext.checkpoints.format import CheckpointError

    flags = dict(learning_rate=1e-4, save_steps=1, save_only_model=True)
    trained(tmp_path / "run", max_steps=2, **flags)
    checkpoint = tmp_path / "run" / "checkpoint-2"
    with pytest.raises(CheckpointError, match=f"{checkpoint} holds no optimizer state \\(saved with --save_only_model\\):"
                                              " pass --resume_weights_only to continue its weights and step 2 with a "
                                              "new optimizer state .*, or --fresh_start to start over"):
        trained(tmp_path / "run", resume=str(checkpoint), max_steps=4, **flags)
    written = {path.name: path.read_bytes() for path in checkpoint.iterdir()}
    with caplog.at_level(logging.WARNING):
        continued, outcome = trained(tmp_path / "run", resume=str(checkpoint), max_steps=4, resume_weights_only=True,
                                     **flags)
    assert outcome.global_step == 4 and rates(continued)[3] == 5e-5 and rates(continued)[4] == 2.5e-5
    assert "--resume_weights_only: " in caplog.text and "the optimizer state starts anew" in caplog.text
    assert {path.name: path.read_bytes() for path in checkpoint.iterdir()} == written  # resumed from, not changed


def test_another_optimizer_is_refused_before_it_reads_the_checkpoints_state(tmp_path, caplog):
    """--optim adafactor on a checkpoint of AdamW loaded AdamW's state into Adafactor and failed at the first step with
    a traceback; the fused and plain AdamW share one state format and resume each other."""
    from trainer_ext.checkpoints.format import CheckpointError

    flags = dict(save_steps=1)
    trained(tmp_path / "run", max_steps=2, optim="adamw_torch_fused", **flags)
    checkpoint = tmp_path / "run" / "checkpoint-2"
    with pytest.raises(CheckpointError, match=re.escape(
            f"{checkpoint} holds the optimizer state of AdamW (--optim adamw_torch_fused), and this run trains with "
            "Adafactor (--optim adafactor): to continue it, give --optim adamw_torch_fused, pass --resume_weights_only "
            "to continue its weights and step 2 with a new Adafactor state, or --fresh_start to start over")):
        trained(tmp_path / "run", resume=str(checkpoint), max_steps=3, optim="adafactor", **flags)
    with caplog.at_level(logging.WARNING):
        _, outcome = trained(tmp_path / "run", resume=str(checkpoint), max_steps=3, optim="adafactor",
                             resume_weights_only=True, **flags)
    assert outcome.global_step == 3 and "holds another optimizer's state" in caplog.text
    _, outcome = trained(tmp_path / "run", resume=str(checkpoint), max_steps=3, optim="adamw_torch", **flags)
    assert outcome.global_step == 3
    # DeepSpeed: its optimizer.type, Adam and AdamW one state (FusedAdam in either mode), said by the backend
    from types import SimpleNamespace

    from trainer_ext.backends.deepspeed.backend import DeepSpeedBackend
    from trainer_ext.checkpoints.policy import optimizer_record

    def record(kind):
        backend = DeepSpeedBackend()
        backend.resolution = SimpleNamespace(config={"zero_optimization": {"stage": 2},
                                                     **({"optimizer": {"type": kind}} if kind else {})}, notes=[])
        return optimizer_record(SimpleNamespace(backend=backend))

    assert record("Adam")["state"] == record("AdamW")["state"] != record("Lamb")["state"]
    assert record("Lamb")["back"] == "set the DeepSpeed file's optimizer.type back to Lamb"
    assert record(None) is None  # no optimizer.type: transformers' optimizer inside the engine, not checked


def test_a_resume_with_another_batch_size_reports_and_records_the_batch_it_trains(tmp_path, capsys):
    """The resumed state held the checkpoint's batch size: the settings printed "batch 8 per device" for a run that
    trained batches of 4, and its checkpoints recorded 8."""
    trained(tmp_path / "run", max_steps=2)
    continued, _ = trained(tmp_path / "run", max_steps=3, save_steps=1, per_device_train_batch_size=4)
    assert "batch 4 per device x 1 accumulation x 1 ranks = 4 per step; 3 steps" in capsys.readouterr().out
    assert continued.state.train_batch_size == 4
    assert json.loads((tmp_path / "run" / "checkpoint-3" / "trainer_state.json").read_text())["train_batch_size"] == 4


def test_a_checkpoint_without_its_random_state_resumes_and_says_so(tmp_path, caplog):
    """A checkpoint missing only rng_state.pth was skipped by auto-resume (training restarted at step 0) and refused
    when named: it resumes (the data order is ours, exact), saying that the random state is not restored."""
    from trainer_ext.checkpoints.format import newest_valid_checkpoint

    trained(tmp_path / "run", max_steps=2)
    (tmp_path / "run" / "checkpoint-2" / "rng_state.pth").unlink()
    assert newest_valid_checkpoint(tmp_path / "run", checksums=True) == tmp_path / "run" / "checkpoint-2"
    with caplog.at_level(logging.WARNING):
        _, outcome = trained(tmp_path / "run", resume=str(tmp_path / "run" / "checkpoint-2"))
    assert outcome.global_step == 4 and "holds no rng_state*.pth: the data order continues exactly" in caplog.text


def test_resume_from_a_folder_that_is_not_a_checkpoint_names_the_ones_inside(tmp_path):
    """--resume_from_checkpoint at the run's folder (not a checkpoint) warned, then died with transformers'
    `FileNotFoundError: trainer_state.json` traceback: one line naming the checkpoints it holds."""
    trained(tmp_path / "run")
    with pytest.raises(CheckpointNotFoundError, match=f"--resume_from_checkpoint {tmp_path / 'run'}: not a checkpoint "
                                                      "\\(no trainer_state.json\\); it holds checkpoint-2, checkpoint-4: "
                                                      f"pass {tmp_path / 'run' / 'checkpoint-4'}"):
        trained(tmp_path / "run", resume=str(tmp_path / "run"))


def test_a_resume_trains_with_the_learning_rate_and_weight_decay_it_is_given(tmp_path, caplog):
    """A resumed run restored the checkpoint's learning rate and weight decay over the flags in silence (a raised
    --learning_rate trained on at the old rate): this run's flags apply from the resumed step, said once."""
    flags = dict(save_steps=1, lr_scheduler_type="constant")
    trained(tmp_path / "run", max_steps=2, learning_rate=1e-4, **flags)
    with caplog.at_level(logging.WARNING):
        continued, _ = trained(tmp_path / "run", resume=str(tmp_path / "run" / "checkpoint-2"), max_steps=4,
                               learning_rate=1e-3, weight_decay=0.1, **flags)
    assert rates(continued) == {1: 1e-4, 2: 1e-4, 3: 1e-3, 4: 1e-3}
    assert [group["weight_decay"] for group in continued.optimizer.param_groups] == [0.1, 0.0]  # biases, norms: none
    assert "with this run's settings: weight decay 0.0 -> 0.1; learning rate 0.0001 -> 0.001" in caplog.text


def test_another_model_on_the_same_output_dir_is_refused_not_resumed(tmp_path, caplog):
    """Another model of the same shape on a run's --output_dir resumed the checkpoint there and never used the model
    given (exit 0, "resuming from"): refused before training with the choices. Fails too when the same weights in a
    moved folder, or the checkpoint named on purpose, stop resuming, or other rows of the same length go unsaid."""
    from trainer_ext.checkpoints.format import CheckpointError

    def folder(name, seed):
        config = tiny_model().config
        torch.manual_seed(seed)
        BertForSequenceClassification(config).save_pretrained(tmp_path / name)
        return tmp_path / name

    def run(model_dir, resume=True, data=None, **flags):
        model = BertForSequenceClassification.from_pretrained(model_dir) if model_dir else tiny_model()
        trainer = ExtTrainer(model=model, args=arguments(tmp_path / "run", save_steps=1, **flags),
                             train_dataset=data or rows())
        return trainer.train(resume_from_checkpoint=resume)

    first, other = folder("first", 1), folder("other", 2)
    run(first, resume=False, max_steps=2)
    checkpoint = tmp_path / "run" / "checkpoint-2"
    refused = (f"{checkpoint} was trained from {first}, not from this run's model ({other}): resuming would continue "
               "the checkpoint's weights and never use yours. To train your model, pass --fresh_start (start over "
               "here) or another --output_dir; to continue the checkpoint, load the model it was trained from, or name "
               f"it with --resume_from_checkpoint {checkpoint} (its weights replace your model's)")
    with pytest.raises(CheckpointError, match=re.escape(refused)):
        run(other, max_steps=3)
    with pytest.raises(CheckpointError, match="not from this run's model \\(a model built from its config"):
        run(None, max_steps=3)  # a model object with no folder behind it
    with caplog.at_level(logging.WARNING):
        assert run(other, resume=str(checkpoint), max_steps=3).global_step == 3  # named: it continues, said
    assert f"resuming from {checkpoint} as asked: it was trained from {first}, and its weights replace" in caplog.text
    caplog.clear()
    (tmp_path / "first").rename(tmp_path / "moved")  # the same weights elsewhere: the same model
    with caplog.at_level(logging.WARNING):
        assert run(tmp_path / "moved", resume=str(tmp_path / "run" / "checkpoint-2"), max_steps=3).global_step == 3
    assert "as asked" not in caplog.text and "other training data" not in caplog.text
    shuffled = rows()[::-1]  # the same number of rows, others at each index
    with caplog.at_level(logging.WARNING):
        assert run(tmp_path / "moved", data=shuffled, max_steps=4).global_step == 4
    assert (f"resuming from {tmp_path / 'run' / 'checkpoint-3'} with other training data: the same {ROWS} samples in "
            "number, other rows; the order continues exactly where it stopped") in caplog.text
