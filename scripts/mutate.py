"""`make mutate`: mutmut over the code behind trainer_ext's promises (SCOPE), against the unit subset (the tests `make
test-fast` runs: in process, no launcher), then each module's mutation score. Fails when a module scores under 90% or a
surviving mutant is neither killed nor listed, with the reason it is equivalent, in docs/mutation.md's table.

    python scripts/mutate.py                 run what changed since the last run (mutmut keeps its results in mutants/)
    python scripts/mutate.py MODULE.py ...   only these modules' mutants (the report covers all)
    python scripts/mutate.py --report        the scores of the last run only
"""

from __future__ import annotations

import argparse
import configparser
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
THRESHOLD = 0.90
# Module -> the functions and methods that carry the promise (None: all of it). A method is Class.method.
SCOPE = {
    "trainer_ext/checkpoints/format.py": None,  # the newest valid checkpoint, damage, rotation, resume requests
    "trainer_ext/checkpoints/preemption.py": None,  # the stop every rank agrees on
    "trainer_ext/data/samplers.py": None,  # the training order and its resume
    "trainer_ext/training/losses.py": None,  # which tokens a loss counts; the token-weighted evaluation loss
    "trainer_ext/data/packing.py": None,  # best-fit rows, positions per sample, the collator
    "trainer_ext/deepspeed_config/passes.py": (  # the translator's batch fields, precision and scheduler rules
        "warmup_steps_for", "precision", "_enabled", "batch", "_batch_problem", "_batch_field", "file_scheduler",
        "_warmup", "flag_scheduler", "precision_safety"),
    "trainer_ext/planner.py": (  # the memory formulas
        "DecoderShape.parameter_tensors", "DecoderShape.linears", "lora_parameters", "DecoderActivations.peak",
        "formulas", "Estimate.model_states", "Estimate.device_total", "Plan.cheapest_fitting", "activation_bytes",
        "decoder_activation_bytes", "plan", "_bert_like", "_gpt2", "_llama_like"),
    "trainer_ext/config/optimizer.py": None,  # settings resolved from the flags: warmup rules, optimizer, scheduler
}
EQUIVALENT = REPO / "docs" / "mutation.md"
KILLED = {"killed", "timeout", "segfault", "caught by type check"}  # a test (or the run itself) noticed


def module_name(path: str) -> str:
    return path[:-3].replace("/", ".")


def mutant_pattern(path: str, function: str | None) -> str:
    """mutmut's name for the mutants of a function (x_name) or method (xǁClassǁname) of a module."""
    if function is None:
        return f"{module_name(path)}.*"
    cls, _, name = function.rpartition(".")
    return f"{module_name(path)}.{f'xǁ{cls}ǁ{name}' if cls else f'x_{name}'}__mutmut_*"


def in_scope(path: str, mutant: str) -> bool:
    import fnmatch

    functions = SCOPE[path]
    return any(fnmatch.fnmatchcase(mutant, mutant_pattern(path, function)) for function in functions or [None])


def check_setup_cfg() -> None:
    """setup.cfg's [mutmut] only_mutate (what mutmut reads) lists exactly SCOPE's modules."""
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    listed = [line.strip() for line in config.get("mutmut", "only_mutate").splitlines() if line.strip()]
    if sorted(listed) != sorted(SCOPE):
        sys.exit(f"setup.cfg [mutmut] only_mutate lists {sorted(listed)}, scripts/mutate.py SCOPE {sorted(SCOPE)}: "
                 "make them the same")
    # A unit test file named for a mutated module that mutmut does not run kills none of its mutants, silently (the
    # planner's three unit files were written and left out: every mutant they kill was reported surviving).
    selected = set(config.get("mutmut", "pytest_add_cli_args_test_selection").split())
    named = {str(test.relative_to(REPO)) for path in SCOPE
             for test in (REPO / "tests" / "unit").glob(f"test_{Path(path).stem}*.py")}
    if named - selected:
        sys.exit(f"setup.cfg [mutmut] pytest_add_cli_args_test_selection leaves out {', '.join(sorted(named - selected))}"
                 ": add it, or mutmut never runs its tests against the module it is named for")


def equivalents() -> dict[str, str]:
    """docs/mutation.md's table: mutant name -> why no test can tell it from the original."""
    rows = re.findall(r"^\|\s*`([^`]+__mutmut_\d+)`\s*\|(.+)\|\s*$", EQUIVALENT.read_text(), re.M)
    return {name: reason.strip() for name, reason in rows}


def results() -> dict[str, dict[str, str]]:
    """Module -> {mutant in scope: mutmut's status}, from the results mutmut keeps in mutants/."""
    from mutmut.stats import status_by_exit_code

    found = {}
    for path in SCOPE:
        meta = REPO / "mutants" / f"{path}.meta"
        codes = json.loads(meta.read_text())["exit_code_by_key"] if meta.is_file() else {}
        found[path] = {name: status_by_exit_code[code] for name, code in codes.items() if in_scope(path, name)}
    return found


def report() -> int:
    listed = equivalents()
    failed, lines = False, []
    print(f"{'module':45} {'mutants':>7} {'killed':>7} {'equiv.':>7} {'left':>5} {'score':>7}")
    for path, statuses in results().items():
        killed = sum(status in KILLED for status in statuses.values())
        equivalent = [name for name, status in statuses.items() if status not in KILLED and name in listed]
        left = [name for name, status in statuses.items() if status not in KILLED and name not in listed]
        counted = len(statuses) - len(equivalent)
        score = killed / counted if counted else 0.0
        unchecked = [name for name, status in statuses.items() if status == "not checked"]
        print(f"{path:45} {len(statuses):7} {killed:7} {len(equivalent):7} {len(left):5} {score:7.1%}")
        if not statuses or unchecked:
            lines.append(f"{path}: {len(unchecked) if statuses else 'no'} mutant(s) not checked: run make mutate")
        if score < THRESHOLD:
            lines.append(f"{path}: mutation score {score:.1%} is under {THRESHOLD:.0%}")
        lines += [f"survived, not listed as equivalent in docs/mutation.md: {name} ({statuses[name]}; "
                  f"`mutmut show {name}` shows it)" for name in left if statuses[name] != "not checked"]
        failed = failed or score < THRESHOLD or bool(left) or not statuses
    every = {name: status for statuses in results().values() for name, status in statuses.items()}
    stale = [name for name in listed if every.get(name, "killed") in KILLED]
    lines += [f"docs/mutation.md lists {name} as equivalent, but it is {every.get(name, 'gone')}: drop its row"
              for name in stale]
    for line in lines:
        print(line)
    return 1 if failed or stale else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", help="only these of SCOPE's modules (paths)")
    parser.add_argument("--report", action="store_true", help="only the scores of the last run")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="mutants tested at a time")
    options = parser.parse_args(argv)
    os.chdir(REPO)
    check_setup_cfg()
    if not options.report:
        unknown = sorted(set(options.modules) - set(SCOPE))
        if unknown:
            sys.exit(f"not in scripts/mutate.py's SCOPE: {', '.join(unknown)}")
        patterns = [mutant_pattern(path, function) for path, functions in SCOPE.items()
                    if path in (options.modules or SCOPE) for function in functions or [None]]
        mutmut = Path(sys.executable).parent / "mutmut"
        subprocess.run([str(mutmut), "run", "--max-children", str(options.jobs), *patterns], check=False)
    return report()


if __name__ == "__main__":
    sys.exit(main())
