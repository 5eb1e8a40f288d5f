"""What the service checks of every environment's answers before it uses or stores them: their
types, and that `info` and transcripts are JSON it can store on every database (Unicode text, finite
numbers, string keys, bounded depth). Runs in the env worker, so a bad answer fails its own call."""

from __future__ import annotations

import math
from typing import Any

from service.envs.base import Reset, Step
from service.text import plain_json, unstorable

MAX_INFO_DEPTH = 32  # nesting of info and transcript values: objects and arrays


class EnvProtocolError(TypeError):
    """An environment answered something the service cannot use or store (a wrong type, a NaN
    reward, an `info` that is not JSON): the episode's env call fails with this message."""


def json_problem(value: Any, where: str, depth: int = 1) -> str | None:
    """Why `value` is not storable JSON, naming the first offending place; None if it is."""
    # The fast way to the common answer, "nothing wrong", asked at every env call and every env's
    # start: 12.5 us for builtin/shop's tools (1.8 KB, 159 values), where the walk naming the place
    # (building it at every step, as it did then) took 124 us.
    if plain_json(value, MAX_INFO_DEPTH - depth + 1, json_types_only=True):
        return None
    found = _first_problem(value, depth)
    if found is None:
        return None
    problem, path = found
    return f"{where}{''.join(reversed(path))} {problem}"


def _first_problem(value: Any, depth: int) -> tuple[str, list[str]] | None:
    """The first problem in `value` and the path to it, innermost step first (built on the way out,
    for a value that has one). Taken when the fast way found something, or a subclass of a JSON
    type, which this accepts as json.dumps writes it."""
    if value is None or isinstance(value, bool | int):
        return None
    if isinstance(value, str):
        if (bad := unstorable(value, column=False)) is None:
            return None
        return f"holds a lone surrogate \\u{ord(bad[2]):04x} (not Unicode text)", []
    if isinstance(value, float):
        return None if math.isfinite(value) else (f"is {value!r}: only finite numbers are stored", [])
    if isinstance(value, dict | list | tuple):
        if depth > MAX_INFO_DEPTH:
            return f"is nested deeper than {MAX_INFO_DEPTH} levels", []
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    return f"has a key {key!r} of type {type(key).__name__}: JSON keys are strings", []
                if (found := _first_problem(key, depth)) is not None:
                    found[1].append(f" key {key!r}")
                    return found
                if (found := _first_problem(item, depth + 1)) is not None:
                    found[1].append(f"[{key!r}]")
                    return found
            return None
        for index, item in enumerate(value):
            if (found := _first_problem(item, depth + 1)) is not None:
                found[1].append(f"[{index}]")
                return found
        return None
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    return f"is a {kind}, not JSON (it is pickled to the service and stored as JSON)", []


def _check_common(value: Reset | Step, what: str) -> None:
    if not isinstance(value.observation, str):
        raise EnvProtocolError(f"{what}.observation must be a str, not {type(value.observation).__name__}")
    if (problem := json_problem(value.observation, f"{what}.observation")) is not None:
        raise EnvProtocolError(problem)
    if not isinstance(value.info, dict):
        raise EnvProtocolError(f"{what}.info must be a dict, not {type(value.info).__name__}")
    if not isinstance(value.transcript, list) or not all(isinstance(m, dict) for m in value.transcript):
        raise EnvProtocolError(f"{what}.transcript must be a list of message dicts")
    for field in ("info", "transcript"):
        if (problem := json_problem(getattr(value, field), f"{what}.{field}")) is not None:
            raise EnvProtocolError(f"unstorable {field}: {problem}")


def check_reset(value: object) -> Reset:
    """`value` if it is a Reset the service can use and store; else EnvProtocolError."""
    if not isinstance(value, Reset):
        raise EnvProtocolError(f"reset() must return a Reset, not {type(value).__name__}")
    _check_common(value, "reset()")
    return value


def check_step(value: object) -> Step:
    """`value` if it is a Step the service can use and store; else EnvProtocolError."""
    if not isinstance(value, Step):
        raise EnvProtocolError(f"step() must return a Step, not {type(value).__name__}")
    reward = value.reward
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise EnvProtocolError(f"step().reward must be a finite number, not {reward!r}")
    if not isinstance(value.done, bool):
        raise EnvProtocolError(f"step().done must be a bool, not {type(value.done).__name__}")
    _check_common(value, "step()")
    return value


def check_tools(system_prompt: object, tools: object) -> None:
    """An environment's `system_prompt` (str) and `tools` (OpenAI function schemas)."""
    if not isinstance(system_prompt, str):
        raise EnvProtocolError(f"system_prompt must be a str, not {type(system_prompt).__name__}")
    if not isinstance(tools, list):
        raise EnvProtocolError(f"tools must be a list of OpenAI function schemas, not {type(tools).__name__}")
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise EnvProtocolError(
                f"tools[{index}] is not an OpenAI function schema "
                '({"type": "function", "function": {"name": ..., "parameters": {...}}})'
            )
    if (problem := json_problem(tools, "tools")) is not None:
        raise EnvProtocolError(problem)
