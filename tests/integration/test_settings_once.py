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


def test_a_flag_of_ours_read_from_stock_arguments_takes_its_declared_default():
    """ExtTrainer also trains stock TrainingArguments, which lack our own flags: where trainer_ext reads one with
    `getattr(args, "flag", default)`, the default must be ExtTrainingArguments' own, or a stock run silently behaves
    otherwise than the same command with ExtTrainingArguments."""
    import dataclasses

    from transformers import TrainingArguments

    from trainer_ext import ExtTrainingArguments

    stock = {f.name for f in dataclasses.fields(TrainingArguments)}
    ours = {f.name: f.default for f in dataclasses.fields(ExtTrainingArguments) if f.name not in stock}
    found, disagree = 0, []
    for path in sorted((REPO / "trainer_ext").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                    and len(node.args) == 3 and isinstance(node.args[1], ast.Constant) \
                    and node.args[1].value in ours and isinstance(node.args[2], ast.Constant):
                found += 1
                if node.args[2].value != ours[node.args[1].value]:
                    disagree.append(f"{path.relative_to(REPO)}:{node.lineno}: getattr(..., {node.args[1].value!r}, "
                                    f"{node.args[2].value!r}) but the field's default is {ours[node.args[1].value]!r}")
    assert found >= 10 and disagree == [], disagree
