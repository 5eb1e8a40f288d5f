"""The environment protocol every domain implements (built-in, tau-bench, plugins). Env authors
import it from `service.envs.api`, its public face."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, SecretStr

RESPOND_ACTION_NAME = "respond"
# The version of this protocol (Environment, Reset, Step, EnvSpec). A spec declares the version it
# was written for; the registry refuses a spec of a version this service does not speak.
PROTOCOL_VERSION = 1
SUPPORTED_PROTOCOLS = frozenset({1})


@dataclass(frozen=True)
class Action:
    """One agent action: a tool call, or `respond` with kwargs {"content": text}."""

    name: str
    kwargs: dict[str, Any]


@dataclass
class Reset:
    observation: str
    info: dict[str, Any] = field(default_factory=dict)
    # What happened in the environment's own turn that the policy does not see (a simulated user's
    # tool calls and their results, marked `"env_only": True`): the episode's transcript shows it
    # before the observation; the prompt never holds it.
    transcript: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Step:
    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)
    transcript: list[dict[str, Any]] = field(default_factory=list)  # as Reset's


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


class UserSimConfig(BaseModel):
    """Where LLM-driven user simulators (tau-bench, tau2) send their turns, and where an LLM judge
    of the reward (tau2's NL_ASSERTION) is asked: OpenAI-compatible APIs. Each field's alias is the
    environment variable it is set by (service.config reads them: USER_SIM_*, JUDGE_*)."""

    model_config = ConfigDict(frozen=True, validate_by_name=True, validate_by_alias=True)

    base_url: str = Field(
        default="",
        validation_alias="user_sim_base_url",
        description="OpenAI-compatible base URL, e.g. http://h:30000/v1.",
    )
    model: str = Field(
        default="", validation_alias="user_sim_model", description="Model name sent to the user simulator."
    )
    api_key: SecretStr = Field(
        default=SecretStr(""),
        validation_alias="user_sim_api_key",
        description="Bearer key of the user simulator endpoint.",
    )
    temperature: float = Field(
        default=0.0,
        ge=0,
        validation_alias="user_sim_temperature",
        description="Temperature of every user turn.",
    )
    seed: int | None = Field(
        default=None,
        validation_alias="user_sim_seed",
        description="Seed sent with every user-simulator call.",
    )
    # The LLM judge of rewards that need one (tau2's NL_ASSERTION: 40 of retail's 114 tasks).
    judge_base_url: str = Field(
        default="",
        validation_alias="judge_base_url",
        description="OpenAI-compatible base URL of the reward's LLM judge; empty: tasks that need one "
        "are refused at submit (422).",
    )
    judge_model: str = Field(
        default="", validation_alias="judge_model", description="Model name sent to the judge."
    )
    judge_api_key: SecretStr = Field(
        default=SecretStr(""),
        validation_alias="judge_api_key",
        description="Bearer key of the judge endpoint.",
    )


@dataclass(frozen=True)
class DriveRequest:
    """One episode handed to an agent-driven env's driver (EnvSpec.driver): where its model is,
    the episode's own OpenAI endpoint (`OpenAI(base_url=base_url, api_key=api_key)`: every call is
    recorded with exact tokens, resumed across weight updates and bounded by its limits), and
    which task it plays."""

    base_url: str
    api_key: str
    task_split: str
    task_index: int
    max_turns: int
    episode_key: str  # "<episode id>:<attempt>"


@dataclass(frozen=True)
class DriveOutcome:
    """How a driven episode ended: its reward with its components in `info` (JSON), or an error
    (the episode then ends `aborted` if `env_error`, the env's own failure, else `failed`: never a
    reward of 0)."""

    reward: float | None
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    env_error: bool = True  # the env's own fault (aborted) rather than infrastructure's (failed)
    truncated: bool = False  # it stopped at a limit (turns, tokens, time): ends `truncated`


@dataclass(frozen=True)
class EnvSpec:
    """A named environment as listed by GET /envs."""

    name: str
    splits: dict[str, int]  # split -> number of tasks
    description: str
    # Builds a fresh Environment for one episode of the given split; runs in the env worker.
    # Must be picklable (a module-level function) and cheap: no LLM call at construction.
    factory: Callable[[str, UserSimConfig], Environment]
    # Splits that cannot run here, and why (a data file the install lacks): submits get a 422 saying so.
    unavailable: dict[str, str] = field(default_factory=dict)
    # Per split, the tasks whose reward needs an LLM judge: refused at submit when none is configured.
    judged_tasks: dict[str, frozenset[int]] = field(default_factory=dict)
    # The split a submit without `task_split` runs; None: every submit must name its split.
    train_split: str | None = None
    protocol: int = PROTOCOL_VERSION  # the env protocol version the spec was written for
    # Where the spec came from, for GET /envs: "builtin", "entry point NAME (dist VERSION)", ...
    source: str = "builtin"
    # An agent-driven env (verifiers'): it owns its rollout loop and calls the model itself. The
    # service hands each episode to `driver(DriveRequest)` in an env worker (its factory is not
    # used), which plays it through the episode's own OpenAI endpoint and returns how it ended.
    # Must pickle, as factory.
    driver: Callable[[DriveRequest], DriveOutcome] | None = None
