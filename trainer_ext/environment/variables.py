"""The process's environment variables as trainer_ext changes them: the one module that writes `os.environ`
(tests/unit/test_internals.py fails on a write anywhere else in trainer_ext). Every change is a call here, so what the
library does to the user's process is in one place: what it sets (a launcher's rank variables for a 1-rank group,
each CPU rank's threads, DeepSpeed's accelerator and op folder, a SageMaker job's TensorBoard folder), what it leaves
as the user set it (`keep_set`), and what it takes back (`restored`)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator, MutableMapping


def set_variables(values: dict[str, str], keep_set: bool = False,
                  environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set these variables (`keep_set`: only those not set already, the user's value wins); returns what was set.
    `environ`: another mapping to change (a test's), default this process's."""
    environ = os.environ if environ is None else environ
    changed = {name: str(value) for name, value in values.items() if not (keep_set and name in environ)}
    environ.update(changed)
    return changed


def unset_variable(name: str) -> None:
    os.environ.pop(name, None)


@contextmanager
def restored() -> Iterator[dict[str, str]]:
    """The variables as they were before the block, afterwards: what it added is removed (and left in the yielded
    dict, for a caller that may want it back), what it changed or removed is put back."""
    before = dict(os.environ)
    added: dict[str, str] = {}
    try:
        yield added
    finally:
        for name in set(os.environ) - set(before):
            added[name] = os.environ.pop(name)
        os.environ.update({name: value for name, value in before.items() if os.environ.get(name) != value})
