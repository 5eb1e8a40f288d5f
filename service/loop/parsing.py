"""What every tool-call format shares: a parsed turn, the error of a call that does not parse,
strict JSON, and the Action of a decoded call."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from service.envs.base import RESPOND_ACTION_NAME, Action


class ToolCallParseError(ValueError):
    """The text tries to call a tool but a call in it cannot be parsed: the episode is aborted
    (executing only the calls that parse would train on a call that never got its answer)."""


@dataclass(frozen=True)
class ParsedTurn:
    actions: list[Action]  # every call of the turn, in order (parallel calls); or one `respond`
    content: str  # the normal text before the first call

    @property
    def action(self) -> Action:
        return self.actions[0]

    @property
    def calls(self) -> int:
        """Tool calls in the turn (0 for a `respond`)."""
        return 0 if self.actions[0].name == RESPOND_ACTION_NAME else len(self.actions)


class ToolCallParser(Protocol):
    """A turn's text (reasoning stripped) -> its calls; `tools` (the episode's OpenAI schemas) type
    the arguments of formats that write them as text."""

    def __call__(self, text: str, tools: Sequence[dict[str, Any]] | None = None) -> ParsedTurn: ...


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


# Strict JSON: Python's decoder also takes NaN and Infinity, which no database stores as JSON.
JSON_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def action_from_call(call: object) -> Action | None:
    """The Action of a decoded {"name", "arguments"} call; None if it is not one a database stores."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models send the arguments as a JSON string
        try:
            arguments = JSON_DECODER.decode(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    # A "\ud800" escape decodes to half a character: stored, it would make the episode unreadable.
    # orjson refuses any (and writes the rest at a tenth of json.dumps's CPU: 1.4% of the event loop
    # at 2,000 episodes in flight); json's check decides what orjson refuses for another reason.
    try:
        orjson.dumps([call["name"], arguments])
    except orjson.JSONEncodeError:
        try:
            json.dumps([call["name"], arguments], ensure_ascii=False).encode()
        except UnicodeEncodeError:
            return None
    return Action(call["name"], arguments)


def respond(text: str) -> ParsedTurn:
    """A turn without tool calls: its text goes to the user."""
    return ParsedTurn([Action(RESPOND_ACTION_NAME, {"content": text})], text)
