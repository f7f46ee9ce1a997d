"""DeepSpeed's JIT ops as environments meet them (issue 48): each environment builds into its own folder, a build
another environment or another ninja made is announced as the rebuild it is, and an environment whose path holds a
space is refused before any work. Nothing here compiles: the build folders are written as torch writes them."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, run

pytestmark = pytest.mark.deepspeed
CPU_CONFIG = {"optimizer": {"type": "AdamW"},  # on CPU ranks: CPU Adam, nothing else
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}


def test_each_environment_builds_into_its_own_folder(tmp_path, monkeypatch):
    """Every venv of one Python shared ~/.cache/torch_extensions/py311_cpu, and their build commands differ by their
    paths: a second clone rebuilt every op and the first rebuilt them back (2-step runs sat silent for minutes). Fails
    when two environments at two paths get the same folder, or TORCH_EXTENSIONS_DIR set by the user stops winning."""
    from trainer_ext.backends.deepspeed import ops

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    folders = {}
    for name in ("clone-a/.venv", "clone-b/.venv", "read-only-a", "read-only-b"):
        prefix = tmp_path / name
        if not name.startswith("read-only"):  # a read-only environment (a system Python) is one it cannot write
            prefix.mkdir(parents=True)
        monkeypatch.setattr(sys, "prefix", str(prefix))
        folders[name] = ops.extensions_dir()
    assert folders["clone-a/.venv"] == tmp_path / "clone-a" / ".venv" / "torch_extensions"
    assert folders["clone-b/.venv"] == tmp_path / "clone-b" / ".venv" / "torch_extensions"
    assert folders["read-only-a"] != folders["read-only-b"]
    assert folders["read-only-a"].parent == folders["read-only-b"].parent  # torch's default root, a folder each
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    assert ops.build_folder("cpu_adam") == tmp_path / "mine" / "cpu_adam"
    from torch.utils.cpp_extension import _get_build_directory  # torch's own rule, where the op is built and found

    assert str(ops.build_folder("cpu_adam")) == _get_build_directory("cpu_adam", verbose=False)


def write_built_op(folder: Path, builder) -> None:
    """The op's folder as torch's JIT build leaves it for DeepSpeed's load in this environment (builder.jit_load's
    arguments through torch's own ninja writer), its library and ninja's log, without compiling anything."""
    from torch.utils import cpp_extension

    folder.mkdir(parents=True)
    sources = [os.path.abspath(builder.deepspeed_src_path(path)) for path in builder.sources()]
    includes = [os.path.abspath(builder.deepspeed_src_path(path)) for path in builder.include_paths()]
    ldflags = cpp_extension._prepare_ldflags(builder.strip_empty_entries(builder.extra_ldflags()), False, False, False,
                                             False)
    cpp_extension._write_ninja_file_to_build_library(
        str(folder / "build.ninja"), builder.NAME, sources, [*builder.strip_empty_entries(builder.cxx_args()),
                                                              "-UC10_USE_GLOG"],
        [], [], ldflags, includes, False, False, False)
    (folder / f"{builder.NAME}.so").write_bytes(b"")
    log = folder / "ninja-run"  # the log the first ninja on PATH writes, from a build of its own
    log.mkdir()
    (log / "build.ninja").write_text("rule touch\n  command = touch $out\nbuild done: touch\n")
    subprocess.run([shutil.which("ninja")], cwd=log, check=True, capture_output=True)
    shutil.copy(log / ".ninja_log", folder / ".ninja_log")
    shutil.rmtree(log)


def test_a_build_another_environment_or_ninja_made_is_announced_as_a_rebuild(tmp_path, monkeypatch):
    """The op's files existed, for another environment, so trainer_ext's notice never appeared while DeepSpeed rebuilt
    it for minutes. Fails when a folder built by this environment is announced, or when one whose build command names
    another environment's paths, or whose ninja log another ninja wrote, is not."""
    from trainer_ext.backends.deepspeed import ops

    (builder,) = ops.op_builders(["CPUAdamBuilder"])
    folder = tmp_path / "shared" / builder.NAME
    write_built_op(folder, builder)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "shared"))
    monkeypatch.setattr(ops, "_ANNOUNCED", set())
    assert ops.announce_builds(CPU_CONFIG) == []  # built here by this environment
    ours = (folder / "build.ninja").read_text()
    site_packages = next(path for path in sys.path if path.endswith("site-packages") and path in ours)
    (folder / "build.ninja").write_text(ours.replace(site_packages, "/home/me/other-clone/.venv/lib/site-packages"))
    (said,) = ops.announce_builds(CPU_CONFIG)
    assert said.startswith(f"DeepSpeed rebuilds its cpu_adam op in {folder} before this run trains, about "
                           "2 min on 2 busy CPU cores, with nothing printed meanwhile: it was built there by another "
                           "environment (of /home/me/other-clone/.venv/lib/site-packages), whose build command names "
                           "its own paths; environments that share a TORCH_EXTENSIONS_DIR rebuild each other's ops")
    (folder / "build.ninja").write_text(ours)
    log = (folder / ".ninja_log").read_text()
    other = "# ninja log v5" if not log.startswith("# ninja log v5") else "# ninja log v7"
    (folder / ".ninja_log").write_text(other + log[log.index("\n"):])
    monkeypatch.setattr(ops, "_ANNOUNCED", set())
    (said,) = ops.announce_builds(CPU_CONFIG)
    assert f"it was built by another ninja (its build log is {other[12:]}; the first ninja on PATH" in said


@pytest.mark.launch
def test_an_environment_whose_path_holds_a_space_is_refused_before_a_build(tmp_path):
    """`make test-fast` and `make demo` in `my clone/` failed after minutes of silence (the link splits torch's library
    path: `ld: cannot find clone/.venv/...`), a traceback on each rank. Fails when an op build in such an environment
    starts instead of one line naming the path."""
    spaced = tmp_path / "my clone" / ".venv"
    spaced.parent.mkdir()
    spaced.symlink_to(sys.prefix)  # this environment, at a path with a space (its files are found through it)
    out = run([spaced / "bin" / "python", "-m", "trainer_ext", "build-ops", "--only", "cpu_adam"],
              env={"TORCH_EXTENSIONS_DIR": str(tmp_path / "empty")}, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.startswith(
        f"trainer-ext build-ops: error: DeepSpeed would build its cpu_adam op here, and torch links it "
        f"with {spaced}/lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages/torch/lib unquoted: "
        "its space splits the path (ld: cannot find ...). Create the environment at a path without spaces"), out.stderr
    assert not (tmp_path / "empty").exists()  # nothing built
