"""What a run was trained from, recorded in every checkpoint's marker: the model's starting weights (its name_or_path,
a local folder resolved, and a digest of the weight files there) and the training data (its length and a digest of
evenly spaced rows). A resume compares them with this run's: another model is refused before training (the
checkpoint's weights would replace it in silence), a moved folder of the same weights is not; other data of the same
length is said (the order, a function of the length and seed, continues exactly; another length is the sampler's
refusal). Files, not memory: the same answer on every backend (ZeRO-3 and FSDP2 hold shards) and for every
randomly initialised part (a new head, LoRA adapters) whatever the seed."""

from __future__ import annotations

import json
from pathlib import Path

WHOLE_FILE_BYTES = 256 << 20  # weight files up to this size are hashed whole; larger ones by evenly spaced blocks
BLOCKS, BLOCK_BYTES = 64, 1 << 20
SAMPLED_ROWS = 16


def model_origin(module) -> dict:
    """{"name_or_path": as given, a local folder resolved (None: built from a config in memory), "weights": a digest
    of the weight files it names (None when there are none to read)}."""
    name = getattr(module, "name_or_path", None) if module is not None else None
    if not name:
        return {"name_or_path": None, "weights": None}
    folder = Path(name)
    if folder.is_file():
        folder = folder.parent
    if folder.is_dir():
        return {"name_or_path": str(folder.resolve()), "weights": weights_digest(folder)}
    return {"name_or_path": str(name), "weights": _hub_weights_digest(str(name))}


def _hub_weights_digest(name: str) -> str | None:
    """The digest of a Hub model's cached files (the snapshot transformers loaded, offline); None when not cached."""
    try:
        from huggingface_hub import try_to_load_from_cache

        config = try_to_load_from_cache(name, "config.json")
    except Exception:  # noqa: BLE001 (not a repository name, or no huggingface_hub: nothing to compare but the name)
        return None
    return weights_digest(Path(config).parent) if isinstance(config, str) else None


def weight_files(folder: Path) -> list[Path]:
    """The model weight files of a folder: safetensors and PyTorch .bin files (not the pickled training arguments)."""
    return sorted(path for path in folder.iterdir() if path.is_file() and (
        path.suffix == ".safetensors" or (path.suffix == ".bin" and path.name != "training_args.bin")))


def weights_digest(folder: Path) -> str | None:
    """xxh3 of the weight files' names, sizes and bytes (each whole up to WHOLE_FILE_BYTES, else BLOCKS evenly spaced
    blocks): the same weights in another folder give the same digest; None for a folder without weight files."""
    import xxhash

    files = weight_files(folder)
    if not files:
        return None
    digest = xxhash.xxh3_64()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}\n".encode())
        with open(path, "rb") as stream:
            if size <= WHOLE_FILE_BYTES:
                for chunk in iter(lambda: stream.read(1 << 24), b""):
                    digest.update(chunk)
                continue
            for block in range(BLOCKS):
                stream.seek((size - BLOCK_BYTES) * block // (BLOCKS - 1))
                digest.update(stream.read(BLOCK_BYTES))
    return digest.hexdigest()


def data_origin(dataset) -> dict | None:
    """{"num_samples", "rows": a digest of SAMPLED_ROWS evenly spaced rows} of a training set with a length: a
    `datasets` table or a list (their rows read the same every time; another Dataset's items may be augmented, so only
    its length is kept); None for a stream."""
    try:
        count = len(dataset)
    except (TypeError, NotImplementedError):
        return None
    rows = None
    indices = sorted({round(i * (count - 1) / max(1, SAMPLED_ROWS - 1)) for i in range(min(count, SAMPLED_ROWS))})
    if type(dataset).__module__.startswith("datasets.") and hasattr(dataset, "with_format"):
        rows = dataset.with_format(None)[indices] if indices else {}
    elif isinstance(dataset, (list, tuple)):
        rows = [dataset[i] for i in indices]
    if rows is None:
        return {"num_samples": count, "rows": None}
    import xxhash

    text = json.dumps(rows, sort_keys=True, default=lambda value: value.tolist() if hasattr(value, "tolist")
                      else repr(value))
    return {"num_samples": count, "rows": xxhash.xxh3_64(text.encode()).hexdigest()}


def same_model(saved: dict, now: dict) -> bool:
    """Whether a checkpoint's starting weights are this run's: the digests when both have one (a moved folder is the
    same model), else the names."""
    if saved.get("weights") and now.get("weights"):
        return saved["weights"] == now["weights"]
    return saved.get("name_or_path") == now.get("name_or_path")


def described(origin: dict) -> str:
    name = origin.get("name_or_path")
    return name if name else "a model built from its config (no weights read from a folder)"


def other_model(checkpoint: Path, saved: dict, now: dict, explicit: bool) -> str | None:
    """The line for a resume whose checkpoint was trained from another model than this run's, or None when it is the
    same. `explicit`: the checkpoint was named (--resume_from_checkpoint PATH), so it continues, said; else it is
    refused with the choices."""
    if not saved or same_model(saved, now):
        return None
    before, given = described(saved), described(now)
    if saved.get("name_or_path") == now.get("name_or_path") and saved.get("name_or_path"):
        before, given = f"{before} as it was then", f"{given}, whose weight files have changed since"
    if explicit:
        return (f"resuming from {checkpoint} as asked: it was trained from {before}, and its weights replace those of "
                f"this run's model ({given})")
    return (f"{checkpoint} was trained from {before}, not from this run's model ({given}): resuming would continue the "
            f"checkpoint's weights and never use yours. To train your model, pass --fresh_start (start over here) or "
            f"another --output_dir; to continue the checkpoint, load the model it was trained from, or name it with "
            f"--resume_from_checkpoint {checkpoint} (its weights replace your model's)")


def other_data(checkpoint: Path, saved: dict | None, now: dict | None) -> str | None:
    """The line for a resume over other rows of the same length (the order continues exactly where it stopped, over
    the new rows), or None. Another length is refused by the sampler (samplers.load_state_dict)."""
    if not saved or not now or saved.get("num_samples") != now.get("num_samples"):
        return None
    if saved.get("rows") is None or now.get("rows") is None or saved["rows"] == now["rows"]:
        return None
    return (f"resuming from {checkpoint} with other training data: the same {now['num_samples']} samples in number, "
            "other rows; the order continues exactly where it stopped (it depends only on the number of samples and "
            "the seed), over this data's rows (--fresh_start trains on it from the start)")


def read_origin(checkpoint) -> tuple[dict, dict | None]:
    """(the model, the data) a checkpoint's marker records it was trained from ({} and None for one written before
    they were recorded, or without trainer_ext)."""
    from .format import MARKER

    try:
        marker = json.loads((Path(checkpoint) / MARKER).read_text())
    except (OSError, ValueError):
        return {}, None
    model = marker.get("trained_from")
    return (model if isinstance(model, dict) else {}), marker.get("data")

