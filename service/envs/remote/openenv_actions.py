"""What an OpenEnv server's actions are, as the policy's tools: an MCP environment's tools (listed
with openenv's list_tools action, each call a call_tool action), or, for a server whose action is
the environment's own, that action as one tool whose arguments are the action's fields (its JSON
schema from the server's /schema). The wire's dicts are read and built here, as openenv-core's
types serialize them (tests check them against the types): no pydantic model per call."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# ListToolsAction().model_dump(), sent as it is on every session's first tool list.
LIST_TOOLS: dict[str, Any] = {"metadata": {}, "type": "list_tools"}
# The action schemas of servers that take MCP actions (openenv routes call_tool/list_tools there).
MCP_ACTION_TYPES = frozenset({"call_tool", "list_tools"})
GENERIC_ACTION_TITLE = "Action"  # openenv's Action base: an MCP environment's default action class
# Observation fields shown as text, in this order, when the observation has several.
TEXT_FIELDS = ("prompt", "text", "message", "content", "observation", "output", "result")
# The base Action's field: the env's own bookkeeping, not the policy's to fill in.
ACTION_METADATA = "metadata"


def call_tool_payload(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """CallToolAction(tool_name=name, arguments=arguments).model_dump(), built directly."""
    return {"metadata": {}, "type": "call_tool", "tool_name": name, "arguments": dict(arguments)}


def function_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """An MCP tool (name, description, input schema) as an OpenAI function schema."""
    schema = tool.get("input_schema") or tool.get("inputSchema") or {"type": "object", "properties": {}}
    return {
        "type": "function",
        "function": {
            "name": tool["name"],
            "description": tool.get("description") or "",
            "parameters": schema,
        },
    }


def action_function(schema: dict[str, Any], name: str) -> dict[str, Any]:
    """An environment's action schema (openenv's /schema "action") as one OpenAI function schema,
    without the base Action's metadata field."""
    properties = {
        key: value for key, value in (schema.get("properties") or {}).items() if key != ACTION_METADATA
    }
    parameters = {
        key: value
        for key, value in schema.items()
        if key not in ("title", "description", "properties", "required")
    }
    parameters["type"] = "object"
    parameters["properties"] = properties
    required = [field for field in schema.get("required") or [] if field != ACTION_METADATA]
    if required:
        parameters["required"] = required
    title = schema.get("title") or "the environment's action"
    description = schema.get("description") or f"Act in the environment ({title})."
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


def is_mcp_action(schema: dict[str, Any]) -> bool:
    """Whether a server's action schema is openenv's MCP actions (CallToolAction, ListToolsAction,
    or the Action base, which openenv routes MCP actions around)."""
    kind = ((schema.get("properties") or {}).get("type") or {}).get("const")
    return kind in MCP_ACTION_TYPES or schema.get("title") == GENERIC_ACTION_TITLE


@dataclass(frozen=True)
class ActionSpace:
    """How the policy acts on one env's servers."""

    mcp: bool  # MCP tools, each call a call_tool step; else one tool, the action itself
    tool_name: str = ""  # the one tool's name (not MCP)
    action_tool: dict[str, Any] | None = None  # the one tool's function schema (not MCP)

    @classmethod
    def from_schema(cls, action_schema: dict[str, Any], tool_name: str) -> ActionSpace:
        if is_mcp_action(action_schema):
            return cls(mcp=True)
        return cls(mcp=False, tool_name=tool_name, action_tool=action_function(action_schema, tool_name))

    async def tools(self, client: Any) -> list[dict[str, Any]]:
        """The session's tools: its MCP tool list (a step of `client`, a SessionClient), or the
        action's tool."""
        if not self.mcp:
            assert self.action_tool is not None
            return [self.action_tool]
        listed = await client.request("step", LIST_TOOLS)
        return [function_schema(tool) for tool in listed.get("observation", {}).get("tools") or []]


def observation_text(observation: Any) -> str:
    """The text of an observation as the wire carries it (its fields but reward, done, metadata)."""
    if isinstance(observation, str):
        return observation
    if not isinstance(observation, dict):
        return json.dumps(observation)
    texts = [value for value in observation.values() if isinstance(value, str)]
    if len(observation) == 1 and len(texts) == 1:
        return texts[0]
    for name in TEXT_FIELDS:
        if isinstance(observation.get(name), str):
            return str(observation[name])
    return json.dumps(observation, sort_keys=True)


def tool_result_text(observation: dict[str, Any]) -> str:
    """An MCP tool call's result (a CallToolObservation as the wire carries it) as the policy reads
    it: its text contents, or the tool's error."""
    error = observation.get("error")
    if error is not None:
        return f"Error ({error.get('error_type')}): {error.get('message')}"
    result = observation.get("result")
    if isinstance(result, dict):
        parts = [item.get("text", "") for item in result.get("content") or [] if isinstance(item, dict)]
        if parts:
            return "\n".join(parts)
        if "data" in result:
            result = result["data"]
    return result if isinstance(result, str) else json.dumps(result)
