"""Run many short commands of the same program as forked copies of one process that loaded the program's modules once:
each command is still a process of its own (its argv, environment, exit status, output and files), but pays none of
Python's, torch's and transformers' start-up, ~5 s of one core that a command ending at argument parsing otherwise
spends on nothing else.

    python forked.py SPEC.json RESULTS.json

SPEC: {"preload": [script, "module:function" or "module:", ...], "timeout": seconds,
       "commands": {key: {"program": script or "module:function", "name": argv[0], "argv": [...], "env": {...},
                          "stdout": path, "stderr": path}}}
A script runs as `python script argv...` would (runpy, __main__); "module:function" as its console script does.
RESULTS: {key: exit status} (negative: killed by that signal)."""

import importlib
import json
import os
import runpy
import signal
import sys
import traceback
from pathlib import Path


def load(program: str) -> None:
    """The program's modules, without running it: a script's top level (its imports and what it sets first, such as
    HF_HUB_OFFLINE before transformers reads it), or a console script's module."""
    if ":" in program:
        importlib.import_module(program.split(":")[0])
    else:
        runpy.run_path(program, run_name="__forked_preload__")


def child(program: str, name: str, argv: list[str], env: dict, stdout: str, stderr: str, timeout: int) -> None:
    """In the forked process: its own output files, environment and argv, then the program; never returns."""
    for fd, path in ((1, stdout), (2, stderr)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    os.environ.update(env)
    signal.alarm(timeout)  # a command that hangs ends with SIGALRM, as run()'s timeout would kill it
    sys.argv, status = [name, *argv], 0
    try:
        if ":" in program:
            module, function = program.split(":")
            status = getattr(importlib.import_module(module), function)()
        else:
            runpy.run_path(program, run_name="__main__")
    except SystemExit as stop:
        if isinstance(stop.code, int) or stop.code is None:
            status = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            status = 1
    except BaseException:  # noqa: BLE001 (as the interpreter would: the traceback, status 1)
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status if isinstance(status, int) else 0)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    for program in spec.get("preload", []):
        load(program)
    results = {}
    for key, command in spec["commands"].items():
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            child(command["program"], command.get("name", command["program"]), command["argv"],
                  command.get("env", {}), command["stdout"], command["stderr"], spec.get("timeout", 300))
        _, status = os.waitpid(pid, 0)
        results[key] = os.waitstatus_to_exitcode(status)
    Path(sys.argv[2]).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
