"""The markers tell the truth on a machine without a library: the subset that leaves it out collects and the package
names what to install instead of a traceback."""

import pytest

from conftest import PYTHON, REPO, run

WITHOUT = REPO / "tests" / "scripts" / "without_libraries"  # its sitecustomize hides deepspeed, fairscale, MiniLM
SUBSET = "not launch and not cuda and not deepspeed and not fairscale and not model_package"


@pytest.mark.launch
def test_the_subset_without_the_libraries_collects_cleanly():
    """A test file importing DeepSpeed, FairScale or the model package at collection would stop the whole subset on a
    machine without them (`make test-without-libraries` runs it whole)."""
    out = run([PYTHON, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", SUBSET, "tests"],
              env={"PYTHONPATH": str(WITHOUT)}, cwd=REPO, timeout=300)
    last = out.stdout.strip().splitlines()[-1]  # e.g. "238/684 tests collected (446 deselected) in 13.2s"
    assert out.returncode == 0 and "deselected" in last and "error" not in last, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.mark.launch
def test_a_backend_without_its_library_is_one_line_before_transformers_imports_it(tmp_path):
    """Without DeepSpeed, accelerate raised ImportError from inside transformers (and left ACCELERATE_USE_DEEPSPEED
    set, so the next arguments built a DeepSpeed plugin); without FairScale the run got as far as the trainer."""
    code = f"""
import os
from trainer_ext import ExtTrainingArguments
from trainer_ext.errors import ArgumentsError
for flags in ({{"deepspeed": "zero2_minimal"}}, {{"sharded_ddp": "simple"}}):
    try:
        ExtTrainingArguments(output_dir={str(tmp_path)!r}, **flags)
    except ArgumentsError as error:
        print(error)
from types import SimpleNamespace
from trainer_ext.backends.fairscale import FairScaleBackend
from trainer_ext.errors import MissingLibraryError
try:  # the check ExtTrainer runs on stock TrainingArguments, which parsed nothing
    given = SimpleNamespace(sharded_ddp=["simple"])
    FairScaleBackend(given)
except MissingLibraryError as error:
    print("trainer", error)
print("env", os.environ.get("ACCELERATE_USE_DEEPSPEED"))
"""
    out = run([PYTHON, "-c", code], env={"PYTHONPATH": f"{WITHOUT}:{REPO}"}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[-2].startswith("trainer --sharded_ddp simple needs fairscale, which is not installed"), lines
    assert lines[-4].startswith("--deepspeed needs deepspeed, which is not installed: pip install 'deepspeed"), lines
    assert lines[-3].startswith("--sharded_ddp simple needs fairscale, which is not installed: pip install fairscale")
    assert lines[-1] == "env None"
