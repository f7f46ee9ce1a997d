"""No dead code under test: every module-level function of trainer_ext is reached from what users run (the package's
public names, the trainer-ext command, the examples, benchmarks and scripts the docs give), following the names each
reached function or class uses (by name: `import x as y` followed); every method is named somewhere in that code or
overrides its upstream base's (a Trainer hook, a callback event). A function only tests call is a promise nobody keeps
(check_training_data was tested while the product never called it, so its one-line error never showed)."""

import ast
import importlib
import re
import sys

from conftest import REPO

# Reached from outside the package's code: the console script (setup.py's entry point) and python -m trainer_ext.
ENTRY_POINTS = {"run", "main"}
# Functions reached only on a branch that is still being wired, each with its reason.
EXEMPT: set[tuple[str, str]] = set()
# Functions the docs give users for their own scripts by their full name (the docs page is checked to name it).
DOCUMENTED = {("trainer_ext/data/packing.py", "pack_dataset"): "docs/llm.md"}
IDENTIFIER = re.compile(r"^[A-Za-z_]\w*$")


def used_names(nodes) -> set[str]:
    """Every name, attribute and identifier-like string the code of these nodes refers to (a registry's "module",
    "Class" strings and getattr(x, "name") included)."""
    found = set()
    for node in nodes:
        for child in ast.walk(node):
            if isinstance(child, ast.Name):
                found.add(child.id)
            elif isinstance(child, ast.Attribute):
                found.add(child.attr)
            elif isinstance(child, ast.Constant) and isinstance(child.value, str):
                found.update(part for part in re.split(r"[.:]", child.value) if IDENTIFIER.match(part))
    return found


def product_code():
    """{module path: its tree} of the package, and the trees of the documented commands."""
    package = {path.relative_to(REPO).as_posix(): ast.parse(path.read_text())
               for path in sorted((REPO / "trainer_ext").rglob("*.py"))}
    commands = [ast.parse(path.read_text()) for folder in ("examples", "benchmarks", "scripts")
                for path in sorted((REPO / folder).glob("*.py"))]
    return package, commands


def dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")  # Python calls it (a module's __getattr__, __init__)


def unreached_functions() -> list[tuple[str, str]]:
    definitions: dict[str, list[tuple[str, ast.AST]]] = {}  # name -> (module, def) of every module-level def/class
    package, reached_code = product_code()  # the commands' code, and what runs when a module is imported
    aliases = {node.asname: node.name for tree in [*package.values(), *reached_code] for node in ast.walk(tree)
               if isinstance(node, ast.alias) and node.asname}
    for module, tree in package.items():
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                definitions.setdefault(node.name, []).append((module, node))
                reached_code += node.decorator_list
            else:
                reached_code.append(node)
    reached, pending = set(), used_names(reached_code) | ENTRY_POINTS
    while pending:
        name = pending.pop()
        for module, node in definitions.get(name, []) + definitions.get(aliases.get(name), []):
            if (module, node.name) not in reached:
                reached.add((module, node.name))
                pending |= used_names([node]) - {n for _, n in reached}
    return sorted((module, name) for name, found in definitions.items() for module, node in found
                  if not isinstance(node, ast.ClassDef) and not dunder(name)
                  and (module, name) not in reached | EXEMPT | set(DOCUMENTED))


def unused_methods() -> list[str]:
    """Methods no product code names, less those overriding a method of an upstream base (the Trainer's, a
    TrainerCallback's event): those are called by transformers. A module whose library is missing is not judged."""
    package, commands = product_code()
    named = used_names([*package.values(), *commands])
    unused = []
    for module, tree in package.items():
        for cls in (node for node in tree.body if isinstance(node, ast.ClassDef)):  # a module's own classes
            for method in cls.body:
                if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) or dunder(method.name) \
                        or method.name in named:
                    continue
                try:
                    found = getattr(importlib.import_module(module[:-3].replace("/", ".")), cls.name)
                except ImportError:
                    continue
                upstream = [base for base in found.__mro__[1:] if not base.__module__.startswith("trainer_ext")]
                if not any(method.name in vars(base) for base in upstream):
                    unused.append(f"{module}: {cls.name}.{method.name}")
    return unused


def test_every_module_level_function_has_a_caller_outside_the_tests():
    """A function nothing a user runs reaches is dead code: call it where its promise belongs, or delete it with its
    test."""
    assert unreached_functions() == []
    for (module, name), page in DOCUMENTED.items():  # still documented by its full name, so users do reach it
        assert f"{module[:-3].replace('/', '.')}.{name}(" in (REPO / page).read_text(), (module, name, page)


def test_every_method_is_named_by_product_code_or_overrides_an_upstream_one():
    """A method nothing calls (OptimizerSettings.from_file was one) is dead code too."""
    assert unused_methods() == []


def test_the_reachability_finds_a_function_only_a_test_calls(tmp_path, monkeypatch):
    """The check itself: a function defined in the package and called by nobody is reported."""
    package = tmp_path / "trainer_ext"
    package.mkdir()
    (package / "live.py").write_text("VALUE = helper\n\ndef helper():\n    return inner()\n\ndef inner():\n    return 1\n"
                                     "\ndef dead():\n    return inner()\n\nclass Used:\n    def method(self):\n"
                                     "        return reached_by_method()\n\ndef reached_by_method():\n    return 2\n"
                                     "\nUSED = Used\n")
    (package / "other.py").write_text("from .live import aliased as renamed\n\nrenamed()\n\n\ndef aliased():\n    "
                                      "return 3\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert unreached_functions() == [("trainer_ext/live.py", "dead")]
