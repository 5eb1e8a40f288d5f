"""episode_timeout_seconds: an episode still running past it ends truncated with the note
`deadline`, its engine request aborted, its env closed, its reward the env's so far. On SQLite and
PostgreSQL through the service, and at the runner against an engine that hangs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.app import create_app
from service.engine.client import Generation
from service.envs.host import EnvHost
from service.loop.runner import EpisodeRunner
from service.loop.toolcalls import get_parser
from service.records import EpisodeRequest, EpisodeResult, EpisodeSpec, EpisodeStatus
from service.serving import serve_app
from service.sim.policy import SimConfig
from service.sim.worker import SimWorker, create_sim_app, serve_in_thread
from tests.conftest import service_settings
from tests.support.engines import FixedReplies, tool_call
from tests.support.envs import TEST_ENVS
from tests.support.service_process import submission
from tests.support.tokenizer import chat_tokenizer


@dataclass
class HangsFromTurn(FixedReplies):
    """Plays its replies up to turn `hangs_at`, then takes every call and never answers (an
    overloaded engine)."""

    hangs_at: int = 1

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        rid: str,
        *,
        input_ids_json: str | None = None,
    ) -> Generation:
        if len(self.rids) >= self.hangs_at:
            self.rids.append(rid)
            await asyncio.Event().wait()
        return await super().generate(input_ids, sampling_params, rid, input_ids_json=input_ids_json)


async def run_until_deadline(engine: HangsFromTurn, timeout_seconds: float) -> EpisodeResult:
    """One episode of test/probe on `engine`, run by the runner with that deadline."""
    host = EnvHost(workers=1, executor="thread", envs=TEST_ENVS)
    try:
        runner = EpisodeRunner(engine, host, chat_tokenizer(), get_parser("qwen25"))
        request = EpisodeRequest(
            "test/probe", "train", 3, {"max_new_tokens": 64}, 5, episode_timeout_seconds=timeout_seconds
        )
        return await asyncio.wait_for(runner.run(EpisodeSpec("ep", 2, request)), 10)
    finally:
        await host.close()


async def test_the_runner_ends_an_episode_at_its_deadline() -> None:
    engine = HangsFromTurn([tool_call("whoami"), "never"], hangs_at=1)
    result = await run_until_deadline(engine, 0.5)
    assert result.status is EpisodeStatus.TRUNCATED
    assert result.error is not None and result.error.startswith("deadline: still running after 0.5 s")
    assert result.reward == 0.0  # the env's after its one step
    assert engine.rids == ["ep:2:0", "ep:2:1"] and engine.aborted == ["ep:2:"]
    assert len(result.turns) == 1 and sum(result.tokens.loss_mask) > 0  # the turn played is kept, whole
    assert result.tokens.response_ids[-len(chat_tokenizer().close_ids) :] != []


async def test_a_deadline_before_the_first_turn_fails_the_episode_as_no_sample() -> None:
    """Truncated with reward 0 and no sampled token, the episode would reach trainers as a sample
    the model never played: it fails (no reward) and is re-run within the attempt budget."""
    engine = HangsFromTurn([], hangs_at=0)
    result = await run_until_deadline(engine, 0.3)
    assert (result.status, result.reward, result.retryable) == (EpisodeStatus.FAILED, None, True)
    assert result.error == "deadline: still running after 0.3 s (step), before its first turn"
    assert result.turns == [] and engine.rids == ["ep:2:0"] and engine.aborted == ["ep:2:"]


@pytest.fixture
async def slow_service(database_url: str) -> AsyncIterator[tuple[SimWorker, httpx.AsyncClient]]:
    sim = SimWorker(SimConfig(latency_seconds=0.5, malformed_call_rate=0.0, ramble_rate=0.0))
    with serve_in_thread(create_sim_app(sim.config, worker=sim)) as sim_url:
        async with serve_app(create_app(service_settings(database_url, sim_url))) as url:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                yield sim, http


async def test_episodes_past_their_deadline_end_truncated(
    slow_service: tuple[SimWorker, httpx.AsyncClient],
) -> None:
    sim, http = slow_service
    body = submission("late", 3, 2, max_turns=30, episode_timeout_seconds=1.0)
    assert (await http.post("/episodes", json=body)).status_code == 202
    batch = (await http.get("/batches/late", params={"wait": 60})).json()
    assert batch["complete"] and batch["counts"]["truncated"] == 6, batch["counts"]
    for summary in batch["episodes"]:
        episode = (await http.get(f"/episodes/{summary['id']}")).json()
        assert episode["error"].startswith("deadline: still running after 1 s"), episode["error"]
        assert episode["reward"] is not None
        assert len(episode["response_ids"]) == len(episode["loss_mask"]) == len(episode["rollout_logprobs"])
    aborted = {entry["rid"] for entry in sim.aborts}
    assert {f"{summary['id']}:0:" for summary in batch["episodes"]} <= aborted
    metrics = text_string_to_metric_families((await http.get("/metrics")).text)
    past = [s.value for f in metrics for s in f.samples if s.name == "rollout_episodes_past_deadline_total"]
    assert past == [6.0]
    assert (
        await http.post("/episodes", json=submission("late-bad", 1, 1, episode_timeout_seconds=0))
    ).status_code == 422
