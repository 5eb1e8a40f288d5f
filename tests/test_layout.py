"""The packages' layering: the import-linter contracts in pyproject.toml ([tool.importlinter], run
by `make lint` as lint-imports) hold, function-level imports included, and they fail when an import
runs the wrong way; the client imports nothing of the service's."""

from __future__ import annotations

import configparser
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import grimp
import pytest

import service

PACKAGE_DIR = Path(service.__file__).parent
ROOT = PACKAGE_DIR.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def contracts() -> list[dict[str, Any]]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    found: list[dict[str, Any]] = pyproject["tool"]["importlinter"]["contracts"]
    return found


def lint_imports(config: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(cwd), "COLUMNS": "200"}  # no wrapped names
    command = [str(LINT_IMPORTS), str(config), "--no-cache"]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, check=False)


def test_the_import_graph_has_no_cycles() -> None:
    graph = grimp.build_graph("service")
    assert "service.records" in graph.modules
    assert "service.records" in graph.find_modules_directly_imported_by("service.storage.queue")
    assert {contract["type"] for contract in contracts()} >= {"layers", "acyclic_siblings"}
    result = lint_imports(ROOT / "pyproject.toml", ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Contracts: {len(contracts())} kept, 0 broken." in result.stdout


# --- The contracts catch what they are for, on a stand-in package with the same module names -------

STAND_IN = "standin"


def stand_in_name(name: str) -> str:
    return STAND_IN + name.removeprefix("service") if name.split(".")[0] == "service" else name


def named_modules(contract: dict[str, Any]) -> set[str]:
    """Every module the contract names, as a full name under the stand-in package."""
    names: set[str] = set()
    for layer in contract.get("layers", []):
        for tail in layer.replace(":", "|").split("|"):
            names |= {f"{container}.{tail.strip().strip('()')}" for container in contract["containers"]}
    names |= {f"{container}.{tail}" for container in contract.get("containers", [])
              for tail in contract.get("exhaustive_ignores", [])}  # fmt: skip
    for key in ("source_modules", "forbidden_modules", "modules"):
        names |= set(contract.get(key, []))
    return {stand_in_name(name) for name in names}


def write_stand_in(root: Path, imports: dict[str, str]) -> Path:
    """A package `standin` with a module for every name the contracts use, importing nothing but
    `imports` (module -> the module it imports inside a function), and the contracts for it."""
    config = configparser.ConfigParser()
    config["importlinter"] = {"root_packages": "\n" + STAND_IN}
    modules = {STAND_IN}
    for number, contract in enumerate(contracts(), 1):
        modules |= named_modules(contract)
        section: dict[str, str] = {}
        for key, value in contract.items():
            if key == "ignore_imports":  # the stand-in has none of the imports they name
                continue
            if isinstance(value, list):
                section[key] = "\n" + "\n".join(stand_in_name(item) for item in value)
            else:
                section[key] = str(value)
        config[f"importlinter:contract:{number}"] = section
    modules |= set(imports) | set(imports.values())
    for name in sorted(modules):
        path = root.joinpath(*name.split("."), "__init__.py")
        path.parent.mkdir(parents=True, exist_ok=True)
        imported = imports.get(name)
        path.write_text(f"def later() -> None:\n    import {imported}  # noqa\n" if imported else "")
    with (root / ".importlinter").open("w") as file:
        config.write(file)
    return root / ".importlinter"


def test_the_stand_in_keeps_every_contract(tmp_path: Path) -> None:
    result = lint_imports(write_stand_in(tmp_path, {}), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("imports", "broken"),
    [
        pytest.param({"standin.records": "standin.storage"}, "Layers", id="records-imports-storage"),
        pytest.param({"standin.storage": "standin.loop"}, "Layers", id="storage-imports-the-loop"),
        pytest.param({"standin.engine": "standin.envs"}, "Layers", id="engine-imports-envs"),
        pytest.param({"standin.api": "standin.app"}, "Layers", id="api-imports-the-app"),
        pytest.param({"standin.api": "standin.sim"}, "simulated", id="api-imports-the-simulator"),
        pytest.param(
            {"standin.storage.queue": "standin.storage.db", "standin.storage.db": "standin.storage.queue"},
            "cycles", id="a-cycle-inside-storage",
        ),
    ],
)  # fmt: skip
def test_the_contracts_fail_when_an_import_runs_the_wrong_way(
    tmp_path: Path, imports: dict[str, str], broken: str
) -> None:
    result = lint_imports(write_stand_in(tmp_path, imports), tmp_path)
    assert result.returncode != 0, result.stdout
    assert "1 broken" in result.stdout, result.stdout
    broken_line = next(line for line in result.stdout.splitlines() if line.endswith("BROKEN"))
    assert broken in broken_line, result.stdout


def test_the_core_imports_nothing_of_the_service() -> None:
    graph = grimp.build_graph("service")
    assert graph.find_modules_directly_imported_by("service.records") == set()


ADAPTERS = ["slime", "verl", "trl", "skyrl", "areal", "openrlhf"]


def test_the_client_stands_alone() -> None:
    """rollout_client goes into a trainer's environment: it pulls in no part of the service, no web
    framework, database or tokenizer, and its package asks for httpx, pyarrow and numpy only."""
    heavy = ["service", "fastapi", "sqlalchemy", "transformers", "torch", "tau_bench", "uvicorn"]
    heavy += ["slime", "verl", "trl", "skyrl", "areal", "openrlhf"]  # the trainers: imported when used
    check = (
        "import sys, rollout_client, rollout_client.slime, rollout_client.verl, rollout_client.trl, "
        "rollout_client.skyrl, rollout_client.areal, rollout_client.openrlhf; "
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({heavy!r})))"
    )
    loaded = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"
    pyproject = tomllib.loads((PACKAGE_DIR.parent / "client" / "pyproject.toml").read_text())
    names = {requirement.split(">")[0].split("=")[0] for requirement in pyproject["project"]["dependencies"]}
    assert names == {"httpx", "pyarrow", "numpy"}


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_each_trainer_adapter_imports_alone(adapter: str) -> None:
    """A trainer's environment installs the client and uses one adapter: it loads no other."""
    check = f"import sys, rollout_client.{adapter}; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    others = {f"rollout_client.{other}" for other in ADAPTERS if other != adapter}
    assert not others & set(loaded.stdout.split()), loaded.stdout


# --- The layout (docs/reference/layout.md) ---------------------------------------------------------

LAYOUT_PAGE = ROOT / "docs" / "reference" / "layout.md"


def layout_entries() -> list[tuple[str, str]]:
    """(entry, its description) per entry of the layout page's block, an entry indented under a
    folder as `<folder>/<name>`."""
    page = LAYOUT_PAGE.read_text(encoding="utf-8")
    block = page.split("\n```\n", 1)[1].split("```\n", 1)[0]
    entries: list[tuple[str, str]] = []
    folder = ""
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip())
        name, _, description = line.strip().partition(" ")
        if indent == 0:
            entries.append((name, description))
            folder = name
        elif indent == 2:
            entries.append((folder + name, description))
        else:  # a description's continuation
            entry, text = entries[-1]
            entries[-1] = (entry, f"{text} {line.strip()}")
    return entries


def test_the_layout_page_matches_the_tree() -> None:
    entries = layout_entries()
    for entry, description in entries:
        assert (ROOT / entry).exists(), f"the layout page names {entry}, which is not in the tree"
        folder = ROOT / entry if entry.endswith("/") else (ROOT / entry).parent
        for named in re.findall(r"\b[\w/]+\.py\b", description):
            where = folder.relative_to(ROOT)
            assert (folder / named).exists(), f"the layout page puts {named} in {where}"
    service_text = " ".join(f"{entry} {text}" for entry, text in entries if entry.startswith("service/"))
    for path in PACKAGE_DIR.iterdir():
        name = path.name + "/" if path.is_dir() else path.name
        if name in {"__init__.py", "__pycache__/"} or not (path.is_dir() or name.endswith(".py")):
            continue
        named = re.search(rf"(^|[\s(/]){re.escape(name)}", service_text)
        assert named, f"the layout page lacks service/{name}"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    folders = {line.split("/")[0] + "/" for line in tracked.stdout.splitlines() if "/" in line[1:]}
    assert folders - {".ci/"} <= {entry for entry, _ in entries}, "the layout page lacks a folder"
