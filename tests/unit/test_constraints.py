"""constraints/tested.txt (what `make setup` and CI install) against setup.py (what users' pip admits)."""

import runpy

import setuptools
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest import REPO


def pins(path):
    found = {}
    for line in (REPO / path).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            requirement = Requirement(line)
            found[canonicalize_name(requirement.name)] = requirement
    return found


def setup_py_requirements(monkeypatch, extra):
    """setup.py's own lists (an editable install's metadata is as old as its last `pip install`)."""
    given = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: given.update(kwargs))
    runpy.run_path(str(REPO / "setup.py"))
    return [Requirement(text) for text in [*given["install_requires"], *given["extras_require"][extra]]]


def test_every_tested_requirement_is_pinned_inside_setup_py_s_range(monkeypatch):
    """Fails when setup.py gains a dependency (or an extra of `.[test]` does) that constraints/tested.txt does not pin
    (a fresh clone would take whatever was released last night), when a pin falls outside setup.py's range (pip would
    refuse to install: a floor moved without the tested file), or when a pin is not an exact `==`."""
    tested = pins("constraints/tested.txt")
    assert all(str(r.specifier).startswith("==") and "," not in str(r.specifier) for r in tested.values())
    assert "torch" not in tested  # installed first (CPU wheel) or kept (a GPU machine's CUDA build)
    needed = setup_py_requirements(monkeypatch, "test")
    assert {"transformers", "deepspeed", "peft", "pytest-xdist"} <= {canonicalize_name(r.name) for r in needed}
    for requirement in needed:
        name = canonicalize_name(requirement.name)
        if name == "torch":
            continue
        assert name in tested, f"constraints/tested.txt pins no {name}"
        version = str(tested[name].specifier)[2:]
        assert requirement.specifier.contains(version, prereleases=True), (name, version, str(requirement.specifier))


def test_the_oldest_pins_are_inside_setup_py_s_ranges(monkeypatch):
    """Fails when constraints/oldest.txt pins a release setup.py no longer admits."""
    needed = {canonicalize_name(r.name): r for r in setup_py_requirements(monkeypatch, "test-core")}
    for name, pin in pins("constraints/oldest.txt").items():
        if name in needed and name != "torch":
            assert needed[name].specifier.contains(str(pin.specifier)[2:], prereleases=True), (name, str(pin))


def readme_extras():
    """README's extras table: {extra: the backticked words of its "installs" column}."""
    import re

    text = (REPO / "README.md").read_text()
    table = text[text.index("| extra | installs | for |"):]
    table = table[:table.index("\n\n")]
    rows = {}
    for line in table.splitlines()[2:]:
        extra, installs = (cell.strip() for cell in line.strip("|").split("|")[:2])
        rows[extra.strip("`")] = re.findall(r"`([^`]+)`", installs)
    return rows


def test_readme_s_extras_table_is_setup_py_s(monkeypatch):
    """README named extras whose contents differed from setup.py (`deepspeed>=0.19` where setup.py asks 0.19.8, an
    `all` without `llm`): each row's requirements (another extra's name standing for its contents) must be setup.py's."""
    given = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: given.update(kwargs))
    runpy.run_path(str(REPO / "setup.py"))
    extras = given["extras_require"]

    def expanded(words):
        found = set()
        for word in words:
            found |= expanded(readme_extras()[word]) if word in extras else {str(Requirement(word))}
        return found

    rows = readme_extras()
    assert set(rows) == set(extras)
    for extra, words in rows.items():
        assert expanded(words) == {str(Requirement(text)) for text in extras[extra]}, extra


def test_the_torch_floor_is_the_one_transformers_accepts(monkeypatch):
    """setup.py admitted torch 2.1, which transformers 5 disables ("PyTorch >= 2.6 is required"): a user's pip could
    pick a torch that cannot train. The floor is the installed transformers' own torch floor."""
    from importlib.metadata import requires

    theirs = next(Requirement(text) for text in requires("transformers") if Requirement(text).name == "torch")
    floor = next(spec.version for spec in theirs.specifier if spec.operator == ">=")
    ours = next(r for r in setup_py_requirements(monkeypatch, "test") if r.name == "torch")
    assert str(ours.specifier) == f">={floor}"
