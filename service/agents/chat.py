"""One chat completion of an external agent, recorded exactly.

The agent sends its whole conversation on every call. When it extends what the episode's current
segment recorded (the same messages, with the assistant's answers as this service gave them, then
new tool or user messages), only the new messages are rendered and appended as context (mask 0),
as the service's own loop does: the model's earlier tokens stay exactly as sampled. When it does
not (the agent dropped earlier reasoning, summarized, reordered, changed its tools), the
conversation is rendered whole as the prompt of a new segment: a training sample of its own that
shares the episode. Never a mask on tokens the model did not sample.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from service.engine.client import EngineError, EngineRequestError, Generation
from service.loop.runner import Engine, sample_turn
from service.loop.tokens import ChatTokenizer, Trajectory
from service.loop.toolcalls import ToolCallParseError, ToolCallParser, strip_reasoning
from service.records import DEFAULT_MAX_NEW_TOKENS, TurnRecord, attempt_rid_prefix
from service.storage.agents import AgentEpisode, HeldEpisodes, Segment

# The agent's sampling parameters that map onto SGLang's; the trainer's (POST /episodes) win.
OPENAI_TO_SGLANG = {
    "temperature": "temperature",
    "top_p": "top_p",
    "stop": "stop",
    "seed": "sampling_seed",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
}


class AgentCallError(Exception):
    """The call cannot be answered; `status` is its HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _text(content: Any) -> str:
    """A message's content as text: OpenAI's content parts joined, None as empty."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content)


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def message_key(message: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two messages the same turn of a conversation: role, text, and tool calls by name
    and arguments (call ids and the assistant's echoed reasoning are left out: the model's tokens
    for its turn are the sampled ones either way)."""
    calls = tuple(
        (
            call.get("function", {}).get("name"),
            json.dumps(_arguments(call.get("function", {}).get("arguments")), sort_keys=True),
        )
        for call in message.get("tool_calls") or ()
    )
    return (message.get("role"), _text(message.get("content")).strip(), calls)


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates take it: text content; tool-call arguments as objects."""
    out: dict[str, Any] = {"role": message.get("role"), "content": _text(message.get("content"))}
    for name in ("name", "tool_call_id"):
        if message.get(name) is not None:
            out[name] = message[name]
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": call.get("id"),
                "type": "function",
                "function": {
                    "name": call.get("function", {}).get("name"),
                    "arguments": _arguments(call.get("function", {}).get("arguments")),
                },
            }
            for call in message["tool_calls"]
        ]
    return out


@dataclass
class ChatCall:
    """A chat completion request, as this service uses it."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    sampling: dict[str, Any]  # the agent's, as SGLang names them
    max_tokens: int | None


@dataclass
class ChatAnswer:
    message: dict[str, Any]  # the assistant message, OpenAI's shape
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    segment: Segment
    closed: Segment | None  # the segment this call closed by starting a new one


def continuation(
    segment: Segment | None, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]] | None:
    """The messages that continue `segment` (its messages, then only tool and user messages), or
    None when `messages` do not continue it."""
    if segment is None or not segment.messages or segment.messages[-1].get("role") != "assistant":
        return None
    if segment.messages[0].get("tools", None) != (tools or None):
        return None
    recorded = [message_key(message) for message in segment.messages[1:]]
    new = messages[len(recorded) :]
    if not new or any(message.get("role") == "assistant" for message in new):
        return None
    if [message_key(message) for message in messages[: len(recorded)]] != recorded:
        return None
    return new


def _sampling(episode: AgentEpisode, call: ChatCall, response_so_far: int) -> dict[str, Any]:
    params = dict(call.sampling) | dict(episode.sampling_params)
    max_new_tokens = int(params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
    if call.max_tokens is not None:
        max_new_tokens = min(max_new_tokens, call.max_tokens)
    if episode.max_response_tokens is not None:
        remaining = episode.max_response_tokens - response_so_far
        if remaining <= 0:
            raise AgentCallError(
                409, f"the episode spent its max_response_tokens ({episode.max_response_tokens})"
            )
        max_new_tokens = min(max_new_tokens, remaining)
    return params | {"max_new_tokens": max_new_tokens}


class AgentChat:
    """Answers external agents' chat completions with the service's engine, tokenizer and parser."""

    def __init__(
        self, engine: Engine, chat: ChatTokenizer, parser: ToolCallParser, *, max_turn_resumes: int
    ) -> None:
        self.engine = engine
        self.chat = chat
        self.parser = parser
        self.max_turn_resumes = max_turn_resumes
        self.held = HeldEpisodes()  # its agents' episodes as this process stored them last

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
        segment = Segment(
            prompt_ids=self.chat.conversation_ids(
                [template_message(message) for message in call.messages], call.tools
            ),
            response_ids=[],
            loss_mask=[],
            rollout_logprobs=[],
            turns=[],
            messages=[head, *call.messages],
        )
        if last is not None:
            episode.segments += 1
        return segment, last, []

    async def answer(self, episode: AgentEpisode, call: ChatCall) -> ChatAnswer:
        if episode.calls >= episode.max_turns:
            raise AgentCallError(409, f"the episode made its max_turns ({episode.max_turns}) calls")
        segment, closed, context = self._segment_for(episode, call)
        trajectory = Trajectory(  # over the segment's own lists: what it adds, the segment holds
            prompt_ids=segment.prompt_ids,
            response_ids=segment.response_ids,
            loss_mask=segment.loss_mask,
            logprobs=segment.rollout_logprobs,
        )
        trajectory.add_context(context)
        prompt_tokens = len(trajectory.prompt_ids) + len(trajectory.response_ids)
        params = _sampling(episode, call, len(trajectory.response_ids))
        records: list[TurnRecord] = []
        rid = f"{attempt_rid_prefix(episode.episode_id, 0)}{episode.calls}"
        try:
            generation, sampled = await sample_turn(
                self.engine, trajectory, records, episode.calls, rid, params, self.max_turn_resumes
            )
        except EngineRequestError as error:  # e.g. the conversation outgrew the model's context
            raise AgentCallError(400, f"the engine refused the request: {error}") from None
        except EngineError as error:
            raise AgentCallError(502, f"the engine: {error}") from None
        if generation.finish_type == "abort":
            raise AgentCallError(
                502, f"the engine aborted the request: {generation.finish_reason.get('message', '')}"
            )
        trajectory.add_context(self.chat.closing_ids(sampled))
        message, finish_reason, actions = self._message(generation, sampled, call.tools, episode.calls)
        records[-1].action = actions[0] if actions else None
        records[-1].actions = actions if len(actions) > 1 else None
        segment.turns += [record.to_json() for record in records]
        segment.messages.append(message)
        return ChatAnswer(
            message=message,
            finish_reason=finish_reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=len(sampled),
            segment=segment,
            closed=closed,
        )

    def _message(
        self, generation: Generation, sampled: list[int], tools: list[dict[str, Any]] | None, call: int
    ) -> tuple[dict[str, Any], str, list[str]]:
        """The assistant message in OpenAI's shape, its finish reason, and the tools it called."""
        text = self.chat.sampled_text(sampled)
        visible = strip_reasoning(text)
        reasoning = text[: len(text) - len(visible)].replace("<think>", "").replace("</think>", "").strip()
        message: dict[str, Any] = {"role": "assistant", "content": visible.strip()}
        if reasoning:
            message["reasoning_content"] = reasoning
        try:
            parsed = self.parser(visible, tools)
        except ToolCallParseError:
            parsed = None  # not a well-formed call: the agent gets the text, as from OpenAI
        if parsed is not None and parsed.calls:
            message["content"] = parsed.content.strip() or None
            message["tool_calls"] = [
                {
                    "id": f"call_{call}_{index}",
                    "type": "function",
                    "function": {"name": action.name, "arguments": json.dumps(action.kwargs)},
                }
                for index, action in enumerate(parsed.actions)
            ]
            return message, "tool_calls", [action.name for action in parsed.actions]
        return message, "length" if generation.finish_type == "length" else "stop", []


def completion_body(answer: ChatAnswer, model: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "message": answer.message, "finish_reason": answer.finish_reason, "logprobs": None}
        ],
        "usage": _usage(answer),
    }


def _usage(answer: ChatAnswer) -> dict[str, int]:
    return {
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": answer.completion_tokens,
        "total_tokens": answer.prompt_tokens + answer.completion_tokens,
    }


def completion_chunks(answer: ChatAnswer, model: str, include_usage: bool) -> list[dict[str, Any]]:
    """The answer as OpenAI streams one: the role, the content, each tool call, the finish reason,
    and (with stream_options.include_usage) a last chunk with the usage and no choices."""
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
    }

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {
            **head,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
        }

    message = answer.message
    chunks = [chunk({"role": "assistant", "content": ""})]
    if message.get("reasoning_content"):
        chunks.append(chunk({"reasoning_content": message["reasoning_content"]}))
    if message.get("content"):
        chunks.append(chunk({"content": message["content"]}))
    for index, call in enumerate(message.get("tool_calls") or ()):
        chunks.append(chunk({"tool_calls": [{"index": index, **call}]}))
    chunks.append(chunk({}, answer.finish_reason))
    if include_usage:
        chunks.append({**head, "choices": [], "usage": _usage(answer)})
    return chunks
