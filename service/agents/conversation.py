"""A call and its answer in no protocol's shape, and the conversation logic on them (no I/O).

An episode's conversation is recorded as chat messages in the shape chat templates take (OpenAI's
chat messages: `role`, `content`, `tool_calls` with `function.name` and `function.arguments`); each
wire format (chat_completions.py, ...) turns its requests into a `ChatCall` of such messages and
an `Answer` into its responses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from service.agents.repository import Segment

FinishReason = Literal["stop", "length", "tool_calls"]


@dataclass
class ChatCall:
    """What an agent asks: its whole conversation, its tools, its sampling parameters."""

    messages: list[dict[str, Any]]  # chat messages, as chat templates take them
    tools: list[dict[str, Any]] | None  # OpenAI's function tools
    sampling: dict[str, Any]  # the agent's, as SGLang names them
    max_tokens: int | None


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Answer:
    """The assistant's turn, recorded before it is sent."""

    content: str | None  # the visible text (None beside tool calls when there is none)
    reasoning: str | None  # the model's thinking, without its tags
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: FinishReason = "stop"
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def message(self) -> dict[str, Any]:
        """The answer as the conversation records it (a chat message)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
                }
                for call in self.tool_calls
            ]
        return message


def _text(content: Any) -> str:
    """A message's content as text: content parts joined, None as empty."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content)


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def message_key(message: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two messages the same turn of a conversation: role, text, and tool calls by name
    and arguments (call ids and the assistant's echoed reasoning are left out: the model's tokens
    for its turn are the sampled ones either way)."""
    calls = tuple(
        (
            call.get("function", {}).get("name"),
            json.dumps(_arguments(call.get("function", {}).get("arguments")), sort_keys=True),
        )
        for call in message.get("tool_calls") or ()
    )
    return (message.get("role"), _text(message.get("content")).strip(), calls)


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates take it: text content; tool-call arguments as objects."""
    out: dict[str, Any] = {"role": message.get("role"), "content": _text(message.get("content"))}
    for name in ("name", "tool_call_id"):
        if message.get(name) is not None:
            out[name] = message[name]
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": call.get("id"),
                "type": "function",
                "function": {
                    "name": call.get("function", {}).get("name"),
                    "arguments": _arguments(call.get("function", {}).get("arguments")),
                },
            }
            for call in message["tool_calls"]
        ]
    return out


def continuation(
    segment: Segment | None, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]] | None:
    """The messages that continue `segment` (its messages, then only tool and user messages), or
    None when `messages` do not continue it."""
    if segment is None or not segment.messages or segment.messages[-1].get("role") != "assistant":
        return None
    if segment.messages[0].get("tools", None) != (tools or None):
        return None
    recorded = [message_key(message) for message in segment.messages[1:]]
    new = messages[len(recorded) :]
    if not new or any(message.get("role") == "assistant" for message in new):
        return None
    if [message_key(message) for message in messages[: len(recorded)]] != recorded:
        return None
    return new
