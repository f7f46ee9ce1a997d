"""No import cycle inside trainer_ext/, and every module imports alone: modules that need each other at import time
break as soon as one of them is imported first from a new place (a user's script, a launcher, a test)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PYTHON, REPO, run

PACKAGE = REPO / "trainer_ext"


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports(module: str, path: Path, modules: dict) -> set[str]:
    """The trainer_ext modules `module` imports anywhere in its code (also inside functions: a lazy import only moves
    a cycle), and those its strings name relatively (the backend registry's ".deepspeed"). The package's own lazy
    attribute table (trainer_ext/__init__.py) is its public face, not a dependency."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(".") \
                and module != "trainer_ext" and f"{package}{node.value}" in modules:
            names = [f"{package}{node.value}"]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module and not (name == "trainer_ext" and module.startswith("trainer_ext.")
                                                and isinstance(node, ast.ImportFrom) and node.level == 1
                                                and path.parent == PACKAGE and node.module is None):
                found.add(name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_inside_the_package():
    """args -> backends -> deepspeed -> args and planner <-> backends were cycles: fails naming any new one."""
    modules = module_names()
    graph = {module: imports(module, path, modules) for module, path in modules.items()}
    assert "trainer_ext.backends.deepspeed.backend" in graph["trainer_ext.backends"]  # the registry's strings are read
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    """The check above would pass on anything if the finder could not see a cycle."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The package's floors, lowest first (CONTRIBUTING.md, "Floors"): a module imports only from its own floor or below.
FLOORS = [
    {"errors", "integrations"},  # what every floor may raise; the one door to upstream internals
    {"environment", "data"},  # facts of the process (launcher, host, SageMaker's variables); data order and loading
    {"config"},  # what users write: flags' values, ranges and checks (the backends' own checks handed in)
    {"deepspeed_config"},  # the pure translator: flags + a user's file -> one DeepSpeed config
    {"backends"},  # one folder per backend: settings, process set-up, the trainer's hooks
    {"checkpoints"},  # the checkpoint format, resumes, preemption, remote copies
    {"args"},  # ExtTrainingArguments: the flags composed with the chosen backend's settings and the resume checks
    {"training", "trainer", "seq2seq", "trl"},  # the process's set-up step, ExtTrainer and its combinations
    {"tasks", "search", "experiment", "planner"},  # recipes, experiment files, search, the planner
    {"cli", "__main__", "trainer_ext"},  # the commands and the package's public face
]
# Each import that still runs back up, with why; the redesign (issue 46) removes them. A stale entry fails too.
BACK_UP = {
    ("trainer_ext.config.flags", "trainer_ext.args"):
        "ExtTrainingArguments' path from 2026-11-24 to 2026-11-28, re-exported: a training_args.bin saved then "
        "pickles it (test_args.py loads one)",
}


def floor(module: str) -> int:
    top = module.split(".")[1] if "." in module else module
    return next(number for number, names in enumerate(FLOORS) if top in names)


def back_up(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(module, other) for module, others in graph.items() for other in others if floor(other) > floor(module)}


def test_no_import_runs_back_up_the_floors():
    """An import from a higher floor (environment/prepare.py calling backends/, config/experiment_file.py reading the
    tasks) makes the lower floor need everything above it: fails naming any import that is not in BACK_UP with its
    reason, and any BACK_UP entry that no longer happens (the list only shrinks)."""
    modules = module_names()
    graph = {module: imports(module, path, modules) for module, path in modules.items()}
    found = back_up(graph)
    assert sorted(found - set(BACK_UP)) == [], "an import runs back up the floors"
    assert sorted(set(BACK_UP) - found) == [], "no longer imported: drop it from BACK_UP"
    assert back_up({"trainer_ext.config.x": {"trainer_ext.tasks.y"}}) == {("trainer_ext.config.x", "trainer_ext.tasks.y")}


# The modules outside backends/ whose code (not their prose) names a backend's library, with why; the list only
# shrinks. The translator (deepspeed_config/) is DeepSpeed's by definition, integrations/ is the door to upstream.
NAMES_A_BACKEND = {
    "trainer_ext.cli": "the DeepSpeed tools: `trainer-ext ds-config` (the translator's explain, the resolved config) "
                       "and `trainer-ext build-ops`",
    "trainer_ext.experiment": "an experiment file's deepspeed section: its paths resolved against the file, the "
                              "translator's error said as the file's",
    "trainer_ext.tasks.causal_lm": "QLoRA places the 4-bit model on the rank's device except under ZeRO-3 "
                                   "(transformers' public is_deepspeed_zero3_enabled)",
}
LIBRARIES = ("deepspeed", "fairscale")


def names_a_backend(path: Path) -> bool:
    """Whether the module's code names DeepSpeed or FairScale: an import, a name, an attribute or an argument."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            words = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            words = [node.module or "", *(alias.name for alias in node.names)]
        elif isinstance(node, ast.Name):
            words = [node.id]
        elif isinstance(node, ast.Attribute):
            words = [node.attr]
        elif isinstance(node, ast.arg):
            words = [node.arg]
        else:
            continue
        if any(library in word.lower() for word in words for library in LIBRARIES):
            return True
    return False


def test_backend_knowledge_stays_in_backends():
    """A backend is its folder: the search reaches into a backend's config through its `config_keys`, SageMaker and
    the checkpoints read its attributes. Fails naming a module outside backends/ that names DeepSpeed or FairScale in
    its code and is not in NAMES_A_BACKEND with its reason, or an entry that no longer does (issue 46: search/space.py,
    search/check.py and search/runner.py did, and environment/launcher.py's fp16 check)."""
    outside = {module for module, path in module_names().items()
               if module.split(".")[1:2] not in (["backends"], ["deepspeed_config"], ["integrations"])
               and names_a_backend(path)}
    assert sorted(outside - set(NAMES_A_BACKEND)) == [], "backend knowledge outside backends/"
    assert sorted(set(NAMES_A_BACKEND) - outside) == [], "no longer names a backend: drop it from NAMES_A_BACKEND"


@pytest.mark.launch
def test_every_module_imports_alone():
    """A module that works only when another was imported before it: each is imported first, in a fresh state."""
    names = sorted(name for name in module_names() if not name.endswith("__main__"))  # that one runs the CLI
    code = ("import importlib, sys\nfailed = []\nfor name in sys.argv[1:]:\n"
            "    for loaded in [m for m in sys.modules if m == 'trainer_ext' or m.startswith('trainer_ext.')]:\n"
            "        del sys.modules[loaded]\n"
            "    try:\n        importlib.import_module(name)\n"
            "    except Exception as error:\n        failed.append(f'{name}: {type(error).__name__}: {error}')\n"
            "print('\\n'.join(failed) or 'all imported')\n")
    out = run([PYTHON, "-c", code, *names], env={"PYTHONPATH": str(REPO)}, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("all imported"), out.stdout[-3000:] + out.stderr[-3000:]


@pytest.mark.launch
def test_translator_imports_without_torch_or_deepspeed():
    """Config rendering must work on a login node with neither installed."""
    code = ("import sys\n"
            "for name in ('torch', 'deepspeed', 'transformers'):\n"
            "    sys.modules[name] = None  # any import of them now fails\n"
            "from trainer_ext.deepspeed_config import build_deepspeed_config\n"
            "import trainer_ext\n"
            "cfg = build_deepspeed_config({'bf16': True}, world_size=8, num_training_steps=100, config='zero2_auto')\n"
            "assert cfg['train_batch_size'] == 64 and trainer_ext.build_deepspeed_config is build_deepspeed_config\n"
            "print('pure ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "pure ok" in out.stdout
