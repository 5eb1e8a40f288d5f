"""A call answered as a stream: the sampled ids as the engine sends them, turned into the text an
agent may be shown so far, and the agent going away (no I/O of its own).

An answer's text is shown as the model samples it: reasoning up to `</think>`, then the visible
text, less what may still turn out to be something else: a tool call's opening (its call comes
whole at the end, parsed), an agent's stop string (cut from the answer), trailing whitespace (the
answer is stripped) and an incomplete character. So the shown text is, but for a rare model that
writes reasoning without its tags, a prefix of what the non-streamed answer carries; the rest is
shown at the end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from service.agents.conversation import Answer

Kind = Literal["reasoning", "content"]
Delta = tuple[Kind, str]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Where the tool-call formats (TOOL_CALL_FORMAT) open a call: text from one on is held back.
TOOL_CALL_OPENERS = (
    "<tool_call>",  # qwen25/hermes, glm45
    "<function=",  # qwen3_coder
    "[TOOL_CALLS]",  # mistral
    "<｜tool▁calls▁begin｜>",  # deepseekv3
    "<|tool_calls_section_begin|>",  # kimi_k2
    "<|channel|>",  # gpt-oss
    "<|python_tag|>",  # llama3
)


def _held_tail(text: str, markers: tuple[str, ...] | list[str]) -> int:
    """Where `text` must be cut so that no marker starts in what is shown: at a marker it holds,
    else before a tail that may be a marker's beginning."""
    cut = len(text)
    for marker in markers:
        found = text.find(marker)
        if found >= 0:
            cut = min(cut, found)
            continue
        # The earliest start of a tail that begins the marker: only where its first character is
        # (a find, where trying every tail's size was half of reading a streamed frame: py-spy).
        start = text.find(marker[0], max(0, len(text) - len(marker) + 1))
        while start >= 0:
            if marker.startswith(text[start:]):
                cut = min(cut, start)
                break
            start = text.find(marker[0], start + 1)
    return cut


def shown_text(text: str, markers: tuple[str, ...] | list[str]) -> str:
    """The part of a growing text that can be shown now: before any marker (or its possible
    beginning), without leading or trailing whitespace or an incomplete last character."""
    text = text.rstrip("\ufffd")
    return text[: _held_tail(text, markers)].strip()


class TextDeltas:
    """A growing answer's text, as the deltas of reasoning and content to show next."""

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]) -> None:
        self._decode = decode
        self._content_markers = (*TOOL_CALL_OPENERS, *stops)
        self.ids: list[int] = []
        self.shown: dict[Kind, str] = {"reasoning": "", "content": ""}

    def add(self, ids: list[int]) -> list[Delta]:
        self.ids += ids
        text = self._decode(self.ids)
        opened = text.lstrip()
        if THINK_CLOSE in text:
            before, _, after = text.partition(THINK_CLOSE)
            reasoning, content = before.replace(THINK_OPEN, ""), after
        elif opened.startswith(THINK_OPEN):
            reasoning, content = opened[len(THINK_OPEN) :], ""
        elif THINK_OPEN.startswith(opened):  # it may still open with <think>
            reasoning, content = "", ""
        else:
            reasoning, content = "", text
        return [
            *self._delta("reasoning", shown_text(reasoning, (THINK_CLOSE,))),
            *self._delta("content", shown_text(content, self._content_markers)),
        ]

    def rest(self, answer: Answer) -> list[Delta]:
        """What is left to show of the answer as it was recorded."""
        return [
            *self._delta("reasoning", answer.reasoning or ""),
            *self._delta("content", answer.content or ""),
        ]

    def _delta(self, kind: Kind, text: str) -> list[Delta]:
        shown = self.shown[kind]
        if len(text) <= len(shown) or not text.startswith(shown):
            return []  # nothing new, or not what was shown (never taken back)
        self.shown[kind] = text
        return [(kind, text[len(shown) :])]


GONE = "the agent went away mid-stream"


@dataclass
class AnswerStream:
    """A call being answered as a stream: the ids the engine samples go to `on_tokens`, which
    keeps what may be shown of them (`take`) and wakes the response waiting in `changed`;
    `leave()` says the agent went away (its generation is aborted and what it sampled is
    recorded)."""

    deltas: TextDeltas | None = None  # set once the call's tokenizer is known
    pending: list[Delta] = field(default_factory=list)  # shown, not yet taken
    prompt_tokens: int = 0  # the call's, once known (before its first token)
    gone: bool = False
    muted: bool = False  # no more deltas: the call is answered again, the agent saw the first
    abort: Callable[[], None] | None = None  # aborts the generation in flight, if any
    # What `changed` waits on: one future per wait, where a queue's get() was a task per frame
    # (bench/verifiers_envs.py --profile: the streamed answer's tasks and waits).
    _waiter: asyncio.Future[None] | None = None

    def on_tokens(self, ids: list[int]) -> None:
        if self.deltas is not None and not self.muted and (shown := self.deltas.add(ids)):
            self.pending += shown
            self.wake()

    def take(self) -> list[Delta]:
        shown, self.pending = self.pending, []
        return shown

    def wake(self, *_: object) -> None:
        """Ends the current `changed` wait, if any (a done callback for the call and the agent)."""
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def changed(self) -> None:
        """Returns at the next `wake` (new text, or whatever else the caller made call it)."""
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def leave(self) -> None:
        self.gone = True
        if self.abort is not None:
            self.abort()
