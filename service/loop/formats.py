"""Tool-call formats of the model families SGLang serves (its `--tool-call-parser` names), beside
qwen25 (toolcalls.py, which gathers them all): each parses a turn's sampled text (special tokens as
text) into its calls, in order, or one `respond`, as SGLang's detector of that name does; and each
says how its chat template shows it, for TOOL_CALL_FORMAT=auto.

Where a format writes arguments as text (qwen3_coder's `<parameter=...>`, glm45's `<arg_value>`),
a value becomes the type the tool's JSON schema gives it, as SGLang converts it: "19122" stays a
string for a string parameter and becomes 19122 for an integer one.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from service.envs.base import Action
from service.loop.parsing import (
    JSON_DECODER,
    ParsedTurn,
    ToolCallParseError,
    ToolCallParser,
    action_from_call,
    respond,
)

Tools = Sequence[dict[str, Any]] | None
PARSERS: dict[str, ToolCallParser] = {}  # by SGLang's name
MARKERS: dict[str, tuple[str, ...]] = {}  # text a chat template of the format holds, for auto


def register(name: str, markers: tuple[str, ...] = ()) -> Callable[[ToolCallParser], ToolCallParser]:
    def decorate(parser: ToolCallParser) -> ToolCallParser:
        PARSERS[name] = parser
        if markers:
            MARKERS[name] = markers
        return parser

    return decorate


def _calls(content: str, actions: list[Action | None], text: str) -> ParsedTurn:
    if not actions or any(action is None for action in actions):
        bad = next(number for number, action in enumerate(actions, 1) if action is None) if actions else 0
        what = (
            f"call {bad}'s name or arguments (a JSON object) cannot be read" if bad else "no call can be read"
        )
        raise ToolCallParseError(f"{what} in {text[:300]!r}")
    return ParsedTurn([action for action in actions if action is not None], content.strip())


def _json_call(name: str, arguments: str) -> Action | None:
    try:
        decoded = JSON_DECODER.decode(arguments.strip()) if arguments.strip() else {}
    except ValueError:
        return None
    return action_from_call({"name": name.strip(), "arguments": decoded})


def _parameter_types(tools: Tools, name: str) -> dict[str, Any]:
    for tool in tools or []:
        function = tool.get("function", tool)
        if function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties") or {}
            return {key: value.get("type") for key, value in properties.items() if isinstance(value, dict)}
    return {}


def _typed(value: str, kind: Any) -> Any:
    """A value written as text, as the type its schema gives (text where it says string or
    nothing, or where the text is not that type's JSON)."""
    if kind == "string" or kind is None or (isinstance(kind, list) and "string" in kind):
        return value
    try:
        return JSON_DECODER.decode(value)
    except ValueError:
        return value


# ---- Qwen3-Coder: XML parameters ----

QWEN3_CODER_CALL = re.compile(
    r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*(?:</tool_call>|$)", re.DOTALL
)
QWEN3_CODER_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


@register("qwen3_coder", markers=("<function=", "<parameter="))
def parse_qwen3_coder(text: str, tools: Tools = None) -> ParsedTurn:
    start = text.find("<tool_call>")
    if start < 0:
        return respond(text)
    actions: list[Action | None] = []
    position = start
    while (match := QWEN3_CODER_CALL.match(text, position)) is not None:
        name, body = match.group(1).strip(), match.group(2)
        types = _parameter_types(tools, name)
        arguments = {key: _typed(value, types.get(key)) for key, value in QWEN3_CODER_PARAMETER.findall(body)}
        actions.append(action_from_call({"name": name, "arguments": arguments}))
        position = match.end()
        while position < len(text) and text[position].isspace():
            position += 1
    if position < len(text):  # something after the calls that is not a call
        actions.append(None)
    return _calls(text[:start], actions, text[start:])


# ---- GLM-4.5: <arg_key> / <arg_value> pairs ----

GLM45_CALL = re.compile(r"<tool_call>([^\n<]+)\n?(.*?)</tool_call>", re.DOTALL)
GLM45_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


@register("glm45", markers=("<arg_key>",))
def parse_glm45(text: str, tools: Tools = None) -> ParsedTurn:
    start = text.find("<tool_call>")
    if start < 0:
        return respond(text)
    actions: list[Action | None] = []
    rest = text[start:]
    for match in GLM45_CALL.finditer(rest):
        name = match.group(1).strip()
        types = _parameter_types(tools, name)
        arguments = {
            key.strip(): _typed(value, types.get(key.strip()))
            for key, value in GLM45_ARGUMENT.findall(match.group(2))
        }
        actions.append(action_from_call({"name": name, "arguments": arguments}))
    if GLM45_CALL.sub("", rest).strip():
        actions.append(None)  # an unclosed or malformed call
    return _calls(text[:start], actions, rest)


# ---- Llama 3.x: JSON, after <|python_tag|> or bare (a turn that starts with `{`, as SGLang) ----

LLAMA3_TAG = "<|python_tag|>"


@register("llama3", markers=("<|start_header_id|>", "ipython"))
def parse_llama3(text: str, tools: Tools = None) -> ParsedTurn:
    stripped = text.strip()
    if stripped.startswith(LLAMA3_TAG):
        stripped = stripped[len(LLAMA3_TAG) :].lstrip()
    elif not stripped.startswith("{"):
        return respond(text)
    actions: list[Action | None] = []
    position = 0
    while position < len(stripped):
        try:
            call, end = JSON_DECODER.raw_decode(stripped, position)
        except ValueError:
            actions.append(None)
            break
        if isinstance(call, dict) and "parameters" in call and "arguments" not in call:
            call = {"name": call.get("name"), "arguments": call["parameters"]}  # and "type": "function"
        actions.append(action_from_call(call))
        position = end
        while position < len(stripped) and (stripped[position].isspace() or stripped[position] == ";"):
            position += 1
    return _calls("", actions, stripped)


# ---- Mistral: [TOOL_CALLS] and a JSON list, or name[ARGS]{...} (tokenizer v11 and later) ----

MISTRAL_TAG = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
MISTRAL_CALL_ID = "[CALL_ID]"


@register("mistral", markers=("[TOOL_CALLS]",))
def parse_mistral(text: str, tools: Tools = None) -> ParsedTurn:
    start = text.find(MISTRAL_TAG)
    if start < 0:
        return respond(text)
    actions: list[Action | None] = []
    for part in text[start:].split(MISTRAL_TAG)[1:]:
        part = part.strip().removesuffix("</s>").strip()
        if MISTRAL_ARGS in part and not part.startswith("["):
            name, _, arguments = part.partition(MISTRAL_ARGS)
            actions.append(_json_call(name.partition(MISTRAL_CALL_ID)[0], arguments))  # v11: name[CALL_ID]id
            continue
        try:
            calls, end = JSON_DECODER.raw_decode(part)
        except ValueError:
            actions.append(None)
            continue
        if part[end:].strip() or not isinstance(calls, list) or not calls:
            actions.append(None)
            continue
        actions.extend(action_from_call(call) for call in calls)
    return _calls(text[:start], actions, text[start:])


# ---- DeepSeek V3 and V3.1 ----

DEEPSEEK_BEGIN = "<｜tool▁calls▁begin｜>"
DEEPSEEK_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(?:function<｜tool▁sep｜>([^\n]+)\n```json\n(.*?)\n```"  # V3
    r"|([^<]+?)<｜tool▁sep｜>(.*?))<｜tool▁call▁end｜>",  # V3.1
    re.DOTALL,
)


def _section_calls(
    text: str, begin: str, end: str, call: re.Pattern[str], action: Callable[[re.Match[str]], Action | None]
) -> ParsedTurn:
    """Formats whose calls stand in a section between `begin` and `end`, each matching `call`."""
    start = text.find(begin)
    if start < 0:
        return respond(text)
    body = text[start + len(begin) :].split(end)[0]
    actions = [action(match) for match in call.finditer(body)]
    if call.sub("", body).strip():  # something in the section that is no call
        actions.append(None)
    return _calls(text[:start], actions, text[start:])


@register("deepseekv3", markers=("<｜tool▁calls▁begin｜>",))
def parse_deepseekv3(text: str, tools: Tools = None) -> ParsedTurn:
    def action(match: re.Match[str]) -> Action | None:
        if match.group(1) is not None:  # V3
            return _json_call(match.group(1), match.group(2))
        return _json_call(match.group(3), match.group(4))

    return _section_calls(text, DEEPSEEK_BEGIN, "<｜tool▁calls▁end｜>", DEEPSEEK_CALL, action)


register("deepseekv31", markers=())(parse_deepseekv3)  # SGLang's name for V3.1's form: both parse


# ---- Kimi K2 ----

KIMI_BEGIN = "<|tool_calls_section_begin|>"
KIMI_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*(?:functions\.)?([^:<\s]+)(?::\d+)?\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>",
    re.DOTALL,
)


@register("kimi_k2", markers=("<|tool_calls_section_begin|>",))
def parse_kimi_k2(text: str, tools: Tools = None) -> ParsedTurn:
    return _section_calls(
        text, KIMI_BEGIN, "<|tool_calls_section_end|>", KIMI_CALL, lambda match: _json_call(*match.groups())
    )


# ---- gpt-oss: harmony channels ----

HARMONY_MESSAGE = re.compile(
    r"(?:<\|start\|>assistant)?(.*?)<\|message\|>(.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|$)", re.DOTALL
)
HARMONY_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


@register("gpt-oss", markers=("<|channel|>",))
def parse_gpt_oss(text: str, tools: Tools = None) -> ParsedTurn:
    """Harmony: the analysis channel is reasoning (dropped), a message to `functions.<name>` is a
    call (its JSON arguments), the final channel is the answer."""
    if "<|message|>" not in text:
        return respond(text)
    actions: list[Action | None] = []
    final: list[str] = []
    for header, body in HARMONY_MESSAGE.findall(text):
        if (recipient := HARMONY_RECIPIENT.search(header)) is not None:
            actions.append(_json_call(recipient.group(1), body))
        elif "<|channel|>final" in header or "<|channel|>" not in header:
            final.append(body)
    if actions:
        return _calls("".join(final), actions, text)
    return respond("".join(final).strip())
