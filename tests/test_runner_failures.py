"""How the runner ends an episode when something below it fails: the status and the recorded reason.

Real env worker processes (EnvHost) run real test environments; the engine is the real SGLang
client where its failure is the point, else a protocol-level double that plays fixed replies.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from service.engine.client import SGLangClient
from service.envs.host import EnvHost
from service.loop.runner import EpisodeRunner
from service.loop.toolcalls import get_parser
from service.records import EpisodeRequest, EpisodeSpec, EpisodeStatus
from tests.support.engines import FixedReplies, tool_call
from tests.support.envs import TEST_ENVS
from tests.support.openai_stub import closed_port_url
from tests.support.tokenizer import chat_tokenizer


@pytest.fixture
async def host() -> AsyncIterator[EnvHost]:
    env_host = EnvHost(workers=1, executor="process", envs=TEST_ENVS)
    yield env_host
    await env_host.close()


def spec(env: str = "test/probe", attempt: int = 0) -> EpisodeSpec:
    return EpisodeSpec("ep1", attempt, EpisodeRequest(env, "train", 3, {"max_new_tokens": 64}, max_turns=5))


async def test_a_completed_episode(host: EnvHost) -> None:
    engine = FixedReplies([tool_call("whoami"), "All done."])
    result = await EpisodeRunner(engine, host, chat_tokenizer(), get_parser("qwen25")).run(spec())
    assert result.status is EpisodeStatus.COMPLETED and result.reward == 1.0 and result.error is None
    assert engine.rids == ["ep1:0:0", "ep1:0:1"]
    assert [turn.action for turn in result.turns] == ["whoami", "respond"]
    assert result.info["task_index"] == 3 and result.info["steps"] == 2


async def test_env_step_raising_aborts_with_the_error(host: EnvHost) -> None:
    engine = FixedReplies([tool_call("whoami"), tool_call("boom")])
    result = await EpisodeRunner(engine, host, chat_tokenizer(), get_parser("qwen25")).run(spec())
    assert result.status is EpisodeStatus.ABORTED and result.reward == 0.0  # the env's after step 1
    assert result.error is not None and "ValueError: boom at step 2" in result.error
    assert len(result.turns) == 2 and sum(result.tokens.loss_mask) > 0  # the turns played are kept


async def test_env_worker_crash_fails_the_episode(host: EnvHost) -> None:
    engine = FixedReplies([tool_call("crash", code=9)])
    result = await EpisodeRunner(engine, host, chat_tokenizer(), get_parser("qwen25")).run(spec())
    assert result.status is EpisodeStatus.FAILED and result.reward is None
    assert result.error is not None and "env worker crashed" in result.error
    # The host replaced the worker: the next episode runs.
    again = FixedReplies(["bye"])
    ok = await EpisodeRunner(again, host, chat_tokenizer(), get_parser("qwen25")).run(spec(attempt=1))
    assert ok.status is EpisodeStatus.COMPLETED


async def test_env_that_cannot_be_built_aborts(host: EnvHost) -> None:
    result = await EpisodeRunner(FixedReplies([]), host, chat_tokenizer(), get_parser("qwen25")).run(
        spec("test/failing")
    )
    assert result.status is EpisodeStatus.ABORTED
    assert (
        result.error is not None and "env construction failed" in result.error and "KeyError" in result.error
    )


async def test_engine_down_fails_after_retries(host: EnvHost) -> None:
    async with httpx.AsyncClient() as http:
        engine = SGLangClient(
            http, closed_port_url(), max_inflight=4, retries=2, backoff_seconds=0.01, timeout_seconds=2
        )
        result = await EpisodeRunner(engine, host, chat_tokenizer(), get_parser("qwen25")).run(spec())
    assert result.status is EpisodeStatus.FAILED
    assert result.error is not None and result.error.startswith("engine:") and "3 attempts" in result.error
    assert len(result.tokens.prompt_ids) > 0 and result.tokens.response_ids == []
