"""What a checkpoint folder is: written to a staging folder and renamed into place with a marker file only when
complete; the marker records every file's size and checksum and the process that wrote it, so resume picks the newest
checkpoint that is complete and still intact (a disk or sync fault can damage a file after the save finished);
rotation never deletes the only valid one. Which checkpoint a run resumes is policy.py's."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import time
import uuid
from pathlib import Path

from ..config.own_flags import CheckpointFlags, flags_of
from ..errors import UserError, UserFileNotFoundError

logger = logging.getLogger(__name__)

MARKER = "checkpoint_complete.json"
DATA_STATE = "data_state.json"  # where the training order stands (samples consumed); see data/samplers.py
LOSS_STATE = "loss_state.json"  # the sum of every step's training loss up to the checkpoint (the run's train_loss)
STAGING = ".staging"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
CHECKSUM = "xxh3_64"  # ~10 GB/s in memory: a checkpoint is hashed at the speed it is read


# This process, as the markers it writes name it: a run resumes automatically only from checkpoints an earlier
# process wrote (a restart), never from those a train() earlier in this same process wrote.
WRITER = {"host": socket.gethostname(), "pid": os.getpid(), "process": uuid.uuid4().hex}
# Weight files a user may re-save in another layout (one file <-> shards + index) without damaging the checkpoint.
_WEIGHTS = re.compile(r"^(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)$|^(model\.safetensors|pytorch_model\.bin)"
                      r"\.index\.json$")


class CheckpointError(UserError):
    """A checkpoint the user asked for cannot be resumed: damaged, or written by another model."""


class CheckpointNotFoundError(CheckpointError, UserFileNotFoundError):
    """The checkpoint the user named is not there, or resuming was asked for and there is none."""


def checkpoint_folder(args) -> str:
    """Where a run writes and resumes its checkpoints: --checkpoint_dir (set for a SageMaker job), else output_dir."""
    return flags_of(CheckpointFlags, args).checkpoint_dir or args.output_dir


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
    said in a phrase; None when all match. Sizes first: they cost a stat each. Weight files re-saved in another
    complete layout (see relaid_weights) are not missing."""
    folder = Path(folder)
    if relaid_weights(folder, files):
        files = {relative: entry for relative, entry in files.items()
                 if not (_WEIGHTS.match(relative) and not (folder / relative).is_file())}
    # A checkpoint without its random state still continues exactly (the resume says what it lacks), as in transformers.
    files = {relative: entry for relative, entry in files.items()
             if not (Path(relative).match("rng_state*.pth") and not (folder / relative).is_file())}
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


def relaid_weights(folder: Path, files: dict) -> str | None:
    """When weight files the marker lists are gone but the folder holds the weights whole in another layout (one file
    re-saved as shards + index by save_pretrained(max_shard_size=...), or shards merged into one file): what it holds
    now, for a note; None otherwise. A deliberate re-save, not a fault: faults do not write a complete index."""
    folder = Path(folder)
    gone = [relative for relative in files if _WEIGHTS.match(relative) and not (folder / relative).is_file()]
    if not gone:
        return None
    layout = loadable_weights(folder)
    return f"{layout} instead of {', '.join(sorted(gone))}" if layout else None


def loadable_weights(folder: Path) -> str | None:
    """The complete set of Hugging Face weight files in `folder`, said in a phrase; None when there is none."""
    folder = Path(folder)
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                return None
            return f"{index_name} and its {len(shards)} shard(s)" if all((folder / s).is_file() for s in shards) \
                else None
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (folder / name).is_file():
            return name
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
    from ..backends import checkpoint_state_patterns

    # Hugging Face weight files, or a backend's own training state (which holds the weights without them)
    patterns = checkpoint_state_patterns()
    weights = [p for p in path.iterdir() if p.suffix in (".safetensors", ".bin")
               or any(p.match(pattern) for pattern in patterns)]
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


def newest_valid_checkpoint(output_dir, checksums: bool = False, earlier_processes: bool = False) -> Path | None:
    """The newest complete (and, with `checksums`, intact) checkpoint; damaged newer ones are skipped with a warning
    naming the file. With `earlier_processes`, only those another (earlier) process wrote."""
    root = Path(output_dir)
    if not root.is_dir():
        return None
    candidates = sorted(((checkpoint_step(p), p) for p in root.iterdir()
                         if p.is_dir() and checkpoint_step(p) is not None), reverse=True)
    for _, path in candidates:
        if earlier_processes and written_by_this_process(path):
            continue
        problem = problem_with(path, checksums)
        if problem is None:
            return path
        logger.warning("skipping checkpoint %s: %s", path, problem)
    return None


def written_by_this_process(checkpoint) -> bool:
    """Whether this process wrote the checkpoint (a train() before this one, in the same script or notebook)."""
    try:
        marker = json.loads((Path(checkpoint) / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("writer", {}).get("process") == WRITER["process"]


def read_data_state(checkpoint) -> dict | None:
    """The saved position in the training order, or None for checkpoints written without it (stock transformers)."""
    path = Path(checkpoint) / DATA_STATE
    return json.loads(path.read_text()) if path.is_file() else None


def read_loss_sum(checkpoint) -> float | None:
    """The sum of the training losses of steps 1..N of checkpoint-N: from its loss_state.json, else from the losses
    its trainer_state.json logged when the last log was at step N (a checkpoint stock transformers wrote); None when
    neither tells it."""
    checkpoint = Path(checkpoint)
    try:
        recorded = json.loads((checkpoint / LOSS_STATE).read_text())
        return float(recorded["loss_sum"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        state = json.loads((checkpoint / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return None
    logged = [(row["step"], row["loss"]) for row in state.get("log_history", []) if "loss" in row and "step" in row]
    if not logged or logged[-1][0] != state.get("global_step"):
        return None
    total, previous = 0.0, 0
    for step, loss in logged:  # each logged loss is the mean of the steps since the previous log
        total, previous = total + loss * (step - previous), step
    return total


def staging_dir(output_dir) -> Path:
    return Path(output_dir) / STAGING


def publish(staged: Path, output_dir, info: dict) -> Path:
    """Mark a fully written checkpoint complete and move it into output_dir in one rename."""
    staged, final = Path(staged), Path(output_dir) / Path(staged).name
    record = {"writer": WRITER, **info, "saved_at": time.time(), "checksum": CHECKSUM, "files": inventory(staged)}
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


FRESH, AUTO, NEWEST, PATH = "fresh", "auto", "newest", "path"


def resume_request(requested) -> str:
    """How `train(resume_from_checkpoint=...)` (or --resume_from_checkpoint) reads:
    FRESH   False (or "false"): start from scratch, as the stock Trainer does by default;
    AUTO    None or "auto": the newest intact checkpoint an earlier process wrote (a restarted command), else scratch;
    NEWEST  True (or "true"): the newest intact checkpoint in output_dir; an error when there is none (as stock);
    PATH    a checkpoint folder."""
    if requested is None:
        return AUTO
    if isinstance(requested, bool):
        return NEWEST if requested else FRESH
    text = str(requested).strip()
    return {"auto": AUTO, "true": NEWEST, "false": FRESH}.get(text.lower(), PATH) if text else AUTO


def check_compatible(checkpoint, fingerprint: dict) -> None:
    """Refuse, before training, a checkpoint written by a different model (no fingerprint: nothing to compare)."""
    marker = Path(checkpoint) / MARKER
    if fingerprint is None or not marker.is_file():
        return
    saved = json.loads(marker.read_text()).get("model", {})
    differences = [f"{key}: checkpoint {saved[key]!r}, this run {value!r}" for key, value in fingerprint.items()
                   if key in saved and saved[key] != value]
    if differences:
        raise CheckpointError(f"checkpoint {checkpoint} was written by a different model ({'; '.join(differences)}): "
                         "resume with the model that wrote it, or pass --fresh_start (or another --output_dir) "
                         "to start over; nothing was overwritten")
