"""The markers tell the truth: the marked node ids are recorded at collection, and every command a test starts
(run, run_forked) is checked first, failing a test (or the fixture it asked for) that starts a process, trains the
pretrained MiniLM or launches DeepSpeed without `launch`, `model_package` or `deepspeed`; requires_cuda marks and
skips the CUDA-only tests."""

import os
from pathlib import Path

import pytest
import torch

from .ops import wait_for_deepspeed_ops

_MARKED: dict[str, set[str]] = {"launch": set(), "model_package": set(), "deepspeed": set()}  # marker -> node ids
_EXAMPLES = {"run_glue.py", "run_qa.py", "run_translation.py"}


def record_markers(items) -> None:
    """The node ids of the collected tests carrying each checked marker."""
    for marker, nodeids in _MARKED.items():
        nodeids.update(item.nodeid for item in items if item.get_closest_marker(marker))


def check_markers(args: list[str]) -> None:
    """The markers select subsets (`make test-fast`: no `launch`; a GPU machine with only the repository: no
    `model_package`), so they must be true: a test (or the fixture it asked for) that starts a process, trains the
    pretrained MiniLM or launches DeepSpeed without its marker fails here, before the process starts."""
    current = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    if not current:
        return
    names = {Path(arg).name for arg in args}
    needs = {"launch"}
    if "--model_name_or_path" not in args and (names & _EXAMPLES or "train" in args and any(a.endswith(".yaml")
                                                                                           for a in args)):
        needs.add("model_package")
    if "deepspeed" in names or "deepspeed.launcher.runner" in args or "--deepspeed" in args and "ds-config" not in args:
        needs.add("deepspeed")
    missing = sorted(marker for marker in needs if current not in _MARKED[marker])
    assert not missing, f"{current} starts {' '.join(args[:3])} ...: mark it " + " ".join(
        f"@pytest.mark.{marker}" for marker in missing)
    if current in _MARKED["deepspeed"]:  # a session fixture's runs start before the test's autouse fixtures
        wait_for_deepspeed_ops()


def requires_cuda(test):
    """A CUDA-only test: marked `cuda` (`make gpu-check` runs exactly these), skipped cleanly without a GPU."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))
