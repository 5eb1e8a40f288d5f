"""The packages' layering: no module of `service` imports one that imports it back, even lazily;
the client imports nothing of the service's."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import service

PACKAGE_DIR = Path(service.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def service_imports(path: Path, modules: set[str]) -> set[str]:
    """The service modules `path` imports anywhere in its body (function-level imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from service.storage import queue` imports the module service.storage.queue.
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        found.update(name for name in names if name in modules)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(path): path for path in PACKAGE_DIR.rglob("*.py")}
    modules = set(paths)
    return {name: service_imports(path, modules) - {name} for name, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_import_graph_has_no_cycles() -> None:
    graph = import_graph()
    assert "service.records" in graph and graph["service.storage.queue"] >= {"service.records"}
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_core_imports_nothing_of_the_service() -> None:
    assert import_graph()["service.records"] == set()


def test_the_client_stands_alone() -> None:
    """rollout_client goes into a trainer's environment: it pulls in no part of the service, no web
    framework, database or tokenizer, and its package asks for httpx, pyarrow and numpy only."""
    heavy = ["service", "fastapi", "sqlalchemy", "transformers", "torch", "tau_bench", "uvicorn"]
    check = (
        "import sys, rollout_client, rollout_client.slime; "
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({heavy!r})))"
    )
    loaded = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"
    pyproject = tomllib.loads((PACKAGE_DIR.parent / "client" / "pyproject.toml").read_text())
    names = {requirement.split(">")[0].split("=")[0] for requirement in pyproject["project"]["dependencies"]}
    assert names == {"httpx", "pyarrow", "numpy"}
