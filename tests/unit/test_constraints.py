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
