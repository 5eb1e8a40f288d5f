from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.envs.base import RESPOND_ACTION_NAME, Action
from service.loop.toolcalls import ToolCallParseError, get_parser, parse_qwen25, strip_reasoning


def call(name: str, arguments: object, key: str = "arguments") -> str:
    return f"<tool_call>\n{json.dumps({'name': name, key: arguments})}\n</tool_call>"


def test_plain_text_is_a_respond_action() -> None:
    turn = parse_qwen25("Your order is on its way.")
    assert turn.actions == [Action(RESPOND_ACTION_NAME, {"content": "Your order is on its way."})]
    assert turn.calls == 0


def test_every_call_in_order_with_content_before_them() -> None:
    text = "Let me check.\n" + call("get_order", {"id": "#W1"}) + "\n" + call("cancel", {"id": "#W1"})
    turn = parse_qwen25(text)
    assert turn.actions == [Action("get_order", {"id": "#W1"}), Action("cancel", {"id": "#W1"})]
    assert turn.content == "Let me check."
    assert turn.calls == 2


def test_parameters_and_string_arguments_are_accepted() -> None:
    assert parse_qwen25(call("f", {"a": 1}, key="parameters")).action == Action("f", {"a": 1})
    assert parse_qwen25(call("f", json.dumps({"a": 1}))).action == Action("f", {"a": 1})


@pytest.mark.parametrize("broken_first", [True, False])
def test_a_malformed_call_among_good_ones_ends_the_turn(broken_first: bool) -> None:
    """SGLang skips it; run, the other calls would be answered and this one never: the episode is
    aborted instead, as a turn whose only call is malformed is."""
    broken = "<tool_call>\n{broken\n</tool_call>"
    text = f"{broken}\n{call('g', {})}" if broken_first else f"{call('g', {})}\n{broken}"
    with pytest.raises(ToolCallParseError):
        parse_qwen25(text)


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\n{broken json}\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',
        "<tool_call>{no newline}</tool_call>",
    ],
)
def test_unparseable_call_raises(text: str) -> None:
    with pytest.raises(ToolCallParseError):
        parse_qwen25(text)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>', "call 1 is not valid JSON ("),
        (
            '<tool_call>\n{"name": "f", "arguments": {}} and more\n</tool_call>',
            "call 1 has text after its JSON",
        ),
        (
            '<tool_call>\n{"arguments": {}}\n</tool_call>',
            'call 1 is not {"name": <text>, "arguments": <an object>}',
        ),
        (
            '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><tool_call>{}</tool_call>',
            "call 2 has no newline",
        ),
    ],
    ids=["missing-brace", "trailing-text", "no-name", "second-call"],
)
def test_a_parse_error_says_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ToolCallParseError) as error:
        parse_qwen25(text)
    assert says in str(error.value) and "unparseable" not in str(error.value)


def test_unclosed_call_at_the_end_is_parsed() -> None:
    assert parse_qwen25('<tool_call>\n{"name": "f", "arguments": {}}').action == Action("f", {})


def test_registry() -> None:
    assert get_parser("qwen25") is parse_qwen25
    with pytest.raises(ValueError, match=r"known: .*'qwen25'"):
        get_parser("nope")


TEXT = st.text(st.characters(exclude_categories=["Cs"]))  # Unicode text: no lone surrogates


@given(st.text(), st.dictionaries(TEXT, st.integers() | TEXT))
def test_any_arguments_round_trip(prefix: str, arguments: dict[str, object]) -> None:
    prefix = prefix.replace("<tool_call>", "")
    turn = parse_qwen25(prefix + call("tool", arguments))
    assert turn.action == Action("tool", arguments)


def test_a_closing_tag_inside_the_arguments_is_text() -> None:
    arguments = {"</tool_call>": "<tool_call>\n", "note": "a\n</tool_call>"}
    turn = parse_qwen25(call("tool", arguments) + call("second", {}))
    assert turn.actions == [Action("tool", arguments), Action("second", {})]


def test_reasoning_is_not_part_of_the_action() -> None:
    text = "<think>\nThe user wants order #W1.\n</think>\n\n" + call("get_order", {"id": "#W1"})
    assert parse_qwen25(strip_reasoning(text)).action == Action("get_order", {"id": "#W1"})
    # The header opened the thinking block; the sample starts inside it.
    assert strip_reasoning("checking...</think>\n\nYour order shipped.") == "Your order shipped."
    assert strip_reasoning("No reasoning here.") == "No reasoning here."


@pytest.mark.parametrize(
    "block",
    [
        '{"name": "get_order", "arguments": {"id": "\\ud800"}}',  # half a character
        '{"name": "get_order", "arguments": {"\\udfff": 1}}',
        '{"name": "get_order\\ud800", "arguments": {}}',
        '{"name": "get_order", "arguments": {"amount": NaN}}',  # not JSON, though Python reads it
        '{"name": "get_order", "arguments": {"amount": -Infinity}}',
        '{"name": "get_order", "arguments": "{\\"id\\": \\"\\\\ud800\\"}"}',  # the same, as a string
    ],
)
def test_a_call_no_database_could_store_is_no_call(block: str) -> None:
    """What the model wrote stays in its tokens; what the service stores and serves must be JSON."""
    with pytest.raises(ToolCallParseError):
        parse_qwen25(f"<tool_call>\n{block}\n</tool_call>")
    good = call("get_order", {"id": "#W1"})
    with pytest.raises(ToolCallParseError):
        parse_qwen25(f"{good}\n<tool_call>\n{block}\n</tool_call>")


def test_a_call_orjson_cannot_write_is_checked_by_json() -> None:
    """An int past 64 bits is JSON any database stores: the surrogate check's orjson refuses it and
    json's check takes it, as before."""
    block = '{"name": "get_order", "arguments": {"id": 123456789012345678901234567890}}'
    parsed = parse_qwen25(f"<tool_call>\n{block}\n</tool_call>")
    assert parsed.action == Action("get_order", {"id": 123456789012345678901234567890})
