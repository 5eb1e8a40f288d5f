"""Remote environments by configuration: the REMOTE_ENVS setting, a JSON list (or the path of a
JSON or YAML file holding one) of RemoteEnvConfig, each listed by GET /envs like any env.

    REMOTE_ENVS='[{"name": "remote/echo", "protocol": "openenv",
                   "urls": ["http://env-a:8000", "http://env-b:8000"], "splits": {"train": 1000}}]'
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from service.envs.base import EnvSpec, UserSimConfig
from service.envs.remote.nemo_gym_data import dataset_splits

Protocol = Literal["openenv", "mcp", "nemo_gym"]


class RemoteEnvConfig(BaseModel):
    """One remote environment: where its servers are and what its tasks are."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=128, description="The env's name in GET /envs and submits.")
    protocol: Protocol = Field(
        description="`openenv`: OpenEnv servers (WebSocket sessions; MCP tools as the policy's tools). "
        "`mcp`: MCP tool servers (streamable HTTP URLs, or `command` for stdio), with tasks and reward "
        "from `tasks`. `nemo_gym`: NeMo Gym resource servers (HTTP; tasks from `datasets`, reward "
        "from the server's /verify)."
    )
    urls: list[str] = Field(
        default_factory=list,
        description="Base URLs of the pool's servers (OpenEnv, NeMo Gym: http://h:8000; MCP: .../mcp).",
    )
    command: list[str] = Field(
        default_factory=list,
        description="MCP over stdio: the server's command line, one process per episode.",
    )
    splits: dict[str, int] = Field(
        default_factory=dict,
        description="Split name -> number of tasks (a task is its index); NeMo Gym envs: from `datasets`.",
    )
    datasets: dict[str, str] = Field(
        default_factory=dict,
        description="NeMo Gym envs: split name -> path of its JSONL dataset (a row per task, as nemo-gym's "
        "agents send it to /seed_session and /verify).",
    )
    train_split: str | None = Field(default=None, description="The split a submit without task_split runs.")
    description: str = ""
    tasks: str = Field(
        default="",
        description="MCP envs: `module:function` returning the env's McpTasks (prompts and reward).",
    )
    system_prompt: str = Field(
        default="",
        description="The policy's system message (OpenEnv envs; NeMo Gym rows without one).",
    )
    respond_tool: str = Field(
        default="",
        description="OpenEnv envs: the tool a plain answer (no tool call) is sent to, with the answer as "
        "`respond_argument`; empty: a plain answer ends the episode with the reward given so far.",
    )
    respond_argument: str = "answer"
    action_tool: str = Field(
        default="step",
        min_length=1,
        description="OpenEnv envs whose server takes its environment's own action (no MCP tools): the "
        "name of the one tool the policy is shown, whose arguments are the action (its schema from the "
        "server's /schema).",
    )
    reuse_idle_seconds: float = Field(
        default=5.0,
        ge=0,
        description="OpenEnv envs: how long a server session whose episode ended stays open for the "
        "server's next episode (reset there); 0: a session per episode. Keep it below the servers' "
        "session idle timeout.",
    )
    reset_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Sent with every reset, besides seed/task_index/split/episode_id."
    )
    max_sessions_per_server: int = Field(default=64, ge=1, description="Sessions in flight per server.")
    connect_timeout_seconds: float = Field(default=10.0, gt=0)
    call_timeout_seconds: float = Field(default=60.0, gt=0, description="One reset or tool call.")
    reset_retries: int = Field(
        default=3, ge=0, description="Retries of an open/reset that did not take effect, with jitter."
    )
    retry_backoff_seconds: float = Field(default=0.2, ge=0)
    health_interval_seconds: float = Field(default=2.0, gt=0)
    placement_timeout_seconds: float = Field(
        default=30.0, gt=0, description="How long a new episode waits for a server with a free slot."
    )

    @model_validator(mode="after")
    def _check(self) -> RemoteEnvConfig:
        if self.protocol in ("openenv", "nemo_gym") and not self.urls:
            raise ValueError(f"remote env {self.name!r}: an {self.protocol} env needs urls")
        if self.protocol == "nemo_gym":
            if not self.datasets:
                raise ValueError(f"remote env {self.name!r}: a nemo_gym env needs datasets (split -> JSONL)")
            if self.splits:
                raise ValueError(f"remote env {self.name!r}: a nemo_gym env's splits are its datasets' rows")
        elif not self.splits:
            raise ValueError(f"remote env {self.name!r}: an {self.protocol} env needs splits")
        elif self.datasets:
            raise ValueError(f"remote env {self.name!r}: datasets are for nemo_gym envs")
        if self.protocol == "mcp":
            if bool(self.urls) == bool(self.command):
                raise ValueError(f"remote env {self.name!r}: an mcp env needs urls or command (one of them)")
            if not self.tasks:
                raise ValueError(f"remote env {self.name!r}: an mcp env needs tasks (module:function)")
        if self.train_split is not None and self.train_split not in (self.splits or self.datasets):
            raise ValueError(f"remote env {self.name!r}: train_split {self.train_split!r} is not a split")
        return self


CONFIGS = TypeAdapter(list[RemoteEnvConfig])


def parse_remote_envs(text: str) -> list[RemoteEnvConfig]:
    """REMOTE_ENVS: a JSON list, or the path of a .json/.yaml/.yml file holding one; "" is none.
    Raises ValueError naming the problem."""
    text = text.strip()
    if not text:
        return []
    if text.startswith("["):
        data: Any = json.loads(text)
    else:
        path = Path(text)
        if not path.is_file():
            raise ValueError(f"REMOTE_ENVS is neither a JSON list nor a file: {text!r}")
        body = path.read_text()
        data = yaml.safe_load(body) if path.suffix in (".yaml", ".yml") else json.loads(body)
    configs = CONFIGS.validate_python(data)
    names = [config.name for config in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"REMOTE_ENVS names an env twice: {names}")
    return configs


def runs_remotely(name: str, split: str, user_sim: UserSimConfig) -> Any:
    """The factory of a remote env's spec: never called (the service opens remote sessions itself,
    not in an env worker)."""
    raise RuntimeError(f"{name!r} runs on its env servers, not in an env worker")


def env_spec(config: RemoteEnvConfig) -> EnvSpec:
    """The env as GET /envs lists it; a NeMo Gym env's splits are its datasets' rows (ValueError if a
    file cannot be read: the service does not start)."""
    where = ", ".join(config.urls) or " ".join(config.command)
    return EnvSpec(
        name=config.name,
        splits=dataset_splits(config.datasets) if config.datasets else dict(config.splits),
        description=config.description or f"{config.protocol} env served by {where}",
        factory=functools.partial(runs_remotely, config.name),
        train_split=config.train_split,
        source=f"REMOTE_ENVS ({config.protocol})",
    )
