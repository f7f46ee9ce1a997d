"""README is a front page and every page it leads to is reachable, every link lands, and every flag a documented command
types exists in the parser that reads it (a renamed flag would leave the docs telling users to type an error)."""

import re
import shlex

import pytest

from conftest import REPO

PAGES = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]


def example_tasks() -> dict[str, str]:
    """{examples/run_*.py: the task (trainer_ext.tasks.TASKS) whose recipe it runs}, read from each script's
    `script("<task>", __name__)`: a new example or task is checked without a list here to keep (causal_lm and dpo
    were missed)."""
    from trainer_ext.tasks import TASKS

    found = {}
    for script in sorted((REPO / "examples").glob("run_*.py")):
        named = set(re.findall(r"^main = script\(\"(\w+)\", __name__\)", script.read_text(), re.M)) & set(TASKS)
        assert len(named) == 1, f"{script.name}: runs the recipes {sorted(named)}"
        found[script.name] = named.pop()
    return found


EXAMPLES = example_tasks()


def anchors(text: str) -> set[str]:
    """GitHub's anchors for a page's headings (outside code blocks)."""
    found, in_code = set(), False
    for line in text.splitlines():
        in_code ^= line.startswith("```")
        if not in_code and line.startswith("#"):
            found.add(re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-"))
    return found


def commands(text: str):
    """The shell commands of a page's ```bash blocks, continuation lines joined, comments dropped."""
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                yield line


def test_readme_is_a_front_page_that_reaches_every_page():
    """README grew to 1,487 lines; a page no link reaches is a page nobody reads."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    for page in PAGES[1:]:
        assert f"]({page.relative_to(REPO)}" in readme, f"README does not link {page.relative_to(REPO)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_link_lands(page):
    """A moved section or file leaves a link to nothing."""
    text = page.read_text()
    for target, anchor in re.findall(r"\]\((?!https?://)([^)#\s]*)(?:#([^)\s]+))?\)", text):
        path = (page.parent / target).resolve() if target else page
        assert path.exists(), f"{page.name}: link to {target} (no such file)"
        if anchor and path.suffix == ".md":
            assert anchor in anchors(path.read_text()), f"{page.name}: link to {target}#{anchor} (no such heading)"


def option_strings(parser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


@pytest.fixture(scope="module")
def known_flags():
    """Every example's flags (model, data and training arguments, as the example builds its parser)."""
    from trainer_ext import ExtArgumentParser
    from trainer_ext.experiment import argument_classes

    return {script: option_strings(ExtArgumentParser(argument_classes(task))) for script, task in EXAMPLES.items()}


def test_every_flag_a_documented_example_command_types_exists(known_flags):
    """`examples/run_*.py` commands in README and docs/, under any launcher: each --flag after the script must be one
    its parser takes (the launchers' own flags before the script are theirs)."""
    checked = 0
    for page in PAGES:
        for command in commands(page.read_text()):
            words = shlex.split(command)
            script = next((i for i, word in enumerate(words) if word.split("/")[-1] in EXAMPLES), None)
            if script is None:
                continue
            valid = known_flags[words[script].split("/")[-1]]
            unknown = [word.split("=")[0] for word in words[script + 1:]
                       if word.startswith("--") and word.split("=")[0] not in valid]
            assert not unknown, f"{page.name}: {command}\n  flags no parser takes: {unknown}"
            checked += 1
    assert checked >= 10


def test_every_flag_a_documented_trainer_ext_command_types_exists(known_flags, capsys):
    """`trainer-ext ds-config|plan|search|train` commands: their flags are the subcommand's, or (train, search) a
    task's."""
    from trainer_ext import cli

    helps = {}
    for command in ("ds-config", "plan", "search", "train"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        helps[command] = capsys.readouterr().out
    every_task = set().union(*known_flags.values())
    checked = 0
    for page in PAGES:
        for line in commands(page.read_text()):
            words = shlex.split(line)
            if "trainer-ext" not in words or words.index("trainer-ext") + 1 >= len(words):
                continue
            command = words[words.index("trainer-ext") + 1]
            if command not in helps:
                continue
            for word in words[words.index("trainer-ext") + 2:]:
                flag = word.split("=")[0]
                if not flag.startswith("--") or flag in ("--help",):
                    continue
                known = re.search(rf"(^|[\s,\[]){re.escape(flag)}\b", helps[command]) or (
                    command in ("train", "search") and flag in every_task)
                assert known, f"{page.name}: {line}\n  {flag} is not a flag of trainer-ext {command}"
            checked += 1
    assert checked >= 5


def test_the_package_is_laid_out_by_concern_as_contributing_says():
    """At most ten modules at the top of trainer_ext/ (the rest live in a folder named for their concern), and
    CONTRIBUTING's layout names every folder and module that exists, and none that does not."""
    package = REPO / "trainer_ext"
    top = sorted(path.name for path in package.glob("*.py"))
    assert len(top) <= 10, top
    text = (REPO / "CONTRIBUTING.md").read_text()
    layout = text[text.index("\ntrainer_ext/\n"):text.index("\nexamples/ ")]
    entries = set(re.findall(r"^ +([a-z_0-9]+(?:\.py|/)) ", layout, re.M))  # the first column
    named = entries | set(re.findall(r"\b([a-z_0-9]+\.py)\b", layout))
    present = {path.name for path in package.rglob("*.py") if "__pycache__" not in path.parts} \
        | {f"{path.name}/" for path in package.rglob("*") if path.is_dir() and (path / "__init__.py").exists()}
    present -= {"__init__.py", "__main__.py"} - named
    assert present - named == set(), "modules CONTRIBUTING's layout does not describe"
    stale = entries - present
    assert stale == set(), "names in CONTRIBUTING's layout that trainer_ext/ no longer has"
