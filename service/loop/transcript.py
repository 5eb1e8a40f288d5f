"""The one shape of a stored transcript (an episode's `messages`; docs/trainers/arrow-schema.md), whichever
path played it (the service's loop, an external agent in any protocol): chat messages as chat
templates take them, an assistant's tool calls parsed, the text the model sampled kept beside them."""

from __future__ import annotations

import json
from typing import Any

from service.loop.parsing import ParsedTurn
from service.loop.toolcalls import strip_reasoning


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning without its tags, the visible text) of a turn's text."""
    visible = strip_reasoning(text)
    reasoning = text[: len(text) - len(visible)].replace("<think>", "").replace("</think>", "").strip()
    return reasoning, visible


def call_id(turn: int, index: int) -> str:
    """The id of a turn's `index`-th tool call (its tool message answers it by this id)."""
    return f"call_{turn}_{index}"


def tool_call(id_: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """A tool call as OpenAI's chat messages carry one (arguments as a JSON string)."""
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def assistant_message(sampled: str, parsed: ParsedTurn | None, turn: int) -> dict[str, Any]:
    """A sampled turn as the transcript records it: `content` the visible text (without reasoning
    and calls; None beside calls when there is none), `reasoning_content`, `tool_calls`, and
    `sampled`, the text as the model sampled it. `parsed` is None for a turn that was not parsed
    (cut, aborted, unparseable)."""
    reasoning, visible = split_reasoning(sampled)
    message: dict[str, Any] = {"role": "assistant", "content": visible.strip()}
    if reasoning:
        message["reasoning_content"] = reasoning
    if parsed is not None and parsed.calls:
        message["content"] = parsed.content.strip() or None
        message["tool_calls"] = [
            tool_call(call_id(turn, index), action.name, action.kwargs)
            for index, action in enumerate(parsed.actions)
        ]
    message["sampled"] = sampled
    return message
