"""One episode: the multi-turn tool-calling loop between the policy (SGLang) and an environment."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol

from service.engine.client import EngineError, EngineRequestError, EngineUnavailableError, Generation
from service.envs.base import RESPOND_ACTION_NAME, Action, Reset, Step
from service.envs.errors import EnvError, EnvWorkerCrashed
from service.loop.tokens import ChatTokenizer, Trajectory
from service.loop.toolcalls import ToolCallParseError, ToolCallParser, strip_reasoning
from service.loop.transcript import assistant_message, call_id
from service.records import (
    DEADLINE_NOTE,
    DEFAULT_MAX_NEW_TOKENS,
    EpisodeResult,
    EpisodeSpec,
    EpisodeStatus,
    TurnRecord,
    attempt_rid_prefix,
    version_number,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_TURN_RESUMES = 8  # engine aborts one turn survives (MAX_TURN_RESUMES)
# SGLang's 400 when input + max_new_tokens exceeds the model: "... the model's context length ...",
# "... the model's maximum context length of N tokens ...".
CONTEXT_LENGTH_ERRORS = ("context length", "maximum model length")  # SGLang's, vLLM's


class Engine(Protocol):
    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        rid: str,
        *,
        input_ids_json: str | None = None,
    ) -> Generation: ...

    async def abort(self, rid: str) -> None: ...


class EnvSession(Protocol):
    system_prompt: str
    tools: list[dict[str, Any]]

    async def reset(self, task_index: int) -> Reset: ...

    async def step(self, action: Action) -> Step: ...

    async def close(self) -> None: ...


class EnvOpener(Protocol):
    async def open(self, env_name: str, split: str, episode_key: str) -> EnvSession: ...


class EpisodeRunner:
    def __init__(
        self,
        engine: Engine,
        envs: EnvOpener,
        chat: ChatTokenizer,
        parser: ToolCallParser,
        *,
        max_turn_resumes: int = DEFAULT_MAX_TURN_RESUMES,
    ) -> None:
        self.engine = engine
        self.envs = envs
        self.chat = chat
        self.parser = parser
        self.max_turn_resumes = max_turn_resumes
        # The newest weight version (as a number) any episode of this process was sampled from.
        self.newest_version: int | None = None

    async def run(self, spec: EpisodeSpec) -> EpisodeResult:
        try:
            return await self._run(spec)
        except asyncio.CancelledError:
            # Shutdown or a lost lease: free the engine of this attempt's request.
            await asyncio.shield(self.engine.abort(attempt_rid_prefix(spec.episode_id, spec.attempt)))
            raise

    async def _run(self, spec: EpisodeSpec) -> EpisodeResult:
        episode = _Episode(spec)
        session: EnvSession | None = None
        timeout = spec.request.episode_timeout_seconds
        deadline = asyncio.timeout(timeout)  # None: no deadline
        try:
            async with deadline:
                episode.phase = "construction"
                session = await self.envs.open(spec.request.env, spec.request.task_split, spec.key)
                return await self._play(episode, session)
        except TimeoutError:
            if not deadline.expired():
                raise
            # The engine call under way, if any, was cancelled: free its slot on the engine too.
            await self.engine.abort(attempt_rid_prefix(spec.episode_id, spec.attempt))
            note = f"{DEADLINE_NOTE}: still running after {timeout:g} s ({episode.phase})"
            if not episode.turns:
                # Cut before the model sampled a turn (a slow env construction or reset, a first
                # call still waiting on the engine): no sample to train on, and not the policy's
                # doing. Failed, re-run within the attempt budget, as an agent-driven episode
                # finished before its first call is failed.
                return episode.end(EpisodeStatus.FAILED, f"{note}, before its first turn", retryable=True)
            return episode.end(EpisodeStatus.TRUNCATED, note)
        except EngineRequestError as error:
            if any(words in str(error).lower() for words in CONTEXT_LENGTH_ERRORS):  # outgrew the model
                return episode.end(EpisodeStatus.TRUNCATED, f"context length reached: {error}")
            return episode.end(EpisodeStatus.FAILED, f"engine refused the request: {error}")
        except EngineError as error:
            down = isinstance(error, EngineUnavailableError) and error.engine_down
            return episode.end(
                EpisodeStatus.FAILED, f"engine: {error}", retryable=error.retryable, engine_down=down
            )
        except EnvWorkerCrashed as error:
            return episode.end(EpisodeStatus.FAILED, f"{error.what}: {error}", retryable=True)
        except EnvError as error:
            # Infrastructure (the user simulator's endpoint, a hung env call) is not the policy's
            # doing: the episode fails (not trained on) instead of being aborted.
            status = EpisodeStatus.FAILED if error.infrastructure else EpisodeStatus.ABORTED
            return episode.end(status, f"env {episode.phase} failed: {error}")
        finally:
            if session is not None:
                await session.close()

    async def _play(self, episode: _Episode, session: EnvSession) -> EpisodeResult:
        request = episode.spec.request
        episode.phase = "reset"
        reset = await session.reset(request.task_index)
        episode.info = dict(reset.info)
        episode.messages = [
            {"role": "system", "content": session.system_prompt},
            *reset.transcript,  # the env's own turn before the first observation: never prompted
            {"role": "user", "content": reset.observation},
        ]
        episode.trajectory = self.chat.prompt(session.system_prompt, session.tools, reset.observation)
        episode.phase = "step"
        for turn in range(request.max_turns):
            status = await self._turn(episode, session, turn)
            if (stale := self._staleness(episode)) is not None:  # checked up to the last turn's end
                return episode.end(EpisodeStatus.FAILED, stale, stale=True)
            if status is not None:
                return episode.end(status)
        episode.note = f"turn limit {request.max_turns} reached"
        return episode.end(EpisodeStatus.TRUNCATED)

    def _staleness(self, episode: _Episode) -> str | None:
        """Why the episode's oldest sampled token lags the newest weights seen by more than its
        max_staleness; None if it does not (or has no bound, or no versions are numbers)."""
        bound, newest = episode.spec.request.max_staleness, self.newest_version
        if bound is None or newest is None:
            return None
        numbers = [n for turn in episode.turns if (n := version_number(turn.weight_version)) is not None]
        if not numbers or newest - min(numbers) <= bound:
            return None
        return (
            f"stale: sampled from weight version {min(numbers)}, {newest - min(numbers)} behind the "
            f"newest ({newest}); max_staleness is {bound}"
        )

    async def _generate(
        self, episode: _Episode, turn: int, params: dict[str, Any]
    ) -> tuple[Generation, list[int]]:
        calls = len(episode.turns)
        generation, sampled = await sample_turn(
            self.engine,
            episode.trajectory,
            episode.turns,
            turn,
            episode.spec.rid(turn),
            params,
            self.max_turn_resumes,
        )
        for record in episode.turns[calls:]:
            number = version_number(record.weight_version)
            if number is not None and (self.newest_version is None or number > self.newest_version):
                self.newest_version = number
        return generation, sampled

    async def _turn(self, episode: _Episode, session: EnvSession, turn: int) -> EpisodeStatus | None:
        """Plays one turn; returns the episode's final status if the turn ended it."""
        request, trajectory = episode.spec.request, episode.trajectory
        params = dict(request.sampling_params)
        max_new_tokens = int(params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
        if request.max_response_tokens is not None:
            remaining = request.max_response_tokens - len(trajectory.response_ids)
            if remaining <= 0:
                episode.note = "response-token budget spent"
                return EpisodeStatus.TRUNCATED
            max_new_tokens = min(max_new_tokens, remaining)
        params["max_new_tokens"] = max_new_tokens

        generation, sampled_ids = await self._generate(episode, turn, params)
        record = episode.turns[-1]
        content = self.chat.sampled_text(sampled_ids)
        assistant = assistant_message(content, None, turn)  # its calls are added once parsed
        episode.messages.append(assistant)
        closing = self.chat.closing_ids(sampled_ids)
        trajectory.add_context(closing)

        if generation.finish_type == "abort":
            message = generation.finish_reason.get("message", "")
            if generation.interrupted:  # infrastructure: the engine kept aborting this turn
                episode.note = (
                    f"the engine aborted turn {turn} {record.resume + 1} times "
                    f"(MAX_TURN_RESUMES={self.max_turn_resumes}): {message}"
                )
                return EpisodeStatus.FAILED
            episode.note = f"engine refused the request: {message}".strip()
            return EpisodeStatus.ABORTED
        # SGLang checks the length limit first: a turn whose last allowed token ended it says
        # "length" yet is whole. Only a turn without its end-of-turn token is cut.
        ended_turn = len(closing) < len(self.chat.close_ids)
        if generation.finish_type == "length" and not ended_turn:
            episode.note = f"turn {turn} hit max_new_tokens={max_new_tokens}"
            return EpisodeStatus.TRUNCATED
        try:
            parsed = self.parser(strip_reasoning(content), session.tools)
        except ToolCallParseError as error:
            episode.note = f"unparseable tool call: {error}"
            return EpisodeStatus.ABORTED
        assistant.update(assistant_message(content, parsed, turn))

        # Every call of the turn, in order, each answered by its own tool message (parallel calls).
        started = time.perf_counter()
        answers: list[dict[str, Any]] = []
        done = False
        for action in parsed.actions:
            step = await session.step(action)
            episode.messages.extend(step.transcript)  # the env's own turn: shown, never prompted
            if action.name == RESPOND_ACTION_NAME:
                answers.append({"role": "user", "content": step.observation})
            else:  # (the transcript also names the call it answers: see below)
                answers.append({"role": "tool", "name": action.name, "content": step.observation})
            episode.reward = step.reward
            episode.info.update(step.info)
            if step.done:  # calls after the one that ended the episode are not run
                done = True
                break
        record.env_seconds = time.perf_counter() - started
        record.action = parsed.action.name
        record.actions = [action.name for action in parsed.actions[: len(answers)]]
        episode.messages.extend(
            {**answer, "tool_call_id": call_id(turn, index)} if answer["role"] == "tool" else answer
            for index, answer in enumerate(answers)
        )
        trajectory.add_context(self.chat.messages_ids(answers))  # rendered as before: same tokens
        return EpisodeStatus.COMPLETED if done else None


async def sample_turn(
    engine: Engine,
    trajectory: Trajectory,
    turns: list[TurnRecord],
    turn: int,
    rid: str,
    params: dict[str, Any],
    max_turn_resumes: int,
) -> tuple[Generation, list[int]]:
    """One turn's generation, resumed after every engine abort (a weight update, a pause): each
    call continues from prompt + everything sampled so far, with what is left of max_new_tokens,
    so no sampled token is lost or sampled twice. Each call is added to `trajectory` (its ids,
    mask 1) and recorded in `turns`. Returns the last call's generation and every id the turn
    sampled; that generation is an abort only if the engine refused the request (an abort with a
    4xx status: not resumed) or `max_turn_resumes` ran out."""
    max_new_tokens = params["max_new_tokens"]
    sampled: list[int] = []
    for resume in range(max_turn_resumes + 1):
        started = time.perf_counter()
        call_rid = rid if resume == 0 else f"{rid}.{resume}"
        call_params = params | {"max_new_tokens": max_new_tokens - len(sampled)}
        generation = await engine.generate(
            trajectory.input_ids(), call_params, call_rid, input_ids_json=trajectory.input_ids_json()
        )
        turns.append(
            TurnRecord(
                turn=turn,
                weight_version=generation.weight_version,
                finish_reason=generation.finish_reason,
                output_tokens=len(generation.output_ids),
                engine_seconds=time.perf_counter() - started,
                has_logprobs=generation.has_logprobs,
                resume=resume,
                logprobs_mode=generation.logprobs_mode,
                prompt_tokens=generation.prompt_tokens,
                cached_tokens=generation.cached_tokens,
            )
        )
        trajectory.add_sampled(generation.output_ids, generation.logprobs)
        sampled += generation.output_ids
        if not generation.interrupted:
            return generation, sampled
        if len(sampled) >= max_new_tokens:  # aborted on its last allowed token: cut as by length
            length = {"type": "length", "length": max_new_tokens}
            return replace(generation, finish_type="length", finish_reason=length), sampled
        logger.info("turn %s aborted by the engine after %d tokens; resuming", call_rid, len(sampled))
    return generation, sampled  # still aborted: the resumes ran out


class _Episode:
    """The mutable state of one episode while it runs."""

    def __init__(self, spec: EpisodeSpec) -> None:
        self.spec = spec
        self.trajectory = Trajectory(prompt_ids=[])
        self.messages: list[dict[str, Any]] = []
        self.info: dict[str, Any] = {}
        self.turns: list[TurnRecord] = []
        self.reward: float | None = None  # the environment's latest, once it gave one
        self.phase = "construction"  # of the environment: construction, reset, step
        self.note: str | None = None  # why a non-completed episode ended

    def end(
        self,
        status: EpisodeStatus,
        error: str | None = None,
        *,
        retryable: bool = False,
        stale: bool = False,
        engine_down: bool = False,
    ) -> EpisodeResult:
        message = error if error is not None else self.note
        if status is EpisodeStatus.FAILED and not engine_down:  # an outage: the worker says what follows
            logger.warning("episode %s failed: %s", self.spec.episode_id, message)
        reward = self.reward
        if status is EpisodeStatus.FAILED:
            reward = None  # cut short by infrastructure: no reward to train on
        elif reward is None and status in (EpisodeStatus.COMPLETED, EpisodeStatus.TRUNCATED):
            reward = 0.0  # a played episode that earned nothing
        trajectory = self.trajectory
        return EpisodeResult(
            status=status,
            reward=reward,
            tokens=trajectory.tokens() if trajectory.prompt_ids else None,
            messages=self.messages,
            info=self.info,
            turns=self.turns,
            error=message,
            retryable=retryable,
            stale=stale,
            engine_down=engine_down,
        )
