"""The examples run in the test's own process: examples/<name>.py's main imported from its file (its flags and its
one-line exit), an example that must stop on a user's mistake with exit status 2 and one error line, and the JSON
lines files a user's data would be."""

import importlib.util
import json

import pytest

from .environment import REPO

EXAMPLES = REPO / "examples"


def example(name):
    """examples/<name>.py's main, imported from its file (its flags and its one-line exit, in this process)."""
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
