"""DeepSpeed's JIT-built ops: which ones a run's config makes DeepSpeed load, whether this environment has them built, a
notice before a run builds one (minutes of silence otherwise), and `trainer-ext build-ops`, which builds them ahead."""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from ...environment.variables import restored, set_variables, unset_variable

logger = logging.getLogger(__name__)

# Seconds each op took to build once in a fresh-clone CI run on 2 busy CPU cores (DeepSpeed 0.19.8, torch 2.13): what
# the notice before a build quotes. On a GPU machine the CUDA builds were not measured.
BUILD_SECONDS = {"fused_adam": 257, "cpu_adam": 140}
# What `trainer-ext build-ops` builds: the ops a ZeRO run loads on this accelerator, FusedAdam (the default optimizer)
# and CPU Adam (offload_optimizer). Builders this accelerator lacks are skipped. Not the shared-memory all-reduce of CPU
# ranks: only DeepSpeed's tensor-parallel inference calls it, and the DeepSpeed backend keeps it from loading
# (internals.skip_deepspeed_cpu_allreduce_op).
DEFAULT_BUILDERS = ("FusedAdamBuilder", "CPUAdamBuilder")
_ANNOUNCED: set[str] = set()  # ops this process has said it builds


@contextmanager
def deepspeed_imported():
    """Import DeepSpeed's modules inside without its "Setting accelerator to CPU" warning on a machine without a GPU
    (DS_ACCELERATOR=cpu for the import only; the DeepSpeed backend's prepare_environment sets the same choice for the
    run itself), and with the environment variables as they were after a first import (checking a config is not a
    run: tests/integration/test_args.py compares the process with stock arguments')."""
    from ...environment.launcher import accelerator_available

    if "deepspeed" in sys.modules:
        yield
        return
    # DeepSpeed's import sets variables too (PYTORCH_NVML_BASED_CUDA_CHECK): the process as it was, afterwards
    added: dict[str, str] = {}
    try:
        with restored() as added:
            if not accelerator_available():
                set_variables({"DS_ACCELERATOR": "cpu"}, keep_set=True)
            yield
    finally:
        _TAKEN_BACK.update({name: value for name, value in added.items() if name != "DS_ACCELERATOR"})


def import_deepspeed_quietly(trains: bool = False) -> None:
    """Where DeepSpeed is installed: import it now, as the Trainer's set-up would (accelerate imports it whenever
    installed), without its "Setting accelerator to CPU" warning and leaving the environment variables as they were
    (building ExtTrainer changes none). Where it `trains` on CPU ranks, before its communication backend is formed
    (accelerate forms it with the process group): its shared-memory all-reduce kept from loading, which only
    tensor-parallel inference calls (minutes of build on a first run, a /dev/shm buffer of ~66 MB a rank)."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return
    if "deepspeed" not in sys.modules:
        with deepspeed_imported():
            import deepspeed  # noqa: F401 (imported for its side effects, under deepspeed_imported)
    if trains:
        from ...environment.launcher import accelerator_available
        from ...integrations import internals

        if not accelerator_available():
            with deepspeed_imported():
                internals.skip_deepspeed_cpu_allreduce_op()


_TAKEN_BACK: dict[str, str] = {}  # what DeepSpeed's import set and deepspeed_imported took back


def restore_import_environment() -> None:
    """For a run (process set-up, not a config check): the variables DeepSpeed's own import sets, where a config check
    imported it first and took them back, so the run sees what DeepSpeed arranged (unless the user set them)."""
    set_variables(_TAKEN_BACK, keep_set=True)


def op_buildable(builder_name: str) -> bool:
    """Whether DeepSpeed has this op prebuilt or can build it here (its builder's own compatibility check)."""
    with deepspeed_imported():
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import installed_ops

    builder = get_accelerator().create_op_builder(builder_name)
    return builder is not None and (installed_ops.get(builder.NAME, False) or builder.is_compatible(verbose=False))


def environment_folder() -> Path:
    """This environment's own folder for DeepSpeed's JIT ops: sys.prefix/torch_extensions (the venv's or conda env's,
    where `make test` builds them too), or, where the environment is read-only, a folder of its own under torch's
    default root. torch's default (~/.cache/torch_extensions/<python>_<cpu|cuXY>) is shared by every environment of one
    Python, whose build commands name their own paths: each rebuilt the ops of the other, in silence."""
    own = Path(sys.prefix) / "torch_extensions"
    if os.access(own if own.is_dir() else sys.prefix, os.W_OK | os.X_OK):
        return own
    import hashlib

    import torch
    from torch.utils.cpp_extension import get_default_build_root

    accelerator = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip is not None
                   else f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda is not None else "cpu")
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    environment = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:12]
    return Path(get_default_build_root()) / f"{python}_{accelerator}_env-{environment}"


def extensions_dir() -> Path:
    """Where torch's cpp_extension builds (and later finds) DeepSpeed's ops: $TORCH_EXTENSIONS_DIR when set (by the
    user, or by a DeepSpeed run: use_environment_folder), else this environment's own folder."""
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(configured) if configured else environment_folder()


def use_environment_folder() -> None:
    """For a DeepSpeed run (as DS_ACCELERATOR): torch builds and finds the ops in this environment's own folder unless
    the user chose one with TORCH_EXTENSIONS_DIR."""
    set_variables({"TORCH_EXTENSIONS_DIR": str(environment_folder())}, keep_set=True)


@contextmanager
def environment_folder_used():
    """use_environment_folder for one build (`trainer-ext build-ops`), the variable as it was afterwards."""
    before = os.environ.get("TORCH_EXTENSIONS_DIR")
    use_environment_folder()
    try:
        yield
    finally:
        if before is None:
            unset_variable("TORCH_EXTENSIONS_DIR")


def build_folder(name: str) -> Path:
    """The op's build folder, as torch's cpp_extension computes it from TORCH_EXTENSIONS_DIR (a test holds this to
    torch's _get_build_directory)."""
    return extensions_dir() / name


def needed_builders(config: dict) -> list[str]:
    """DeepSpeed's op builders a run of this resolved config loads (the engine's _configure_basic_optimizer): the
    optimizer's fused or CPU kernel, and async_io for ZeRO-3's NVMe offload (on CPU ranks not the shared-memory
    all-reduce: the backend keeps it from loading)."""
    from ...deepspeed_config.keys import OPTIMIZER_OPS
    from ...deepspeed_config.passes import built_optimizer, nvme_offloads

    builders = []
    built = built_optimizer(config)
    if built is not None and built[0] in OPTIMIZER_OPS:
        builders.append(OPTIMIZER_OPS[built[0]])
    if nvme_offloads(config):
        builders.append("AsyncIOBuilder")
    return builders


def op_builders(names) -> list:
    """DeepSpeed's builders of these names for this machine's accelerator, less those it has none of or that DeepSpeed
    installed prebuilt (it then loads them without building)."""
    with deepspeed_imported():
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import installed_ops

    found = []
    for name in names:
        builder = get_accelerator().create_op_builder(name)
        if builder is None or builder.NAME == "deepspeed_not_implemented" or installed_ops.get(builder.NAME, False):
            continue
        found.append(builder)
    return found


def rebuild_reason(builder) -> str | None:
    """Why DeepSpeed's load of this op will compile it (torch's JIT build runs ninja in the op's folder), in a phrase;
    None when it loads the library built there. A build into an empty folder says "first"."""
    folder = build_folder(builder.NAME)
    library = folder / f"{builder.NAME}.so"
    if not library.is_file():
        return "first"
    sources = [Path(builder.deepspeed_src_path(path)).resolve() for path in builder.sources()]
    includes = [Path(builder.deepspeed_src_path(path)).resolve() for path in builder.include_paths()]
    headers = [header for include in includes for header in include.glob("*.h")]
    newest = max((path.stat().st_mtime for path in sources + headers if path.is_file()), default=0.0)
    if library.stat().st_mtime < newest:
        return "its sources are newer than the library built there (DeepSpeed was installed again since)"
    try:
        command = (folder / "build.ninja").read_text().replace("$ ", " ").replace("'", "")
    except OSError:
        command = ""
    from torch.utils.cpp_extension import include_paths, library_paths

    ours = [*map(str, sources + includes), *include_paths(), *library_paths()]
    if any(path not in command for path in ours):
        other = re.search(r"-isystem (\S+?)/torch/include", command)
        return ("it was built there by another environment" + (f" (of {other.group(1)})" if other else "")
                + ", whose build command names its own paths; environments that share a TORCH_EXTENSIONS_DIR rebuild "
                "each other's ops: unset it (each environment then builds into its own folder) or give each its own")
    written, used = ninja_log_version(folder / ".ninja_log"), ninja_writes()
    if written and used and written != used[1]:
        return (f"it was built by another ninja (its build log is {written}; the first ninja on PATH, {used[0]}, "
                f"writes {used[1]} and starts over); a run with the other ninja first on PATH rebuilds it back: start "
                "runs with the same PATH (the environment activated, or not)")
    return None


def ninja_log_version(log: Path) -> str | None:
    """A ninja build log's version ("v5"), from its first line; None when there is none."""
    try:
        with open(log) as stream:
            match = re.match(r"# ninja log (v\d+)", stream.readline())
    except OSError:
        return None
    return match.group(1) if match else None


def ninja_writes() -> tuple[str, str] | None:
    """(path, log version) of the ninja torch runs (the first on PATH): a log of another version is discarded."""
    import shutil

    ninja = shutil.which("ninja")
    return (ninja, _log_version_of(ninja)) if ninja else None


@functools.cache
def _log_version_of(ninja: str) -> str | None:
    """The log version this ninja writes, from one trivial build in a temporary folder (milliseconds)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="trainer-ext-ninja-") as folder:
        (Path(folder) / "build.ninja").write_text("rule touch\n  command = touch $out\nbuild done: touch\n")
        try:
            subprocess.run([ninja], cwd=folder, capture_output=True, timeout=60, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return ninja_log_version(Path(folder) / ".ninja_log")


def check_buildable_here(builders) -> None:
    """Before any work, for ops this run will compile: torch links them with its library folder unquoted
    (`-L<torch>/lib`), so a path with a space fails the link after minutes (ld: cannot find ...)."""
    from torch.utils.cpp_extension import library_paths

    from ...errors import UserError

    spaced = [path for path in library_paths() if any(char.isspace() for char in path)]
    if builders and spaced:
        names = ", ".join(builder.NAME for builder in builders)
        many = len(builders) > 1
        raise UserError(f"DeepSpeed would build its {names} op{'s' if many else ''} here, and torch links "
                        f"{'them' if many else 'it'} with {spaced[0]} unquoted: its space splits the path (ld: cannot find ...). Create the "
                        f"environment at a path without spaces (e.g. python3 -m venv ~/venvs/trainer_ext, or make setup "
                        f"VENV=~/venvs/trainer_ext)")


def cpu_accelerator() -> bool:
    with deepspeed_imported():
        from deepspeed.accelerator import get_accelerator
    return get_accelerator().device_name() == "cpu"


def build_time(name: str, cpu: bool) -> str:
    """How long building `name` takes, as measured (CPU builds only)."""
    seconds = BUILD_SECONDS.get(name)
    if not cpu or seconds is None:
        return "several minutes"
    return f"about {max(1, round(seconds / 60))} min on 2 busy CPU cores"


def announce_builds(config: dict) -> list[str]:
    """Before DeepSpeed loads an op this run needs and will compile (not built in this folder yet, built by another
    environment or ninja, or from older sources): say which, why, where, roughly how long it takes and how to build it
    ahead (main process, once per op); DeepSpeed itself prints nothing while it compiles. Refused before any work where
    the build cannot succeed (check_buildable_here). Returns what was said."""
    from ...errors import main_process

    cpu = cpu_accelerator()
    builds = [(builder, reason) for builder in op_builders(needed_builders(config))
              if builder.is_compatible(verbose=False) and (reason := rebuild_reason(builder))]
    check_buildable_here([builder for builder, _ in builds])
    said = []
    for builder, reason in builds:
        if builder.NAME in _ANNOUNCED:
            continue
        _ANNOUNCED.add(builder.NAME)
        folder, time_taken = build_folder(builder.NAME), build_time(builder.NAME, cpu)
        if reason == "first":
            said.append(f"DeepSpeed builds its {builder.NAME} op before this run trains: once per environment (into "
                        f"{folder}), {time_taken}, with nothing printed meanwhile; `trainer-ext build-ops` builds "
                        "DeepSpeed's ops ahead of a run")
        else:
            said.append(f"DeepSpeed rebuilds its {builder.NAME} op in {folder} before this run trains, "
                        f"{time_taken}, with nothing printed meanwhile: {reason}")
    if main_process():
        for line in said:
            logger.warning(line)
    return said


def build_ops(out=None, only=None) -> int:
    """`trainer-ext build-ops`: build (or load, when built already) every op of DEFAULT_BUILDERS this machine's DeepSpeed
    can build (`only`: those of these names), with what each took; 0 when all are ready, 1 when a build failed."""
    from .cuda_arch import prepare_for_deepspeed

    out = out or sys.stdout
    cpu = cpu_accelerator()
    if not cpu:
        prepare_for_deepspeed()  # a TORCH_CUDA_ARCH_LIST DeepSpeed's builder can read
    with environment_folder_used():
        return _build(out, only, cpu)


def _build(out, only, cpu: bool) -> int:
    builders = op_builders(DEFAULT_BUILDERS)
    if only:
        from ...errors import ArgumentsError, closest

        names = [builder.NAME for builder in builders]
        unknown = [name for name in only if name not in names]
        if unknown:
            hints = [f"{name} (did you mean {closest(name, names)}?)" if closest(name, names) else name
                     for name in unknown]
            raise ArgumentsError(f"--only {', '.join(hints)}: not one of this machine's ops: {', '.join(names)}")
        builders = [builder for builder in builders if builder.NAME in only]
    check_buildable_here([builder for builder in builders if builder.is_compatible(verbose=False)
                          and rebuild_reason(builder)])
    root = extensions_dir()
    print(f"DeepSpeed's ops for this machine ({'CPU' if cpu else 'GPU'} ranks), built in {root}:", file=out, flush=True)
    failed = 0
    for builder in builders:
        if not builder.is_compatible(verbose=False):
            print(f"  {builder.NAME}: cannot be built here, skipped (DeepSpeed will not load it on this machine)",
                  file=out, flush=True)
            continue
        reason = rebuild_reason(builder)
        built = reason is None
        print(f"  {builder.NAME}: " + ("built already, loading" if built else f"building ({build_time(builder.NAME, cpu)})"
                                       if reason == "first" else f"rebuilding: {reason} "
                                       f"({build_time(builder.NAME, cpu)})"), file=out, flush=True)
        start = time.monotonic()
        with _ticking(out, start, every_s=None if built else 30.0):
            try:
                builder.load(verbose=False)
            except Exception as err:  # noqa: BLE001 (torch and DeepSpeed raise RuntimeError, OSError, ImportError)
                failed += 1
                print(f"  {builder.NAME}: failed after {time.monotonic() - start:.0f} s: "
                      f"{str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__}", file=out,
                      flush=True)
                continue
        print(f"  {builder.NAME}: ready ({'loaded' if built else 'built'} in {time.monotonic() - start:.1f} s)",
              file=out, flush=True)
    if failed:
        print(f"{failed} op(s) failed to build: a DeepSpeed run that needs them would fail the same way", file=out)
        return 1
    print("the ops named are built: a DeepSpeed run that needs no other starts without building" if only else
          "every op is built: DeepSpeed runs in this environment start without building", file=out)
    return 0


class _ticking:
    """Prints the time elapsed every `every_s` seconds while a build runs (None: silent)."""

    def __init__(self, out, start: float, every_s: float | None):
        self.out, self.start, self.every_s = out, start, every_s
        self.done = threading.Event()

    def __enter__(self):
        if self.every_s:
            threading.Thread(target=self._tick, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.done.set()

    def _tick(self):
        while not self.done.wait(self.every_s):
            print(f"    ... {time.monotonic() - self.start:.0f} s", file=self.out, flush=True)
