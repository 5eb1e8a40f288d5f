"""Tool-call parsers: the policy's text -> its tool calls, in order, or one `respond` action.

Formats are registered by name (the `TOOL_CALL_FORMAT` setting); the Qwen2.5 / Hermes format is
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, parsed as SGLang's `qwen25` parser
does: each block is JSON on its own, `parameters` is accepted for `arguments`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

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


PARSERS: dict[str, ToolCallParser] = {}
# Per format, text its chat templates hold (and others do not), most specific formats first.
MARKERS: dict[str, tuple[str, ...]] = {}
AUTO = "auto"


def register(name: str, markers: tuple[str, ...] = ()) -> Callable[[ToolCallParser], ToolCallParser]:
    def decorate(parser: ToolCallParser) -> ToolCallParser:
        PARSERS[name] = parser
        if markers:
            MARKERS[name] = markers
        return parser

    return decorate


def get_parser(name: str) -> ToolCallParser:
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call format {name!r}; known: {sorted(PARSERS)}") from None


def format_of_template(template: str) -> str:
    """The tool-call format a chat template writes (TOOL_CALL_FORMAT=auto): the first, in MARKERS'
    order, all of whose markers it holds. Raises ValueError naming the known formats."""
    for name, markers in MARKERS.items():
        if all(marker in template for marker in markers):
            return name
    raise ValueError(
        "TOOL_CALL_FORMAT=auto: the tokenizer's chat template shows none of the known tool-call "
        f"formats ({', '.join(sorted(PARSERS))}); set TOOL_CALL_FORMAT to one of them"
    )


# Reasoning of thinking models (Qwen3, DeepSeek-R1): everything up to the first </think>. The
# opening tag may be in the generation header rather than in the sampled text.
REASONING = re.compile(r"^.*?</think>\s*", re.DOTALL)


def strip_reasoning(text: str) -> str:
    """The part of a turn meant for the user or the tools: the text after the reasoning, if any."""
    return REASONING.sub("", text, count=1)


QWEN25_OPEN = "<tool_call>"
QWEN25_BLOCK_OPEN = "<tool_call>\n"
QWEN25_CLOSE = "</tool_call>"


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


# Strict JSON: Python's decoder also takes NaN and Infinity, which no database stores as JSON.
JSON_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def parse_qwen25(text: str, tools: Sequence[dict[str, Any]] | None = None) -> ParsedTurn:
    start = text.find(QWEN25_OPEN)
    if start < 0:
        return respond(text)
    content = text[:start].strip()
    actions = []
    position = start
    while position >= 0:
        if not text.startswith(QWEN25_BLOCK_OPEN, position):
            raise ToolCallParseError(f"a tool call without its newline: {text[position : position + 200]!r}")
        action, end = _qwen25_block(text, position + len(QWEN25_BLOCK_OPEN))
        if action is None:
            raise ToolCallParseError(f"an unparseable tool call: {text[position : position + 200]!r}")
        actions.append(action)
        position = text.find(QWEN25_OPEN, end)
    return ParsedTurn(actions, content)


def respond(text: str) -> ParsedTurn:
    """A turn without tool calls: its text goes to the user."""
    return ParsedTurn([Action(RESPOND_ACTION_NAME, {"content": text})], text)


def _qwen25_block(text: str, body: int) -> tuple[Action | None, int]:
    """The call of the block whose JSON starts at `body`, and where the block ends. The JSON is
    read as JSON (so a `</tool_call>` inside a string is text, not the end of the block); it must
    be followed by the closing tag or the end of the text. A malformed block is skipped whole."""
    skip = text.find(QWEN25_CLOSE, body)
    skip = len(text) if skip < 0 else skip + len(QWEN25_CLOSE)
    try:
        call, end = JSON_DECODER.raw_decode(text, len(text) - len(text[body:].lstrip()))
    except ValueError:
        return None, skip
    rest = text[end:].lstrip()
    if rest and not rest.startswith(QWEN25_CLOSE):
        return None, skip
    close = text.find(QWEN25_CLOSE, end)
    return action_from_call(call), len(text) if close < 0 else close + len(QWEN25_CLOSE)


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
    try:  # a "\ud800" escape decodes to half a character: stored, it would make the episode unreadable
        json.dumps([call["name"], arguments], ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return None
    return Action(call["name"], arguments)


# The families (formats.py) register after the ones above; qwen25 is tried last by `auto`: every
# format that wraps its calls in <tool_call> (qwen3_coder, glm45) is more specific.
from service.loop import formats  # noqa: E402, F401

register("qwen25", markers=("<tool_call>",))(parse_qwen25)
register("hermes")(parse_qwen25)
