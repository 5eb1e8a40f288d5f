"""The environment protocol every domain implements (built-in, tau-bench, ...)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

RESPOND_ACTION_NAME = "respond"


@dataclass(frozen=True)
class Action:
    """One agent action: a tool call, or `respond` with kwargs {"content": text}."""

    name: str
    kwargs: dict[str, Any]


@dataclass
class Reset:
    observation: str
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Step:
    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


class Environment(Protocol):
    """One episode's environment. Not thread-safe; lives in one env worker for its lifetime.

    `system_prompt` and `tools` (OpenAI function schemas) are what the policy is shown.
    `info` from reset/step is for the trainer's records (ground truth included) and never
    reaches the policy.
    """

    system_prompt: str
    tools: list[dict[str, Any]]

    def reset(self, task_index: int) -> Reset: ...

    def step(self, action: Action) -> Step: ...


@dataclass(frozen=True)
class UserSimConfig:
    """Where LLM-driven user simulators (tau-bench) send their turns: an OpenAI-compatible API."""

    base_url: str = ""
    model: str = ""
    api_key: str = ""
    temperature: float = 0.0
    seed: int | None = None


@dataclass(frozen=True)
class EnvSpec:
    """A named environment as listed by GET /envs."""

    name: str
    splits: dict[str, int]  # split -> number of tasks
    description: str
    # Builds a fresh Environment for one episode of the given split; runs in the env worker.
    # Must be picklable (a module-level function) and cheap: no LLM call at construction.
    factory: Callable[[str, UserSimConfig], Environment]
