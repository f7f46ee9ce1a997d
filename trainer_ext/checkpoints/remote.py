"""Remote checkpoints (--checkpoint_uri, any fsspec URL): every complete local checkpoint is copied there in the
background, its marker last, and a run whose output_dir holds none starts from the newest complete remote one."""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import threading
from pathlib import Path

from .format import CHECKSUM, MARKER, STAGING, checkpoint_step, damaged_file, publish
from ..errors import UserError

logger = logging.getLogger(__name__)

UPLOADING = ".uploading"  # hard-linked snapshots of checkpoints being uploaded: rotation may delete the originals


class RemoteCheckpointError(UserError):
    """--checkpoint_uri cannot be used (credentials, bucket, endpoint, protocol): found before training."""


def _s3_options(options: dict) -> dict:
    """s3fs takes the endpoint inside client_kwargs; accept it at the top level, or from AWS_ENDPOINT_URL, and fail
    fast (seconds, not botocore's minutes of retries) on an unreachable endpoint."""
    options = dict(options)
    client = dict(options.pop("client_kwargs", {}))
    endpoint = options.pop("endpoint_url", None) or client.get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        client["endpoint_url"] = endpoint
    options["client_kwargs"] = client
    config = dict(options.pop("config_kwargs", {}))
    config.setdefault("connect_timeout", 10)
    config.setdefault("retries", {"max_attempts": 2})
    options["config_kwargs"] = config
    return options


class RemoteCheckpoints:
    """The checkpoints under one remote prefix: `prefix/checkpoint-N/...`, complete when `checkpoint_complete.json`
    is there (uploaded last, so a listing never shows a half-uploaded checkpoint as complete)."""

    def __init__(self, uri: str, storage_options: dict | None = None):
        try:
            import fsspec
        except ImportError:
            raise RemoteCheckpointError("--checkpoint_uri needs fsspec (and s3fs for s3://): "
                                        "pip install fsspec s3fs") from None
        self.uri = uri.rstrip("/")
        options = dict(storage_options or {})
        if self.uri.startswith(("s3://", "s3a://")):
            options = _s3_options(options)
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.uri, **options)
        except (ImportError, ValueError) as err:
            raise RemoteCheckpointError(f"--checkpoint_uri {uri}: {err}") from None
        self.root = self.root.rstrip("/")
        self._tasks: queue.Queue = queue.Queue()
        self._worker: threading.Thread | None = None
        self.failed: list[str] = []

    # -- before training -------------------------------------------------------------------------------
    def check(self) -> None:
        """Write to, list and read the prefix once, before any training starts: bad credentials, an unreachable
        endpoint or a missing bucket fail here, not at the first checkpoint hours later."""
        probe = f"{self.root}/.trainer_ext-write-check-{os.getpid()}"
        try:
            if "file" in _protocols(self.fs):
                self.fs.makedirs(self.root, exist_ok=True)
            self.fs.pipe_file(probe, b"ok")
            self.complete()
            self.fs.rm_file(probe)
        except Exception as err:  # noqa: BLE001 - every backend raises its own types; the message is what matters
            raise RemoteCheckpointError(_explain(self.uri, err) + ". Nothing was trained.") from None

    def complete(self) -> list[tuple[int, str]]:
        """(step, name) of the complete remote checkpoints, oldest first."""
        self.fs.invalidate_cache()  # other runs may have written since the last listing
        try:
            listing = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:  # object stores: an empty prefix does not exist
            return []
        found = []
        for path in listing:
            name = path.rstrip("/").rsplit("/", 1)[-1]
            step = checkpoint_step(Path(name))
            if step is not None and self.fs.exists(f"{self.root}/{name}/{MARKER}"):
                found.append((step, name))
        return sorted(found)

    def download_newest(self, output_dir) -> Path | None:
        """Copy the newest complete remote checkpoint that arrives intact (every file's size and checksum as its
        marker recorded them) into output_dir, staged then renamed into place; a damaged one is skipped with a
        warning naming the file, and the next older one tried."""
        for _, name in reversed(self.complete()):
            staged = Path(output_dir) / STAGING / name
            shutil.rmtree(staged, ignore_errors=True)
            remote = f"{self.root}/{name}"
            for path in self.fs.find(remote):
                relative = (path[len(remote.rstrip("/")) + 1:] if path.startswith(remote)
                            else path.rsplit(f"/{name}/", 1)[-1])
                if relative == MARKER:
                    continue  # written by publish() once everything else is here
                target = staged / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(path, str(target))
            info = json.loads(self.fs.cat_file(f"{remote}/{MARKER}"))
            problem = damaged_file(staged, info["files"]) if info.get("checksum") == CHECKSUM else None
            if problem:
                logger.warning("skipping remote checkpoint %s/%s: %s", self.uri, name, problem)
                shutil.rmtree(staged, ignore_errors=True)
                continue
            for key in ("saved_at", "checksum", "files"):  # publish() records them anew for the local copy
                info.pop(key, None)
            final = publish(staged, output_dir, {**info, "downloaded_from": f"{self.uri}/{name}"})
            logger.warning("downloaded %s/%s to %s", self.uri, name, final)
            return final
        return None

    # -- during training -------------------------------------------------------------------------------
    def upload(self, checkpoint: Path) -> None:
        """Queue a complete local checkpoint; returns at once (the copy runs in a background thread)."""
        checkpoint = Path(checkpoint)
        snapshot = checkpoint.parent / UPLOADING / checkpoint.name
        shutil.rmtree(snapshot, ignore_errors=True)
        shutil.copytree(checkpoint, snapshot, copy_function=_link_or_copy)
        self._submit(("upload", snapshot))

    def delete(self, names: list[str]) -> None:
        """Queue the removal of remote checkpoints rotated away locally (after earlier uploads finished)."""
        if names:
            self._submit(("delete", list(names)))

    def wait(self) -> None:
        """Block until every queued upload is done (end of training, preemption)."""
        if self._worker is not None:
            self._tasks.join()
        if self.failed:
            logger.error("these checkpoints were NOT uploaded to %s: %s (they are complete locally)", self.uri,
                         ", ".join(self.failed))

    def _submit(self, task) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="checkpoint-upload", daemon=True)
            self._worker.start()
        self._tasks.put(task)

    def _work(self) -> None:
        while True:
            kind, payload = self._tasks.get()
            try:
                if kind == "upload":
                    self._upload_now(payload)
                else:
                    for name in payload:
                        if self.fs.exists(f"{self.root}/{name}"):
                            self.fs.rm(f"{self.root}/{name}", recursive=True)
            except Exception as err:  # noqa: BLE001 - training goes on; the local checkpoint is intact
                name = payload.name if kind == "upload" else ", ".join(payload)
                logger.error("remote checkpoint %s failed for %s: %s", kind, name, _explain(self.uri, err))
                if kind == "upload":
                    self.failed.append(name)
            finally:
                if kind == "upload":
                    shutil.rmtree(payload, ignore_errors=True)
                self._tasks.task_done()

    def _upload_now(self, snapshot: Path) -> None:
        remote = f"{self.root}/{snapshot.name}"
        if self.fs.exists(remote):  # saved again after a resume: make it incomplete before changing it
            self.fs.rm(remote, recursive=True)
        files = sorted(p for p in snapshot.rglob("*") if p.is_file() and p.name != MARKER)
        local = "file" in _protocols(self.fs)  # object stores have no folders; a file system needs them made
        for path in files:
            target = f"{remote}/{path.relative_to(snapshot).as_posix()}"
            if local:
                self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
            self.fs.put_file(str(path), target)
        self.fs.put_file(str(snapshot / MARKER), f"{remote}/{MARKER}")
        logger.info("uploaded %s to %s", snapshot.name, remote)


def _link_or_copy(source, destination):
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


def _explain(uri: str, err: Exception) -> str:
    text = f"{type(err).__name__}: {err}"
    hints = []
    lowered = text.lower()
    if "credential" in lowered or "accessdenied" in lowered or "forbidden" in lowered or "signature" in lowered:
        hints.append("set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or pass credentials in "
                     "--checkpoint_storage_options")
    if "connect" in lowered or "endpoint" in lowered or "timeout" in lowered or "resolve" in lowered:
        hints.append("check the endpoint (AWS_ENDPOINT_URL or --checkpoint_storage_options "
                     "'{\"endpoint_url\": ...}') and the network")
    if "nosuchbucket" in lowered or "bucket does not exist" in lowered or "not found" in lowered:
        hints.append("create the bucket first, or fix its name in --checkpoint_uri")
    return f"--checkpoint_uri {uri}: cannot use it ({text})" + (f"; {'; '.join(hints)}" if hints else "")


def _protocols(fs) -> tuple:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
