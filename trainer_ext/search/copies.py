"""A trial's files when workers do not share a disk: its checkpoints are in the folder of the worker that ran it (which
another worker reaches only on the same machine) and, with --checkpoint_uri, in the remote copy. A worker taking a
trial over fetches the newest checkpoint it can reach; the best trial's model is copied to the remote for the other
workers' `best`; the remote copies of trials that never run again are removed."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..checkpoints.format import STAGING, checkpoint_step, newest_valid_checkpoint

MODEL = "model"  # <checkpoint_uri>/trial-N/model/: the finished trial's folder, without its checkpoints
MODEL_MARKER = "model_complete.json"  # uploaded last: the file list of a complete copy
BEST_RECORD = "search_trial.json"  # in a copied best/: which trial it holds and where it came from


def remote(uri: str, options: dict | None):
    from ..checkpoints.remote import RemoteCheckpoints

    return RemoteCheckpoints(uri, options)


def _step(checkpoint) -> int:
    return -1 if checkpoint is None else checkpoint_step(Path(checkpoint))


def fetch_checkpoint(attrs: dict, trial_dir: Path, me: dict, options: dict | None) -> str:
    """Put into `trial_dir` the newest checkpoint of the trial this worker can reach when it is newer than what the
    folder holds (another folder on this machine, or the remote copy); returns where the trial continues from."""
    here = newest_valid_checkpoint(trial_dir)
    owner, before = attrs.get("owner") or {}, attrs.get("trial_dir")
    if before and Path(before) != trial_dir and owner.get("host") == me["host"]:
        found = newest_valid_checkpoint(before)
        if found is not None and _step(found) > _step(here):
            staged = trial_dir / STAGING / found.name
            shutil.rmtree(staged, ignore_errors=True)
            shutil.copytree(found, staged)
            os.replace(staged, trial_dir / found.name)
            return f"continues from {found} (copied here)"
    uri = attrs.get("checkpoint_uri")
    if uri:
        copies = remote(uri, options)
        complete = copies.complete()
        if complete and complete[-1][0] > _step(here):
            fetched = copies.download_newest(trial_dir)
            if fetched is not None:
                return f"continues from {uri}/{fetched.name} (downloaded)"
    if here is not None:
        return f"continues from {here}"
    if before and Path(before) != trial_dir:
        return (f"restarts from step 0 with the same values: the checkpoints in {owner.get('host')}:{before} are out of "
                "reach (give --checkpoint_uri to continue from a remote copy)")
    return "starts from step 0 with the same values (no checkpoint was written)"


def upload_model(trial_dir: Path, uri: str, options: dict | None) -> str:
    """The finished trial's folder without its checkpoints to <uri>/model (its file list last); returns that URL."""
    copies = remote(uri, options)
    target = f"{copies.root}/{MODEL}"
    if copies.fs.exists(target):
        copies.fs.rm(target, recursive=True)
    files = sorted(path.name for path in trial_dir.iterdir() if path.is_file())
    local = "file" in ((copies.fs.protocol,) if isinstance(copies.fs.protocol, str) else copies.fs.protocol)
    if local:
        copies.fs.makedirs(target, exist_ok=True)
    for name in files:
        copies.fs.put_file(str(trial_dir / name), f"{target}/{name}")
    copies.fs.pipe_file(f"{target}/{MODEL_MARKER}", json.dumps({"files": files}).encode())
    return f"{copies.uri}/{MODEL}"


def download_model(model_uri: str, options: dict | None, destination: Path, record: dict) -> None:
    """A complete <uri>/model copy into `destination` (staged beside it, then swapped in); FileNotFoundError when the
    copy is incomplete or gone."""
    copies = remote(model_uri, options)
    files = json.loads(copies.fs.cat_file(f"{copies.root}/{MODEL_MARKER}"))["files"]
    staged = destination.parent / f".{destination.name}.download"
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    for name in files:
        copies.fs.get_file(f"{copies.root}/{name}", str(staged / name))
    (staged / BEST_RECORD).write_text(json.dumps(record) + "\n")
    replace(destination, staged)


def replace(destination: Path, new: Path) -> None:
    """`destination` (a link or a folder, or nothing) becomes `new`."""
    old = destination.parent / f".{destination.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if destination.is_symlink() or destination.is_file():
        destination.unlink()
    elif destination.is_dir():
        os.replace(destination, old)
    os.replace(new, destination)
    shutil.rmtree(old, ignore_errors=True)


def copied_trial(folder: Path) -> dict | None:
    """What a copied best/ holds (None for a link or nothing)."""
    record = folder / BEST_RECORD
    if folder.is_symlink() or not record.is_file():
        return None
    return json.loads(record.read_text())


def remove_remote(uri: str, options: dict | None) -> bool:
    """Every remote file of a trial; False when there was nothing (or another worker removed it meanwhile)."""
    copies = remote(uri, options)
    copies.fs.invalidate_cache()
    try:
        if not copies.fs.exists(copies.root):
            return False
        copies.fs.rm(copies.root, recursive=True)
    except FileNotFoundError:  # workers clean up after the same trial at once
        return False
    return True
