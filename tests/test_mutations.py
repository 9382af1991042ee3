"""tests/MUTATIONS.md stays executable: every row's breakage (tests/mutations.py) still
applies to today's source and names tests that exist (the default run, in process, a
second or two); and, in the long tier, a random sample of rows run through
scripts/mutate.py is caught (``FTRUN_MUTATION_SEED`` picks the sample)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.mutations import MUTATIONS, NOT_EXECUTABLE, Mutation

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "mutate.py"
#: The long tier's draw when FTRUN_MUTATION_SEED is not set.
DEFAULT_SEED = 20261203
SAMPLE = 3


def _mutate() -> ModuleType:
    """scripts/mutate.py, imported by path (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("mutate_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_row_applies_to_todays_source_and_names_tests_that_exist() -> None:
    """Each row's ``find`` occurs exactly once in its file (and the edit leaves valid
    Python), each of its tests is a function of a test file, and no id is used twice: what
    ``scripts/mutate.py --check-only`` says, without running anything."""
    mutate = _mutate()
    problems = [p for m in MUTATIONS for p in mutate.problems(m)]
    assert not problems, "\n".join(problems)
    assert not mutate.duplicate_ids(MUTATIONS)
    assert all(re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", m.id) for m in MUTATIONS)


def test_a_row_whose_text_is_gone_is_stale_naming_the_row_and_the_file() -> None:
    mutate = _mutate()
    gone = Mutation(id="gone", promise="", file="ftrun/cli.py", find="no such text at all",
                    replace="", tests=("tests/test_cli.py::test_unreadable_script",),
                    section="")
    assert mutate.problems(gone) == [
        "gone: its find text occurs 0 times in ftrun/cli.py (exactly once required: the "
        "code changed; update the row)"]
    twice = Mutation(id="twice", promise="", file="ftrun/cli.py", find="import",
                     replace="", tests=("tests/test_cli.py::test_no_such_test",), section="")
    found = mutate.problems(twice)
    assert found[0].startswith("twice: its find text occurs") and "ftrun/cli.py" in found[0]
    assert found[1] == ("twice: tests/test_cli.py::test_no_such_test: tests/test_cli.py "
                        "defines no test_no_such_test")
    broken = Mutation(id="broken", promise="", file="ftrun/exitcodes.py",
                      find="def for_signal(", replace="def for_signal((", tests=(),
                      section="")
    assert [p.split(" (")[0] for p in mutate.problems(broken)] == [
        "broken: the edit leaves ftrun/exitcodes.py without valid syntax", "broken: no tests"]


def test_the_table_and_the_data_name_the_same_rows() -> None:
    """tests/MUTATIONS.md's id column names every entry once, in the data's order, and a
    row without an id is one of the rows kept there alone (marked not executable)."""
    ids, unmarked = [], []
    for line in (REPO / "tests" / "MUTATIONS.md").read_text().splitlines():
        if not line.startswith("| ") or line.startswith(("| id ", "|---")):
            continue
        first = line.split(" | ", 1)[0].removeprefix("| ").strip()
        if first.startswith("`") and first.endswith("`"):
            ids.append(first.strip("`"))
        elif "not executable" not in line:
            unmarked.append(line[:100])
    assert ids == [m.id for m in MUTATIONS]
    assert not unmarked, unmarked
    text = (REPO / "tests" / "MUTATIONS.md").read_text()
    assert all(promise in text for promise in NOT_EXECUTABLE)


@pytest.mark.long
@pytest.mark.timeout(3600)
def test_a_random_sample_of_the_breakages_is_caught() -> None:
    """Three rows drawn with ``FTRUN_MUTATION_SEED`` (default 20261203; known misses and
    rows that act on this machine are never drawn), each run by scripts/mutate.py in a
    scratch copy: each must be caught. Rows whose tests all skip here (no root for network
    namespaces, no etcd) cannot be judged: the test then skips, after the others."""
    seed = int(os.environ.get("FTRUN_MUTATION_SEED", DEFAULT_SEED))
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--sample", str(SAMPLE), "--seed", str(seed),
         "--timeout", "1100", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=3500, check=False)
    print(result.stderr[-4000:], result.stdout, sep="\n")
    report = json.loads(result.stdout.strip().splitlines()[-1])
    table = result.stdout.rsplit("\n", 2)[0]
    assert report["checked"] == SAMPLE, table
    assert not report["missed"] and not report["stale"], \
        f"FTRUN_MUTATION_SEED={seed}:\n{table}"
    if report["not_judged"]:
        pytest.skip(f"FTRUN_MUTATION_SEED={seed}: caught {report['caught']}, not judged here "
                    f"{report['not_judged']}:\n{table}")
    assert len(report["caught"]) == SAMPLE, table


def test_a_scratch_copy_s_interpreter_imports_its_ftrun_whatever_the_pythonpath(
        tmp_path: Path) -> None:
    """The scratch copy's virtual environment (``scratch_venv``) imports ``ftrun`` from the
    copy, also in a process started with a ``PYTHONPATH`` of its own or with none (the
    tests of ``ftrun status`` and of the exit hook start ``ftrun`` that way), and its
    ``ftrun`` script runs that interpreter: a mutant is never hidden by the installed
    package."""
    mutate = _mutate()
    (tmp_path / "ftrun").mkdir()
    (tmp_path / "ftrun" / "__init__.py").write_text("SCRATCH = True\n")
    python = mutate.scratch_venv(tmp_path)
    assert python.parent.parent == tmp_path / mutate.VENV
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for env in ({"PYTHONPATH": str(elsewhere)}, {}):
        done = subprocess.run(
            [str(python), "-c", "import ftrun, sys; print(ftrun.__file__, ftrun.SCRATCH)"],
            cwd=elsewhere, env={"PATH": "/usr/bin:/bin", **env}, capture_output=True,
            text=True, timeout=60, check=False)
        assert done.stdout.split() == [str(tmp_path / "ftrun" / "__init__.py"), "True"], done
    if (Path(sys.executable).parent / "ftrun").is_file():
        first = (python.parent / "ftrun").read_text().splitlines()[0]
        assert first == f"#!{python}"
