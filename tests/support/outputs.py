"""What a run leaves in its output folder, read back and compared: a module's scratch folder for its shared runs
(removed when the module ends unless a test failed), the per-step logged values, the saved weights, a checkpoint
copied into a new output_dir to resume, and the assertions that two runs trained alike or that a resumed run
continues an uninterrupted one."""

import json
import shutil
from pathlib import Path


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


def logged(output_dir, key="loss"):
    """Per-step values of `key` from trainer_state.json."""
    history = json.loads((Path(output_dir) / "trainer_state.json").read_text())["log_history"]
    return {row["step"]: row[key] for row in history if key in row and "eval_loss" not in row}


def weights(output_dir):
    from safetensors.torch import load_file

    return load_file(str(Path(output_dir) / "model.safetensors"))


def max_weight_difference(a, b):
    first, second = weights(a), weights(b)
    assert first.keys() == second.keys()
    return max((first[k].float() - second[k].float()).abs().max().item() for k in first)


def assert_same_training(base, other, steps):
    ours, theirs = logged(base), logged(other)
    assert sorted(ours) == sorted(theirs) == list(range(1, steps + 1))
    assert max(abs(ours[s] - theirs[s]) for s in ours) < 1e-5
    assert max_weight_difference(base, other) < 1e-5


def copy_checkpoint(source, step, destination):
    """A new output_dir holding only checkpoint-<step> of `source`: the same command then resumes from it."""
    destination.mkdir()
    shutil.copytree(source / f"checkpoint-{step}", destination / f"checkpoint-{step}")
    return destination


def assert_continues(uninterrupted, resumed, first_step, last_step=12):
    """A resumed run's steps first_step..last_step and final weights equal the uninterrupted run's (1e-5)."""
    ours, theirs = logged(uninterrupted), logged(resumed)
    assert max(abs(ours[s] - theirs[s]) for s in range(first_step, last_step + 1)) < 1e-5
    assert max_weight_difference(uninterrupted, resumed) < 1e-5
