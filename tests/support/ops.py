"""DeepSpeed's JIT ops, built once per environment in the background: `trainer-ext build-ops` starts when a selected
test launches DeepSpeed, in a process of its own holding a lock in the session's shared folder, while the files without
a DeepSpeed test run; a test marked `deepspeed` and `launch` (and a run that launches DeepSpeed) waits for the build,
once, and the summary says what it cost. The unit subset loads no op (check_no_op_loaded)."""

import fcntl
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from trainer_ext.backends.deepspeed.leftovers import clear_stale_build_locks

from .environment import PYTHON, clean_env
from .shared import say, shared_dir

# `trainer-ext build-ops` itself (what README tells users to run), in a process of its own; the marker file once it
# succeeded. The ops the launched tests load, those of them this machine's DeepSpeed offers: FusedAdam (the translator
# gives every ZeRO run DeepSpeed's AdamW) and CPU Adam (offload). Not the CPU all-reduce, which the DeepSpeed backend
# keeps from loading (internals.skip_deepspeed_cpu_allreduce_op).
PREBUILT_OPS = ("fused_adam", "cpu_adam")
PREBUILD = f"""
import sys
from pathlib import Path
from trainer_ext.backends.deepspeed.ops import DEFAULT_BUILDERS, op_builders
from trainer_ext.cli import main
offered = {{builder.NAME for builder in op_builders(DEFAULT_BUILDERS)}}
wanted = [name for name in {PREBUILT_OPS!r} if name in offered]
code = main(["build-ops", "--only", *wanted]) if wanted else 0
if code == 0:
    Path(sys.argv[1]).touch()
sys.exit(code)
"""

_OPS: dict = {}  # the background build of DeepSpeed's ops: its process, log file and start time
_OPS_LOCK = threading.Lock()


def prepare_ops_folder(session) -> None:
    """This environment's own folder for the ops; a lock a killed build left there is removed once, before any
    worker starts a build."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    if not hasattr(session.config, "workerinput"):
        clear_stale_build_locks(min_age_s=0)


def needs_built_ops(item) -> bool:
    """A test that launches DeepSpeed (marked `deepspeed` and `launch`): the unit subset loads no op (check_no_op_loaded)."""
    return bool(item.get_closest_marker("deepspeed") and item.get_closest_marker("launch"))


def start_building_ops(session) -> None:
    """Start building DeepSpeed's JIT ops in this environment's own folder, in the background, when a selected test
    launches DeepSpeed: a fresh clone builds them (~5-8 min on 2 cores) while the files without a DeepSpeed test run
    (they go first, see order.py); such a test waits for the build (wait_for_deepspeed_ops), so no
    launcher test builds them under its timeout, and a build killed elsewhere (another clone, a stopped session)
    cannot leave a lock that hangs every later run."""
    import importlib.util

    config = session.config
    if (importlib.util.find_spec("deepspeed") is None or "not launch" in config.getoption("markexpr", "")
            or config.getoption("collectonly") or not any(needs_built_ops(item) for item in session.items)):
        return
    _OPS["started"] = time.time()
    built = shared_dir() / "ops-built"
    lock = open(shared_dir() / "ops-build.lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # another worker builds them: wait_for_deepspeed_ops waits for its lock
        lock.close()
        _OPS["elsewhere"] = True
        return
    if built.exists():  # another worker built them already
        lock.close()
        return
    # The build process inherits the lock (the same open file), which is then held exactly as long as it runs.
    log = tempfile.TemporaryFile("w+")
    _OPS.update(process=subprocess.Popen([PYTHON, "-c", PREBUILD, built], stdout=log, stderr=subprocess.STDOUT,
                                         text=True, env=clean_env(), start_new_session=True, pass_fds=(lock.fileno(),)),
                log=log)
    lock.close()
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter:
        reporter.write_line(f"building DeepSpeed's ops in {os.environ['TORCH_EXTENSIONS_DIR']} in the background "
                            "(once per environment)")


def wait_for_deepspeed_ops():
    """Block until the background build has ended; say once what it took and how long the tests waited for it."""
    with _OPS_LOCK:  # run_many's threads
        _wait_for_deepspeed_ops()


def _wait_for_deepspeed_ops():
    if "waited" in _OPS:
        return
    if _OPS.get("elsewhere"):
        _wait_for_another_worker()
    process = _OPS.get("process")
    if process is None:
        return
    waiting = time.time()
    try:
        process.wait(timeout=max(1.0, 1800 - (time.time() - _OPS["started"])))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        process.wait()
        clear_stale_build_locks(min_age_s=0)
    _OPS["waited"] = True
    log = _OPS["log"]
    log.seek(0)
    built = log.read()
    log.close()
    # Said in the summary: a test's output is captured while its fixtures wait.
    timings = ", ".join(f"{name}: {seconds} s" for name, seconds in  # build-ops' lines
                        re.findall(r"^\s*(\w+): ready \((?:built|loaded) in (\d+)(?:\.\d)? s\)", built, re.M))
    _OPS["said"] = (f"DeepSpeed's ops built in the background ({timings}); the tests waited "
                    f"{time.time() - waiting:.0f} s for them"
                    if process.returncode == 0
                    else f"building DeepSpeed's ops failed or took over 30 min (the DeepSpeed tests show why):\n"
                         f"{built[-2000:]}")
    say(_OPS["said"])


def _wait_for_another_worker():
    """Another worker's build holds the lock until it ends (or is killed at its 30 minutes)."""
    waiting = time.time()
    with open(shared_dir() / "ops-build.lock", "w") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.time() - _OPS["started"] > 1860:
                    break  # the DeepSpeed tests show why
                time.sleep(1)
    _OPS["waited"] = True
    say(f"a test worker waited {time.time() - waiting:.0f} s for DeepSpeed's ops being built by another")


def stop_building_ops(session, exitstatus) -> None:
    """At the session's end: a worker that ran no DeepSpeed test still waits for its build (another worker may be
    waiting for it); a session stopped before a DeepSpeed test (-x, ^C) kills it and removes its locks."""
    process = _OPS.get("process")
    if process is None or process.poll() is not None:
        return
    if hasattr(session.config, "workerinput") and not (session.shouldstop or session.shouldfail
                                                         or exitstatus == pytest.ExitCode.INTERRUPTED):
        wait_for_deepspeed_ops()
        return
    os.killpg(process.pid, 9)
    process.wait()
    clear_stale_build_locks(min_age_s=0)


def ops_loaded_here() -> set[str]:
    """The DeepSpeed JIT ops this process has loaded (each compiled for minutes first in an environment without it)."""
    builder = sys.modules.get("deepspeed.ops.op_builder.builder")
    return set(builder.OpBuilder._loaded_ops) if builder is not None else set()


def check_no_op_loaded(request, before: set[str]) -> None:
    """The unit subset (`make test-fast`: no test marked `launch`) compiles no DeepSpeed op: a test that loads one took
    minutes in a fresh environment (DeepSpeed's shared-memory all-reduce and FusedAdam made `make test-fast` 5 min
    instead of under one) and passed or failed by which test had built it before."""
    loaded = sorted(ops_loaded_here() - before)
    if loaded and not request.node.get_closest_marker("launch"):
        pytest.fail(f"{request.node.nodeid} loaded DeepSpeed's JIT op(s) {', '.join(loaded)}, which compile for "
                    "minutes where they are not built: give DeepSpeed a config that needs none (torch_adam, no "
                    "offload; support/deepspeed_oracle.py starts without the shared-memory op), or mark it launch",
                    pytrace=False)
