"""Tool-call parsers: the policy's text -> at most one Action per turn.

Formats are registered by name (the `TOOL_CALL_FORMAT` setting); the Qwen2.5 / Hermes format is
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, parsed as SGLang's `qwen25` parser
does: each block is JSON on its own, `parameters` is accepted for `arguments`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from service.envs.base import RESPOND_ACTION_NAME, Action


class ToolCallParseError(ValueError):
    """The text tries to call a tool but no call in it can be parsed: the episode is aborted."""


@dataclass(frozen=True)
class ParsedTurn:
    action: Action
    content: str  # the normal text before the first call
    calls_found: int  # well-formed calls in the text; only the first is acted on


ToolCallParser = Callable[[str], ParsedTurn]
PARSERS: dict[str, ToolCallParser] = {}


def register(name: str) -> Callable[[ToolCallParser], ToolCallParser]:
    def decorate(parser: ToolCallParser) -> ToolCallParser:
        PARSERS[name] = parser
        return parser

    return decorate


def get_parser(name: str) -> ToolCallParser:
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call format {name!r}; known: {sorted(PARSERS)}") from None


# Reasoning of thinking models (Qwen3, DeepSeek-R1): everything up to the first </think>. The
# opening tag may be in the generation header rather than in the sampled text.
REASONING = re.compile(r"^.*?</think>\s*", re.DOTALL)


def strip_reasoning(text: str) -> str:
    """The part of a turn meant for the user or the tools: the text after the reasoning, if any."""
    return REASONING.sub("", text, count=1)


QWEN25_OPEN = "<tool_call>"
QWEN25_BLOCK = re.compile(r"<tool_call>\n(.*?)\n?</tool_call>|<tool_call>\n(.*)$", re.DOTALL)


@register("qwen25")
def parse_qwen25(text: str) -> ParsedTurn:
    start = text.find(QWEN25_OPEN)
    if start < 0:
        return ParsedTurn(Action(RESPOND_ACTION_NAME, {"content": text}), text, 0)
    content = text[:start].strip()
    actions = []
    for match in QWEN25_BLOCK.finditer(text, start):
        body = match.group(1) if match.group(1) is not None else match.group(2)
        action = _action_from_json(body)
        if action is not None:
            actions.append(action)
    if not actions:
        raise ToolCallParseError(f"no parseable tool call in {text[start : start + 200]!r}")
    return ParsedTurn(actions[0], content, len(actions))


def _action_from_json(body: str) -> Action | None:
    try:
        call = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models send the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return Action(call["name"], arguments)
