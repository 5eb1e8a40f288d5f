"""Token accounting of one conversation: the ids the model saw and sampled, built incrementally.

The first prompt is rendered once with the chat template. After that nothing is re-rendered:
each turn appends the ids the engine returned (loss mask 1, its logprobs), the template tokens
that close the assistant turn when the model did not sample them, and the tokens of the next
message plus the next generation header (mask 0, logprob 0.0). Those template pieces come from
rendering only the new message against a small fixed prefix and taking the suffix, so a turn
costs what its new message costs, not what the conversation costs.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, overload

import orjson
from cachetools import LRUCache

from service.loop.detokenize import ByteLevelDecoder
from service.records import EpisodeTokens

_K = TypeVar("_K")  # a prompt cache's key
logger = logging.getLogger(__name__)

# Probe conversation for the template pieces. Contents are arbitrary but must not be empty
# (some templates skip empty contents) and must not look like template syntax.
PROBE_PREFIX = [{"role": "system", "content": "PROBE_SYSTEM"}, {"role": "user", "content": "PROBE_USER"}]
PROBE_ASSISTANT = {"role": "assistant", "content": "PROBE_ASSISTANT"}
PROMPT_CACHE_SIZE = 4096  # prompts kept: a batch's tasks (each a GRPO group), with room to spare
# Env replies kept as ids (see message_ids): a group's samples often get the same tool results.
MESSAGE_CACHE_SIZE = 8192
MESSAGE_CACHE_MAX_CHARS = 4096  # longer contents are encoded each time (bounds the cache's memory)
# Stands in for a message's content when its template text is learned (see message_ids).
CONTENT_SLOT = "PROBE_CONTENT_SLOT"
# Contents a learned template text must render exactly as the template does, or it is not used.
# Tool call ids a tool result is rendered with, to tell whether a template renders them.
PROBE_CALL_IDS = ("call_PROBE_0", "PROBE-TOOL-CALL-ID-1")
SLOT_CHECKS = ("  padded  ", "two\nlines\n", "{{ braces }} <tags> & 'quotes' \"double\"", "ünïcødé ✓")


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be extended incrementally (or renders a role badly)."""


class HFTokenizer(Protocol):
    """The part of a Hugging Face tokenizer this module uses."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class _FastTokenizer(Protocol):
    """A `tokenizers.Tokenizer` (a fast HF tokenizer's backend_tokenizer)."""

    def encode(self, sequence: str, add_special_tokens: bool = ...) -> Any: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True)
class EncodedIds:
    """The first `count` ids of a trajectory's P + R as JSON number text (without brackets)."""

    text: str
    count: int


@dataclass
class Trajectory:
    """The token arrays of one episode (see EpisodeTokens) as they grow; `tokens()` once done."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    # P + R as JSON number text, extended as R grows: encoding the whole conversation on every
    # turn would cost quadratic time over an episode (half our per-turn CPU at 30 turns).
    _encoded: str = field(default="", repr=False)
    _encoded_count: int = field(default=0, repr=False)

    def tokens(self) -> EpisodeTokens:
        """The arrays so far as one checked value, over this trajectory's own lists: take it when
        the trajectory grows no more."""
        return EpisodeTokens(self.prompt_ids, self.response_ids, self.loss_mask, self.rollout_logprobs)

    def input_ids(self) -> Sequence[int]:
        """P + R as one sequence, read in place: copying a 64k-token context on every turn would
        make a long episode's late turns dearer than its early ones."""
        return _Joined(self.prompt_ids, self.response_ids)

    def input_ids_json(self) -> str:
        """`json.dumps(self.input_ids())`, computed from the new ids only."""
        # orjson writes a list of ints as `",".join(map(str, ids))` in brackets, at a tenth of its
        # CPU: a measured hot path (every turn's new ids, 2-3% of the event loop at 2,000 in flight).
        if not self._encoded_count and self.prompt_ids:
            self._encoded = orjson.dumps(self.prompt_ids).decode()[1:-1]
            self._encoded_count = len(self.prompt_ids)
        new = self.response_ids[self._encoded_count - len(self.prompt_ids) :]
        if new:
            self._encoded = f"{self._encoded},{orjson.dumps(new).decode()[1:-1]}"
            self._encoded_count += len(new)
        return f"[{self._encoded}]"

    def encoded(self) -> EncodedIds:
        """What input_ids_json encoded so far, for a trajectory that continues this one."""
        return EncodedIds(self._encoded, self._encoded_count)

    def continue_encoding(self, encoded: EncodedIds | None) -> None:
        """Takes up what another trajectory with the same first ids encoded (`encoded()`)."""
        if encoded is not None and encoded.count <= len(self.prompt_ids) + len(self.response_ids):
            self._encoded, self._encoded_count = encoded.text, encoded.count

    def add_sampled(self, ids: list[int], logprobs: list[float]) -> None:
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} sampled ids but {len(logprobs)} logprobs")
        self.response_ids.extend(ids)
        self.loss_mask.extend([1] * len(ids))
        self.rollout_logprobs.extend(logprobs)

    def add_context(self, ids: list[int]) -> None:
        self.response_ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.rollout_logprobs.extend([0.0] * len(ids))


class _Joined(Sequence[int]):
    """Two lists read as their concatenation, without copying them."""

    __slots__ = ("_first", "_second")

    def __init__(self, first: list[int], second: list[int]) -> None:
        self._first, self._second = first, second

    def __len__(self) -> int:
        return len(self._first) + len(self._second)

    def __iter__(self) -> Iterator[int]:
        return itertools.chain(self._first, self._second)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return list(self)[index]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("index out of range")
        size = len(self._first)
        return self._first[index] if index < size else self._second[index - size]

    def __eq__(self, other: object) -> bool:
        return list(self) == (list(other) if isinstance(other, _Joined) else other)

    __hash__ = None  # type: ignore[assignment]


class ChatTokenizer:
    """Renders a conversation's pieces with one tokenizer's chat template, as token ids."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        tool_instruction: str = "",
        template_tool_instruction: str = "",
    ) -> None:
        self.tokenizer = tokenizer
        self.tool_instruction = tool_instruction
        self.template_tool_instruction = template_tool_instruction
        self._backend = self._checked_backend(tokenizer)
        self._byte_level = None if self._backend is None else ByteLevelDecoder.of(self._backend)
        # (role, name, whether it names a tool call) -> the text around a message's content, or
        # None where the template does not render the content verbatim (it trims or escapes it):
        # see message_ids.
        self._message_texts: dict[tuple[str, str | None, bool], tuple[str, str] | None] = {}
        # A group's samples share their prompt: its ids and their engine JSON, made once (see prompt).
        self._prompts: LRUCache[tuple[str, str, str], tuple[list[int], EncodedIds]]
        self._prompts = LRUCache(PROMPT_CACHE_SIZE)
        self._conversations: LRUCache[str, tuple[list[int], EncodedIds]]  # see conversation
        self._conversations = LRUCache(PROMPT_CACHE_SIZE)
        self._message_ids: dict[tuple[str, str | None, bool, str], list[int]] = {}  # see message_ids
        self._ids_ignored: dict[tuple[str, str | None], bool] = {}  # (role, name): see _id_free
        # Only what follows the assistant's content is taken from the template: thinking templates
        # (Qwen3) render the text before it differently once later messages exist, but never
        # the text after it, and the model has already seen and sampled everything before it.
        self.close_text = self._after_content(
            self.render([*PROBE_PREFIX, PROBE_ASSISTANT], add_generation_prompt=False)
        )
        self.close_ids = self.encode(self.close_text)
        if tool_instruction and template_tool_instruction:
            probe_tools = [
                {"type": "function", "function": {"name": "probe", "parameters": {"type": "object"}}}
            ]
            raw = tokenizer.apply_chat_template(
                PROBE_PREFIX, tools=probe_tools, tokenize=False, add_generation_prompt=True
            )
            if template_tool_instruction not in raw:
                logger.warning(
                    "the chat template has no %r: the one-call-per-turn tool instruction is not applied",
                    template_tool_instruction,
                )
        for role in ("user", "tool"):
            self.message_ids({"role": role, "content": "PROBE_MESSAGE"})  # fails early, not mid-episode

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool,
    ) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        if not isinstance(text, str):
            raise ChatTemplateError("apply_chat_template(tokenize=False) did not return text")
        if tools and self.tool_instruction and self.template_tool_instruction:
            text = text.replace(self.template_tool_instruction, self.tool_instruction)
        return text

    def encode(self, text: str) -> list[int]:
        if self._backend is not None:
            return list(self._backend.encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    @staticmethod
    def _checked_backend(tokenizer: HFTokenizer) -> _FastTokenizer | None:
        """The `tokenizers` backend of a fast tokenizer, called directly (half the cost of the
        transformers wrapper), if it encodes and decodes probes exactly as the wrapper does."""
        backend: _FastTokenizer | None = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        rendered = tokenizer.apply_chat_template(
            [*PROBE_PREFIX, PROBE_ASSISTANT], tokenize=False, add_generation_prompt=True
        )
        for text in (rendered if isinstance(rendered, str) else "", *SLOT_CHECKS):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if list(backend.encode(text, add_special_tokens=False).ids) != ids or backend.decode(
                ids, skip_special_tokens=False
            ) != tokenizer.decode(ids, skip_special_tokens=False):
                logger.warning("the tokenizer's backend differs from its wrapper: not used")
                return None
        return backend

    def decode(self, ids: list[int]) -> str:
        if self._byte_level is not None:
            return self._byte_level.decode(ids)
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=False)
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def prompt_ids(self, system_prompt: str, tools: list[dict[str, Any]], first_message: str) -> list[int]:
        """P: system prompt with the tools, the first user message, the first generation header.

        The samples of a GRPO group share their prompt: it is rendered and encoded once."""
        return self.prompt(system_prompt, tools, first_message).prompt_ids

    def prompt(self, system_prompt: str, tools: list[dict[str, Any]], first_message: str) -> Trajectory:
        """A new trajectory of P (prompt_ids), with P's engine JSON already encoded: a group's
        samples share it (encoding a tool-laden prompt's ids was an episode's dearest turn)."""
        # orjson: json.dumps of a tau-bench-sized tool list was 1% of the CPU at 2,000 in flight.
        key = (system_prompt, orjson.dumps(tools, option=orjson.OPT_SORT_KEYS).decode(), first_message)
        messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": first_message}]
        return self._shared_prompt(
            self._prompts, key, lambda: self.render(messages, tools=tools, add_generation_prompt=True)
        )

    def conversation(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Trajectory:
        """A new trajectory whose prompt is a whole conversation as the template renders it, with
        the next generation header, and nothing of this service's own (no tool instruction): an
        external agent's prompt. The samples of a group share theirs: it is rendered, and its
        engine JSON encoded, once (as `prompt`'s)."""
        key = json.dumps([messages, tools], sort_keys=True)
        return self._shared_prompt(
            self._conversations,
            key,
            lambda: str(
                self.tokenizer.apply_chat_template(
                    messages, tools=tools, tokenize=False, add_generation_prompt=True
                )
            ),
        )

    def _shared_prompt(
        self, cache: LRUCache[_K, tuple[list[int], EncodedIds]], key: _K, render: Callable[[], str]
    ) -> Trajectory:
        """A new trajectory of the prompt `render` writes, rendered, encoded and its engine JSON
        written once per `key` in `cache`."""
        cached = cache.get(key)
        if cached is None:
            first = Trajectory(self.encode(render()))
            first.input_ids_json()
            cached = cache[key] = (first.prompt_ids, first.encoded())
        ids, encoded = cached
        trajectory = Trajectory(list(ids))
        trajectory.continue_encoding(encoded)
        return trajectory

    def closing_ids(self, sampled_ids: list[int]) -> list[int]:
        """Template tokens that end the assistant turn after `sampled_ids`, less what the model sampled.

        If the model sampled the end-of-turn token (e.g. `<|im_end|>`), only the rest (`\\n`) is
        added; a turn cut by length or abort gets the whole closing sequence.
        """
        close = self.close_ids
        for overlap in range(min(len(close), len(sampled_ids)), 0, -1):
            if sampled_ids[-overlap:] == close[:overlap]:
                return close[overlap:]
        return list(close)

    def sampled_text(self, sampled_ids: list[int]) -> str:
        """The assistant message content of a turn: its sampled ids, less a sampled end of turn."""
        kept = len(sampled_ids) - (len(self.close_ids) - len(self.closing_ids(sampled_ids)))
        return self.decode(sampled_ids[:kept])

    def message_ids(self, message: dict[str, Any]) -> list[int]:
        """Ids of a user or tool message that follows an assistant turn, plus the next header.

        The template's text around a message's content is learned once per (role, name, whether
        it names a tool call) and reused, where the template renders the content verbatim (checked
        on SLOT_CHECKS); the ids are always those of encoding the whole message text at once. A
        tool result's `tool_call_id` is left to the template where it renders it (its text is then
        the message's own).
        """
        content = message.get("content")
        canonical = self._id_free(message) if isinstance(content, str) else None
        if canonical is not None:
            key = (str(message["role"]), message.get("name"), "tool_call_id" in message)
            if not content:  # rendered in full: some templates leave empty contents out altogether
                return self._cached(key, "", lambda: self.encode(self._message_text([canonical])))
            if key not in self._message_texts:
                self._message_texts[key] = self._learn_message_text(canonical)
            around = self._message_texts[key]
            if around is not None:
                if len(content) > MESSAGE_CACHE_MAX_CHARS:
                    return self.encode(around[0] + content + around[1])
                return self._cached(key, content, lambda: self.encode(around[0] + content + around[1]))
        return self.encode(self._message_text([message]))

    def _cached(
        self, key: tuple[str, str | None, bool], content: str, ids: Callable[[], list[int]]
    ) -> list[int]:
        """A copy of the message's ids, made once. Hand-written cache on the hot path: encoding env
        replies was 8-10% of the event loop at 2,000 in flight, and a group's samples often get the
        same ones."""
        cached = (*key, content)
        found = self._message_ids.get(cached)
        if found is None:
            found = self._message_ids[cached] = ids()
            if len(self._message_ids) > MESSAGE_CACHE_SIZE:
                del self._message_ids[next(iter(self._message_ids))]  # the oldest
        return list(found)

    def _id_free(self, message: dict[str, Any]) -> dict[str, Any] | None:
        """The message as the template renders it whatever its `tool_call_id` (that id replaced by
        a probe's), or None when its text may depend on more than its role, name, content and
        whether it has an id: other fields, or an id the template renders (checked once per role
        and name, rendering two probe ids)."""
        if not set(message) <= {"role", "name", "content", "tool_call_id"}:
            return None
        if "tool_call_id" not in message:
            return message
        key = (str(message["role"]), message.get("name"))
        if key not in self._ids_ignored:
            probes = [{**message, "content": CONTENT_SLOT, "tool_call_id": probe} for probe in PROBE_CALL_IDS]
            self._ids_ignored[key] = len({self._message_text([probe]) for probe in probes}) == 1
        return {**message, "tool_call_id": PROBE_CALL_IDS[0]} if self._ids_ignored[key] else None

    def messages_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """Ids of the messages that follow an assistant turn, plus the next header: the results of
        a turn's parallel tool calls are rendered together, as the template lays out several (Qwen
        puts them in one user turn, Llama gives each its own), never as separate renders."""
        if len(messages) == 1:
            return self.message_ids(messages[0])
        return self.encode(self._message_text(messages))

    def _message_text(self, messages: list[dict[str, Any]]) -> str:
        text = self.render([*PROBE_PREFIX, PROBE_ASSISTANT, *messages], add_generation_prompt=True)
        after_assistant = self._after_content(text)
        if not after_assistant.startswith(self.close_text):
            raise ChatTemplateError(
                f"a {messages[0]['role']!r} message changes how the assistant turn before it is closed"
            )
        return after_assistant[len(self.close_text) :]

    def _learn_message_text(self, message: dict[str, Any]) -> tuple[str, str] | None:
        slotted = self._message_text([{**message, "content": CONTENT_SLOT}])
        if slotted.count(CONTENT_SLOT) != 1:
            return None
        before, _, after = slotted.partition(CONTENT_SLOT)
        for content in (*SLOT_CHECKS, message["content"]):
            if before + content + after != self._message_text([{**message, "content": content}]):
                return None
        return before, after

    @staticmethod
    def _after_content(text: str) -> str:
        content = PROBE_ASSISTANT["content"]
        if text.count(content) != 1:
            raise ChatTemplateError("the chat template does not render an assistant message's content once")
        return text[text.index(content) + len(content) :]


REPLACEMENT_CHARACTER = "\ufffd"
MAX_CHARACTER_TOKENS = 4  # a UTF-8 character is at most 4 bytes, so at most 4 byte-level tokens


class TokenTexts:
    """Token id -> its text, one token decoded alone (special tokens kept), except where tokens
    split a multi-byte character (see `_mend_split_characters`). `tokenizer` gives the tokenizer,
    loaded on first use: a process that only serves the API loads it only if asked."""

    def __init__(self, tokenizer: Callable[[], Awaitable[HFTokenizer]]) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}  # bounded by the vocabulary

    async def texts(self, ids: Sequence[int]) -> list[str]:
        missing = set(ids).difference(self._texts)
        if missing:
            tokenizer = await self._tokenizer()
            decoded = await asyncio.to_thread(
                lambda: {token: tokenizer.decode([token], skip_special_tokens=False) for token in missing}
            )
            self._texts.update(decoded)
        texts = [self._texts[token] for token in ids]
        if any(REPLACEMENT_CHARACTER in text for text in texts):
            tokenizer = await self._tokenizer()
            await asyncio.to_thread(_mend_split_characters, tokenizer, ids, texts)
        return texts

    async def whole(self, ids: list[int]) -> str:
        """The text of `ids` decoded together (multi-byte characters whole)."""
        tokenizer = await self._tokenizer()
        return await asyncio.to_thread(lambda: tokenizer.decode(ids, skip_special_tokens=False))


def _mend_split_characters(tokenizer: HFTokenizer, ids: Sequence[int], texts: list[str]) -> None:
    """A byte-level token that holds part of a multi-byte character (é, 日, an emoji) decodes alone
    to U+FFFD. Where such a token and at most three after it decode together without one, their
    text goes to the first of them and the others read empty: the tokens read as the response
    decodes. A token that decodes to U+FFFD with every neighbour keeps it: the model sampled it."""
    index = 0
    while index < len(ids):
        if REPLACEMENT_CHARACTER in texts[index]:
            for end in range(index + 2, min(index + MAX_CHARACTER_TOKENS, len(ids)) + 1):
                text = tokenizer.decode(list(ids[index:end]), skip_special_tokens=False)
                if REPLACEMENT_CHARACTER not in text:
                    texts[index:end] = [text] + [""] * (end - index - 1)
                    index = end - 1
                    break
        index += 1
