"""How our commands, examples and launched scripts end (trainer_ext.exit_process): as a normal exit, without the
interpreter's teardown, where gloo's leftover threads can abort a rank that finished (docs/operations.md)."""

import subprocess
import textwrap

import pytest

from conftest import PYTHON, REPO

ENDING = textwrap.dedent("""
    import atexit, sys, threading, time
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path
    sys.path.insert(0, {repo!r})
    from trainer_ext import exit_process

    out = Path(sys.argv[2])
    def late(name):
        time.sleep(0.3)
        (out / name).write_text("done")
    threading.Thread(target=late, args=("thread",)).start()  # non-daemon: a normal exit waits for it
    ThreadPoolExecutor(1).submit(late, "pool")  # an executor's work: a normal exit finishes it
    atexit.register(lambda: (out / "atexit").write_text("ran"))  # e.g. ExtTrainer's process-group release

    class TornDown:
        def __del__(self):
            (out / "finalized").write_text("the interpreter's teardown ran")

    kept = TornDown()
    print("unflushed", end="")
    if sys.argv[1] == "exit_process":
        exit_process(3)
    sys.exit(3)
    """)


@pytest.mark.launch
def test_exit_process_is_a_normal_exit_without_the_teardown(tmp_path):
    """exit_process keeps the status, waits for threads and executors, runs the exit handlers (the process group's
    release) and flushes output, then skips the interpreter's teardown; sys.exit, the control, runs the teardown, so
    the check on it is live. Broken, a finished rank's work or output is lost, or it still tears down under gloo."""
    script = tmp_path / "ending.py"
    script.write_text(ENDING.format(repo=str(REPO)))
    seen = {}
    for ending in ("exit_process", "sys.exit"):
        out = tmp_path / ending
        out.mkdir()
        done = subprocess.run([PYTHON, str(script), ending, str(out)], capture_output=True, text=True, timeout=120)
        assert (done.returncode, done.stdout) == (3, "unflushed"), done.stderr
        seen[ending] = sorted(path.name for path in out.iterdir())
    assert seen == {"exit_process": ["atexit", "pool", "thread"],
                    "sys.exit": ["atexit", "finalized", "pool", "thread"]}
