"""The package's shape, as docs/architecture.md draws it: no import cycle anywhere, and the
worker side (what every training process imports) never reaches the agent's modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.launch import REPO

PACKAGE = REPO / "ftrun"
# What a training process may import of ftrun: the API, the contract, the control plane.
WORKER_SIDE = ("ftrun.worker", "ftrun.protocol", "ftrun.control")
AGENT_SIDE = ("ftrun.agent", "ftrun.shim", "ftrun.doctor", "ftrun.cli", "ftrun.config",
              "ftrun.host", "ftrun.client", "ftrun.observe", "ftrun.report")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """Every ftrun module and the ftrun modules it imports (anywhere in the file, including
    imports for type checking and inside functions)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level
                                                      + 1] + ([base] if base else []))
                targets.add(base)
                targets.update(f"{base}.{alias.name}" for alias in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph[node])
    return seen


def _is_package_init(name: str) -> bool:
    return (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    # A package's __init__ that re-exports its modules is not a cycle with them.
    for name in graph:
        if _is_package_init(name):
            graph[name] = {t for t in graph[name] if not t.startswith(name + ".")}
    assert _cycles(graph) == []


def test_the_graph_sees_a_cycle_when_there_is_one() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_worker_side_imports_nothing_of_the_agent_side() -> None:
    graph = import_graph()
    reached = set().union(*(_reach(graph, m) for m in graph if m.startswith(WORKER_SIDE)))
    assert sorted(m for m in reached if m.startswith(AGENT_SIDE)) == []


def test_a_training_process_loads_no_agent_module() -> None:
    code = ("import sys, ftrun, ftrun.worker; ftrun.init; "
            "print(sorted(m for m in sys.modules if m.startswith('ftrun.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=REPO, check=True).stdout
    loaded = eval(out)  # a list of strings printed by the line above
    assert any(m.startswith("ftrun.worker") for m in loaded)
    assert [m for m in loaded if m.startswith(AGENT_SIDE)] == []


def test_the_client_commands_and_the_exit_hook_import_neither_torch_nor_the_agent() -> None:
    """``ftrun status`` and ``ftrun inject`` answer in a fraction of a second, and the exit
    hook runs inside every worker of an unmodified script: none of them may pull in torch
    (~2 s of CPU) or the agent's modules."""
    modules = ["ftrun.client.status", "ftrun.client.inject", "ftrun.client.jobref",
               "ftrun.client.faultspec", "ftrun.exithook"]
    probe = ("import importlib, json, sys\n"
             f"for name in {modules!r}: importlib.import_module(name)\n"
             "print(json.dumps(sorted(m for m in sys.modules if m == 'torch' "
             "or m.startswith('ftrun.agent'))))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          cwd=REPO, timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout
