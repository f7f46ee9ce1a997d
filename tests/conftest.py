"""pytest's hooks and the suite's fixtures; the code behind them lives in tests/support/ (one module per concern, see
its __init__.py). The names test files import (`from conftest import run, launch, REPO, ...`) are re-exported here
from support/, so those imports keep working; new code may import from support.<module> directly. tests/ is on
sys.path wherever this file is (pytest's rootdir conftest), so `support` imports the same way."""

import os

# support first: its environment module sets OMP_WAIT_POLICY and PATH before torch loads.
from support.environment import (BIN, DISTRIBUTED_ENV, PYTHON, REPO, clean_env, free_port, launcher,
                                 signal_at_step)
import pytest

from support.deepspeed_oracle import DataParallelWorld, deepspeed_config_check
from support.examples import EXAMPLES, example, user_error, write_lines
from support.launches import GLUE, GLUE_COMMON, TINY_COMMON, TINY_TRAIN, launch
from support.markers import check_markers, record_markers, requires_cuda
from support.models import build_tiny_bert, tiny_bart_config, tiny_bert
from support.ops import (PREBUILD, PREBUILT_OPS, check_no_op_loaded, needs_built_ops, ops_loaded_here,
                         prepare_ops_folder, start_building_ops, stop_building_ops, wait_for_deepspeed_ops)
from support.order import order_files
from support.outputs import (assert_continues, assert_same_training, copy_checkpoint, logged, max_weight_difference,
                             scratch, weights)
from support.processes import launched_report, rank_process, run, run_forked, run_many, selected
from support.references import ACCUMULATE, PLAIN, STEPS, TINY, TINY_LLM, TRL, TRL_BACKENDS, SharedRuns
from support import references
from support.sample_order import ORDER_COMMON, RECORD_ORDER, loaded, train, uninterrupted_run
from support.shared import SHARED_ENV, create_shared_dir, remove_shared_dir, said, shared_dir, shared_once

_check_markers = check_markers  # the name test_sagemaker.py imports

__all__ = [
    # support.environment
    "BIN", "DISTRIBUTED_ENV", "PYTHON", "REPO", "clean_env", "free_port", "launcher", "signal_at_step",
    # support.shared, support.ops, support.markers
    "SHARED_ENV", "shared_dir", "shared_once", "PREBUILD", "PREBUILT_OPS", "wait_for_deepspeed_ops",
    "check_markers", "_check_markers", "requires_cuda",
    # support.processes, support.launches
    "run", "run_many", "run_forked", "selected", "rank_process", "launch", "GLUE", "GLUE_COMMON", "TINY_TRAIN",
    "TINY_COMMON",
    # support.outputs, support.references, support.sample_order
    "scratch", "logged", "weights", "max_weight_difference", "assert_same_training", "copy_checkpoint",
    "assert_continues", "SharedRuns", "STEPS", "PLAIN", "ACCUMULATE", "TINY", "TINY_LLM", "TRL", "TRL_BACKENDS",
    "RECORD_ORDER", "ORDER_COMMON", "train", "loaded",
    # support.models, support.examples, support.deepspeed_oracle
    "build_tiny_bert", "tiny_bert", "tiny_bart_config", "EXAMPLES", "example", "user_error", "write_lines",
    "DataParallelWorld",
]


# -- hooks -------------------------------------------------------------------------------------------------------------
def pytest_configure(config):
    create_shared_dir(config)  # the controller, before its workers


def pytest_unconfigure(config):
    remove_shared_dir(config)


def pytest_sessionstart(session):
    prepare_ops_folder(session)


def pytest_collection_modifyitems(config, items):
    record_markers(items)
    order_files(items)


def pytest_collection_finish(session):
    start_building_ops(session)


def pytest_sessionfinish(session, exitstatus):
    stop_building_ops(session, exitstatus)


def pytest_report_header(config):
    """The versions under test: `make test` runs the newest, `make test-oldest` the lowest setup.py admits."""
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for name in ("torch", "transformers", "accelerate", "datasets", "deepspeed", "fairscale"):
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            found.append(f"{name} absent")
    return "versions: " + ", ".join(found)


def pytest_terminal_summary(terminalreporter):
    """How many processes the tests launched and their seconds, per file (the CI time budget is spent on them), and
    what DeepSpeed's op build cost: the controller prints what every worker recorded."""
    if hasattr(terminalreporter.config, "workerinput") or SHARED_ENV not in os.environ:
        return
    for line in said():
        terminalreporter.write_sep("=", line)
    launched_report(terminalreporter)


# -- fixtures ----------------------------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _deepspeed_ops_built(request):
    """A test that launches DeepSpeed starts once its ops are built; one not marked `launch` loads none
    (support/ops.check_no_op_loaded), so it neither waits nor starts the build."""
    if needs_built_ops(request.node):
        wait_for_deepspeed_ops()
    before = ops_loaded_here()
    yield
    check_no_op_loaded(request, before)


@pytest.fixture(autouse=True)
def _no_world_size_env(monkeypatch):
    """Each test starts without WORLD_SIZE and leaves this process's environment as it found it: what a test's code
    sets (transformers' ACCELERATE_USE_DEEPSPEED left set when PartialState() raises, prepare_process's variables,
    a SageMaker job's TENSORBOARD_LOGGING_DIR) would otherwise reach every later test in the worker and the processes
    it launches, so a test's outcome would depend on which file ran before it."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    before = dict(os.environ)
    yield
    for key in [key for key in os.environ if key not in before]:
        del os.environ[key]
    os.environ.update(before)


# The shared reference runs, each started once per session (support/references.py says what each holds).
for _runs in (references.plain_runs, references.accumulate_runs, references.tiny_runs, references.trl_runs):
    globals()[_runs.__name__] = pytest.fixture(scope="session")(_runs)
del _runs


@pytest.fixture(scope="session")
def uninterrupted():
    """record_order.py's 2-rank run of 14 steps, checkpoints every 4 (support/sample_order.py)."""
    return uninterrupted_run()


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory):
    """A user's own small model folder (see build_tiny_bert): read-only for the tests; copy it to change it."""
    return build_tiny_bert(tmp_path_factory.mktemp("tiny-bert") / "model")


@pytest.fixture(scope="session")
def deepspeed_accepts():
    """Returns check(config, world_size) -> DeepSpeedConfig, parsed by DeepSpeed itself (raises if rejected)."""
    return deepspeed_config_check()
