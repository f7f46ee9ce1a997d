"""A config's dotted fields (read, write, list, compare) and where each value came from: a Source is data the passes
ask (its Origin), and its words are what `trainer-ext ds-config --explain` prints."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

from .keys import INTEGER_TEXT, NUMBER_TEXT, STRING_KEYS


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
