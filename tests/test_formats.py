"""The tool-call formats of model families, on the strings their models emit: every call of a turn
in order, arguments typed by the tool's schema where the format writes them as text, reasoning kept
out, malformed calls refused; and TOOL_CALL_FORMAT=auto."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.app import lifespan
from service.config import TEST_TOKENIZER_DIR
from service.envs.base import RESPOND_ACTION_NAME, Action
from service.loop.toolcalls import MARKERS, PARSERS, ToolCallParseError, format_of_template, get_parser
from service.metrics import Metrics
from tests.conftest import service_settings

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "find_user",
            "parameters": {
                "type": "object",
                "properties": {
                    "zip": {"type": "string"},
                    "count": {"type": "integer"},
                    "tags": {"type": "array"},
                    "exact": {"type": "boolean"},
                },
            },
        },
    }
]
CALLS = [
    Action("find_user", {"zip": "19122", "count": 2, "tags": ["a", "b"], "exact": True}),
    Action("get_weather", {"city": "Paris"}),
]


def qwen3_coder(calls: list[Action]) -> str:
    def parameter(key: str, value: Any) -> str:
        text = value if isinstance(value, str) else json.dumps(value)
        return f"<parameter={key}>\n{text}\n</parameter>\n"

    return "".join(
        f"<tool_call>\n<function={c.name}>\n"
        + "".join(parameter(k, v) for k, v in c.kwargs.items())
        + "</function>\n</tool_call>\n"
        for c in calls
    )


def glm45(calls: list[Action]) -> str:
    def argument(key: str, value: Any) -> str:
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        return f"<arg_key>{key}</arg_key>\n<arg_value>{text}</arg_value>\n"

    return "".join(
        f"<tool_call>{c.name}\n{''.join(argument(k, v) for k, v in c.kwargs.items())}</tool_call>"
        for c in calls
    )


# What each family's model writes for CALLS after some words, as its chat template renders an
# assistant message with these tool_calls (special tokens as text).
EMITTED: dict[str, str] = {
    "qwen25": "Checking.\n"
    + "\n".join(
        f"<tool_call>\n{json.dumps({'name': c.name, 'arguments': c.kwargs})}\n</tool_call>" for c in CALLS
    ),
    "qwen3_coder": "Checking.\n" + qwen3_coder(CALLS),
    "glm45": "Checking.\n" + glm45(CALLS),
    "llama3": "<|python_tag|>"
    + "; ".join(json.dumps({"name": c.name, "parameters": c.kwargs}) for c in CALLS),
    "mistral": "Checking.[TOOL_CALLS]"
    + json.dumps(
        [{"name": c.name, "arguments": c.kwargs, "id": f"abc12345{n}"} for n, c in enumerate(CALLS)]
    ),
    "deepseekv3": "Checking.<｜tool▁calls▁begin｜>"
    + "\n".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{c.name}\n```json\n{json.dumps(c.kwargs)}\n```<｜tool▁call▁end｜>"
        for c in CALLS
    )
    + "<｜tool▁calls▁end｜>",
    "deepseekv31": "Checking.<｜tool▁calls▁begin｜>"
    + "".join(
        f"<｜tool▁call▁begin｜>{c.name}<｜tool▁sep｜>{json.dumps(c.kwargs)}<｜tool▁call▁end｜>" for c in CALLS
    )
    + "<｜tool▁calls▁end｜>",
    "kimi_k2": "Checking.<|tool_calls_section_begin|>"
    + "".join(
        f"<|tool_call_begin|>functions.{c.name}:{n}<|tool_call_argument_begin|>{json.dumps(c.kwargs)}<|tool_call_end|>"
        for n, c in enumerate(CALLS)
    )
    + "<|tool_calls_section_end|>",
}
CONTENT = {name: "Checking." for name in EMITTED} | {"llama3": ""}


@pytest.mark.parametrize("name", sorted(EMITTED))
def test_every_call_of_a_turn_in_order_typed_by_the_schema(name: str) -> None:
    turn = get_parser(name)(EMITTED[name], TOOLS)
    assert turn.actions == CALLS
    assert turn.content == CONTENT[name]


def test_mistral_v11_calls() -> None:
    text = '[TOOL_CALLS]find_user[ARGS]{"zip": "19122"}[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}</s>'
    assert get_parser("mistral")(text).actions == [Action("find_user", {"zip": "19122"}), CALLS[1]]


def test_text_as_the_schema_types_it() -> None:
    """ "19122" stays text for a string parameter; an untyped or unknown one stays text too."""
    text = (
        "<tool_call>\n<function=find_user>\n<parameter=zip>\n19122\n</parameter>\n"
        "<parameter=other>\n7\n</parameter>\n</function>\n</tool_call>"
    )
    assert get_parser("qwen3_coder")(text, TOOLS).action == Action(
        "find_user", {"zip": "19122", "other": "7"}
    )
    text = "<tool_call>find_user\n<arg_key>count</arg_key>\n<arg_value>two</arg_value>\n</tool_call>"
    assert get_parser("glm45")(text, TOOLS).action == Action(
        "find_user", {"count": "two"}
    )  # not JSON: as written


HARMONY_CALL = (
    "<|channel|>analysis<|message|>The user wants the weather in Paris.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)


def test_gpt_oss_channels() -> None:
    parse = get_parser("gpt-oss")
    assert parse(HARMONY_CALL).actions == [CALLS[1]]  # the analysis channel is reasoning
    final = (
        "<|channel|>analysis<|message|>Easy.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>"
    )
    assert parse(final).actions == [Action(RESPOND_ACTION_NAME, {"content": "It is sunny."})]
    recipient_first = (
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
        '<|message|>{"city": "Paris"}<|call|>'
    )
    assert parse(recipient_first).actions == [CALLS[1]]


PLAIN = "Your order shipped on Monday."


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_plain_text_is_a_respond(name: str) -> None:
    assert get_parser(name)(PLAIN).actions == [Action(RESPOND_ACTION_NAME, {"content": PLAIN})]


MALFORMED = {
    "qwen25": '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n",
    "glm45": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris",
    "llama3": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Par',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}',
    "deepseekv3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    "```json\n{bad}\n```<｜tool▁call▁end｜>",
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    "<|tool_call_argument_begin|>{bad<|tool_call_end|>",
    "gpt-oss": "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    "<|message|>{bad<|call|>",
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_malformed_call_ends_the_turn(name: str) -> None:
    with pytest.raises(ToolCallParseError):
        get_parser(name)(MALFORMED[name], TOOLS)


@pytest.mark.parametrize("name", sorted(set(EMITTED) - {"llama3"}))
def test_a_malformed_call_after_a_good_one_ends_the_turn(name: str) -> None:
    good = get_parser(name)(EMITTED[name], TOOLS)
    assert good.calls == 2
    broken = EMITTED[name] + MALFORMED.get(name, MALFORMED["qwen25"]).replace("Checking.", "")
    if name == "deepseekv31":
        broken = EMITTED[name].replace(json.dumps(CALLS[1].kwargs), "{bad")
    if name in ("deepseekv3", "kimi_k2"):
        broken = EMITTED[name].replace(json.dumps(CALLS[1].kwargs), "{bad")
    if name == "mistral":
        broken = EMITTED[name][:-3]
    with pytest.raises(ToolCallParseError):
        get_parser(name)(broken, TOOLS)


# ---- auto ----

TEMPLATE_SNIPPETS = {
    "qwen25": '{{- \'<tool_call>\\n{"name": "\' }}',
    "qwen3_coder": "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{{- '<parameter=' + name }}",
    "glm45": "{{ '<tool_call>' + tc.name }}{{ '<arg_key>' + k + '</arg_key>' }}",
    "llama3": '{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}',
    "mistral": '{{- "[TOOL_CALLS][" }}',
    "deepseekv3": "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>'}}",
    "kimi_k2": "{{- '<|tool_calls_section_begin|>' -}}",
    "gpt-oss": "{{- '<|start|>assistant<|channel|>commentary to=functions.' }}",
}


@pytest.mark.parametrize("name", sorted(TEMPLATE_SNIPPETS))
def test_auto_finds_the_format_a_template_writes(name: str) -> None:
    assert format_of_template(TEMPLATE_SNIPPETS[name]) == name


def test_auto_names_the_known_formats_when_none_matches() -> None:
    with pytest.raises(ValueError, match="qwen3_coder") as error:
        format_of_template("{{ messages }}")
    assert all(name in str(error.value) for name in MARKERS)


TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=20)
ARGUMENTS = st.dictionaries(
    st.text("abcdefgh_", min_size=1, max_size=8), st.integers() | TEXT | st.booleans(), max_size=4
)


@given(st.lists(st.tuples(st.sampled_from(["f", "get_x", "a_b"]), ARGUMENTS), min_size=1, max_size=4))
def test_parallel_calls_round_trip_in_every_json_format(calls: list[tuple[str, dict[str, Any]]]) -> None:
    actions = [Action(name, arguments) for name, arguments in calls]
    emitted = {
        "qwen25": "\n".join(
            f"<tool_call>\n{json.dumps({'name': a.name, 'arguments': a.kwargs})}\n</tool_call>"
            for a in actions
        ),
        "llama3": "<|python_tag|>"
        + ";".join(json.dumps({"name": a.name, "parameters": a.kwargs}) for a in actions),
        "mistral": "[TOOL_CALLS]" + json.dumps([{"name": a.name, "arguments": a.kwargs} for a in actions]),
        "deepseekv31": "<｜tool▁calls▁begin｜>"
        + "".join(
            f"<｜tool▁call▁begin｜>{a.name}<｜tool▁sep｜>{json.dumps(a.kwargs)}<｜tool▁call▁end｜>"
            for a in actions
        )
        + "<｜tool▁calls▁end｜>",
        "kimi_k2": "<|tool_calls_section_begin|>"
        + "".join(
            f"<|tool_call_begin|>functions.{a.name}:{n}<|tool_call_argument_begin|>{json.dumps(a.kwargs)}<|tool_call_end|>"
            for n, a in enumerate(actions)
        )
        + "<|tool_calls_section_end|>",
    }
    for name, text in emitted.items():
        assert get_parser(name)(text).actions == actions, name


# ---- the service: auto at start-up, GET /model ----


async def test_model_reports_the_format_auto_found(client: httpx.AsyncClient) -> None:
    model = (await client.get("/model")).json()
    assert model["tool_call_format"] == "qwen25"  # the test tokenizer's template writes <tool_call>
    assert set(model["tool_call_formats"]) == set(PARSERS)


@pytest.mark.parametrize(("template", "problem"), [("{{ messages }}", "shows none of the known"), (None, "")])
async def test_a_format_the_service_cannot_parse_stops_it_at_start(
    template: str | None, problem: str, tmp_path: Path, database_url: str
) -> None:
    settings = service_settings(database_url, "http://127.0.0.1:9", tool_call_format="nope")
    if template is not None:
        tokenizer = tmp_path / "tokenizer"
        shutil.copytree(TEST_TOKENIZER_DIR, tokenizer)
        (tokenizer / "chat_template.jinja").write_text(template)
        settings = service_settings(database_url, "http://127.0.0.1:9", tokenizer_path=str(tokenizer))
    with pytest.raises(ValueError, match=problem or "unknown tool-call format 'nope'") as error:
        async with lifespan(settings, Metrics(), asyncio.Event()):
            pass
    assert "qwen3_coder" in str(error.value) and "gpt-oss" in str(error.value)  # the known formats
