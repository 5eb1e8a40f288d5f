"""Property tests: the four invariants of docs/trainer-contract.md hold for any conversation.

The runner is driven by an engine double that answers as SGLang's /generate does (ids, logprobs,
finish reasons stop/length/abort, stop token included or not) with ids that are NOT the canonical
tokenization of its text, and by an environment double with arbitrary observations.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import cycle, islice, takewhile
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.api.token_calls import token_version_codes
from service.engine.client import Generation
from service.envs.base import Action, Reset, Step
from service.loop.runner import EpisodeRunner
from service.loop.toolcalls import ToolCallParseError, get_parser
from service.records import EpisodeRequest, EpisodeResult, EpisodeSpec, EpisodeStatus
from tests.support.contract import GenerateCall, assert_trainer_contract
from tests.support.tokenizer import CHAT_VARIANTS, ChatVariant, chat_tokenizer, chat_variant, noncanonical_ids

text = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=60).filter(
    lambda value: "<|" not in value
)


MAX_TURN_RESUMES = 3


@dataclass
class PlannedTurn:
    kind: str  # tool | respond | malformed
    body: str
    finish: str  # stop_with_token | stop_without_token | length | length_at_eot | refused
    observation: str
    split_seed: int
    # Engine aborts (a weight update) cutting the turn's calls short, each after `cuts[i]` more of
    # its tokens; past MAX_TURN_RESUMES the episode fails.
    cuts: list[int] = field(default_factory=list)
    calls: int = 1  # tool calls in a `tool` turn: parallel calls when more than one


@st.composite
def planned_turns(draw: st.DrawFn) -> PlannedTurn:
    kind = draw(st.sampled_from(["tool", "tool", "respond", "malformed"]))
    finish = draw(
        st.sampled_from(
            ["stop_with_token", "stop_with_token", "stop_without_token", "length", "length_at_eot", "refused"]
        )
    )
    cuts = draw(st.lists(st.integers(0, 12), max_size=MAX_TURN_RESUMES + 1))
    calls = draw(st.integers(1, 3))
    return PlannedTurn(kind, draw(text), finish, draw(text), draw(st.integers(0, 2**32)), cuts, calls)


@dataclass
class RecordingEngine:
    """Answers each turn's calls from its plan: the turn's output (which `finish` ends), cut by an
    abort after each of `cuts` (partial output, finish abort) and continued by the resumed calls."""

    turns: list[PlannedTurn]
    variant: ChatVariant
    calls: list[tuple[list[int], Generation]] = field(default_factory=list)
    rids: list[str] = field(default_factory=list)

    def planned_output(self, plan: PlannedTurn) -> tuple[list[int], list[float], dict[str, Any]]:
        if plan.kind == "tool":
            calls = [
                json.dumps({"name": "lookup", "arguments": {"q": f"{n}:{plan.body[:20]}"}})
                for n in range(plan.calls)
            ]
            reply = plan.body + "\n".join(f"<tool_call>\n{call}\n</tool_call>" for call in calls)
        elif plan.kind == "malformed":
            reply = f"<tool_call>\n{{not json {plan.body}\n</tool_call>"
        else:
            reply = plan.body or "ok"
        rng = random.Random(plan.split_seed)
        ids = noncanonical_ids(reply, rng)
        finish: dict[str, Any]
        if plan.finish == "length":
            ids = ids[: max(1, len(ids) // 2)]
            finish = {"type": "length", "length": len(ids)}
        elif plan.finish == "refused":  # an abort that is the engine refusing the request (4xx)
            ids = ids[: len(ids) // 3]
            finish = {"type": "abort", "message": "refused by test", "status_code": 400}
        elif plan.finish == "length_at_eot":  # the end of turn was the last allowed token
            ids = [*ids, self.variant.end_of_turn_id]
            finish = {"type": "length", "length": len(ids)}
        else:
            if plan.finish == "stop_with_token":
                ids = [*ids, self.variant.end_of_turn_id]
            finish = {"type": "stop", "matched": self.variant.end_of_turn_id}
        return ids, [-rng.random() * 3 for _ in ids], finish

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        rid: str,
        *,
        input_ids_json: str | None = None,
    ) -> Generation:
        assert input_ids_json is not None and json.loads(input_ids_json) == list(input_ids)
        turn_part = rid.split(":")[2]
        turn, resume = int(turn_part.split(".")[0]), int(turn_part.partition(".")[2] or 0)
        plan = self.turns[turn]
        ids, logprobs, finish = self.planned_output(plan)
        done = sum(plan.cuts[:resume])  # what the calls before this one sampled
        if resume < len(plan.cuts) and done + plan.cuts[resume] < len(ids):
            end = done + plan.cuts[resume]
            finish = {"type": "abort", "message": "Abort request (a weight update)"}
        else:
            end = len(ids)
        ids, logprobs = ids[done:end], logprobs[done:end]
        if finish["type"] == "length":  # as SGLang: the length of this call's output
            finish = {"type": "length", "length": len(ids)}
        generation = Generation(
            output_ids=ids,
            logprobs=logprobs,
            finish_type=finish["type"],
            finish_reason=finish,
            weight_version=f"v{len(self.calls)}",
            prompt_tokens=len(input_ids),
            cached_tokens=0,
            text=self.variant.chat.decode(ids),
        )
        self.calls.append((list(input_ids), generation))
        self.rids.append(rid)
        return generation

    async def abort(self, rid: str) -> None:
        raise AssertionError(f"nothing is cancelled in these tests, yet {rid} was aborted")


@dataclass
class ScriptedSession:
    system_prompt: str
    tools: list[dict[str, Any]]
    first_observation: str
    turns: list[PlannedTurn]
    done_at: int
    steps: list[Action] = field(default_factory=list)

    async def reset(self, task_index: int) -> Reset:
        return Reset(self.first_observation, {"task": task_index})

    async def step(self, action: Action) -> Step:
        self.steps.append(action)
        index = len(self.steps) - 1  # steps, not turns: a turn of parallel calls takes several
        done = index == self.done_at
        observation = f"{self.turns[index % len(self.turns)].observation} #{index}"
        return Step(observation, 1.0 if done else 0.0, done, {"step": index})

    async def close(self) -> None:
        pass


@dataclass
class ScriptedEnvs:
    session: ScriptedSession

    async def open(self, env_name: str, split: str, episode_key: str) -> ScriptedSession:
        return self.session


TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Looks something up.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
    },
}


def run_episode(
    system: str,
    first: str,
    turns: list[PlannedTurn],
    done_at: int,
    max_turns: int,
    variant: ChatVariant | None = None,
) -> tuple[EpisodeResult, RecordingEngine]:
    variant = variant or chat_variant("chatml")
    engine = RecordingEngine(turns, variant)
    session = ScriptedSession(system or "sys", [TOOL_SCHEMA], first or "hi", turns, done_at)
    runner = EpisodeRunner(
        engine, ScriptedEnvs(session), variant.chat, get_parser("qwen25"), max_turn_resumes=MAX_TURN_RESUMES
    )
    spec = EpisodeSpec("ep", 0, EpisodeRequest("test", "train", 0, {"max_new_tokens": 512}, max_turns))
    return asyncio.run(runner.run(spec)), engine


def check_invariants(result: EpisodeResult, engine: RecordingEngine) -> None:
    calls = [GenerateCall(ids, g.output_ids, g.logprobs) for ids, g in engine.calls]
    tokens = result.tokens
    assert_trainer_contract(
        tokens.prompt_ids, tokens.response_ids, tokens.loss_mask, tokens.rollout_logprobs, calls
    )
    # Resumed turns: nothing sampled twice or lost (the stored sampled tokens are every call's
    # output, in order), one record per call, and each sampled token carries its call's version.
    sampled = [token for token, m in zip(tokens.response_ids, tokens.loss_mask, strict=True) if m]
    assert sampled == [token for _, g in engine.calls for token in g.output_ids]
    assert [turn.resume for turn in result.turns] == [int(rid.partition(".")[2] or 0) for rid in engine.rids]
    codes, versions = token_version_codes(
        [np.array(tokens.loss_mask, np.uint8)], [[t.to_json() for t in result.turns]]
    )
    expected = [f"v{index}" for index, (_, g) in enumerate(engine.calls) for _ in g.output_ids]
    assert [versions[code] for code in codes if code >= 0] == expected
    assert all(code == -1 for code, m in zip(codes, result.tokens.loss_mask, strict=True) if not m)
    # Every call of a turn is run, in order, and answered by its own tool message (the last turn's
    # calls after the one that ended the episode excepted).
    for index, message in enumerate(result.messages):
        if message["role"] != "assistant" or index + 1 == len(result.messages):
            continue
        try:
            calls = get_parser("qwen25")(message["sampled"]).calls
            assert len(message.get("tool_calls") or ()) == calls  # parsed into the transcript
        except ToolCallParseError:
            continue
        answers = list(takewhile(lambda m: m["role"] == "tool", result.messages[index + 1 :]))
        assert [a["name"] for a in answers] == ["lookup"] * len(answers)
        assert [a["tool_call_id"] for a in answers] == [c["id"] for c in message.get("tool_calls", [])][
            : len(answers)
        ]
        last_turn = index + 1 + len(answers) == len(result.messages)
        assert len(answers) == calls or (last_turn and result.status is EpisodeStatus.COMPLETED)
    # 4. P + R is the transcript as the model is fed it: one full render of the messages, and the
    # tokens of every turn boundary are present (header after each env message, close after each turn).
    chat = engine.variant.chat
    ends_on_assistant = result.messages[-1]["role"] == "assistant"
    if ends_on_assistant and engine.variant.rewrites_last_assistant:
        return  # a re-render adds a think block the model never saw; the stored ids are right
    # The transcript as the model was fed it: each assistant turn as sampled, each tool result as
    # the loop renders it (docs/trainers/arrow-schema.md: "The transcript").
    fed = [
        {"role": "assistant", "content": m["sampled"]}
        if m["role"] == "assistant"
        else {key: m[key] for key in ("role", "name", "content") if key in m}
        for m in result.messages
    ]
    expected = chat.render(fed, tools=[TOOL_SCHEMA], add_generation_prompt=not ends_on_assistant)
    assert chat.decode(result.tokens.prompt_ids + result.tokens.response_ids) == expected


@pytest.mark.parametrize("variant_name", CHAT_VARIANTS)
@settings(max_examples=100)
@given(
    system=text,
    first=text,
    turns=st.lists(planned_turns(), min_size=1, max_size=6),
    done_at=st.integers(0, 8),
    max_turns=st.integers(1, 8),
)
def test_invariants_hold_for_any_conversation(
    variant_name: str, system: str, first: str, turns: list[PlannedTurn], done_at: int, max_turns: int
) -> None:
    """For the project's template, a thinking template and another tokenizer with its own."""
    variant = chat_variant(variant_name)
    turns = list(islice(cycle(turns), max_turns))  # a planned turn for every turn the limit allows
    result, engine = run_episode(system, first, turns, done_at, max_turns, variant)
    check_invariants(result, engine)
    last = engine.calls[-1][1]
    assert len(engine.calls) == len(result.turns)
    assert [turn.weight_version for turn in result.turns] == [f"v{i}" for i in range(len(engine.calls))]
    if last.finish_type == "abort" and "status_code" in last.finish_reason:
        assert result.status is EpisodeStatus.ABORTED  # refused, not resumed
    elif last.finish_type == "abort":  # interrupted more than MAX_TURN_RESUMES times
        assert result.status is EpisodeStatus.FAILED and "MAX_TURN_RESUMES" in (result.error or "")
        assert [turn.resume for turn in result.turns][-1] == MAX_TURN_RESUMES
    elif last.finish_type == "length" and last.output_ids[-1:] != [variant.end_of_turn_id]:
        assert result.status is EpisodeStatus.TRUNCATED
    elif result.status is EpisodeStatus.COMPLETED:
        assert result.reward == 1.0


def test_stop_token_is_closed_without_mask_and_header_is_stored() -> None:
    """The seed's defects: header of later turns missing; `\\n` after <|im_end|> trained on."""
    turns = [
        PlannedTurn("tool", "", "stop_with_token", "result one", 1),
        PlannedTurn("tool", "", "stop_without_token", "result two", 2),
        PlannedTurn("respond", "bye", "stop_with_token", "###STOP###", 3),
    ]
    result, engine = run_episode("sys", "hello", turns, done_at=2, max_turns=5)
    check_invariants(result, engine)
    assert result.status is EpisodeStatus.COMPLETED and result.reward == 1.0
    chat = chat_tokenizer()
    response, mask = result.tokens.response_ids, result.tokens.loss_mask
    trained = [token for token, m in zip(response, mask, strict=True) if m]
    im_end, newline = chat.close_ids
    # The first and third turns sampled <|im_end|> (trained); the second did not (added, mask 0).
    assert trained.count(im_end) == 2
    assert newline not in trained[-1:]
    header = chat.encode("<|im_start|>assistant\n")
    response_text = chat.decode(result.tokens.response_ids)
    assert response_text.count("<|im_start|>assistant\n") == 3  # before turns 2 and 3, and at the end
    assert result.tokens.response_ids[-len(header) :] == header


def test_unparseable_tool_call_aborts_and_keeps_the_turn() -> None:
    turns = [PlannedTurn("malformed", "x", "stop_with_token", "", 1)]
    result, engine = run_episode("sys", "hello", turns, done_at=5, max_turns=3)
    check_invariants(result, engine)
    assert result.status is EpisodeStatus.ABORTED
    assert result.error is not None and "unparseable tool call" in result.error
    # Said once, with what is wrong with it (the JSON's own complaint), not "an unparseable call".
    assert result.error.count("unparseable") == 1 and "call 1 is not valid JSON (" in result.error
    assert sum(result.tokens.loss_mask) == len(engine.calls[0][1].output_ids)
    assert [turn.actions for turn in result.turns] == [[]]  # the turn ran nothing: a list, never null


def test_every_turn_record_lists_what_it_ran() -> None:
    turns = [
        PlannedTurn("tool", "a", "stop_with_token", "r", 1),
        PlannedTurn("tool", "b", "stop_with_token", "r", 2, calls=2),
        PlannedTurn("respond", "done", "stop_with_token", "###STOP###", 3),
    ]
    result, engine = run_episode("sys", "hello", turns, done_at=10, max_turns=3)
    check_invariants(result, engine)
    assert [turn.actions for turn in result.turns] == [["lookup"], ["lookup", "lookup"], ["respond"]]
    assert [turn.action for turn in result.turns] == ["lookup", "lookup", "respond"]


def test_turn_limit_truncates() -> None:
    turns = [PlannedTurn("tool", "a", "stop_with_token", "r", i) for i in range(3)]
    result, engine = run_episode("sys", "hello", turns, done_at=10, max_turns=3)
    check_invariants(result, engine)
    assert result.status is EpisodeStatus.TRUNCATED and len(engine.calls) == 3


def test_a_turn_the_engine_aborts_resumes_without_losing_or_repeating_a_token() -> None:
    """A weight update aborts the first turn twice: its calls continue each other (rids
    `<id>:<attempt>:<turn>.<n>`), and the episode ends as if nothing happened."""
    turns = [
        PlannedTurn("tool", "look it up", "stop_with_token", "found", 1, cuts=[3, 0, 5]),
        PlannedTurn("respond", "done", "stop_with_token", "###STOP###", 2),
    ]
    result, engine = run_episode("sys", "hello", turns, done_at=1, max_turns=4)
    check_invariants(result, engine)
    assert result.status is EpisodeStatus.COMPLETED and result.reward == 1.0
    assert engine.rids == ["ep:0:0", "ep:0:0.1", "ep:0:0.2", "ep:0:0.3", "ep:0:1"]
    assert [len(g.output_ids) for _, g in engine.calls][:3] == [3, 0, 5]
    assert result.num_turns == 2 and len(result.turns) == 5
    uninterrupted, _, _ = engine.planned_output(turns[0])
    assert [token for _, g in engine.calls[:4] for token in g.output_ids] == uninterrupted


def test_a_turn_aborted_past_max_turn_resumes_fails_the_episode() -> None:
    turns = [
        PlannedTurn("tool", "look it up", "stop_with_token", "found", 1, cuts=[1] * (MAX_TURN_RESUMES + 1))
    ]
    result, engine = run_episode("sys", "hello", turns, done_at=1, max_turns=4)
    check_invariants(result, engine)
    assert result.status is EpisodeStatus.FAILED and result.reward is None
    assert len(engine.calls) == MAX_TURN_RESUMES + 1
    assert result.error is not None and f"MAX_TURN_RESUMES={MAX_TURN_RESUMES}" in result.error
