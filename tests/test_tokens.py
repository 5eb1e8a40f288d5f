"""ChatTokenizer: the template pieces it derives, and the templates it refuses."""

from __future__ import annotations

import json
import logging
import random
from typing import Any

import pytest

from service.loop.detokenize import ByteLevelDecoder
from service.loop.tokens import ChatTemplateError, ChatTokenizer, TokenTexts, Trajectory
from tests.support.tokenizer import (
    TEMPLATES_DIR,
    chat_tokenizer,
    chat_variant,
    fresh_test_tokenizer,
    load_test_tokenizer,
)


def test_closing_ids_skip_what_the_model_sampled() -> None:
    chat = chat_tokenizer()
    im_end, newline = chat.close_ids
    assert chat.closing_ids([7, 8, im_end]) == [newline]  # sampled <|im_end|>: only "\n" is added
    assert chat.closing_ids([7, 8]) == [im_end, newline]  # cut by length or abort: the whole close
    assert chat.closing_ids([]) == [im_end, newline]
    assert chat.sampled_text([*chat.encode("hello"), im_end]) == "hello"
    assert chat.sampled_text(chat.encode("hello")) == "hello"


def test_prompt_has_the_one_call_instruction_and_ends_with_the_header() -> None:
    chat = chat_tokenizer()
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    text = chat.decode(chat.prompt_ids("Be brief.", tools, "Hi"))
    assert "allowed to call one or no function" in text
    assert "You may call one or more functions" not in text
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_thinking_template_is_accepted() -> None:
    """Qwen3-style templates re-render the last assistant turn; pieces are taken after its content."""
    chat = chat_variant("qwen3").chat
    assert chat.close_text == "<|im_end|>\n"
    assert chat.decode(chat.message_ids({"role": "user", "content": "ok"})) == (
        "<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_template_that_drops_assistant_content_is_refused() -> None:
    tokenizer = fresh_test_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role != 'assistant' %}{{ m.role }}: {{ m.content }}\n{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="content once"):
        ChatTokenizer(tokenizer)


def test_trajectory_keeps_lengths_aligned() -> None:
    trajectory = Trajectory(prompt_ids=[1, 2])
    trajectory.add_sampled([5, 6], [-0.5, -0.25])
    trajectory.add_context([9])
    assert trajectory.input_ids() == [1, 2, 5, 6, 9]
    assert trajectory.loss_mask == [1, 1, 0] and trajectory.rollout_logprobs == [-0.5, -0.25, 0.0]
    with pytest.raises(ValueError, match="2 sampled ids but 1 logprobs"):
        trajectory.add_sampled([1, 2], [-1.0])


def test_a_template_without_the_tool_instruction_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    tokenizer = fresh_test_tokenizer()
    tokenizer.chat_template = (TEMPLATES_DIR / "llama3_headers.jinja").read_text()
    ChatTokenizer(tokenizer, tool_instruction="One call a turn.", template_tool_instruction="You may call")
    assert "tool instruction is not applied" in caplog.text
    caplog.clear()
    ChatTokenizer(
        load_test_tokenizer(), tool_instruction="One call a turn.", template_tool_instruction="You may call"
    )
    assert "not applied" not in caplog.text


@pytest.mark.parametrize("variant", ["chatml", "qwen3", "llama3"])
def test_a_learned_message_text_gives_the_ids_of_a_full_render(variant: str) -> None:
    chat = chat_variant(variant).chat
    messages = [
        {"role": "user", "content": "Cancel order #W1, please.\n"},
        {"role": "tool", "name": "get_order", "content": '{"id": "#W1", "status": "pending"}'},
        {"role": "user", "content": "  spaced  "},
        {"role": "tool", "name": "get_order", "content": ""},
    ]
    for _ in range(2):  # encoded, then from the cache: the same ids
        for message in messages:
            assert chat.message_ids(message) == chat.encode(chat._message_text([message]))
    assert chat._message_texts[("user", None, False)] is not None  # learned, then reused
    cached = chat.message_ids(messages[1])
    cached.append(0)  # a caller's list is its own
    assert chat.message_ids(messages[1]) == cached[:-1]


def test_a_groups_samples_share_their_prompt_and_its_engine_json() -> None:
    chat = chat_tokenizer()
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    first, second = chat.prompt("Be brief.", tools, "Hi"), chat.prompt("Be brief.", tools, "Hi")
    assert first.prompt_ids == second.prompt_ids == chat.prompt_ids("Be brief.", tools, "Hi")
    assert first.prompt_ids is not second.prompt_ids  # each episode grows its own
    second.add_sampled([5, 6], [-0.5, -0.25])
    assert json.loads(second.input_ids_json()) == [*first.prompt_ids, 5, 6]
    assert json.loads(first.input_ids_json()) == first.prompt_ids


def test_a_template_that_trims_contents_is_rendered_in_full() -> None:
    tokenizer = fresh_test_tokenizer()  # its own: the template changes
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    chat = ChatTokenizer(tokenizer)
    message = {"role": "user", "content": "  padded  "}
    assert (
        chat.decode(chat.message_ids(message))
        == "<|im_start|>user\npadded<|im_end|>\n<|im_start|>assistant\n"
    )
    assert chat._message_texts[("user", None, False)] is None


@pytest.mark.parametrize("variant", ["chatml", "qwen3", "llama3"])
def test_tool_results_naming_their_call_give_the_ids_of_a_full_render(variant: str) -> None:
    """An agent's tool results carry their call's id (OpenAI's tool_call_id), which these templates
    do not render: learned and cached as any message, empty contents too, with the ids of the
    message rendered whole."""
    chat = chat_variant(variant).chat
    messages = [
        {"role": "tool", "name": "bash", "tool_call_id": "call_0_0", "content": "total 0\n"},
        {"role": "tool", "name": "bash", "tool_call_id": "call_1_0", "content": ""},
        {"role": "tool", "name": "bash", "tool_call_id": "call_7_0", "content": ""},
    ]
    for _ in range(2):
        for message in messages:
            assert chat.message_ids(message) == chat.encode(chat._message_text([message]))
    assert chat._ids_ignored[("tool", "bash")] and chat._message_texts[("tool", "bash", True)] is not None


def test_a_template_that_renders_tool_call_ids_is_rendered_in_full() -> None:
    tokenizer = fresh_test_tokenizer()  # its own: the template changes
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_call_id %}[{{ m.tool_call_id }}] "
        "{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    chat = ChatTokenizer(tokenizer)
    for call, content in (("call_1", "ok"), ("call_2", "ok"), ("call_3", "")):
        message = {"role": "tool", "tool_call_id": call, "content": content}
        assert chat.decode(chat.message_ids(message)) == (
            f"<|im_start|>tool\n[{call}] {content}<|im_end|>\n<|im_start|>assistant\n"
        )
    assert not chat._ids_ignored[("tool", None)]


async def test_token_texts_keep_multi_byte_characters_whole() -> None:
    """Byte-level tokens that split ï, 日 or an emoji read as the character on its first token (the
    rest empty), not as U+FFFD each; every other token reads as it decodes alone."""
    tokenizer = load_test_tokenizer()

    async def loaded() -> Any:
        return tokenizer

    ids = tokenizer.encode("naïve 日本語 🙂 ok", add_special_tokens=False)
    alone = [tokenizer.decode([token]) for token in ids]
    texts = await TokenTexts(loaded).texts(ids)
    assert texts == [
        "n",
        "a",
        "ï",
        "",
        "ve",
        " ",
        "日",
        "",
        "",
        "本",
        "",
        "",
        "語",
        "",
        "",
        " ",
        "🙂",
        "",
        "",
        "",
        " o",
        "k",
    ]
    assert alone.count("\ufffd") == 15  # what each of them decodes to alone
    # U+FFFD sampled as such (3 byte-level tokens) decodes to U+FFFD with any neighbour: kept.
    sampled = tokenizer.encode("a\ufffd", add_special_tokens=False)
    assert await TokenTexts(loaded).texts(sampled) == [tokenizer.decode([token]) for token in sampled]


# ---- byte-level decoding by table (service/loop/detokenize.py) ----


def test_sampled_text_is_decoded_by_table_as_the_tokenizer_decodes() -> None:
    """Random ids (tokens of every kind, added ones among them) and runs of single-byte tokens
    (which make and break multi-byte characters: U+FFFD where they break) decode as the
    tokenizer's own decoder does."""
    backend = load_test_tokenizer().backend_tokenizer
    decoder = ByteLevelDecoder.of(backend)
    assert decoder is not None and chat_tokenizer()._byte_level is not None
    size = backend.get_vocab_size(with_added_tokens=True)
    single_bytes = [token_id for token_id in range(size) if len(decoder._table[token_id]) == 1]
    rng = random.Random(7)
    probes = [[rng.randrange(size) for _ in range(rng.randrange(0, 60))] for _ in range(500)]
    probes += [[rng.choice(single_bytes) for _ in range(rng.randrange(1, 12))] for _ in range(500)]
    probes.append([*chat_tokenizer().encode('ünïcødé ✓ <tool_call>{"a": 1}</tool_call>'), 2])  # <|im_end|>
    texts = [decoder.decode(ids) for ids in probes]
    assert texts == backend.decode_batch(probes, skip_special_tokens=False)
    assert any("\ufffd" in text for text in texts)  # broken characters were among them


def test_ids_outside_the_table_go_to_the_tokenizer() -> None:
    backend = load_test_tokenizer().backend_tokenizer
    decoder = ByteLevelDecoder.of(backend)
    assert decoder is not None
    size = backend.get_vocab_size(with_added_tokens=True)
    ids = [100, size + 5, 101]
    assert decoder.decode(ids) == backend.decode(ids, skip_special_tokens=False)


def test_a_tokenizer_that_is_not_byte_level_or_decodes_otherwise_keeps_its_decoder(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from tokenizers import Tokenizer, decoders, models

    metaspace = Tokenizer(models.WordLevel({"▁a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    metaspace.decoder = decoders.Metaspace()
    assert ByteLevelDecoder.of(metaspace) is None

    backend = fresh_test_tokenizer().backend_tokenizer
    backend.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)])  # drops a space
    assert ByteLevelDecoder.of(backend) is None  # not a ByteLevel decoder alone

    class Differs:  # a ByteLevel decoder whose output the table would not give
        decoder = decoders.ByteLevel()

        def __getattr__(self, name: str) -> Any:
            return getattr(load_test_tokenizer().backend_tokenizer, name)

        def decode_batch(self, probes: list[list[int]], skip_special_tokens: bool) -> list[str]:
            texts = load_test_tokenizer().backend_tokenizer.decode_batch(probes, skip_special_tokens)
            return [*texts[:-1], texts[-1] + "!"]

    with caplog.at_level(logging.WARNING, logger="service.loop.detokenize"):
        assert ByteLevelDecoder.of(Differs()) is None
    assert "differs from its table" in caplog.text
