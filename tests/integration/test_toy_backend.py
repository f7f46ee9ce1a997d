"""Adding a backend takes its folder and one registry line: tests/scripts/toy_backend/ (a DDP that all-reduces
gradients only at optimizer steps, with no_sync on every other micro-batch) registered from outside the package,
trains examples/run_glue.py on 2 ranks through the same hooks as the shipped backends, exactly as DDP does."""

import json
import os

import pytest

from conftest import ACCUMULATE, REPO, assert_same_training, clean_env, launch

pytestmark = [pytest.mark.launch, pytest.mark.model_package]


def test_a_backend_added_outside_the_package_trains_as_ddp_and_syncs_only_at_steps(accumulate_runs, tmp_path):
    """Fails if a hook ExtTrainer calls is missing from backends/base.py's interface, if the registry is not the one
    place backends are found, or if the backend's wrapper is trained through other than as it is (transformers
    wrapping it again, or no_sync lost: 24 all-reduces instead of 12)."""
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "tests" / "scripts" / "toy_backend"),
                                                      env.get("PYTHONPATH")]))
    out = launch("launch", tmp_path, *ACCUMULATE, "--per_device_train_batch_size", 4, "--save_strategy", "no",
                 env=env)
    assert "trainer_ext: backend toy-ddp on 2 rank(s)" in out.stderr + out.stdout
    assert_same_training(accumulate_runs / "ddp", tmp_path, 12)
    for rank in (0, 1):
        counted = json.loads((tmp_path / f"allreduces-rank{rank}.json").read_text())
        assert counted == {"allreduces": 12, "steps": 12}, counted
