"""Which checkpoint a run resumes and which rotation deletes (checkpoints/format.py), on folders written by its own
publish(): steps compared as numbers (9 < 10 < 100), damaged and unfinished ones skipped, the only valid one and the
best never deleted."""

import json
import os

import pytest

from trainer_ext.checkpoints import format as checkpoint_format
from trainer_ext.checkpoints.format import (AUTO, FRESH, MARKER, NEWEST, PATH, CheckpointError, check_compatible,
                                            checkpoint_step, damage, newest_valid_checkpoint, problem_with, publish,
                                            read_data_state, read_loss_sum, resume_request, rotate, valid_checkpoints,
                                            written_by_this_process)


def saved(root, step, weights=b"weights", **info):
    """checkpoint-<step> as a save writes it: staged, then published with its marker (sizes and checksums)."""
    staged = root / ".staging" / f"checkpoint-{step}"
    staged.mkdir(parents=True)
    (staged / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (staged / "model.safetensors").write_bytes(weights)
    return publish(staged, root, info)


def by_an_earlier_process(checkpoint):
    """The marker as a process before this one (a restarted command) wrote it."""
    marker = json.loads((checkpoint / MARKER).read_text())
    marker["writer"] = {**marker["writer"], "process": "an earlier one"}
    (checkpoint / MARKER).write_text(json.dumps(marker))
    return checkpoint


def names(paths):
    return [path.name for path in paths]


def test_checkpoints_live_in_checkpoint_dir_when_set_else_in_output_dir():
    """A SageMaker job sets --checkpoint_dir (the folder SageMaker syncs to S3); otherwise output_dir holds them."""
    from types import SimpleNamespace

    assert checkpoint_format.checkpoint_folder(SimpleNamespace(checkpoint_dir="/opt/ml/checkpoints",
                                                               output_dir="out")) == "/opt/ml/checkpoints"
    assert checkpoint_format.checkpoint_folder(SimpleNamespace(checkpoint_dir=None, output_dir="out")) == "out"
    assert checkpoint_format.checkpoint_folder(SimpleNamespace(output_dir="out")) == "out"  # stock arguments


def test_the_newest_checkpoint_is_the_highest_step_not_the_last_name(tmp_path):
    """Sorted by name, checkpoint-9 comes after checkpoint-10 and checkpoint-100: a resume would go back 91 steps."""
    for step in (100, 9, 10):
        saved(tmp_path, step)
    (tmp_path / "checkpoint-final").mkdir()  # not a checkpoint-N folder: never chosen, never a step
    (tmp_path / "checkpoint-7").write_text("a file, not a folder")
    assert newest_valid_checkpoint(tmp_path) == tmp_path / "checkpoint-100"
    assert names(valid_checkpoints(tmp_path)) == ["checkpoint-9", "checkpoint-10", "checkpoint-100"]
    assert [checkpoint_step(tmp_path / name) for name in ("checkpoint-100", "checkpoint-final", "x-checkpoint-3",
                                                          "checkpoint-3-old")] == [100, None, None, None]
    assert newest_valid_checkpoint(tmp_path / "absent") is None and valid_checkpoints(tmp_path / "absent") == []


def test_a_damaged_or_unfinished_newest_checkpoint_is_skipped_for_the_next_newest(tmp_path, caplog):
    """A checkpoint cut off mid-save, with a broken trainer_state.json, without weights or with a truncated file must
    never be resumed; the newest intact one is, by step (10, not 9), and each skipped one is named with its problem."""
    for step in (9, 10):
        saved(tmp_path, step)
    unfinished = saved(tmp_path, 100)
    (unfinished / MARKER).unlink()  # a crash while saving (or a stock transformers folder)
    broken = saved(tmp_path, 200)
    (broken / "trainer_state.json").write_text("{not json")
    weightless = saved(tmp_path, 300)
    (weightless / "model.safetensors").unlink()
    truncated = saved(tmp_path, 400)
    (truncated / "model.safetensors").write_bytes(b"weig")
    assert newest_valid_checkpoint(tmp_path) == tmp_path / "checkpoint-10"
    for name, problem in (("checkpoint-100", f"no {MARKER}"), ("checkpoint-200", "unreadable metadata"),
                          ("checkpoint-300", "no model weights"), ("checkpoint-400", "model.safetensors is 4 bytes "
                                                                                      "but 7 were written")):
        assert f"skipping checkpoint {tmp_path / name}: {problem}" in caplog.text
    assert names(valid_checkpoints(tmp_path)) == ["checkpoint-9", "checkpoint-10"]  # what rotation counts


def test_other_bytes_of_the_same_size_are_found_by_the_checksums(tmp_path):
    """A file damaged in place (a disk or sync fault) keeps its size: only the recorded checksum tells."""
    saved(tmp_path, 9)
    flipped = saved(tmp_path, 10)
    (flipped / "model.safetensors").write_bytes(b"weightz")
    assert newest_valid_checkpoint(tmp_path) == flipped  # sizes only: the cheap check
    assert newest_valid_checkpoint(tmp_path, checksums=True) == tmp_path / "checkpoint-9"
    assert damage(flipped) == "model.safetensors does not match the checksum recorded when it was written (damaged)"
    assert damage(flipped, checksums=False) is None
    assert problem_with(flipped, checksums=True) == damage(flipped)


def test_what_a_checkpoint_may_lack_or_relay_without_being_damaged(tmp_path):
    """A missing rng_state (transformers continues without it), weights re-saved as shards with a complete index, and
    a marker from before checksums were recorded are not damage; shards with their index incomplete are."""
    checkpoint = saved(tmp_path, 5)
    assert damage(checkpoint) is None
    marker = json.loads((checkpoint / MARKER).read_text())
    assert sorted(marker["files"]) == ["model.safetensors", "trainer_state.json"] and marker["writer"]["pid"] == \
        os.getpid()
    (checkpoint / "rng_state.pth").write_bytes(b"rng")
    marker["files"]["rng_state.pth"] = [3, "0"]
    (checkpoint / MARKER).write_text(json.dumps(marker))
    (checkpoint / "rng_state.pth").unlink()
    assert damage(checkpoint) is None
    (checkpoint / "model.safetensors").unlink()
    (checkpoint / "model-00001-of-00001.safetensors").write_bytes(b"weights")
    index = {"weight_map": {"w": "model-00001-of-00001.safetensors"}}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    assert damage(checkpoint) is None and problem_with(checkpoint) is None
    index["weight_map"]["v"] = "model-00002-of-00002.safetensors"  # a shard the index names is missing
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    assert damage(checkpoint) == "model.safetensors is missing"
    (checkpoint / MARKER).write_text(json.dumps({"writer": marker["writer"]}))  # written before checksums
    assert damage(checkpoint) is None


def test_rotation_deletes_the_oldest_by_step_and_never_the_only_valid_one_nor_the_best(tmp_path):
    """--save_total_limit counts only complete checkpoints, deletes the oldest steps first (9 before 10), and never
    the newest, the best (kept) or the only one a resume could use."""
    saved(tmp_path, 10)
    for step in (20, 30):
        (saved(tmp_path, step) / MARKER).unlink()  # unfinished: not counted, not deleted by rotation
    assert rotate(tmp_path, limit=1) == []
    assert (tmp_path / "checkpoint-10").is_dir()
    for step in (9, 100, 1000):
        saved(tmp_path, step)
    assert rotate(tmp_path, limit=None) == [] and rotate(tmp_path, limit=0) == []
    assert rotate(tmp_path, limit=-1) == []
    deleted = rotate(tmp_path, limit=2, keep=tmp_path / "checkpoint-10")
    assert names(deleted) == ["checkpoint-9", "checkpoint-100"]  # the best (10) and the newest (1000) stay
    assert names(valid_checkpoints(tmp_path)) == ["checkpoint-10", "checkpoint-1000"]
    assert rotate(tmp_path, limit=2) == [] and rotate(tmp_path, limit=5) == []  # within the limit: nothing goes
    saved(tmp_path, 2000)
    assert names(rotate(tmp_path, limit=2)) == ["checkpoint-10"]  # one over: the oldest only
    assert names(valid_checkpoints(tmp_path)) == ["checkpoint-1000", "checkpoint-2000"]
    assert names(rotate(tmp_path, limit=1, keep=tmp_path / "checkpoint-2000")) == ["checkpoint-1000"]
    assert rotate(tmp_path, limit=1, keep=tmp_path / "checkpoint-2000") == []


def test_rotation_goes_on_when_a_checkpoint_it_deletes_is_already_gone(tmp_path, monkeypatch):
    """Another process (a user, a second job's rotation) removed it between the listing and the delete: the run
    trains on."""
    for step in (1, 2):
        saved(tmp_path, step)
    listed = valid_checkpoints(tmp_path)
    monkeypatch.setattr(checkpoint_format, "valid_checkpoints", lambda root: [tmp_path / "checkpoint-0", *listed])
    assert names(rotate(tmp_path, limit=1)) == ["checkpoint-0", "checkpoint-1"]


def test_a_restart_resumes_only_what_an_earlier_process_wrote(tmp_path):
    """A second train() in one script must not resume the first's checkpoints unasked; a restarted command does."""
    earlier = by_an_earlier_process(saved(tmp_path, 9))
    mine = saved(tmp_path, 10)
    assert written_by_this_process(mine) and not written_by_this_process(earlier)
    assert not written_by_this_process(tmp_path / "checkpoint-11")  # no marker
    (tmp_path / "checkpoint-12").mkdir()
    (tmp_path / "checkpoint-12" / MARKER).write_text("{}")  # a marker that names no writer
    assert not written_by_this_process(tmp_path / "checkpoint-12")
    assert newest_valid_checkpoint(tmp_path) == mine
    assert newest_valid_checkpoint(tmp_path, earlier_processes=True) == earlier


def test_publishing_a_step_again_replaces_it_whole(tmp_path):
    """The same step saved after a resume: the old folder's files must not survive next to the new ones."""
    first = saved(tmp_path, 4, weights=b"first")
    (first / "left-over.bin").write_bytes(b"old")
    again = saved(tmp_path, 4, weights=b"second one", best=True)
    assert again == first and (again / "model.safetensors").read_bytes() == b"second one"
    assert not (again / "left-over.bin").exists() and json.loads((again / MARKER).read_text())["best"] is True
    assert sorted(p.name for p in tmp_path.iterdir()) == [".staging", "checkpoint-4"]


@pytest.mark.parametrize("requested,reading", [
    (None, AUTO), ("auto", AUTO), (" Auto ", AUTO), ("", AUTO), (True, NEWEST), ("true", NEWEST), ("True", NEWEST),
    (False, FRESH), ("false", FRESH), ("FALSE", FRESH), ("out/checkpoint-9", PATH)])
def test_resume_from_checkpoint_reads_as_documented(requested, reading):
    """train(resume_from_checkpoint=...) and the flag: None/auto a restart's newest, True the newest, False none."""
    assert resume_request(requested) == reading


def test_the_loss_sum_comes_from_the_record_else_from_logged_losses(tmp_path):
    """A resumed run's train_loss covers the whole run: the recorded sum, else each logged mean times its steps
    (stock transformers' checkpoints), else None when the last log is not at the checkpoint's step."""
    checkpoint = tmp_path / "checkpoint-6"
    checkpoint.mkdir()
    assert read_loss_sum(checkpoint) is None and read_data_state(checkpoint) is None
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 6}))
    assert read_loss_sum(checkpoint) is None  # nothing logged
    state = {"global_step": 6, "log_history": [{"step": 2, "loss": 1.0}, {"step": 2, "eval_loss": 9.0},
                                               {"step": 3, "loss": 0.75}, {"step": 6, "loss": 0.5}]}
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    assert read_loss_sum(checkpoint) == pytest.approx(1.0 * 2 + 0.75 * 1 + 0.5 * 3)
    state["global_step"] = 7
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    assert read_loss_sum(checkpoint) is None
    (checkpoint / checkpoint_format.LOSS_STATE).write_text(json.dumps({"loss_sum": 3.25}))
    assert read_loss_sum(checkpoint) == 3.25
    (checkpoint / checkpoint_format.DATA_STATE).write_text(json.dumps({"samples_consumed": 48}))
    assert read_data_state(checkpoint) == {"samples_consumed": 48}


def test_another_models_checkpoint_is_refused_naming_both(tmp_path):
    """Resuming another model's checkpoint must fail before training, naming what differs and the way out."""
    checkpoint = saved(tmp_path, 5, model={"model_class": "GPT2LMHeadModel", "num_parameters": 124439808})
    check_compatible(checkpoint, {"model_class": "GPT2LMHeadModel", "num_parameters": 124439808, "new": 1})
    check_compatible(checkpoint, None)
    check_compatible(saved(tmp_path, 6), {"model_class": "GPT2LMHeadModel"})  # a marker without a model: nothing to say
    check_compatible(tmp_path / "checkpoint-7", {"model_class": "GPT2LMHeadModel"})  # no marker: a stock checkpoint
    with pytest.raises(CheckpointError) as refused:
        check_compatible(checkpoint, {"model_class": "BertForSequenceClassification", "num_parameters": 4386})
    assert str(refused.value) == (
        f"checkpoint {checkpoint} was written by a different model (model_class: checkpoint 'GPT2LMHeadModel', this "
        "run 'BertForSequenceClassification'; num_parameters: checkpoint 124439808, this run 4386): resume with the "
        "model that wrote it, or pass --fresh_start (or another --output_dir) to start over; nothing was overwritten")
