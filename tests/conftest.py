"""Shared fixtures: DeepSpeed's own config parser as an oracle, and helpers to run real processes."""

import fcntl
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning (set before torch loads its OpenMP; launched processes inherit it). Two
# test files at a time put more threads than cores on CI's 2 cores, where spinning threads steal the cores the working
# ones need: three concurrent one-process run_glue.py runs took 70 s of wall and 139 s of CPU with the default policy,
# 24 s and 47 s with PASSIVE. The policy changes no arithmetic (the same threads, the same kernels).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# This environment's bin first on PATH, as when it is activated (`make test` runs .venv/bin/python without activating
# it): torch builds DeepSpeed's ops with the first `ninja` on PATH, and pip's ninja 1.13 and a system 1.11 hash the
# build commands differently, so each switch rebuilt the ops (25 s for the shared-memory op alone, measured): the
# SageMaker job (its toolkit needs the bin first to find torchrun) rebuilt them, the next DeepSpeed test rebuilt them
# back. The product finds its launchers through sys.executable, not PATH, so this hides no lookup of its own.
_BIN = os.path.dirname(sys.executable)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _BIN:
    os.environ["PATH"] = _BIN + os.pathsep + os.environ.get("PATH", "")

import pytest  # noqa: E402
import torch  # noqa: E402

from trainer_ext.leftovers import clear_stale_build_locks

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
BIN = Path(sys.executable).parent
DISTRIBUTED_ENV = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


# `trainer-ext build-ops` itself (what README tells users to run), in a process of its own; the marker file once it
# succeeded. Only the ops the launched tests load: the CPU all-reduce and CPU Adam (offload). None trains with
# DeepSpeed's own Adam without offload (FusedAdam, 267 s of a CI run's 2 cores); one that did would build it itself,
# saying so (ops.announce_builds), and still pass.
PREBUILT_OPS = ("deepspeed_shm_comm", "cpu_adam")
PREBUILD = f"""
import sys
from pathlib import Path
from trainer_ext.cli import main
code = main(["build-ops", "--only", *{PREBUILT_OPS!r}])
if code == 0:
    Path(sys.argv[1]).touch()
sys.exit(code)
"""

SHARED_ENV = "TRAINER_EXT_TEST_SHARED"


def shared_dir() -> Path:
    """This session's folder shared by every pytest-xdist worker (`make test` runs two test files at a time): the
    session-wide reference runs, the op build's lock and what each worker launched live there, so each is done once."""
    return Path(os.environ[SHARED_ENV])


def pytest_configure(config):
    if not hasattr(config, "workerinput") and SHARED_ENV not in os.environ:  # the controller, before its workers
        import tempfile

        os.environ[SHARED_ENV] = config._shared_created = tempfile.mkdtemp(prefix="trainer-ext-tests-")


def pytest_unconfigure(config):
    created = getattr(config, "_shared_created", None)
    if created:
        shutil.rmtree(created, ignore_errors=True)
        del os.environ[SHARED_ENV]


@contextmanager
def shared_once(name):
    """Exclusive access to `shared_dir()/name` across workers (a file lock): the first worker to come does the work,
    the others wait for it and read the result."""
    with open(shared_dir() / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield shared_dir() / name
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


_OPS: dict = {}  # the background build of DeepSpeed's ops: its process, log file and start time
_OPS_LOCK = threading.Lock()


def pytest_sessionstart(session):
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    if not hasattr(session.config, "workerinput"):  # once, before any worker starts a build
        clear_stale_build_locks(min_age_s=0)


def pytest_collection_finish(session):
    """Start building DeepSpeed's JIT ops in this environment's own folder, in the background, when a selected test
    needs DeepSpeed: a fresh clone builds them (~5-8 min on 2 cores) while the files without a DeepSpeed test run
    (they go first, see pytest_collection_modifyitems); a test marked `deepspeed` waits for the build
    (wait_for_deepspeed_ops), so no launcher test builds them under its timeout, and a build killed elsewhere
    (another clone, a stopped session) cannot leave a lock that hangs every later run."""
    import importlib.util
    import tempfile

    config = session.config
    if (importlib.util.find_spec("deepspeed") is None or "not launch" in config.getoption("markexpr", "")
            or config.getoption("collectonly") or not any(i.get_closest_marker("deepspeed") for i in session.items)):
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
                    if process.returncode == 0 else f"building DeepSpeed's ops failed or took over 30 min (the DeepSpeed "
                                                    f"tests show why):\n{built[-2000:]}")
    _say(_OPS["said"])


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
    _say(f"a test worker waited {time.time() - waiting:.0f} s for DeepSpeed's ops being built by another")


def _say(line: str) -> None:
    """A line for the session's summary: written to the shared folder, where the controller of the workers reads it."""
    with open(shared_dir() / f"said-{os.getpid()}.txt", "a") as said:
        said.write(line + "\n")


@pytest.fixture(autouse=True)
def _deepspeed_ops_built(request):
    """A test that needs DeepSpeed (in this process or a launched one) starts once its ops are built."""
    if request.node.get_closest_marker("deepspeed"):
        wait_for_deepspeed_ops()


def pytest_sessionfinish(session, exitstatus):
    process = _OPS.get("process")
    if process is None or process.poll() is not None:
        return
    if hasattr(session.config, "workerinput") and not (session.shouldstop or session.shouldfail
                                                         or exitstatus == pytest.ExitCode.INTERRUPTED):
        wait_for_deepspeed_ops()  # a worker that ran no DeepSpeed test: another may be waiting for this build
        return
    os.killpg(process.pid, 9)  # the session stopped before a DeepSpeed test (-x, ^C)
    process.wait()
    clear_stale_build_locks(min_age_s=0)


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


def scratch(request, name) -> Path:
    """A new folder for a module's shared runs, removed when the fixture's scope ends (a full run once left 18 GB of
    checkpoints behind and filled CI's disk); kept when a test of this worker failed, to be read. Tests' own tmp_path
    folders go the same way (pytest.ini: tmp_path_retention_policy = failed)."""
    path = request.getfixturevalue("tmp_path_factory").mktemp(name)

    def remove():
        if request.session.testsfailed == 0:
            shutil.rmtree(path, ignore_errors=True)

    request.addfinalizer(remove)
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_MARKED: dict[str, set[str]] = {"launch": set(), "model_package": set(), "deepspeed": set()}  # marker -> node ids
_EXAMPLES = {"run_glue.py", "run_qa.py", "run_translation.py"}


def pytest_collection_modifyitems(config, items):
    for marker, nodeids in _MARKED.items():
        nodeids.update(item.nodeid for item in items if item.get_closest_marker(marker))
    # Files without a DeepSpeed test first, while DeepSpeed's ops build in the background; within each group the files
    # that launch most processes first, so that the two workers of `make test` (pytest-xdist, a file each) end
    # together; a file's tests stay together and in order (its module fixtures are set up once).
    with_deepspeed = {item.path for item in items if item.get_closest_marker("deepspeed")}
    launches = {}
    for item in items:
        launches[item.path] = launches.get(item.path, 0) + bool(item.get_closest_marker("launch"))
    items.sort(key=lambda item: (item.path in with_deepspeed, -launches[item.path], str(item.path)))


def _check_markers(args: list[str]) -> None:
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




def pytest_terminal_summary(terminalreporter):
    """How many processes the tests launched and their seconds, per file (the CI time budget is spent on them), and
    what DeepSpeed's op build cost."""
    if hasattr(terminalreporter.config, "workerinput") or SHARED_ENV not in os.environ:
        return
    for said in sorted(shared_dir().glob("said-*.txt")):
        for line in said.read_text().splitlines():
            terminalreporter.write_sep("=", line)
    launched = [json.loads(line) for record in sorted(shared_dir().glob("launched-*.jsonl"))
                for line in record.read_text().splitlines()]
    if not launched:
        return
    per_file: dict[str, list[float]] = {}
    for path, seconds in launched:
        per_file.setdefault(path, []).append(seconds)
    terminalreporter.write_sep("=", f"{len(launched)} processes launched by run(), "
                                    f"{sum(s for _, s in launched):.0f} s")
    for path, times in sorted(per_file.items(), key=lambda item: -sum(item[1])):
        terminalreporter.write_line(f"{sum(times):8.0f} s {len(times):4d} processes  {path}")


def run(cmd, timeout=600, env=None, cwd=REPO):
    """Run a real process in its own process group; return CompletedProcess with text output. On timeout the
    whole group is killed: a launcher's ranks must not live on (holding ports, DeepSpeed's op-build lock)."""
    import signal

    full_env = clean_env()
    full_env.update(PYTHONUNBUFFERED="1", **(env or {}))
    args = [str(c) for c in cmd]
    _check_markers(args)
    started = time.time()
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                               cwd=cwd, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        with open(shared_dir() / f"launched-{os.getpid()}.jsonl", "a") as record:  # CI's time goes there
            record.write(json.dumps([os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[0], time.time() - started])
                         + "\n")
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        clear_stale_build_locks(min_age_s=0)  # a rank killed while loading a DeepSpeed op must not hang the rest
        raise subprocess.TimeoutExpired(args, timeout, output=stdout, stderr=stderr) from None
    return subprocess.CompletedProcess(args, process.returncode, stdout, stderr)


def run_many(commands: dict, jobs: int = 2, **kwargs) -> dict:
    """run() each of {key: (cmd, env)}, `jobs` at a time: a one-process command that ends after parsing is start-up on
    one core (imports, ~5 s), so CI's 2 cores run two; returns {key: CompletedProcess}."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(jobs) as pool:
        futures = {key: pool.submit(run, cmd, env=env, **kwargs) for key, (cmd, env) in commands.items()}
    return {key: future.result() for key, future in futures.items()}


FORKED = REPO / "tests" / "scripts" / "forked.py"
CONSOLE_SCRIPTS = {"trainer-ext": "trainer_ext.cli:run"}


def run_forked(commands: dict, preload=(), timeout: int = 300) -> dict:
    """run() each of {key: (cmd, env)}, cmd a `PYTHON script ...` or `trainer-ext ...` command line, as forked copies
    of one process that loaded each program's modules (and the `preload` modules) once (tests/scripts/forked.py):
    every command is a process of its own, without the ~5 s of one core a start-up costs (imports) when the command
    ends at argument parsing. A script's top level runs in the parent (it must call its main under
    `if __name__ == "__main__"`). Returns {key: CompletedProcess}, as run_many."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="forked-") as folder:
        folder = Path(folder)
        spec = {"preload": [f"{module}:" for module in preload], "timeout": timeout, "commands": {}}
        arguments = {}
        for number, (key, (cmd, env)) in enumerate(commands.items()):
            args = arguments[key] = [str(c) for c in cmd]
            _check_markers(args)
            if Path(args[0]).name in CONSOLE_SCRIPTS:
                program, name, argv = CONSOLE_SCRIPTS[Path(args[0]).name], Path(args[0]).name, args[1:]
            else:
                assert args[0] == str(PYTHON), f"run_forked runs `python script ...` or a console script: {args[:2]}"
                program, name, argv = args[1], args[1], args[2:]
            if program not in spec["preload"]:
                spec["preload"].append(program)
            spec["commands"][key] = {"program": program, "name": name, "argv": argv, "env": env or {},
                                     "stdout": str(folder / f"{number}.out"), "stderr": str(folder / f"{number}.err")}
        (folder / "spec.json").write_text(json.dumps(spec))
        out = run([PYTHON, FORKED, folder / "spec.json", folder / "results.json"],
                  timeout=max(600, timeout + 30 * len(commands)))
        assert out.returncode == 0, f"the forked commands' runner failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
        statuses = json.loads((folder / "results.json").read_text())
        return {key: subprocess.CompletedProcess(arguments[key], statuses[key], Path(command["stdout"]).read_text(),
                                                 Path(command["stderr"]).read_text())
                for key, command in spec["commands"].items()}


def selected(request, test_name: str, param: str) -> list:
    """The values of `param` in this module's selected tests named `test_name`: a fixture that runs their commands
    together (run_many) runs only the cases a `-k` or a failed-first rerun kept."""
    return [item.callspec.params[param] for item in request.session.items
            if item.module is request.module and item.originalname == test_name]


class DataParallelWorld:
    """DeepSpeed's documented `mpu` interface: lets DeepSpeedConfig check batch fields at world size N."""

    def __init__(self, world_size):
        self.world_size = world_size

    def get_data_parallel_world_size(self):
        return self.world_size

    def get_data_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return 1

    def get_model_parallel_rank(self):
        return 0


def signal_at_step(step: int, rank: int, signal_name: str = "SIGTERM") -> dict:
    """clean_env() for a run whose rank `rank` sends itself `signal_name` when it ends optimizer step `step`
    (tests/scripts/signal_at_step/sitecustomize.py): a preemption at the same step every run, on any machine."""
    env = clean_env()
    hook = str(REPO / "tests" / "scripts" / "signal_at_step")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [hook, env.get("PYTHONPATH")]))
    env["TRAINER_EXT_TEST_SIGNAL"] = f"{step}:{rank}:{signal_name}"
    return env


def clean_env() -> dict:
    """This process's environment without the variables that would make a child think it is a rank."""
    return {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV}


@pytest.fixture(scope="session")
def deepspeed_accepts():
    """Returns check(config, world_size) -> DeepSpeedConfig, parsed by DeepSpeed itself (raises if rejected)."""
    wait_for_deepspeed_ops()  # init_distributed loads DeepSpeed's shared-memory op
    saved = {k: os.environ.get(k) for k in DISTRIBUTED_ENV}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1")
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    try:
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    finally:  # later child processes must not inherit a rank from this one
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)

    def check(config, world_size):
        return DeepSpeedConfig(config, mpu=DataParallelWorld(world_size))

    return check


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


def requires_cuda(test):
    """A CUDA-only test: marked `cuda` (`make gpu-check` runs exactly these), skipped cleanly without a GPU."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


# tests/scripts/tiny_train.py: a BERT built from a config on random ids; GPU tests use it (no 83 MB model package).
TINY_TRAIN = REPO / "tests" / "scripts" / "tiny_train.py"
TINY_COMMON = ["--logging_steps", "1", "--report_to", "none", "--disable_tqdm", "true", "--seed", "7"]


GLUE = REPO / "examples" / "run_glue.py"
# Small, deterministic runs: dropout off, fp32, a fixed slice of the shipped set.
GLUE_COMMON = ["--max_seq_length", "32", "--logging_steps", "1", "--dropout", "0", "--max_train_samples", "320",
               "--report_to", "none", "--disable_tqdm", "true", "--seed", "7"]


def launcher(name):
    """This environment's `torchrun` / `deepspeed` script, or its module where packages were installed elsewhere
    (a GPU machine given wheels with pip --target has no script beside its python)."""
    if (BIN / name).exists():
        return [BIN / name]
    return [PYTHON, "-m", {"torchrun": "torch.distributed.run", "deepspeed": "deepspeed.launcher.runner"}[name]]


def launch(kind, output_dir, *flags, ranks=2, timeout=900, env=None, script=GLUE):
    """Run examples/run_glue.py (or `script`, e.g. TINY_TRAIN) single-process or under a real launcher; fail with the
    log on error."""
    flags = [str(f) for f in flags]
    if kind == "single":
        cmd = [PYTHON, script]
    elif kind == "torchrun":
        cmd = [*launcher("torchrun"), "--nproc_per_node", ranks, "--master_port", free_port(), script]
    elif kind == "launch":
        cmd = [PYTHON, "-m", "torch.distributed.launch", "--nproc_per_node", ranks, "--master_port", free_port(), script]
    elif kind == "deepspeed":
        cmd = [*launcher("deepspeed"), "--num_gpus", ranks, "--master_port", free_port(), script]
    else:
        raise ValueError(kind)
    common = GLUE_COMMON if script == GLUE else TINY_COMMON
    out = run([*cmd, "--output_dir", output_dir, *common, *flags], timeout=timeout, env=env)
    assert out.returncode == 0, f"{kind} failed:\n{out.stdout[-4000:]}\n{out.stderr[-6000:]}"
    return out


def logged(output_dir, key="loss"):
    """Per-step values of `key` from trainer_state.json."""
    import json

    history = json.loads((Path(output_dir) / "trainer_state.json").read_text())["log_history"]
    return {row["step"]: row[key] for row in history if key in row and "eval_loss" not in row}


def weights(output_dir):
    from safetensors.torch import load_file

    return load_file(str(Path(output_dir) / "model.safetensors"))


def max_weight_difference(a, b):
    first, second = weights(a), weights(b)
    assert first.keys() == second.keys()
    return max((first[k].float() - second[k].float()).abs().max().item() for k in first)


# Shared runs of examples/run_glue.py (session-wide: the backend tests compare against the same single-process runs).
STEPS = 20
PLAIN = ["--do_train", "--do_eval", "--do_predict", "--max_steps", STEPS, "--max_eval_samples", "64",
         "--max_predict_samples", "37", "--save_strategy", "no"]
# 12 steps, accumulation 2, clipping that bites (grad norms reach ~1.4), linear warmup over 5 steps.
ACCUMULATE = ["--do_train", "--max_steps", "12", "--gradient_accumulation_steps", "2", "--max_grad_norm", "0.5",
              "--warmup_steps", "5", "--learning_rate", "1e-4"]


class SharedRuns:
    """Session-wide reference runs, each launched when a test first reads it (`runs / "zero2"` is its output_dir): a
    test starts only the runs it compares with, so its markers stay true when it runs alone (a FairScale test that
    reads the single and DDP runs launches no DeepSpeed). They live in the workers' shared folder: the first worker
    to read a run launches it, another reading it meanwhile waits for it, a failed run fails every reader."""

    def __init__(self, name, runs, script=GLUE):
        self.name, self.runs, self.script = name, runs, script

    def together(self, *names) -> list:
        """Several runs, launched two at a time (each mostly start-up on one core: CI's 2 cores run two)."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(self.__truediv__, names))

    def __truediv__(self, name):
        with shared_once(f"{self.name}-{name}") as output_dir:
            failed = output_dir.with_name(output_dir.name + ".failed")
            if failed.exists():
                pytest.fail(f"the shared run {self.name}/{name} failed earlier:\n{failed.read_text()}")
            if not output_dir.exists():
                kind, *flags = self.runs[name]
                try:
                    launch(kind, output_dir, *flags, script=self.script)
                except AssertionError as error:
                    failed.write_text(str(error))
                    raise
        return output_dir


@pytest.fixture(scope="session")
def plain_runs():
    return SharedRuns("plain", {
        "single": ["single", *PLAIN, "--per_device_train_batch_size", 16],
        "ddp": ["torchrun", *PLAIN, "--per_device_train_batch_size", 8],
        "zero2": ["deepspeed", *PLAIN, "--per_device_train_batch_size", 8, "--deepspeed", "ds_configs/zero2_minimal.json"],
    })


@pytest.fixture(scope="session")
def accumulate_runs():
    return SharedRuns("accumulate", {
        "single": ["single", *ACCUMULATE, "--per_device_train_batch_size", 8, "--save_strategy", "steps",
                   "--save_steps", 6],
        "ddp": ["launch", *ACCUMULATE, "--per_device_train_batch_size", 4, "--save_strategy", "no"],
        # Every 3 steps: a resume keeps its checkpoint's save_steps, so test_resume_world_size.py's 1-rank
        # continuation of checkpoint-6 saves the 1-rank checkpoint-9 it resumes on 2 ranks.
        "zero2": ["deepspeed", *ACCUMULATE, "--per_device_train_batch_size", 4, "--deepspeed", "zero2_minimal",
                  "--save_strategy", "steps", "--save_steps", 3],
    })


# tests/scripts/tiny_llm.py: a tiny Llama (GQA, SwiGLU, untied embeddings) fine-tuned on seeded chat-like samples of
# 10-49 tokens, completion-only labels, fp32. TRL's SFTTrainer: stock (--stock) or combined with ExtTrainer.
TINY_LLM = REPO / "tests" / "scripts" / "tiny_llm.py"
# 4 steps of 8 samples; eval on 21 samples, whose last global batch accelerate pads on 2 ranks.
TRL = ["--trl", "--do_train", "--max_steps", 4, "--learning_rate", "1e-3", "--save_strategy", "no", "--bf16", "false",
       "--gradient_checkpointing", "false", "--completion_only_loss", "true", "--eval_samples", 21]
TRL_BACKENDS = {"ddp": [], "fsdp2": ["--fsdp", "full_shard auto_wrap", "--fsdp_config",
                                     '{"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}'],
                "simple": ["--sharded_ddp", "simple"], "zero2": ["--deepspeed", "zero2_minimal"],
                "zero3": ["--deepspeed", "zero3"]}


@pytest.fixture(scope="session")
def trl_runs():
    """TRL's SFTTrainer on the tiny Llama: stock on one process (also with LoRA), and `ExtSFTTrainer` (ExtTrainer
    combined with it) on 2 ranks under each backend, every one on the same global batch of 8; evaluated with another
    eval batch size each."""
    def on_ranks(backend, eval_batch, *flags):
        kind = "launch" if backend == "simple" else "torchrun"  # ZeRO under torchrun --deepspeed: ~3 s less CPU
        return [kind, *TRL, "--per_device_train_batch_size", 4, "--per_device_eval_batch_size", eval_batch,
                *TRL_BACKENDS[backend], *flags]

    single = ["single", "--stock", *TRL, "--per_device_train_batch_size", 8, "--per_device_eval_batch_size", 8]
    return SharedRuns("trl", {
        "stock": single, "stock_lora": [*single, "--lora"],
        "fsdp2": on_ranks("fsdp2", 3), "zero2": on_ranks("zero2", 6), "zero3_lora": on_ranks("zero3", 4, "--lora"),
    }, script=TINY_LLM)


def assert_same_training(base, other, steps):
    ours, theirs = logged(base), logged(other)
    assert sorted(ours) == sorted(theirs) == list(range(1, steps + 1))
    assert max(abs(ours[s] - theirs[s]) for s in ours) < 1e-5
    assert max_weight_difference(base, other) < 1e-5


def copy_checkpoint(source, step, destination):
    """A new output_dir holding only checkpoint-<step> of `source`: the same command then resumes from it."""
    import shutil

    destination.mkdir()
    shutil.copytree(source / f"checkpoint-{step}", destination / f"checkpoint-{step}")
    return destination


def assert_continues(uninterrupted, resumed, first_step, last_step=12):
    """A resumed run's steps first_step..last_step and final weights equal the uninterrupted run's (1e-5)."""
    ours, theirs = logged(uninterrupted), logged(resumed)
    assert max(abs(ours[s] - theirs[s]) for s in range(first_step, last_step + 1)) < 1e-5
    assert max_weight_difference(uninterrupted, resumed) < 1e-5


def rank_process(launcher, rank: int, timeout=300, script="run_glue.py"):
    """The process of `rank` among a launcher's children (to signal one rank)."""
    import psutil

    deadline = time.time() + timeout
    while time.time() < deadline:
        for child in psutil.Process(launcher.pid).children(recursive=True):
            try:
                if script in " ".join(child.cmdline()) and child.environ().get("RANK") == str(rank):
                    return child
            except psutil.Error:
                continue
        time.sleep(0.5)
    raise TimeoutError(f"rank {rank} did not start")


# tests/scripts/record_order.py: a tiny model on a dataset that records the indices each rank loads.
RECORD_ORDER = REPO / "tests" / "scripts" / "record_order.py"
# A constant rate: a run stopped early by --max_steps then continued equals one run (the schedule does not depend
# on the total), which lets the remote-checkpoint test stop a run without a signal.
ORDER_COMMON = ["--report_to", "none", "--disable_tqdm", "true", "--seed", "5", "--logging_steps", "1",
                "--learning_rate", "1e-3", "--lr_scheduler_type", "constant", "--save_strategy", "steps", "--save_steps", 4]


def train(output_dir, record_dir, batch_size, ranks=1, *flags, env=None, check=True):
    """Run record_order.py on 1 rank (plain python) or N (torchrun)."""
    launcher = [PYTHON] if ranks == 1 else [BIN / "torchrun", "--nproc_per_node", ranks, "--master_port", free_port()]
    out = run([*launcher, RECORD_ORDER, "--output_dir", output_dir, *ORDER_COMMON, "--per_device_train_batch_size",
               batch_size, *flags], env={"RECORD_DIR": str(record_dir), **(env or {})})
    if check:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out


def loaded(record_dir, rank):
    return [int(line) for line in (record_dir / f"rank{rank}.txt").read_text().split()]


@pytest.fixture(scope="session")
def uninterrupted():
    """2 ranks x 8 = 16 per step, 14 steps over a 100-sample set: 7 steps per epoch, checkpoints every 4 steps."""
    with shared_once("order") as root:  # once across workers (see SharedRuns)
        if not (root / "done").exists():
            shutil.rmtree(root, ignore_errors=True)
            train(root / "run", root / "indices", 8, 2, "--max_steps", 14)
            (root / "done").touch()
    return root


def build_tiny_bert(folder, max_position_embeddings=512):
    """A 2-layer BERT base model (no head) with a fast WordPiece tokenizer over the shipped classification set's words
    and characters, saved as a user's model folder (~200 kB): the examples run on it without the 83 MB package."""
    import json
    import re
    from collections import Counter

    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    words = Counter()
    for line in (REPO / "data" / "classification" / "train.jsonl").read_text().splitlines():
        words.update(re.findall(r"\w+|[^\w\s]", json.loads(line)["sentence"].lower()))
    chars = sorted(set("abcdefghijklmnopqrstuvwxyz0123456789.,!?'-()"))
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *(f"##{c}" for c in chars),
             *(word for word, _ in words.most_common(200) if word not in chars)]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab=str(folder / "vocab.txt")).save_pretrained(folder)  # transformers 5 ignores vocab_file
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=max_position_embeddings,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    BertModel(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory):
    """A user's own small model folder (see build_tiny_bert): read-only for the tests; copy it to change it."""
    return build_tiny_bert(tmp_path_factory.mktemp("tiny-bert") / "model")


def tiny_bert(num_labels=2):
    """A 1-layer BERT classifier from a config (seeded, dropout off) for in-process tests."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, num_labels=num_labels, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config).eval()


def tiny_bart_config(path):
    from transformers import BartConfig

    BartConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
               encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64).to_json_file(path)
    return path


# -- the examples run in this process ----------------------------------------------------------------------------------
EXAMPLES = REPO / "examples"


def example(name):
    """examples/<name>.py's main, imported from its file (its flags and its one-line exit, in this process)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def user_error(capsys, name, *argv):
    """Run an example that must stop on a user's mistake: returns its stderr, after checking exit status 2, one
    error line and no traceback."""
    with pytest.raises(SystemExit) as stopped:
        example(name)([str(a) for a in argv])
    err = capsys.readouterr().err
    assert stopped.value.code == 2, err[-3000:]
    assert "error:" in err and "Traceback" not in err
    return err


def write_lines(path, rows):
    """A JSON lines file of `rows`."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
