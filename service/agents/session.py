"""One call of an external agent, answered and recorded exactly (no storage here).

The agent sends its whole conversation on every call. When it extends what the episode's current
segment recorded (the same messages, with the assistant's answers as this service gave them, then
new tool or user messages), only the new messages are rendered and appended as context (mask 0),
as the service's own loop does: the model's earlier tokens stay exactly as sampled. When it does
not (the agent dropped earlier reasoning, summarized, reordered, changed its tools), the
conversation is rendered whole as the prompt of a new segment: a training sample of its own that
shares the episode. Never a mask on tokens the model did not sample.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from service.agents.conversation import (
    Answer,
    ChatCall,
    ToolCall,
    continuation,
    named_tool_results,
    template_message,
)
from service.agents.errors import EngineRefused, EngineUnavailable, EpisodeClosed
from service.agents.repository import AgentEpisode, Segment
from service.agents.streaming import GONE, AnswerStream, TextDeltas
from service.engine.client import EngineError, EngineRequestError, Generation, OnTokens
from service.loop.runner import Engine, sample_turn
from service.loop.tokens import ChatTokenizer, Trajectory
from service.loop.toolcalls import ToolCallParseError, ToolCallParser
from service.loop.transcript import call_id, split_reasoning
from service.records import DEFAULT_MAX_NEW_TOKENS, EpisodeTokens, TurnRecord, attempt_rid_prefix


@dataclass(frozen=True)
class AnsweredCall:
    """A call's answer and what to store of it."""

    answer: Answer
    segment: Segment  # the episode's last segment, with this call
    closed: Segment | None  # the segment this call closed by starting a new one


def _sampling(episode: AgentEpisode, call: ChatCall, response_so_far: int) -> dict[str, Any]:
    params = dict(call.sampling) | dict(episode.sampling_params)  # the trainer's win
    max_new_tokens = int(params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
    if call.max_tokens is not None:
        max_new_tokens = min(max_new_tokens, call.max_tokens)
    if episode.max_response_tokens is not None:
        remaining = episode.max_response_tokens - response_so_far
        if remaining <= 0:
            raise EpisodeClosed(f"the episode spent its max_response_tokens ({episode.max_response_tokens})")
        max_new_tokens = min(max_new_tokens, remaining)
    return params | {"max_new_tokens": max_new_tokens}


class StreamingEngine(Engine, Protocol):
    async def generate_streamed(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        rid: str,
        on_tokens: OnTokens,
        *,
        input_ids_json: str | None = None,
    ) -> Generation: ...


class _Streamed:
    """The engine as one streamed call uses it: every generation streams to `stream`; once the
    agent left, the generation in flight is aborted and none is resumed (the abort is marked as
    a refused request, HTTP 499 "client closed request", which sample_turn does not resume)."""

    def __init__(self, engine: StreamingEngine, stream: AnswerStream) -> None:
        self.engine = engine
        self.stream = stream
        self._rid: str | None = None
        self._aborts: set[asyncio.Task[None]] = set()
        stream.abort = self._abort_running

    def _abort_running(self) -> None:
        if self._rid is not None:
            task = asyncio.get_running_loop().create_task(self.engine.abort(self._rid))
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        rid: str,
        *,
        input_ids_json: str | None = None,
    ) -> Generation:
        if self.stream.gone:
            return Generation(
                [], [], "abort", {"type": "abort", "message": GONE, "status_code": 499}, None, None, None, ""
            )
        self._rid = rid
        try:
            generation = await self.engine.generate_streamed(
                input_ids, sampling_params, rid, self.stream.on_tokens, input_ids_json=input_ids_json
            )
        finally:
            self._rid = None
        if self.stream.gone and generation.finish_type == "abort":
            return replace(generation, finish_reason={"type": "abort", "message": GONE, "status_code": 499})
        return generation

    async def abort(self, rid: str) -> None:
        await self.engine.abort(rid)


class AgentTurns:
    """Answers external agents' calls with the service's engine, tokenizer and tool-call parser."""

    def __init__(
        self, engine: StreamingEngine, chat: ChatTokenizer, parser: ToolCallParser, *, max_turn_resumes: int
    ) -> None:
        self.engine = engine
        self.chat = chat
        self.parser = parser
        self.max_turn_resumes = max_turn_resumes

    def _segment_for(
        self, episode: AgentEpisode, call: ChatCall
    ) -> tuple[Segment, Segment | None, list[int]]:
        """The segment this call continues and the ids of its new messages (context to append); or
        a new segment, no ids, and the segment it closes."""
        last = episode.last
        new = continuation(last, call.messages, call.tools)
        if last is not None and new is not None:  # `last` is this call's own copy: extended in place
            last.messages += new
            return last, None, self.chat.messages_ids([template_message(message) for message in new])
        # The first message records the tools the prompt was rendered with.
        head = {"role": "tools", "tools": call.tools or None}
        prompt = self.chat.conversation([template_message(message) for message in call.messages], call.tools)
        segment = Segment(
            tokens=EpisodeTokens(prompt.prompt_ids, [], [], []),
            turns=[],
            messages=[head, *call.messages],
            input_json=prompt.encoded(),
        )
        if last is not None:
            episode.segments += 1
        return segment, last, []

    async def answer(
        self, episode: AgentEpisode, call: ChatCall, stream: AnswerStream | None = None
    ) -> AnsweredCall:
        """Samples the answer to `call` and records it in the episode's segment (`episode` is this
        call's own copy, `call` its whole conversation); raises EpisodeClosed, EngineRefused or
        EngineUnavailable. With `stream`,
        the sampled text goes there as the engine samples it; if its agent leaves meanwhile, the
        generation is aborted and what it sampled is the call's answer."""
        if episode.calls >= episode.max_turns:
            raise EpisodeClosed(f"the episode made its max_turns ({episode.max_turns}) calls")
        assert call.previous_call is None, "resolved by AgentSessions: the conversation is whole here"
        call = replace(call, messages=named_tool_results(call.messages))
        segment, closed, context = self._segment_for(episode, call)
        tokens = segment.tokens
        trajectory = Trajectory(  # grows copies: a call that fails leaves the segment as it was
            prompt_ids=tokens.prompt_ids,
            response_ids=list(tokens.response_ids),
            loss_mask=list(tokens.loss_mask),
            rollout_logprobs=list(tokens.rollout_logprobs),
        )
        trajectory.continue_encoding(segment.input_json)  # the segment's ids so far: not encoded again
        trajectory.add_context(context)
        prompt_tokens = len(trajectory.prompt_ids) + len(trajectory.response_ids)
        params = _sampling(episode, call, len(trajectory.response_ids))
        records: list[TurnRecord] = []
        rid = f"{attempt_rid_prefix(episode.episode_id, episode.attempt)}{episode.calls}"
        engine: Engine = self.engine
        if stream is not None:
            stream.prompt_tokens = prompt_tokens
            if stream.deltas is None:
                stream.deltas = TextDeltas(self.chat.sampled_text, list(params.get("stop") or []))
            else:  # answered again (what this process held was stale): the agent saw the first
                stream.muted = True
            engine = _Streamed(self.engine, stream)
        try:
            generation, sampled = await sample_turn(
                engine, trajectory, records, episode.calls, rid, params, self.max_turn_resumes
            )
        except EngineRequestError as error:  # e.g. the conversation outgrew the model's context
            raise EngineRefused(f"the engine refused the request: {error}") from None
        except EngineError as error:
            raise EngineUnavailable(f"the engine: {error}") from None
        if generation.finish_type == "abort" and not (stream is not None and stream.gone):
            raise EngineUnavailable(
                f"the engine aborted the request: {generation.finish_reason.get('message', '')}"
            )
        trajectory.add_context(self.chat.closing_ids(sampled))
        answer = self._answer(generation, sampled, call.tools, episode.calls, prompt_tokens)
        actions = [tool_call.name for tool_call in answer.tool_calls]
        records[-1].action = actions[0] if actions else None
        records[-1].actions = actions if len(actions) > 1 else None
        segment.tokens = trajectory.tokens()
        segment.input_json = trajectory.encoded()
        segment.turns += [record.to_json() for record in records]
        segment.messages.append(answer.message | {"sampled": answer.sampled})  # loop/transcript.py's shape
        return AnsweredCall(answer, segment, closed)

    def _answer(
        self,
        generation: Generation,
        sampled: list[int],
        tools: list[dict[str, Any]] | None,
        call: int,
        prompt_tokens: int,
    ) -> Answer:
        """The sampled ids as an answer: visible text, reasoning, tool calls, finish reason."""
        text = sampled_text = self.chat.sampled_text(sampled)
        matched = generation.finish_reason.get("matched")  # SGLang's: a stop string, or a stop token's id
        stop_sequence = matched if isinstance(matched, str) else None
        if stop_sequence and stop_sequence in text:  # the text ends before it, as OpenAI's and Anthropic's
            text = text[: text.index(stop_sequence)]
        reasoning, visible = split_reasoning(text)
        try:
            parsed = self.parser(visible, tools)
        except ToolCallParseError:
            parsed = None  # not a well-formed call: the agent gets the text, as from OpenAI
        if parsed is not None and parsed.calls:
            return Answer(
                content=parsed.content.strip() or None,
                reasoning=reasoning or None,
                tool_calls=[
                    ToolCall(id=call_id(call, index), name=action.name, arguments=action.kwargs)
                    for index, action in enumerate(parsed.actions)
                ],
                finish_reason="tool_calls",
                sampled=sampled_text,
                call=call,
                prompt_tokens=prompt_tokens,
                completion_tokens=len(sampled),
            )
        return Answer(
            content=visible.strip(),
            reasoning=reasoning or None,
            finish_reason="length" if generation.finish_type == "length" else "stop",
            stop_sequence=stop_sequence,
            sampled=sampled_text,
            call=call,
            prompt_tokens=prompt_tokens,
            completion_tokens=len(sampled),
        )
