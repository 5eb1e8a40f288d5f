"""Tool-call parsers: the policy's text -> its tool calls, in order, or one `respond` action.

Formats go by SGLang's parser names (the `TOOL_CALL_FORMAT` setting, or `auto`: the one whose
markers the tokenizer's chat template holds). The Qwen2.5 / Hermes format is here:
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, parsed as SGLang's `qwen25` parser
does: each block is JSON on its own, `parameters` is accepted for `arguments`. The other families
are in formats.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from service.envs.base import Action
from service.loop import formats
from service.loop.parsing import (
    JSON_DECODER,
    ParsedTurn,
    ToolCallParseError,
    ToolCallParser,
    action_from_call,
    respond,
)

__all__ = [
    "AUTO",
    "PARSERS",
    "ParsedTurn",
    "ToolCallParseError",
    "ToolCallParser",
    "get_parser",
    "strip_reasoning",
]


AUTO = "auto"


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
    if "</think>" not in text:  # the regex's lazy scan of the whole text, three times a turn, spared
        return text
    return REASONING.sub("", text, count=1)


QWEN25_OPEN = "<tool_call>"
QWEN25_BLOCK_OPEN = "<tool_call>\n"
QWEN25_CLOSE = "</tool_call>"


def parse_qwen25(text: str, tools: Sequence[dict[str, Any]] | None = None) -> ParsedTurn:
    start = text.find(QWEN25_OPEN)
    if start < 0:
        return respond(text)
    content = text[:start].strip()
    actions: list[Action] = []
    position = start
    while position >= 0:
        if not text.startswith(QWEN25_BLOCK_OPEN, position):
            call = len(actions) + 1
            raise ToolCallParseError(
                f"call {call} has no newline after {QWEN25_OPEN}: {text[position : position + 200]!r}"
            )
        action, end, problem = _qwen25_block(text, position + len(QWEN25_BLOCK_OPEN))
        if action is None:
            raise ToolCallParseError(
                f"call {len(actions) + 1} {problem}: {text[position : position + 200]!r}"
            )
        actions.append(action)
        position = text.find(QWEN25_OPEN, end)
    return ParsedTurn(actions, content)


def _qwen25_block(text: str, body: int) -> tuple[Action | None, int, str]:
    """The call of the block whose JSON starts at `body`, where the block ends, and what is wrong
    with it when there is no call. The JSON is read as JSON (so a `</tool_call>` inside a string is
    text, not the end of the block); it must be followed by the closing tag or the end of the text.
    A malformed block is skipped whole."""
    skip = text.find(QWEN25_CLOSE, body)
    skip = len(text) if skip < 0 else skip + len(QWEN25_CLOSE)
    start = len(text) - len(text[body:].lstrip())
    try:
        call, end = JSON_DECODER.raw_decode(text, start)
    except json.JSONDecodeError as error:
        return None, skip, f"is not valid JSON ({error.msg} at character {error.pos - start})"
    except ValueError as error:  # NaN or Infinity
        return None, skip, f"is not valid JSON ({error})"
    rest = text[end:].lstrip()
    if rest and not rest.startswith(QWEN25_CLOSE):
        return None, skip, f"has text after its JSON object, before {QWEN25_CLOSE}"
    close = text.find(QWEN25_CLOSE, end)
    action = action_from_call(call)
    if action is None:
        return None, skip, 'is not {"name": <text>, "arguments": <an object>}'
    return action, len(text) if close < 0 else close + len(QWEN25_CLOSE), ""


# Every format by SGLang's name. Per format, text its chat templates hold (and the others' do not),
# in the order `auto` tries them: qwen25 last, since qwen3_coder and glm45 wrap calls in <tool_call> too.
PARSERS: dict[str, ToolCallParser] = {**formats.PARSERS, "qwen25": parse_qwen25, "hermes": parse_qwen25}
MARKERS: dict[str, tuple[str, ...]] = {**formats.MARKERS, "qwen25": ("<tool_call>",)}
