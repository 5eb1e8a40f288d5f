"""The environment protocol, version PROTOCOL_VERSION: all an environment package imports from the
service (docs/environments.md is the guide).

A package registers a function that returns its EnvSpecs under the entry point group
ENTRY_POINT_GROUP, in its pyproject.toml:

    [project.entry-points."rollout_service.envs"]
    my-envs = "my_envs:env_specs"

or, for local work without packaging, the service's ENV_PLUGINS setting names it
(`ENV_PLUGINS=my_envs:env_specs`). Every service process and every env worker process loads it.

The protocol, per episode (one Environment object, built by `EnvSpec.factory(split, user_sim)` in
an env worker process, where it stays; its calls come one at a time):
- `system_prompt` and `tools` (OpenAI function schemas; `function_tool` writes one) are what the
  policy is shown, with `reset(task_index).observation` as the first user turn.
- Each tool call the model makes is `step(Action(name, kwargs))`; a plain answer (no tool call) is
  `step(Action(RESPOND_ACTION_NAME, {"content": text}))`. The Step's observation is the tool's
  result, or the user's next turn after a respond.
- `reward` of the last Step is the episode's reward; `done=True` ends the episode.
- `info` (Reset's and every Step's, merged) goes to the trainer's records only, never to the policy:
  ground truth, reward breakdowns. It and `transcript` must be JSON (str keys, finite numbers,
  Unicode text): anything else fails the call with EnvProtocolError.
- `transcript`: messages of the environment's own turn that the policy does not see (a simulated
  user's tool calls), marked `"env_only": True`; the episode's transcript shows them.
- An exception in reset/step aborts the episode with that error (never a reward of 0).

An agent-driven env (EnvSpec.driver; verifiers': service/envs/verifiers_envs.py) owns its rollout
loop instead: `driver(DriveRequest)` plays the episode against its own OpenAI endpoint
(`base_url`, `api_key`) and returns a DriveOutcome (reward, info, or an error).
"""

from __future__ import annotations

from typing import Any

from service.envs.base import (
    PROTOCOL_VERSION,
    RESPOND_ACTION_NAME,
    Action,
    DriveOutcome,
    DriveRequest,
    Environment,
    EnvSpec,
    Reset,
    Step,
    UserSimConfig,
)
from service.envs.checks import EnvProtocolError, check_reset, check_step, check_tools

ENTRY_POINT_GROUP = "rollout_service.envs"

__all__ = [
    "ENTRY_POINT_GROUP",
    "PROTOCOL_VERSION",
    "RESPOND_ACTION_NAME",
    "Action",
    "DriveOutcome",
    "DriveRequest",
    "EnvProtocolError",
    "EnvSpec",
    "Environment",
    "Reset",
    "Step",
    "UserSimConfig",
    "check_reset",
    "check_step",
    "check_tools",
    "function_tool",
]


def function_tool(
    name: str, description: str, properties: dict[str, dict[str, Any]], required: list[str] | None = None
) -> dict[str, Any]:
    """An OpenAI function schema: `properties` are JSON Schemas of the arguments, all required
    unless `required` says which."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": list(properties) if required is None else required,
            },
        },
    }
