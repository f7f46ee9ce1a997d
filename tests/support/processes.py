"""Real processes started by the tests: run() starts one in its own process group (the whole group killed on
timeout), checks the test's markers first and records its seconds in the session's shared folder; run_many runs
short ones two at a time, run_forked runs commands that end at parsing as forked copies of one process that loaded
them; Started holds processes a test acts on while they run; rank_process finds one rank among a launcher's
children; launched_report is the end-of-run summary of what was launched, per file, from every worker."""

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from trainer_ext.backends.deepspeed.leftovers import clear_stale_build_locks

from .environment import PYTHON, REPO, clean_env
from .markers import check_markers
from .shared import shared_dir

FORKED = REPO / "tests" / "scripts" / "forked.py"
CONSOLE_SCRIPTS = {"trainer-ext": "trainer_ext.cli:run"}


def run(cmd, timeout=600, env=None, cwd=REPO):
    """Run a real process in its own process group; return CompletedProcess with text output. On timeout the
    whole group is killed: a launcher's ranks must not live on (holding ports, DeepSpeed's op-build lock)."""
    full_env = clean_env()
    full_env.update({"PYTHONUNBUFFERED": "1", **(env or {})})
    args = [str(c) for c in cmd]
    check_markers(args)
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


class Started:
    """Processes a test acts on while they run (the elastic tests' nodes): each in its own process group (run()'s
    marker check first), its output into a log file; `wait` ends them all, killing every one on timeout, and so does
    leaving `with Started(folder) as processes:`."""

    def __init__(self, folder: Path):
        self.folder, self.processes = Path(folder), {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()  # a test that failed half-way leaves nothing running

    def start(self, name: str, cmd, env=None) -> subprocess.Popen:
        args = [str(c) for c in cmd]
        check_markers(args)
        full_env = clean_env()
        full_env.update({"PYTHONUNBUFFERED": "1", **(env or {})})
        with open(self.folder / f"{name}.log", "w") as log:
            process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, text=True, env=full_env, cwd=REPO,
                                       start_new_session=True)
        self.processes[name] = (process, time.time())
        return process

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text()

    def wait(self, timeout: float) -> dict:
        """{name: exit status} once every process ended; on timeout all are killed and the test fails with logs."""
        deadline = time.time() + timeout
        try:
            for process, _ in self.processes.values():
                process.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError("timed out:\n" + "\n".join(f"--- {name}\n{self.log(name)[-3000:]}"
                                                              for name in self.processes)) from None
        with open(shared_dir() / f"launched-{os.getpid()}.jsonl", "a") as record:
            for process, started in self.processes.values():
                record.write(json.dumps([os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[0],
                                         time.time() - started]) + "\n")
        return {name: process.returncode for name, (process, _) in self.processes.items()}

    def kill(self) -> None:
        """Every process and its descendants (torchrun starts its workers in sessions of their own)."""
        import psutil

        for process, _ in self.processes.values():
            try:
                family = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
            except psutil.Error:
                family = []
            for member in family:
                try:
                    member.kill()
                except psutil.Error:
                    pass
            process.wait()


def run_many(commands: dict, jobs: int = 2, **kwargs) -> dict:
    """run() each of {key: (cmd, env)}, `jobs` at a time: a one-process command that ends after parsing is start-up on
    one core (imports, ~5 s), so CI's 2 cores run two; returns {key: CompletedProcess}."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(jobs) as pool:
        futures = {key: pool.submit(run, cmd, env=env, **kwargs) for key, (cmd, env) in commands.items()}
    return {key: future.result() for key, future in futures.items()}


def run_forked(commands: dict, preload=(), timeout: int = 300) -> dict:
    """run() each of {key: (cmd, env)}, cmd a `PYTHON script ...` or `trainer-ext ...` command line, as forked copies
    of one process that loaded each program's modules (and the `preload` modules) once (tests/scripts/forked.py):
    every command is a process of its own, without the ~5 s of one core a start-up costs (imports) when the command
    ends at argument parsing. A script's top level runs in the parent (it must call its main under
    `if __name__ == "__main__"`). Returns {key: CompletedProcess}, as run_many."""
    with tempfile.TemporaryDirectory(prefix="forked-") as folder:
        folder = Path(folder)
        spec = {"preload": [f"{module}:" for module in preload], "timeout": timeout, "commands": {}}
        arguments = {}
        for number, (key, (cmd, env)) in enumerate(commands.items()):
            args = arguments[key] = [str(c) for c in cmd]
            check_markers(args)
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


def launched_report(terminalreporter) -> None:
    """How many processes the tests launched and their seconds, per file, from every worker's record (the CI time
    budget is spent on them)."""
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
