"""TORCH_CUDA_ARCH_LIST as DeepSpeed's op builder can read it, settled before any DeepSpeed op is built.

Many Hopper and Blackwell images set TORCH_CUDA_ARCH_LIST="9.0a" (or "10.0f"): torch accepts the letter, which enables
arch-specific instructions, but DeepSpeed 0.19's builder parses each entry as `int(major).int(minor)` and every ZeRO
run without offload dies JIT-building FusedAdam (op_builder/builder.py compute_capability_args: "invalid literal for
int() with base 10: '0a'"). Its ops use none of those instructions, so building them for "9.0" is what the user meant:
the value is normalised for this process, once, and said. An entry nothing can read is an error naming the variable."""

from __future__ import annotations

import logging
import os
import re

from ...environment.variables import set_variables
from ...errors import ArgumentsError

logger = logging.getLogger(__name__)

VARIABLE = "TORCH_CUDA_ARCH_LIST"
# major.minor, an optional arch-specific letter (9.0a, 10.0f), an optional +PTX
_ENTRY = re.compile(r"^(\d+)\.(\d+)([a-z]?)(\+PTX)?$")
_said: list[str] = []


class ArchListError(ArgumentsError):
    """TORCH_CUDA_ARCH_LIST holds an entry DeepSpeed cannot build for."""


def for_deepspeed(value: str) -> str:
    """The arch list with letter suffixes dropped ("9.0a" -> "9.0", "8.0;9.0a+PTX" -> "8.0;9.0+PTX"), or the value
    itself when it has none; entries are separated by ';' or spaces, as torch and DeepSpeed read them. Raises
    ArchListError for an unreadable entry."""
    kept, unreadable, lettered = [], [], False
    for entry in value.replace(" ", ";").split(";"):
        if not entry.strip():
            continue
        match = _ENTRY.match(entry.strip())
        if match is None:
            unreadable.append(entry.strip())
            continue
        major, minor, letter, ptx = match.groups()
        lettered = lettered or bool(letter)
        kept.append(f"{major}.{minor}{ptx or ''}")
    if unreadable:
        raise ArchListError(
            f"{VARIABLE}={value!r}: DeepSpeed cannot build its ops for {', '.join(map(repr, unreadable))}; give "
            f"major.minor compute capabilities separated by ';' (e.g. {VARIABLE}=\"8.0;9.0\"), or unset it to "
            "build for the GPUs present")
    return ";".join(kept) if lettered else value


def check_for_deepspeed(environ=os.environ) -> None:
    """Raises ArchListError for a TORCH_CUDA_ARCH_LIST DeepSpeed cannot build for; reads only (the arguments call it,
    prepare_for_deepspeed normalises the value when the process is prepared)."""
    value = environ.get(VARIABLE)
    if value is not None and value.strip():
        for_deepspeed(value)


def prepare_for_deepspeed(environ=os.environ, main_process: bool | None = None) -> str | None:
    """Normalise TORCH_CUDA_ARCH_LIST in `environ` for DeepSpeed's op builds; returns the note said (None: nothing
    to change). Raises ArchListError (a user's setting, reported before any work) for an unreadable value."""
    value = environ.get(VARIABLE)
    if value is None or not value.strip():
        return None
    normalised = for_deepspeed(value)
    if normalised == value:
        return None
    set_variables({VARIABLE: normalised}, environ=environ)
    if main_process is None:
        main_process = environ.get("RANK", "0").strip() in ("", "0")
    note = (f"{VARIABLE}={value!r} -> {normalised!r} for DeepSpeed's op builds (DeepSpeed 0.19 cannot parse the "
            "arch-specific letter; its ops do not use those instructions)")
    if main_process and note not in _said:
        _said.append(note)
        logger.warning(note)
    return note
