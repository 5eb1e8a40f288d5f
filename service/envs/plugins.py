"""Environment plugins: packages' entry points (group `rollout_service.envs`) and `module:function`
loaders (the ENV_PLUGINS setting), each a function returning EnvSpecs.

A plugin that fails to import, raises, or returns an invalid spec never stops the service: it is
listed unavailable (`unavailable["*"]`), with its error, which a submit to it answers as a 422.
"""

from __future__ import annotations

import functools
import importlib
import logging
import pickle
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from importlib.metadata import entry_points
from typing import Any

from service.envs.api import ENTRY_POINT_GROUP
from service.envs.base import SUPPORTED_PROTOCOLS, EnvSpec, UserSimConfig

logger = logging.getLogger(__name__)

MAX_ENV_NAME_CHARS = 128  # the episodes table's env column
RESERVED_NAMES = frozenset({"external"})  # external agents' env (records.EXTERNAL_ENV)


@dataclass(frozen=True)
class PluginSource:
    name: str  # the entry point's name, or the loader's `module:function`
    label: str  # where it comes from, for GET /envs and logs
    load: Callable[[], Any]  # imports the plugin: its function returning EnvSpecs


def entry_point_sources() -> list[PluginSource]:
    """The installed packages' entry points of ENTRY_POINT_GROUP, by name."""
    sources = []
    for point in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda point: point.name):
        dist = point.dist
        owner = f" ({dist.name} {dist.version})" if dist is not None else ""
        sources.append(PluginSource(point.name, f"entry point {point.name}{owner}", point.load))
    return sources


def loader_sources(loaders: Sequence[str]) -> list[PluginSource]:
    """`module:function` loaders (the ENV_PLUGINS setting), in order."""
    return [
        PluginSource(text, f"ENV_PLUGINS {text}", functools.partial(load_function, text)) for text in loaders
    ]


def load_function(text: str) -> Any:
    """The object `module:attribute` (or `module:a.b`) names, importing its module."""
    module_name, colon, attribute = text.strip().partition(":")
    if not colon or not module_name or not attribute:
        raise ValueError(f"{text!r} is not module:function")
    found: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        found = getattr(found, part)
    return found


def refuse(error: str, split: str, user_sim: UserSimConfig) -> Any:
    """The factory of a plugin's entry that cannot run (submits are refused before it is used)."""
    raise RuntimeError(error)


def failed_entry(name: str, label: str, error: str) -> EnvSpec:
    return EnvSpec(
        name=name,
        splits={},
        description=f"A plugin environment that cannot run here ({label}).",
        factory=functools.partial(refuse, error),
        unavailable={"*": error},
        source=label,
    )


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def spec_problem(spec: object) -> str | None:
    """Why `spec` is not a valid EnvSpec; None if it is."""
    if not isinstance(spec, EnvSpec):
        return f"not an EnvSpec: {type(spec).__module__}.{type(spec).__qualname__}"
    if not isinstance(spec.name, str) or not spec.name.strip() or len(spec.name) > MAX_ENV_NAME_CHARS:
        return f"name must be a non-empty str of at most {MAX_ENV_NAME_CHARS} characters: {spec.name!r}"
    if spec.name in RESERVED_NAMES:
        return f"the name {spec.name!r} is reserved"
    if spec.protocol not in SUPPORTED_PROTOCOLS:
        return (
            f"written for env protocol {spec.protocol!r}; this service speaks {sorted(SUPPORTED_PROTOCOLS)}"
        )
    if not isinstance(spec.description, str):
        return "description must be a str"
    splits_ok = isinstance(spec.splits, dict) and all(
        isinstance(split, str) and isinstance(size, int) and not isinstance(size, bool) and size >= 0
        for split, size in spec.splits.items()
    )
    if not splits_ok:
        return f"splits must map split names to task counts (int >= 0): {spec.splits!r}"
    if not isinstance(spec.unavailable, dict) or not isinstance(spec.judged_tasks, dict):
        return "unavailable and judged_tasks must be dicts"
    if spec.train_split is not None and spec.train_split not in spec.splits:
        return f"train_split {spec.train_split!r} is not one of its splits {sorted(spec.splits)}"
    if not callable(spec.factory):
        return "factory must be callable: (split, user_sim) -> Environment"
    try:
        pickle.dumps(spec.factory)
    except Exception as exc:  # pickling may raise anything
        return (
            "factory must pickle (a module-level function, or functools.partial of one): it is sent "
            f"to the env worker processes: {describe(exc)}"
        )
    return None


def add_plugins(catalog: dict[str, EnvSpec], sources: Iterable[PluginSource]) -> None:
    """Adds each source's specs to `catalog`; a source or spec that fails is added unavailable."""
    for source in sources:
        try:
            loader = source.load()
            if not callable(loader):
                raise TypeError(f"{type(loader).__name__} is not callable: the plugin must name a function")
            specs = list(loader())
        except Exception as exc:  # a plugin's import or loader may raise anything: listed, not raised
            _add_failure(catalog, source.name, source.label, describe(exc))
            continue
        for spec in specs:
            problem = spec_problem(spec)
            if problem is not None:
                named = isinstance(spec, EnvSpec) and isinstance(spec.name, str) and spec.name.strip()
                name = spec.name if named and len(spec.name) <= MAX_ENV_NAME_CHARS else source.name
                if name in RESERVED_NAMES:
                    name = source.name
                _add_failure(catalog, name, source.label, f"invalid EnvSpec: {problem}")
                continue
            assert isinstance(spec, EnvSpec)
            if spec.name in catalog:
                _add_failure(
                    catalog,
                    source.name,
                    source.label,
                    f"env {spec.name!r} is already defined ({catalog[spec.name].source})",
                )
                continue
            catalog[spec.name] = replace(spec, source=source.label)


def _add_failure(catalog: dict[str, EnvSpec], name: str, label: str, error: str) -> None:
    logger.error("env plugin %s: %s", label, error)
    if name in catalog and "*" not in catalog[name].unavailable:
        name = f"{name} ({label})"  # never shadows a working env
    previous = catalog.get(name)
    if previous is not None:
        error = f"{previous.unavailable['*']}; {error}"
    catalog[name] = failed_entry(name, label, error)


def failed_plugin_for(catalog: dict[str, EnvSpec], env_name: str) -> EnvSpec | None:
    """The unavailable plugin entry an unknown env name belongs to (`<plugin name>/...`), if any:
    a plugin that failed to load lists its own name, not its environments'."""
    for name, spec in catalog.items():
        if "*" in spec.unavailable and env_name.startswith(f"{name}/"):
            return spec
    return None
