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
from service.loop.transcript import tool_call

FinishReason = Literal["stop", "length", "tool_calls"]


@dataclass
class ChatCall:
    """What an agent asks: its whole conversation, its tools, its sampling parameters."""

    messages: list[dict[str, Any]]  # chat messages, as chat templates take them
    tools: list[dict[str, Any]] | None  # OpenAI's function tools
    sampling: dict[str, Any]  # the agent's, as SGLang names them
    max_tokens: int | None
    # The earlier call of the episode whose conversation `messages` continue (Responses'
    # previous_response_id), any of them: `messages` are then only what follows its answer, and a
    # system message first replaces that call's.
    previous_call: int | None = None


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
    call: int = 0  # the episode's call this answers (0, 1, ...)
    stop_sequence: str | None = None  # the agent's stop string that ended the answer, if one did
    sampled: str = ""  # the text as the model sampled it (the transcript keeps it)
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def message(self) -> dict[str, Any]:
        """The answer as a chat message (the transcript adds `sampled`: loop/transcript.py)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [
                tool_call(call.id, call.name, call.arguments) for call in self.tool_calls
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


def answered_through(
    turns: list[dict[str, Any]], messages: list[dict[str, Any]], call: int
) -> list[dict[str, Any]] | None:
    """The conversation of a segment (its `turns` and `messages`) through the answer to episode
    call `call` (its messages after the tools head: what that call was sent, then its answer), or
    None when that call is not one of the segment's. A segment's answers are its last assistant
    messages, one per call it answered (its first call's prompt may hold the agent's own assistant
    messages before them)."""
    answered = list(dict.fromkeys(turn.get("turn") for turn in turns))  # resumes share a call
    if call not in answered:
        return None
    assistants = [at for at, message in enumerate(messages) if message.get("role") == "assistant"]
    answer = assistants[len(assistants) - len(answered) + answered.index(call)]
    return messages[1 : answer + 1]


def after_previous(earlier: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The whole conversation of a call that continues an earlier one (`previous_call`): that
    call's conversation through its answer (`earlier`: answered_through), then the call's own
    messages (`new`); a system message these open with takes the earlier one's place."""
    if new and new[0].get("role") == "system":
        earlier = earlier[1:] if earlier and earlier[0].get("role") == "system" else earlier
        return [new[0], *earlier, *new[1:]]
    return [*earlier, *new]


def named_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with each tool result named by the call it answers (when the agent did not
    name it), so that every transcript says which tool a result came from."""
    names: dict[Any, Any] = {}
    named = []
    for message in messages:
        for call in message.get("tool_calls") or ():
            if isinstance(call, dict) and isinstance(call.get("function"), dict):
                names[call.get("id")] = call["function"].get("name")
        if message.get("role") == "tool" and "name" not in message and names.get(message.get("tool_call_id")):
            message = {**message, "name": names[message.get("tool_call_id")]}
        named.append(message)
    return named
