"""The process's environment variables change in one module, environment/variables.py: what trainer_ext does to the
user's process (a 1-rank group's rank variables, each CPU rank's threads, DeepSpeed's accelerator and op folder, a
SageMaker job's TensorBoard folder) is read there, and a variable the user set is kept where the door says so. The
process group is formed in one place too (environment/launcher.py)."""

import ast
import os

from conftest import REPO
from trainer_ext.environment.variables import restored, set_variables, unset_variable

DOOR = "trainer_ext/environment/variables.py"
WRITING_METHODS = {"setdefault", "update", "pop", "popitem", "clear"}


def environ_writes(tree: ast.AST) -> list[tuple[int, str]]:
    """Each write to os.environ (or a name `environ`) in a module: item assignment or deletion, a changing method,
    os.putenv / os.unsetenv."""
    def is_environ(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
                and node.value.id == "os") or (isinstance(node, ast.Name) and node.id == "environ")

    found = []
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete)) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        found += [(node.lineno, "environ[...] = / del") for target in targets
                  if isinstance(target, ast.Subscript) and is_environ(target.value)]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in WRITING_METHODS and is_environ(node.func.value):
                found.append((node.lineno, f"environ.{node.func.attr}()"))
            if node.func.attr in ("putenv", "unsetenv") and isinstance(node.func.value, ast.Name) \
                    and node.func.value.id == "os":
                found.append((node.lineno, f"os.{node.func.attr}()"))
    return found


def test_only_the_door_writes_the_process_environment():
    """Fails naming each write to os.environ outside environment/variables.py (they were spread over four modules)."""
    found = [f"{path.relative_to(REPO)}:{line}: {what}" for path in sorted((REPO / "trainer_ext").rglob("*.py"))
             if path.relative_to(REPO).as_posix() != DOOR
             for line, what in environ_writes(ast.parse(path.read_text()))]
    assert found == []


def test_the_finder_sees_every_kind_of_write():
    """The check above would pass on anything if the finder missed a form of write."""
    source = """
import os
os.environ["A"] = "1"
os.environ.setdefault("B", "2")
os.environ.update(C="3")
os.environ.pop("D", None)
del os.environ["E"]
environ["F"] = "6"
os.putenv("G", "7")
value = os.environ.get("H")
copy = dict(os.environ); copy["I"] = "9"
"""
    assert sorted(line for line, _ in environ_writes(ast.parse(source))) == [3, 4, 5, 6, 7, 8, 9]


def test_set_keeps_what_the_user_set_where_asked_and_restored_takes_back_a_blocks_changes(monkeypatch):
    monkeypatch.setenv("TRAINER_EXT_T_SET", "user")
    monkeypatch.delenv("TRAINER_EXT_T_NEW", raising=False)
    monkeypatch.delenv("TRAINER_EXT_T_ADDED", raising=False)
    assert set_variables({"TRAINER_EXT_T_SET": "ours", "TRAINER_EXT_T_NEW": 1}, keep_set=True) == \
        {"TRAINER_EXT_T_NEW": "1"}
    assert os.environ["TRAINER_EXT_T_SET"] == "user" and os.environ["TRAINER_EXT_T_NEW"] == "1"
    assert set_variables({"TRAINER_EXT_T_SET": "ours"}) == {"TRAINER_EXT_T_SET": "ours"}
    assert os.environ["TRAINER_EXT_T_SET"] == "ours"
    mapping = {"X": "1"}
    assert set_variables({"X": "2", "Y": "3"}, keep_set=True, environ=mapping) == {"Y": "3"} and mapping == \
        {"X": "1", "Y": "3"}
    before = dict(os.environ)
    with restored() as added:
        set_variables({"TRAINER_EXT_T_ADDED": "a", "TRAINER_EXT_T_SET": "changed"})
        unset_variable("TRAINER_EXT_T_NEW")
    assert dict(os.environ) == before and added == {"TRAINER_EXT_T_ADDED": "a"}
    unset_variable("TRAINER_EXT_T_NEW")
    assert "TRAINER_EXT_T_NEW" not in os.environ


def group_formations(tree: ast.AST) -> list[int]:
    """Lines that have a process group formed: a bare `<arguments>.device` statement (transformers' device set-up,
    which forms it under a launcher) or torch's init_process_group."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Attribute) and node.value.attr == "device":
            found.append(node.lineno)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == \
                "init_process_group":
            found.append(node.lineno)
    return found


def test_the_process_group_is_formed_in_one_place():
    """environment/launcher.py's form_process_group alone has the group formed (DeepSpeed's prepare_process touched
    args.device for it too); a backend library joining the formed group (deepspeed.init_distributed) is not forming
    one."""
    found = {path.relative_to(REPO).as_posix(): lines for path in sorted((REPO / "trainer_ext").rglob("*.py"))
             if (lines := group_formations(ast.parse(path.read_text())))}
    assert list(found) == ["trainer_ext/environment/launcher.py"] and len(found[list(found)[0]]) == 1
    assert group_formations(ast.parse("args.device\nx = args.device\ndist.init_process_group('gloo')\n")) == [1, 3]
