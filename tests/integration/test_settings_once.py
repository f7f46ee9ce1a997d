"""Settings are resolved once, when the arguments are parsed: building ExtTrainer on ExtTrainingArguments leaves every
field as parsed (and adds no attribute), for every backend; on stock TrainingArguments, which parsed nothing, it
writes only what transformers reads of the resolution and the backend's resolved settings. And no module but
config/settings.py assigns to an arguments object."""

import ast
import json

import pytest

from conftest import PYTHON, REPO, run_many

# stock TrainingArguments: the complete DeepSpeed config replaces the file's path (transformers reads it); run_settings,
# the one attribute of ours, keeps the global batch settled for this start's ranks (config/batch.py: here the command's
# own, no field changed) and hands the backend what it settled (every backend, DDP's being nothing).
STOCK = {"ddp": {"changed": [], "added": ["run_settings"]},
         "zero2": {"changed": ["deepspeed"], "added": ["run_settings"]},
         "fsdp": {"changed": [], "added": ["run_settings"]}}


@pytest.mark.launch
@pytest.mark.deepspeed
def test_building_ext_trainer_changes_no_field_of_parsed_arguments(tmp_path):
    """Fails if a backend, the process set-up or ExtTrainer writes onto arguments ExtTrainingArguments resolved, or
    if stock TrainingArguments get more than the fields transformers reads."""
    script = REPO / "tests" / "scripts" / "arguments_after_trainer.py"
    outs = run_many({backend: ([PYTHON, script, backend, tmp_path / backend], None)
                     for backend in ("ddp", "zero2", "fsdp", "simple")}, timeout=300)
    for backend, out in outs.items():
        assert out.returncode == 0, out.stderr[-3000:]
        found = json.loads(out.stdout.strip().splitlines()[-1])
        assert found["ext"] == {"changed": [], "added": []}, (backend, found)
        assert found.get("stock", STOCK.get(backend)) == STOCK.get(backend), (backend, found)


def test_only_the_settings_builder_assigns_to_arguments():
    """An assignment to `args.X` / `training_args.X` / `setattr(args, ...)` (or `self.X` in a TrainingArguments
    class) outside config/settings.py is a second owner of the arguments."""
    names = {"args", "training_args"}
    found = []
    for path in sorted((REPO / "trainer_ext").rglob("*.py")):
        if path.relative_to(REPO).as_posix() == "trainer_ext/config/settings.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                        and target.value.id in names:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {target.value.id}.{target.attr} =")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                    and isinstance(node.args[0], ast.Name) and node.args[0].id in names:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: setattr({node.args[0].id}, ...)")
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
                    and n.name.endswith(("TrainingArguments", "SFTConfig"))):
            for node in ast.walk(cls):
                if isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                                                        and t.value.id == "self" for t in node.targets):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: self.X = in {cls.name}")
    assert found == []


def test_a_flag_of_ours_is_read_through_its_group_with_the_declared_default():
    """ExtTrainer also trains stock TrainingArguments, which lack our own flags: a module reading one as
    `getattr(args, "flag", default)` kept a default of its own (chunked_loss read as False would silently train a stock
    run otherwise than the same command with ExtTrainingArguments). Our flags are declared once, in groups
    (config/own_flags.py), composed into ExtTrainingArguments, and read through flags_of: no module names one to
    getattr; flags_of gives stock arguments the declared defaults and keeps a value set on them by hand."""
    import dataclasses

    from transformers import TrainingArguments

    from trainer_ext import ExtTrainingArguments
    from trainer_ext.backends import flag_classes
    from trainer_ext.config.own_flags import OWN_FLAGS, CheckpointFlags, LossFlags, flags_of

    stock = {f.name for f in dataclasses.fields(TrainingArguments)}
    backends = {f.name for cls in flag_classes() for f in dataclasses.fields(cls)}
    grouped = [f.name for group in OWN_FLAGS for f in dataclasses.fields(group)]
    ours = {f.name for f in dataclasses.fields(ExtTrainingArguments)} - stock - backends
    assert sorted(grouped) == sorted(ours) and len(grouped) == len(set(grouped)) >= 12  # each in one group, once
    named = [f"{path.relative_to(REPO)}:{node.lineno}: getattr(..., {node.args[1].value!r})"
             for path in sorted((REPO / "trainer_ext").rglob("*.py")) for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
             and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in ours]
    assert named == [], "read our own flags with flags_of(group, args)"

    plain = TrainingArguments(output_dir="unused", report_to="none")
    for group in OWN_FLAGS:
        assert flags_of(group, plain) == group()  # the declared defaults
    assert flags_of(LossFlags, plain).chunked_loss is True and flags_of(CheckpointFlags, plain).checkpoint_dir is None
    plain.checkpoint_dir = "/fsx/run"  # as a SageMaker job's prepare_process sets it on stock arguments
    assert flags_of(CheckpointFlags, plain).checkpoint_dir == "/fsx/run"
    ext = ExtTrainingArguments(output_dir="unused", report_to="none", use_cpu=True, chunked_loss=False)
    assert flags_of(LossFlags, ext) is ext and flags_of(LossFlags, ext).chunked_loss is False
