#!/usr/bin/env python3
"""Run the breakages of tests/MUTATIONS.md (the data: tests/mutations.py) and say, for each,
whether the tests that promise to catch it do.

For each selected row: a scratch copy of the repository (``ftrun/`` with its built
``ftrun/_native``, ``tests/``, ``scripts/`` and what the tests read beside them) in a
temporary directory, the row's ``find`` replaced by its ``replace`` there, then its tests
run there (``python -m pytest -q -p no:cacheprovider --long -x <tests>``, cwd and
``PYTHONPATH`` the scratch copy: the tests find the repository from their own path,
tests/launch.py's ``REPO``, so the agents and workers they start import the mutant too).
The ``python`` is that of a virtual environment made in the copy (``.mutate-venv``: this
interpreter's packages, the copy's ``ftrun`` before them, never the installed one, and
this environment's scripts, ``ftrun`` among them, run by it), so a process a test starts
with a ``PYTHONPATH`` of its own, or none, imports the mutant as well.
The row is *caught* when a test failed, *MISSED* when they all passed. A row whose ``find``
does not occur exactly once in its file (the code changed since) is *stale*: said loudly,
with the row and the file, never run.

    python scripts/mutate.py --check-only              # every row's text and tests exist
    python scripts/mutate.py --id vote-first-decides   # one row (repeat --id for more)
    python scripts/mutate.py --sample 3 --seed 7       # three rows drawn with seed 7
    python scripts/mutate.py --list                    # the rows: id, file, tests
    python scripts/mutate.py --id ... --json           # and a JSON object, last
    python scripts/mutate.py --id ... --baseline       # its tests on an unchanged copy

Rows marked ``known_miss`` (the table records them as not caught, or caught only in some
runs) are reported as "missed (known)", never as a failure; they and rows marked ``unsafe``
are never drawn by ``--sample``. A row whose tests all skipped here (no root for network
namespaces, no etcd, ...) or that ran past ``--timeout`` is "not judged".

Exit status: 0 when every selected row was caught (with ``--check-only``: checks), 1 when
one was missed or is stale, 3 when none was but some were not judged, 2 on bad usage.
``--baseline`` runs the rows' tests on an unchanged scratch copy instead: they must pass
there, or a "caught" says nothing (exit 1 when one fails).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import functools
import json
import os
import random
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import time
import venv
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.mutations import MUTATIONS, Mutation  # noqa: E402

#: What a scratch copy holds: the package (with ftrun/_native, the built shim and its NCCL
#: test double, when there is one), the tests and the scripts they run, and what the tests
#: read beside them (the shim's C sources, the docs and man page, pytest's configuration).
COPIED = ("ftrun", "tests", "scripts", "csrc", "docs", "man", "pyproject.toml", "setup.py",
          "README.md", "MANIFEST.in")
IGNORED = shutil.ignore_patterns(".pytest_cache", "*.egg-info", ".ruff_cache")
#: The longest one row's tests may run (pytest's own per-test timeout applies inside it).
DEFAULT_TIMEOUT_S = 3600.0

CAUGHT, MISSED, KNOWN, STALE, UNJUDGED = "caught", "MISSED", "missed (known)", "STALE", \
    "not judged"
PASSES, FAILS = "passes", "FAILS"  # --baseline


@dataclasses.dataclass
class Outcome:
    mutation: Mutation
    status: str
    seconds: float = 0.0
    detail: str = ""


# --- checks (no test run) ------------------------------------------------------------------


def _defines(tree: ast.Module, names: Sequence[str]) -> bool:
    """Whether the module defines ``names`` (a function, or a class then its method)."""
    body: list[ast.stmt] = list(tree.body)
    for index, name in enumerate(names):
        last = index == len(names) - 1
        kinds = (ast.FunctionDef, ast.AsyncFunctionDef) if last else (ast.ClassDef,)
        found = next((n for n in body if isinstance(n, kinds) and n.name == name), None)
        if found is None:
            return False
        body = list(getattr(found, "body", []))
    return True


@functools.cache
def _parsed(file: Path) -> ast.Module | str:
    """A test file's syntax tree (once per file and run), or why it does not parse."""
    try:
        return ast.parse(file.read_text(), str(file))
    except SyntaxError as error:
        return str(error)


def node_problems(node_id: str, root: Path = REPO) -> list[str]:
    """Why the pytest node id ``node_id`` names no test in ``root`` ([] when it does: its
    file exists and defines its function; a parameter id is checked by pytest at the run)."""
    path, _, rest = node_id.partition("::")
    if not rest:
        return [f"{node_id}: not a node id (FILE::TEST)"]
    file = root / path
    if not file.is_file():
        return [f"{node_id}: no file {path}"]
    names = rest.split("[", 1)[0].split("::")
    tree = _parsed(file)
    if isinstance(tree, str):
        return [f"{node_id}: {path} does not parse ({tree})"]
    if not _defines(tree, names):
        return [f"{node_id}: {path} defines no {'::'.join(names)}"]
    return []


def mutated_text(mutation: Mutation, root: Path = REPO) -> tuple[str | None, list[str]]:
    """``mutation.file`` with the edit made, or None and why it cannot be made."""
    file = root / mutation.file
    if not file.is_file():
        return None, [f"{mutation.id}: no file {mutation.file}"]
    text = file.read_text()
    count = text.count(mutation.find) if mutation.find else 0
    if count != 1:
        return None, [f"{mutation.id}: its find text occurs {count} times in {mutation.file} "
                      "(exactly once required: the code changed; update the row)"]
    changed = text.replace(mutation.find, mutation.replace, 1)
    if file.suffix == ".py":
        try:
            compile(changed, str(file), "exec")
        except SyntaxError as error:
            return None, [f"{mutation.id}: the edit leaves {mutation.file} without valid "
                          f"syntax ({error.msg}, line {error.lineno})"]
    return changed, []


def problems(mutation: Mutation, root: Path = REPO) -> list[str]:
    """Why ``mutation`` cannot run as written ([] when it can): its text, its tests."""
    found = mutated_text(mutation, root)[1]
    if not mutation.tests:
        found.append(f"{mutation.id}: no tests")
    for node_id in mutation.tests:
        found += [f"{mutation.id}: {p}" for p in node_problems(node_id, root)]
    return found


def uncollected(mutations: Sequence[Mutation], root: Path = REPO) -> list[str]:
    """The rows' node ids that pytest does not collect (a parameter id that changed, too):
    one ``pytest --collect-only`` of their files, with the long tier."""
    ids = {t for m in mutations for t in m.tests}
    files = sorted({t.partition("::")[0] for t in ids if (root / t.partition("::")[0]).is_file()})
    if not files:
        return []
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "--long",
                          "-p", "no:cacheprovider", *files], cwd=root, capture_output=True,
                         text=True, check=False).stdout
    collected = {line.strip() for line in out.splitlines() if "::" in line}
    return [f"{m.id}: pytest collects no {t}" for m in mutations for t in m.tests
            if t not in collected]


def duplicate_ids(mutations: Iterable[Mutation]) -> list[str]:
    seen: set[str] = set()
    twice = []
    for m in mutations:
        if m.id in seen:
            twice.append(m.id)
        seen.add(m.id)
    return twice


# --- one run ---------------------------------------------------------------------------------


def scratch_copy(mutation: Mutation, into: Path, root: Path = REPO) -> None:
    """The repository's COPIED parts under ``into``, ``mutation`` applied (ValueError: the
    edit cannot be made)."""
    for name in COPIED:
        source = root / name
        if source.is_dir():
            shutil.copytree(source, into / name, ignore=IGNORED, symlinks=True)
        elif source.is_file():
            shutil.copy2(source, into / name)
    changed, why = mutated_text(mutation, root)
    if changed is None:
        raise ValueError("; ".join(why))
    (into / mutation.file).write_text(changed)


#: The scratch copy's virtual environment (see the module docstring), under the copy.
VENV = ".mutate-venv"


def scratch_venv(scratch: Path, python: str = sys.executable) -> Path:
    """A virtual environment at ``scratch/VENV`` whose interpreter imports ``ftrun`` from
    ``scratch`` whatever ``PYTHONPATH`` a process is given: a ``.pth`` of its own puts the
    copy on ``sys.path`` ahead of this interpreter's site-packages (whose ``.pth`` files come
    with them, but for an editable install's, which would map ``ftrun`` to the repository).
    The scripts beside ``python`` (``ftrun``, ``torchrun``, ``pytest``, ...) are copied with
    their ``#!`` naming the new interpreter; other programs there (``py-spy``) are linked.
    Its interpreter's path is returned."""
    home = scratch / VENV
    venv.EnvBuilder(symlinks=True, with_pip=False).create(home)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    ours = home / "lib" / version / "site-packages"
    lines = [str(scratch)]
    user = [site.getusersitepackages()] if site.ENABLE_USER_SITE else []
    for packages in [*site.getsitepackages(), *user]:
        where = Path(packages)
        if not where.is_dir() or where.resolve() == ours.resolve():
            continue
        lines.append(str(where))
        for pth in sorted(where.glob("*.pth")):
            if not pth.name.startswith("__editable__"):
                lines += [x for x in pth.read_text().splitlines()
                          if x.startswith(("import ", "import\t"))]
    (ours / "00-ftrun-mutate.pth").write_text("\n".join(lines) + "\n")
    new_python = home / "bin" / "python"
    bin_dir = Path(python).parent
    for source in sorted(bin_dir.iterdir()):
        target = home / "bin" / source.name
        if target.exists() or target.is_symlink() or not source.is_file():
            continue
        with source.open("rb") as f:
            first = f.readline()
        if first.startswith(b"#!") and str(bin_dir).encode() in first:
            rest = source.read_bytes().split(b"\n", 1)[1]
            target.write_bytes(f"#!{new_python}\n".encode() + rest)
            target.chmod(source.stat().st_mode & 0o777)
        else:
            target.symlink_to(source.resolve())
    return new_python


def _junit(path: Path) -> tuple[int, int, int, int, str]:
    """(tests, failures, errors, skipped, the first failure's test and message) of a
    junit report; all 0 when it was not written."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return 0, 0, 0, 0, ""
    totals = [0, 0, 0, 0]
    first = ""
    for suite in root.iter("testsuite"):
        for i, key in enumerate(("tests", "failures", "errors", "skipped")):
            totals[i] += int(suite.get(key, "0"))
    for case in root.iter("testcase"):
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None and not first:
            message = (bad.get("message") or "").strip().splitlines()
            first = f"{case.get('name')}: {message[0][:160] if message else bad.tag}"
    return totals[0], totals[1], totals[2], totals[3], first


def run_one(mutation: Mutation, *, timeout_s: float, keep: bool,
            pytest_args: Sequence[str] = (), baseline: bool = False) -> Outcome:
    """Make the scratch copy, run the row's tests there; the outcome (see the module).
    ``baseline``: the copy left unchanged (PASSES or FAILS)."""
    why = problems(mutation)
    if why:
        return Outcome(mutation, STALE, 0.0, "; ".join(why))
    row = mutation
    if baseline:
        mutation = dataclasses.replace(mutation, replace=mutation.find)
    scratch = Path(tempfile.mkdtemp(prefix=f"ftrun-mutate-{mutation.id}-"))
    # mkdtemp's 0700 would hide the copy from a test's process that runs as another user
    # (test_cli runs ftrun as nobody): Python would skip the PYTHONPATH entry and import
    # the installed package, the unchanged one, and the row would read as missed.
    scratch.chmod(0o755)
    started = time.monotonic()
    try:
        scratch_copy(mutation, scratch)
        report = scratch / ".mutate-junit.xml"
        log = scratch / ".mutate-pytest.log"
        python = scratch_venv(scratch)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(scratch), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
        env["PATH"] = os.pathsep.join([str(python.parent), env.get("PATH", "")])
        if "VIRTUAL_ENV" in env:
            env["VIRTUAL_ENV"] = str(python.parent.parent)
        argv = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--long", "-x",
                f"--junitxml={report}", *pytest_args, *mutation.tests]
        with log.open("w") as out:
            proc = subprocess.Popen(argv, cwd=scratch, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return Outcome(row, UNJUDGED, time.monotonic() - started,
                               f"its tests ran past {timeout_s:g} s" +
                               (f" (kept: {log})" if keep else ""))
        seconds = time.monotonic() - started
        tests, failures, errors, skipped, first = _junit(report)
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        where = f" (log: {log})" if keep else ""
        if failures or errors:
            kind = "failed" if failures else "errors, no failure"
            if mutation.known_miss and not baseline:
                kind += " (a known miss caught: its known_miss may go)"
            return Outcome(row, FAILS if baseline else CAUGHT, seconds, f"{kind}: {first}{where}")
        if rc in (4, 5):  # a usage error (no such test, a parameter id changed) or none collected
            return Outcome(row, STALE, seconds,
                           f"pytest ran none of its tests (exit {rc}): {tail[0][:200]}{where}")
        if tests == 0:  # no report: pytest itself died
            return Outcome(row, UNJUDGED, seconds,
                           f"pytest exit {rc} without a report: {tail[0][:200]}{where}")
        if rc != 0:
            return Outcome(row, UNJUDGED, seconds, f"pytest exit {rc}: {tail[0][:200]}{where}")
        if baseline and not skipped:
            return Outcome(row, PASSES, seconds, f"{tests} tests passed unchanged")
        if skipped:
            return Outcome(row, UNJUDGED, seconds,
                           f"{skipped} of {tests} tests skipped here, none failed: "
                           f"{tail[0][:200]}{where}")
        status = KNOWN if mutation.known_miss else MISSED
        detail = f"{tests} tests passed" + (f"; known: {mutation.known_miss}"
                                            if mutation.known_miss else "")
        return Outcome(row, status, seconds, detail + where)
    except ValueError as error:
        return Outcome(row, STALE, time.monotonic() - started, str(error))
    finally:
        if not keep:
            shutil.rmtree(scratch, ignore_errors=True)
        else:
            print(f"mutate: {mutation.id}: scratch copy kept at {scratch}", file=sys.stderr)


# --- the command -----------------------------------------------------------------------------


def select(ids: Sequence[str], sample: int | None, seed: int | None
           ) -> tuple[list[Mutation], int | None]:
    """The rows asked for (ValueError naming an unknown id), and the seed used to draw."""
    by_id = {m.id: m for m in MUTATIONS}
    unknown = [i for i in ids if i not in by_id]
    if unknown:
        close = {i: [m for m in by_id if i in m or m in i][:3] for i in unknown}
        raise ValueError("no such row: " + ", ".join(
            f"{i}" + (f" (did you mean {', '.join(c)}?)" if c else "") for i, c in close.items()))
    chosen = [by_id[i] for i in dict.fromkeys(ids)] if ids else list(MUTATIONS)
    if sample is None:
        return chosen, None
    pool = [m for m in chosen if not m.known_miss and not m.unsafe]
    seed = random.randrange(1 << 30) if seed is None else seed
    return random.Random(seed).sample(pool, min(sample, len(pool))), seed


def _table(outcomes: Sequence[Outcome]) -> str:
    width = max([len(o.mutation.id) for o in outcomes] + [2])
    lines = [f"{'id':<{width}}  {'result':<14} {'time':>7}  detail"]
    for o in outcomes:
        took = f"{o.seconds:6.1f}s" if o.seconds else "      -"
        lines.append(f"{o.mutation.id:<{width}}  {o.status:<14} {took}  {o.detail}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run tests/MUTATIONS.md's breakages (tests/mutations.py) against the tests "
                    "that promise to catch them.")
    parser.add_argument("--id", action="append", default=[], metavar="ID",
                        help="a row to run (repeat for more); default: every row")
    parser.add_argument("--sample", type=int, metavar="N",
                        help="draw N rows (never known misses or unsafe rows)")
    parser.add_argument("--seed", type=int, metavar="S", help="the seed of --sample's draw")
    parser.add_argument("--list", action="store_true", help="list the rows and exit")
    parser.add_argument("--check-only", action="store_true",
                        help="check that each row's text occurs exactly once and its tests "
                             "exist; run nothing")
    parser.add_argument("--collect", action="store_true",
                        help="with --check-only: also have pytest collect every node id "
                             "(parameter ids included; slower)")
    parser.add_argument("--json", action="store_true", help="end with one JSON object")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copies")
    parser.add_argument("--baseline", action="store_true",
                        help="run the rows' tests on an unchanged copy (they must pass)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help=f"the most one row's tests may run (default {DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("--pytest-arg", action="append", default=[], metavar="ARG",
                        help="an extra argument for pytest (repeat for more)")
    args = parser.parse_args(argv)
    if args.seed is not None and args.sample is None:
        parser.error("--seed draws for --sample")
    try:
        chosen, seed = select(args.id, args.sample, args.seed)
    except ValueError as error:
        parser.error(str(error))
    if seed is not None:
        print(f"mutate: {len(chosen)} rows drawn with --seed {seed}", file=sys.stderr)

    if args.list:
        for m in chosen:
            flags = " [known miss]" if m.known_miss else ""
            flags += " [unsafe]" if m.unsafe else ""
            print(f"{m.id}{flags}\n  {m.file}\n" + "".join(f"  {t}\n" for t in m.tests), end="")
        return 0

    outcomes: list[Outcome] = []
    twice = duplicate_ids(MUTATIONS)
    if args.check_only:
        late = uncollected(chosen) if args.collect else []
        for m in chosen:
            why = problems(m) + [w for w in late if w.startswith(f"{m.id}: ")]
            outcomes.append(Outcome(m, STALE if why else "ok", 0.0, "; ".join(why)))
            for line in why:
                print(f"mutate: STALE {line}", file=sys.stderr)
        stale = [o for o in outcomes if o.status == STALE]
        print("\n".join(o.detail for o in stale) or
              f"all {len(outcomes)} rows: the text occurs once, the tests exist")
    else:
        for m in chosen:
            print(f"mutate: {m.id}: {m.file}, {len(m.tests)} tests ...", file=sys.stderr,
                  flush=True)
            outcome = run_one(m, timeout_s=args.timeout, keep=args.keep,
                              pytest_args=args.pytest_arg, baseline=args.baseline)
            print(f"mutate: {m.id}: {outcome.status} in {outcome.seconds:.1f} s"
                  f"{': ' + outcome.detail if outcome.status != CAUGHT else ''}",
                  file=sys.stderr, flush=True)
            outcomes.append(outcome)
        print(_table(outcomes))
    for duplicate in twice:
        print(f"mutate: STALE: id {duplicate!r} is used by more than one row", file=sys.stderr)

    def named(status: str) -> list[str]:
        return [o.mutation.id for o in outcomes if o.status == status]
    result = {"checked": len(outcomes), "caught": named(CAUGHT), "missed": named(MISSED),
              "stale": named(STALE) + twice, "known_missed": named(KNOWN),
              "not_judged": named(UNJUDGED)}
    if args.baseline:
        result = {"checked": len(outcomes), "passes": named(PASSES), "fails": named(FAILS),
                  "stale": named(STALE) + twice, "not_judged": named(UNJUDGED)}
    if seed is not None:
        result["seed"] = seed
    if args.json:
        print(json.dumps(result))
    if result.get("missed") or result.get("fails") or result["stale"]:
        return 1
    return 3 if result["not_judged"] else 0


if __name__ == "__main__":
    sys.exit(main())
