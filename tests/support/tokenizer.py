"""Shared tokenizer helpers for tests: the project's test tokenizer and non-canonical encodings."""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from service.config import ONE_CALL_TOOL_INSTRUCTION, TEMPLATE_TOOL_INSTRUCTION, TEST_TOKENIZER_DIR
from service.loop.tokens import ChatTokenizer


def fresh_test_tokenizer() -> Any:
    """The project's test tokenizer, a new instance (for a test that changes it). transformers is
    imported here, not at the top: every pytest-xdist worker paid for it (1.5 s of CPU) collecting."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TEST_TOKENIZER_DIR))


@cache
def load_test_tokenizer() -> Any:
    return fresh_test_tokenizer()


@cache
def chat_tokenizer() -> ChatTokenizer:
    return ChatTokenizer(
        load_test_tokenizer(),
        tool_instruction=ONE_CALL_TOOL_INSTRUCTION,
        template_tool_instruction=TEMPLATE_TOOL_INSTRUCTION,
    )


def noncanonical_ids(text: str, rng: random.Random, split_rate: float = 0.3) -> list[int]:
    """Encodes `text` as a sampler might: some tokens replaced by smaller ones with the same bytes."""
    tokenizer = load_test_tokenizer()
    vocab = tokenizer.get_vocab()
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    ids = []
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if token_id in special or len(piece) < 2 or rng.random() >= split_rate:
            ids.append(token_id)
            continue
        cut = rng.randint(1, len(piece) - 1)
        # Byte-level BPE: every single byte (character of the piece) is in the vocabulary.
        for part in (piece[:cut], piece[cut:]):
            ids.extend([vocab[part]] if part in vocab else [vocab[char] for char in part])
    return ids


TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"
LLAMA_SPECIAL_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


@dataclass(frozen=True)
class ChatVariant:
    """A tokenizer + chat template pair the loop must handle, and its end-of-turn token."""

    name: str
    chat: ChatTokenizer
    end_of_turn_id: int
    # Thinking templates render the conversation's last assistant message with a think block
    # that the model never saw when it was not last: a full re-render then differs there.
    rewrites_last_assistant: bool = False


@cache
def chat_variant(name: str) -> ChatVariant:
    if name == "chatml":
        tokenizer = load_test_tokenizer()
        return ChatVariant(name, chat_tokenizer(), tokenizer.convert_tokens_to_ids("<|im_end|>"))
    tokenizer = fresh_test_tokenizer()
    if name == "qwen3":
        tokenizer.chat_template = (TEMPLATES_DIR / "qwen3_thinking.jinja").read_text()
        end_of_turn = "<|im_end|>"
    elif name == "llama3":
        # A different tokenizer too: its own special tokens, BOS and end of turn.
        tokenizer.add_special_tokens({"additional_special_tokens": LLAMA_SPECIAL_TOKENS})
        tokenizer.bos_token = "<|begin_of_text|>"
        tokenizer.eos_token = "<|eot_id|>"
        tokenizer.chat_template = (TEMPLATES_DIR / "llama3_headers.jinja").read_text()
        end_of_turn = "<|eot_id|>"
    else:
        raise ValueError(name)
    chat = ChatTokenizer(
        tokenizer,
        tool_instruction=ONE_CALL_TOOL_INSTRUCTION,
        template_tool_instruction=TEMPLATE_TOOL_INSTRUCTION,
    )
    return ChatVariant(name, chat, tokenizer.convert_tokens_to_ids(end_of_turn), name == "qwen3")


CHAT_VARIANTS = ["chatml", "qwen3", "llama3"]
