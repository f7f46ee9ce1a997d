"""A value from an experiment file or the command line read as its dataclass field's type: strings that are numbers
become the numbers meant (PyYAML reads 5e-5, without a dot, as a string); a value that does not fit is named."""

from __future__ import annotations

import dataclasses
import enum
import os
import types
import typing
from typing import Any, Literal, Union

from ..errors import closest

NONE = type(None)
UNIONS = (Union, types.UnionType)
BOOLEANS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a mapping"}


class WrongType(ValueError):
    """What was expected and what was given, e.g. "expected an integer, got 'six'"."""


def field_types(cls) -> dict[str, tuple[Any, Any]]:
    """Field name -> (its type, the choices in its metadata) for every field the dataclass's __init__ takes."""
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f.metadata.get("choices")) for f in dataclasses.fields(cls) if f.init}


def did_you_mean(word, valid) -> str:
    """" (did you mean 'x'?)" for the closest valid word, or nothing."""
    match = closest(word, valid)
    return f" (did you mean {match!r}?)" if match else ""


def read_as(value, hint, choices=None):
    """`value` as a `hint`: int, float, bool, str, an Enum or Literal, list, tuple, dict, or a union of them."""
    choices = list(choices) if choices is not None else _choices(hint)
    if choices is not None:
        value = value.value if isinstance(value, enum.Enum) else value
        if value is False and "no" in choices:  # YAML 1.1 reads an unquoted `no` as false
            value = "no"
        if value not in choices:
            raise WrongType(f"expected one of {', '.join(map(str, choices))}, got {value!r}"
                            + did_you_mean(value, choices))
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in UNIONS:
        if value is None and NONE in args:
            return None
        if len(_members(args)) == 1:  # its own message, with the closest choice
            return read_as(value, _members(args)[0])
        for member in _members(args):
            try:
                return read_as(value, member)
            except WrongType:
                pass
    elif hint is bool:
        word = str(value).lower() if isinstance(value, (str, int)) else None  # True, 1, "yes", as the flags take
        if word in BOOLEANS:
            return BOOLEANS[word]
    elif hint in (int, float):
        number = _number(value)
        if number is not None and (hint is float or isinstance(number, int) or number.is_integer()):
            return hint(number)
    elif hint is str:
        if isinstance(value, (str, os.PathLike)) or _number(value) is not None:
            return os.fspath(value) if isinstance(value, os.PathLike) else str(value)
    elif list in (origin, hint) and not isinstance(value, dict):
        items = value if isinstance(value, (list, tuple)) else [value]  # one item for a list field
        try:
            return [read_as(item, args[0]) for item in items] if args else list(items)
        except WrongType:
            pass
    elif origin is tuple and isinstance(value, (list, tuple)) and len(value) == len(args):
        try:
            return tuple(read_as(item, member) for item, member in zip(value, args))
        except WrongType:
            pass
    elif dict in (origin, hint):
        if isinstance(value, dict):
            return value
    elif hint is Any or (isinstance(hint, type) and isinstance(value, hint)):
        return value
    raise WrongType(f"expected {describe(hint)}, got {value!r}")


def describe(hint) -> str:
    """A type in the words of a YAML user: 'an integer or null', 'one of linear, cosine, ...'."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    choices = _choices(hint)
    if choices is not None:
        return f"one of {', '.join(map(str, choices))}"
    if origin in UNIONS:
        return " or ".join([describe(member) for member in _members(args)] + (["null"] if NONE in args else []))
    if list in (origin, hint):
        return f"a list (each {describe(args[0])})" if args else "a list"
    if origin is tuple:
        return f"a list of {len(args)} values, each {describe(args[0])}"
    return NAMES.get(origin or hint, f"a {getattr(hint, '__name__', hint)}")


def _choices(hint):
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return [member.value for member in hint]
    return list(typing.get_args(hint)) if typing.get_origin(hint) is Literal else None


def _members(args) -> list:
    """A union's types; `SchedulerType | str` takes only the enum's values, as HfArgumentParser reads it."""
    members = [member for member in args if member is not NONE]
    return [member for member in members if isinstance(member, type) and issubclass(member, enum.Enum)] or members


def _number(value):
    """An int or float, or a string that reads as one; None for anything else (a bool too)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    for kind in (int, float):
        try:
            return kind(value) if isinstance(value, str) else value
        except ValueError:
            pass
    return None


def option_words(value) -> list[str]:
    """An option-list flag (`--sharded_ddp "zero_dp_2 offload"`, `--fsdp "full_shard auto_wrap"`), as a string, a
    list (an experiment file's, or transformers' parsed enums), or nothing (None, False, "", a bare flag's True) -> its
    words, unchecked: the one reading of option words both backends check."""
    if value is None or value is False or value is True or value == "":
        return []
    if isinstance(value, str) and not isinstance(value, enum.Enum):
        return value.split()
    items = [value] if isinstance(value, enum.Enum) else value
    return [word for item in items for word in str(getattr(item, "value", item)).split()]
