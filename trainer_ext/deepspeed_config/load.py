"""Reading --deepspeed: a dict, inline JSON, a JSON/HJSON file or a preset name from ds_configs/; duplicate keys and
unreadable files are one clear problem each."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

from ..errors import UserError, closest

# Presets: name -> file in ds_configs/ (a registry, so an unknown name lists the valid ones).
PRESETS = {
    "zero2": "zero2.json",
    "zero2_offload": "zero2_offload.json",
    "zero2_minimal": "zero2_minimal.json",
    "zero2_auto": "zero2_auto.json",
    "zero3": "zero3.json",
    "zero3_offload": "zero3_offload.json",
}


class DeepSpeedConfigError(UserError):
    """Every problem found in a DeepSpeed config and the flags beside it, reported together."""

    def __init__(self, problems: list[str], origin: str | None = None):
        self.problems, self.origin = list(problems), origin
        head = f"DeepSpeed config {origin}" if origin else "DeepSpeed config"
        noun = "problem" if len(self.problems) == 1 else "problems"
        super().__init__(f"{head}: {len(self.problems)} {noun}:\n" + "\n".join(f"  - {p}" for p in self.problems))


# ---------------------------------------------------------------------------------------------- loading

def presets_dir() -> Path:
    """ds_configs/ of a source checkout or editable install, else the copy installed in the package."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package.parent / "ds_configs", package / "ds_configs"):
        if candidate.is_dir():
            return candidate
    return package.parent / "ds_configs"


GIVEN_AS_DICT = "(given as a dict)"


def load_deepspeed_config(value: Any) -> tuple[dict, str]:
    """Read --deepspeed: a dict, an inline JSON string, a path to a JSON file, or a preset name.

    Returns a deep copy (the caller's object is never mutated) and a phrase naming where it came from."""
    if isinstance(value, dict):
        return copy.deepcopy(value), GIVEN_AS_DICT
    if isinstance(value, Path):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise DeepSpeedConfigError([f"--deepspeed must be a JSON file, inline JSON, a dict or one of the presets "
                                    f"{sorted(PRESETS)}; got {value!r}"])
    text = value.strip()
    if text.startswith("{"):
        return _parse_json(text, "inline --deepspeed JSON"), "(inline JSON)"
    path = Path(os.path.expanduser(text))
    if not path.exists() and text in PRESETS:
        path = presets_dir() / PRESETS[text]
    if not path.exists():
        hint = closest(text, PRESETS, cutoff=0.6)
        also = f"; did you mean the preset {hint!r}?" if hint else ""
        raise DeepSpeedConfigError([f"--deepspeed {text!r}: no such file, and not a preset "
                                    f"(presets: {', '.join(sorted(PRESETS))}){also}"])
    if path.is_dir():
        raise DeepSpeedConfigError([f"--deepspeed {text!r} is a folder; give the JSON file inside it"])
    text = path.read_text(encoding="utf-8")
    if not text.strip():  # hjson reads nothing as {}: ZeRO-2 trained with defaults, in silence
        raise DeepSpeedConfigError([f"--deepspeed {path}: the file is empty ({path.stat().st_size} bytes), which is "
                                    "not JSON: write {} in it for ZeRO-2 with trainer_ext's defaults and your flags, or "
                                    "name a preset (e.g. --deepspeed zero2)"])
    return _parse_json(text, str(path)), str(path)


class _DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


def _parse_json(text: str, origin: str) -> dict:
    """JSON, or HJSON (comments, trailing commas) as DeepSpeed itself reads config files; duplicate keys refused."""
    try:
        config = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKey as err:
        raise DeepSpeedConfigError([f"duplicate key {err.args[0]!r} in {origin}: DeepSpeed rejects it; keep one"]) from None
    except json.JSONDecodeError as err:
        config = _parse_hjson(text, origin)
        if config is None:
            raise DeepSpeedConfigError([f"invalid JSON in {origin}, line {err.lineno}, column {err.colno}: "
                                        f"{err.msg}"]) from None
    if not isinstance(config, dict):
        raise DeepSpeedConfigError([f"{origin} must hold a JSON object, got {type(config).__name__}"])
    return config


def _parse_hjson(text: str, origin: str):
    try:
        import hjson  # DeepSpeed's own config reader; optional here
    except ImportError:
        return None
    try:
        return hjson.loads(text, object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKey as err:
        raise DeepSpeedConfigError([f"duplicate key {err.args[0]!r} in {origin}: DeepSpeed rejects it; keep one"]) from None
    except ValueError:
        return None
