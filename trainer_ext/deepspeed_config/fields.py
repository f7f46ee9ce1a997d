"""A config's dotted fields (read, write, list, compare, read as DeepSpeed's models read them) and where each value came
from: a Source is data the passes ask (its Origin), and its words are what `trainer-ext ds-config --explain` prints."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any

from .keys import INTEGER_TEXT, NUMBER_TEXT, OFFLOAD_DEVICES, STRING_KEYS, FieldType


class Origin(Enum):
    """What decided a field's value; the value is the word --explain starts with."""

    FLAG = "flag"  # a flag the user gave
    DEFAULT = "default"  # a flag left at its default, or one of the translator's own defaults
    FILE = "file"  # the user's DeepSpeed file
    DERIVED = "derived"  # computed from other values (the batch product, the step count, the model's hidden size)
    TRAINER = "left to the Trainer"  # not in the config: transformers builds it


@dataclass(frozen=True)
class Source:
    """Where one field's value came from."""

    origin: Origin
    detail: str = ""  # --explain's words after the origin's: which flag, which rule, the measurement behind it
    file_said_auto: bool = False
    for_world_size: int | None = None  # split from train_batch_size for this many ranks: it holds for no other

    def __str__(self) -> str:
        return self.origin.value + self.detail + (" (file said auto)" if self.file_said_auto else "")


def flag_source(given: bool, detail: str, file_said_auto: bool = False) -> Source:
    """A value taken from a flag: typed by the user, or its default."""
    return Source(Origin.FLAG if given else Origin.DEFAULT, detail, file_said_auto)


def get_field(config: dict, path: str) -> Any:
    node = config
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def set_field(config: dict, path: str, value: Any) -> None:
    parts = path.split(".")
    node = config
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def iter_fields(config: dict, prefix: str = ""):
    """(dotted path, value) of every leaf of a config."""
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from iter_fields(value, path + ".")
        else:
            yield path, value


def copy_tree(node: Any) -> Any:
    """A copy of a config's dicts and lists (what the passes change); its leaves, all immutable JSON values, shared."""
    if isinstance(node, dict):
        return {key: copy_tree(value) for key, value in node.items()}
    if isinstance(node, list):
        return [copy_tree(value) for value in node]
    return node


def source_of(sources: dict[str, Source], path: str) -> Source:
    """A field's source, else its nearest section's; a field nothing filled is the file's."""
    while path:
        if path in sources:
            return sources[path]
        path = path.rpartition(".")[0]
    return Source(Origin.FILE)


def numbers_from_strings(node: Any, key: str | None = None) -> Any:
    """"8" -> 8 and "5e8" -> 5e8 everywhere except in keys that hold names (a new tree: the input is left alone)."""
    if isinstance(node, dict):
        return {k: numbers_from_strings(v, k) for k, v in node.items()}
    if isinstance(node, list):
        return [numbers_from_strings(v, key) for v in node]
    if isinstance(node, str) and key not in STRING_KEYS and NUMBER_TEXT.match(node):
        return int(node) if INTEGER_TEXT.match(node) else float(node)
    return node


def same(a: Any, b: Any) -> bool:
    """Equal as DeepSpeed would use them: 1 == 1.0, floats to 1e-12, lists element by element, bools only as bools."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    return a == b


def positive_int(value) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return isinstance(value, int) and value > 0


def show(value) -> str:
    """A value as a flag would be typed: strings bare, the rest as JSON."""
    return json.dumps(value) if not isinstance(value, str) else value


# pydantic's lax reading of text as a bool, and of digits with underscores as an integer ("1_000").
TRUE_TEXT, FALSE_TEXT = frozenset({"1", "on", "t", "true", "y", "yes"}), frozenset({"0", "off", "f", "false", "n", "no"})
GROUPED_DIGITS = re.compile(r"^\s*[+-]?\d+(_\d+)+\s*$")


def read_field(spec: FieldType, value: Any) -> tuple[bool, Any]:
    """Whether DeepSpeed's config model accepts `value` for a field of this type (its pydantic lax rules), and the value
    as the translator keeps it: bool-like values as true/false, a stage as an integer, numbers as written."""
    if value is None:
        return spec.nullable, None
    if spec.kind == "object":
        return isinstance(value, dict), value
    if spec.kind == "path":
        return isinstance(value, str), value
    if spec.kind == "device":
        return isinstance(value, str) and value in OFFLOAD_DEVICES, value
    if spec.kind == "bool":
        if isinstance(value, bool):
            return True, value
        if isinstance(value, (int, float)) and value in (0, 1):
            return True, bool(value)
        if isinstance(value, str) and value.lower() in TRUE_TEXT | FALSE_TEXT:
            return True, value.lower() in TRUE_TEXT
        return False, value
    if isinstance(value, bool):
        number = int(value) if spec.bools else None
    elif isinstance(value, int):
        number = value
    elif isinstance(value, float):
        whole = value.is_integer() and -2 ** 63 <= value < 2 ** 63  # pydantic's int64 reading of a float
        number = value if math.isfinite(value) and (spec.kind == "float" or whole) else None
    elif isinstance(value, str) and spec.kind != "stage" and GROUPED_DIGITS.match(value):
        number = value = int(value.replace("_", ""))
    else:
        number = None
    if number is None:
        return False, value
    low, high = (0, 3) if spec.kind == "stage" else (spec.low, spec.high)
    if (low is not None and (number <= low if spec.low_open else number < low)) or (high is not None and number > high):
        return False, value
    return True, int(number) if spec.kind == "stage" else value


def requirement(spec: FieldType) -> str:
    """What a field of this type must be, in a problem's words."""
    if spec.kind in ("int", "float"):
        bound = (f" > {spec.low:g}" if spec.low_open else f" in [{spec.low:g}, {spec.high:g}]" if spec.high is not None
                 else f" >= {spec.low:g}" if spec.low is not None else "")
        what = ("a whole number" if spec.kind == "int" else "a number") + bound
    else:
        what = {"bool": "true or false", "stage": "0, 1, 2 or 3", "path": "a folder's path (text)",
                "object": "a JSON object", "device": '"cpu", "nvme" or "none"'}[spec.kind]
    return what + (", or null" if spec.nullable else "")
