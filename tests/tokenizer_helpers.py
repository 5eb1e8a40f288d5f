"""Shared tokenizer helpers for tests: the project's test tokenizer and non-canonical encodings."""

from __future__ import annotations

import random
from functools import cache
from typing import Any

from transformers import AutoTokenizer

from service.config import ONE_CALL_TOOL_INSTRUCTION, TEMPLATE_TOOL_INSTRUCTION, TEST_TOKENIZER_DIR
from service.loop.tokens import ChatTokenizer


@cache
def load_test_tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(str(TEST_TOKENIZER_DIR))


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
