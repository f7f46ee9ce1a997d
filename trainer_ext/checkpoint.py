"""Checkpoint safety: a checkpoint is written to a staging folder and renamed into place with a marker file
only when complete; the marker records every file's size and checksum, so resume picks the newest checkpoint that is
complete and still intact (a disk or sync fault can damage a file after the save finished); rotation never deletes
the only valid one."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

from .errors import UserError
from .sagemaker import checkpoints_to_keep

logger = logging.getLogger(__name__)

MARKER = "checkpoint_complete.json"
DATA_STATE = "data_state.json"  # where the training order stands (samples consumed); see data/samplers.py
STAGING = ".staging"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
CHECKSUM = "xxh3_64"  # ~10 GB/s in memory: a checkpoint is hashed at the speed it is read


class CheckpointError(UserError):
    """A checkpoint the user asked for cannot be resumed: missing, damaged, or written by another model."""


def checkpoint_step(path: Path) -> int | None:
    match = _CHECKPOINT.match(Path(path).name)
    return int(match.group(1)) if match else None


def file_digest(path: Path) -> str:
    import xxhash

    digest = xxhash.xxh3_64()
    with open(path, "rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def inventory(folder: Path) -> dict:
    """{relative path: [size, checksum]} of every file in a checkpoint folder but the marker."""
    folder = Path(folder)
    return {str(path.relative_to(folder)): [path.stat().st_size, file_digest(path)]
            for path in sorted(folder.rglob("*")) if path.is_file() and path.name != MARKER}


def damaged_file(folder: Path, files: dict, checksums: bool = True) -> str | None:
    """The first file that differs from what was written (missing, another size, or with `checksums`, other bytes),
    said in a phrase; None when all match. Sizes first: they cost a stat each."""
    folder = Path(folder)
    for relative, (size, _) in files.items():
        path = folder / relative
        if not path.is_file():
            return f"{relative} is missing"
        if path.stat().st_size != size:
            return f"{relative} is {path.stat().st_size} bytes but {size} were written (truncated or damaged)"
    if checksums:
        for relative, (_, digest) in files.items():
            if file_digest(folder / relative) != digest:
                return f"{relative} does not match the checksum recorded when it was written (damaged)"
    return None


def problem_with(path: Path, checksums: bool = False) -> str | None:
    """Why this folder cannot be resumed from, or None if it is a complete, intact checkpoint: sizes are always
    checked against the marker, file contents with `checksums` (one read of the checkpoint)."""
    path = Path(path)
    if not (path / MARKER).is_file():
        return f"no {MARKER} (the save did not finish, or it was written without trainer_ext)"
    if not (path / "trainer_state.json").is_file():
        return "no trainer_state.json"
    try:
        marker = json.loads((path / MARKER).read_text())
        json.loads((path / "trainer_state.json").read_text())
    except (OSError, ValueError) as err:
        return f"unreadable metadata ({err})"
    weights = [p for p in path.iterdir() if p.suffix in (".safetensors", ".bin") or p.name.startswith("global_step")]
    if not weights:
        return "no model weights"
    return damage(path, checksums, marker)


def damage(path: Path, checksums: bool = True, marker: dict | None = None) -> str | None:
    """Which file of a complete checkpoint is no longer as written, or None. Markers written before checksums were
    recorded have no file list: nothing to compare."""
    path = Path(path)
    if marker is None:
        try:
            marker = json.loads((path / MARKER).read_text())
        except (OSError, ValueError):
            return None
    if marker.get("checksum") != CHECKSUM:
        return None
    return damaged_file(path, marker.get("files", {}), checksums)


def valid_checkpoints(output_dir) -> list[Path]:
    """Complete checkpoints in output_dir, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = sorted((checkpoint_step(p), p) for p in root.iterdir() if p.is_dir() and checkpoint_step(p) is not None)
    return [path for _, path in found if problem_with(path) is None]


def newest_valid_checkpoint(output_dir, checksums: bool = False) -> Path | None:
    """The newest complete (and, with `checksums`, intact) checkpoint; damaged newer ones are skipped with a warning
    naming the file."""
    root = Path(output_dir)
    if not root.is_dir():
        return None
    candidates = sorted(((checkpoint_step(p), p) for p in root.iterdir()
                         if p.is_dir() and checkpoint_step(p) is not None), reverse=True)
    for _, path in candidates:
        problem = problem_with(path, checksums)
        if problem is None:
            return path
        logger.warning("skipping checkpoint %s: %s", path, problem)
    return None


def read_data_state(checkpoint) -> dict | None:
    """The saved position in the training order, or None for checkpoints written without it (stock transformers)."""
    path = Path(checkpoint) / DATA_STATE
    return json.loads(path.read_text()) if path.is_file() else None


def staging_dir(output_dir) -> Path:
    return Path(output_dir) / STAGING


def publish(staged: Path, output_dir, info: dict) -> Path:
    """Mark a fully written checkpoint complete and move it into output_dir in one rename."""
    staged, final = Path(staged), Path(output_dir) / Path(staged).name
    record = {**info, "saved_at": time.time(), "checksum": CHECKSUM, "files": inventory(staged)}
    (staged / MARKER).write_text(json.dumps(record, indent=2) + "\n")
    if final.exists():  # the same step saved again (e.g. after a resume): replace it, never merge into it
        old = final.with_name(f"{final.name}.replaced-{os.getpid()}")
        final.rename(old)
        staged.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staged.rename(final)
    return final


def rotate(output_dir, limit: int | None, keep: Path | None = None) -> list[Path]:
    """Delete the oldest complete checkpoints beyond `limit`; never `keep` (the best), never the newest."""
    if not limit or limit <= 0:
        return []
    valid = valid_checkpoints(output_dir)
    removable = [p for p in valid[:-1] if keep is None or p.resolve() != Path(keep).resolve()]
    excess = len(valid) - max(limit, 1)
    deleted = removable[:max(0, excess)]
    for path in deleted:
        logger.info("deleting older checkpoint %s (save_total_limit=%d)", path, limit)
        shutil.rmtree(path, ignore_errors=True)
    return deleted


def model_fingerprint(model) -> dict:
    """What a checkpoint must match to be resumed by this model."""
    config = getattr(model, "config", None)
    return {
        "model_class": type(model).__name__,
        "model_type": getattr(config, "model_type", None),
        # Under ZeRO-3 a parameter's numel is its gathered size only while gathered; ds_numel is always the whole.
        "num_parameters": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
    }


def check_compatible(checkpoint, fingerprint: dict) -> None:
    """Refuse, before training, a checkpoint written by a different model."""
    marker = Path(checkpoint) / MARKER
    if not marker.is_file():
        return
    saved = json.loads(marker.read_text()).get("model", {})
    differences = [f"{key}: checkpoint {saved[key]!r}, this run {value!r}" for key, value in fingerprint.items()
                   if key in saved and saved[key] != value]
    if differences:
        raise CheckpointError(f"checkpoint {checkpoint} was written by a different model ({'; '.join(differences)}): "
                         "resume with the model that wrote it, or pass --fresh_start (or another --output_dir) "
                         "to start over; nothing was overwritten")


# -- one run's checkpoints, as ExtTrainer uses them --------------------------------------------------------------------

def checkpoint_folder(args) -> str:
    """Where a run writes and resumes its checkpoints: --checkpoint_dir (set for a SageMaker job), else output_dir."""
    return getattr(args, "checkpoint_dir", None) or args.output_dir


def means_newest(requested) -> bool:
    """None, "auto", True, or the command line's "true"/"True": the newest intact checkpoint in output_dir, if any."""
    return requested is None or requested is True or (isinstance(requested, str) and requested in
                                                       ("auto", "true", "True"))


class RunCheckpoints:
    """Which checkpoint a run resumes (the newest intact one, local or from --checkpoint_uri), whether the run is
    already complete, and each new checkpoint written aside, published complete with its marker, rotated and copied to
    the remote. Every rank takes the same decision: the main process reads the files once and shares its answer."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.args = trainer.args
        self.remote = None  # --checkpoint_uri
        self.staging = None  # set while a checkpoint is being written

    # -- before training -------------------------------------------------------------------------------------------
    def open_remote(self) -> None:
        """--checkpoint_uri, checked (write, list, read) by the process that saves, before anything trains (unless
        ExtTrainingArguments checked it already, before the model was loaded)."""
        uri = getattr(self.args, "checkpoint_uri", None)
        if not uri:
            return
        from .remote import RemoteCheckpoints

        self.remote = RemoteCheckpoints(uri, getattr(self.args, "checkpoint_storage_options", None))
        if self.args.should_save and not getattr(self.args, "checkpoint_uri_checked", False):
            self.remote.check()

    def to_resume(self, requested, fingerprint) -> str | None:
        """The checkpoint `train(resume_from_checkpoint=requested)` continues from; None: from scratch."""
        trainer = self.trainer
        if means_newest(requested):
            if requested is None and getattr(self.args, "fresh_start", False):
                return None
            found = self.newest_intact()
            if found is None and self.remote is not None:
                if self.args.should_save:
                    self.remote.download_newest(checkpoint_folder(self.args))
                trainer.accelerator.wait_for_everyone()
                found = self.newest_intact()
            if trainer.is_world_process_zero() and not found:
                logger.info("no complete checkpoint in %s: starting from scratch", checkpoint_folder(self.args))
            checkpoint = str(found) if found else None
        else:
            checkpoint = str(requested)
            if not Path(checkpoint).is_dir():
                raise CheckpointError(f"--resume_from_checkpoint {checkpoint}: no such folder (give a checkpoint-N "
                                      "folder, or auto for the newest complete one in --output_dir)")
            damaged = self.decided_by_main_process(lambda: damage(Path(checkpoint)))
            if damaged:
                raise CheckpointError(f"--resume_from_checkpoint {checkpoint}: {damaged}; resume from another "
                                      "checkpoint, or pass --resume_from_checkpoint auto to take the newest intact one")
            problem = problem_with(Path(checkpoint))
            if problem:
                logger.warning("resuming from %s although %s", checkpoint, problem)
        if checkpoint:
            check_compatible(checkpoint, fingerprint)
        return checkpoint

    def newest_intact(self) -> Path | None:
        """The newest complete checkpoint whose files are all as written (sizes and checksums)."""
        return self.decided_by_main_process(lambda: newest_valid_checkpoint(checkpoint_folder(self.args),
                                                                            checksums=True))

    def decided_by_main_process(self, decide):
        """`decide()` run once, by the main process (reading a checkpoint's files once, not once per rank), and its
        answer shared: every rank must resume from the same checkpoint."""
        answer = decide() if self.args.process_index == 0 else None
        if self.args.world_size > 1:
            from accelerate.utils import broadcast_object_list

            answer = broadcast_object_list([answer], from_process=0)[0]
        return answer

    def already_complete(self, checkpoint, max_steps: int):
        """A re-run of a finished command (a scheduler or spot restart) finds its last checkpoint at the run's final
        step: the trainer's state and finished weights are loaded for evaluation/prediction, and the TrainOutput to
        return is given; None when there is training left. (transformers would train one step more, rotate an older
        checkpoint away and overwrite the metrics.)"""
        from transformers import TrainerState
        from transformers.trainer import TRAINER_STATE_NAME
        from transformers.trainer_utils import TrainOutput

        if not checkpoint:
            return None
        state = TrainerState.load_from_json(str(Path(checkpoint) / TRAINER_STATE_NAME))
        if state.global_step < max_steps:
            return None
        trainer = self.trainer
        trainer.backend.load_weights(trainer, checkpoint)  # for evaluation/prediction after the re-run
        # The saved state says rank 0's is_world_process_zero: on every rank, its callbacks would print and report.
        state.is_local_process_zero, state.is_world_process_zero = (trainer.is_local_process_zero(),
                                                                    trainer.is_world_process_zero())
        trainer.state = state
        final = Path(self.args.output_dir)
        where = final if any(final.glob("model*.safetensors")) or any(final.glob("pytorch_model*.bin")) else checkpoint
        if trainer.is_world_process_zero():
            print(f"trainer_ext: training already complete at step {state.global_step} ({checkpoint}): nothing to "
                  f"train; the model is in {where}", flush=True)
        losses = [row["train_loss"] for row in state.log_history if "train_loss" in row]
        return TrainOutput(state.global_step, losses[-1] if losses else float("nan"), {"already_complete": True})

    # -- while training --------------------------------------------------------------------------------------------
    def publish_staged(self, staged: Path, run_dir: Path, data_state: dict | None, info: dict) -> None:
        """The main process's part once every rank wrote into `staged`: the training order's position, the marker
        (published last, by rename), the best checkpoint's new path, rotation, and the remote copy."""
        state = self.trainer.state
        name = f"checkpoint-{state.global_step}"
        if data_state is not None:
            (staged / name / DATA_STATE).write_text(json.dumps(data_state, indent=2) + "\n")
        final = publish(staged / name, run_dir, info)
        best = state.best_model_checkpoint
        if best and Path(best).parent == staged:
            state.best_model_checkpoint = str(final)
        deleted = rotate(run_dir, checkpoints_to_keep(self.args.save_total_limit),
                         keep=Path(state.best_model_checkpoint) if state.best_model_checkpoint else None)
        if self.remote is not None:  # in the background: the next step does not wait for the copy
            self.remote.upload(final)
            self.remote.delete([path.name for path in deleted])
        if staged.is_dir() and not any(staged.iterdir()):
            staged.rmdir()

    def wait(self) -> None:
        """Uploads still running finish (at the end, and on preemption)."""
        if self.remote is not None:
            self.remote.wait()
