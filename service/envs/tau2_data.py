"""What tau2-bench's data folder holds, read without importing tau2 (it imports litellm, ~2.5 s):
each domain's splits and their sizes, which splits cannot run and exactly which file they lack,
and which tasks need an LLM judge to be graded.

tau2 reads its data from `$TAU2_DATA_DIR/tau2/domains/<domain>/`; without TAU2_DATA_DIR, from the
`data` folder of its checkout (an editable install). The repository's snapshots can lack large
files (airline's db.json, telecom's tasks.json): the domain, or the splits that need them, are
then listed as unavailable, naming the file, rather than failing inside an episode.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

TAU2_DOMAINS = ("retail", "airline", "telecom", "mock")
# The files a domain's environment loads, whatever the split (tau2/domains/<domain>/utils.py).
DOMAIN_FILES: dict[str, tuple[str, ...]] = {
    "retail": ("db.json", "policy.md"),
    "airline": ("db.json", "policy.md"),
    "telecom": ("db.toml", "user_db.toml", "main_policy.md", "tech_support_manual.md"),
    "mock": ("db.json", "user_db.json", "policy.md"),
}
# The task file of a split: tasks.json, but for telecom's `small` split, which has its own.
SPLIT_TASK_FILES: dict[tuple[str, str], str] = {("telecom", "small"): "tasks_small.json"}
USER_SIMULATOR_FILES = (
    "tau2/user_simulator/simulation_guidelines.md",
    "tau2/user_simulator/simulation_guidelines_tools.md",
)
SPLITS_FILE = "split_tasks.json"
NL_ASSERTION = "NL_ASSERTION"


def tau2_installed() -> bool:
    """Whether tau2-bench's `tau2` package is importable (not PyPI's unrelated `tau2`), without
    importing it."""
    return _package_dir() is not None


def _package_dir() -> Path | None:
    spec = importlib.util.find_spec("tau2")
    if spec is None or spec.origin is None:
        return None
    package = Path(spec.origin).parent
    return package if (package / "registry.py").is_file() and (package / "domains").is_dir() else None


def data_dir() -> Path | None:
    """TAU2_DATA_DIR, else the `data` folder of the checkout tau2 was installed from (editable)."""
    if configured := os.environ.get("TAU2_DATA_DIR"):
        return Path(configured)
    package = _package_dir()
    return None if package is None else package.parents[1] / "data"


def split_task_file(domain: str, split: str) -> str:
    return SPLIT_TASK_FILES.get((domain, split), "tasks.json")


@dataclass(frozen=True)
class DomainData:
    """One domain as its data folder stands: its splits (by tau2's split_tasks.json, tasks in its
    order), and what keeps a split from running."""

    domain: str
    splits: dict[str, list[str]]  # split -> task ids, in the order task indexes address them
    unavailable: dict[str, str] = field(default_factory=dict)  # split -> why it cannot run
    judged: dict[str, frozenset[int]] = field(default_factory=dict)  # split -> tasks graded by an LLM judge


def read_domain(root: Path, domain: str) -> DomainData:
    folder = root / "tau2" / "domains" / domain
    splits_path = folder / SPLITS_FILE
    if not splits_path.is_file():
        return DomainData(domain, {}, {"*": _missing(splits_path, root)})
    splits: dict[str, list[str]] = orjson.loads(splits_path.read_bytes())
    missing = [folder / name for name in DOMAIN_FILES[domain]] + [
        root / name for name in USER_SIMULATOR_FILES
    ]
    whole = next((_missing(path, root) for path in missing if not path.is_file()), None)
    unavailable: dict[str, str] = {}
    judged: dict[str, frozenset[int]] = {}
    loaded: dict[str, dict[str, bool]] = {}  # task file -> task id -> graded by a judge
    for split, ids in splits.items():
        if whole is not None:
            unavailable[split] = whole
            continue
        task_file = folder / split_task_file(domain, split)
        if not task_file.is_file():
            unavailable[split] = _missing(task_file, root)
            continue
        if task_file.name not in loaded:
            loaded[task_file.name] = {
                task["id"]: _judged(task) for task in orjson.loads(task_file.read_bytes())
            }
        tasks = loaded[task_file.name]
        absent = [task_id for task_id in ids if task_id not in tasks]
        if absent:
            unavailable[split] = f"{len(absent)} of its tasks are not in {task_file} (first: {absent[0]!r})"
            continue
        judged[split] = frozenset(index for index, task_id in enumerate(ids) if tasks[task_id])
    return DomainData(domain, splits, unavailable, judged)


def read_tasks(root: Path, domain: str, split: str) -> list[dict[str, Any]]:
    """The split's tasks as tau2's JSON, in the order of its ids in split_tasks.json (task indexes
    address them). Raises ValueError for a split that cannot run, saying why."""
    data = read_domain(root, domain)
    if split not in data.splits:
        raise ValueError(f"tau2/{domain} has no split {split!r}; known: {sorted(data.splits)}")
    if (why := data.unavailable.get(split, data.unavailable.get("*"))) is not None:
        raise ValueError(why)
    path = root / "tau2" / "domains" / domain / split_task_file(domain, split)
    by_id = {task["id"]: task for task in orjson.loads(path.read_bytes())}
    return [by_id[task_id] for task_id in data.splits[split]]


def _judged(task: dict[str, object]) -> bool:
    """Whether tau2's evaluator asks an LLM judge about this task: NL_ASSERTION in its reward
    basis, with assertions to judge."""
    criteria = task.get("evaluation_criteria")
    if not isinstance(criteria, dict):
        return False
    return NL_ASSERTION in (criteria.get("reward_basis") or []) and bool(criteria.get("nl_assertions"))


def _missing(path: Path, root: Path) -> str:
    return (
        f"tau2's data file {path} is missing (TAU2_DATA_DIR={root}); a checkout of the tau2-bench "
        "repository that lacks it needs the file restored"
    )
