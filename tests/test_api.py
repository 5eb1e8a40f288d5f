"""The public API over real HTTP, on SQLite and PostgreSQL, against a simulated SGLang worker."""

from __future__ import annotations

import asyncio
import io
import logging
import socket
import time
from typing import Any

import httpx
import pyarrow as pa
import pytest
from sqlalchemy import func, select

from service.app import create_app
from service.serving import serve_app
from service.sim.worker import SimWorker
from service.storage.db import Database
from service.storage.models import Batch, Episode
from service.worker.group_log import STOP_WAIT_SECONDS
from tests.conftest import service_settings
from tests.support.contract import assert_stored_episode_matches_sim
from tests.support.openai_stub import closed_port_url
from tests.support.polling import until
from tests.support.tokenizer import chat_tokenizer

ARROW = "application/vnd.apache.arrow.stream"


def submission(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "env": "builtin/shop",
        "task_split": "test",
        "task_indices": [0, 1, 2],
        "samples_per_task": 2,
        "sampling_params": {"temperature": 0.7, "max_new_tokens": 200},
        "max_turns": 10,
        "metadata": {"step": 7},
    }
    body.update(overrides)
    return body


def nested(levels: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(levels - 1):
        value = [value]
    return value


async def wait_complete(client: httpx.AsyncClient, batch_id: str, seconds: float = 60) -> dict[str, Any]:
    response = await client.get(f"/batches/{batch_id}", params={"wait": seconds})
    assert response.status_code == 200, response.text
    batch: dict[str, Any] = response.json()
    assert batch["complete"], batch["counts"]
    return batch


async def test_submit_run_and_pull_exact_tokens(
    client: httpx.AsyncClient, sim: tuple[SimWorker, str]
) -> None:
    response = await client.post("/episodes", json=submission(batch_id="b-1"))
    assert response.status_code == 202, response.text
    accepted = response.json()
    assert accepted["batch_id"] == "b-1" and accepted["created"] is True
    assert len(accepted["episode_ids"]) == 6

    batch = await wait_complete(client, "b-1")
    assert batch["total"] == 6 and batch["finished"] == 6
    assert batch["groups_total"] == batch["groups_complete"] == 3
    assert batch["metadata"] == {"step": 7}
    assert [(e["group_index"], e["sample_index"]) for e in batch["episodes"]] == [
        (g, s) for g in range(3) for s in range(2)
    ]

    chat = chat_tokenizer()
    for summary in batch["episodes"]:
        episode = (await client.get(f"/episodes/{summary['id']}")).json()
        assert episode["status"] in {"completed", "truncated", "aborted"}
        assert_stored_episode_matches_sim(sim[0], episode)
        # The stored ids decode to the transcript, as one render of the chat template shows it.
        text = chat.decode(episode["prompt_ids"] + episode["response_ids"])
        assert text.startswith(
            chat.render(episode["messages"][:2], tools=[{}], add_generation_prompt=True)[:20]
        )
        for message in episode["messages"]:  # an assistant's as sampled (its calls parsed beside)
            assert message["sampled" if message["role"] == "assistant" else "content"] in text
        assert "task" in episode["info"]  # ground truth, for the trainer
        assert episode["info"]["task"]["instruction"] == episode["messages"][1]["content"]
        assert episode["messages"][0]["content"] not in str(episode["info"]["task"]["actions"])
        if episode["status"] == "completed":
            assert episode["reward"] in (0.0, 1.0)

    arrow = await client.get("/batches/b-1", headers={"Accept": ARROW})
    assert arrow.headers["content-type"] == ARROW
    table = pa.ipc.open_stream(io.BytesIO(arrow.content)).read_all()
    assert table.num_rows == 6
    for row in table.to_pylist():
        episode = (await client.get(f"/episodes/{row['episode_id']}")).json()
        assert row["response_ids"] == episode["response_ids"]
        assert row["prompt_ids"] == episode["prompt_ids"]
        assert row["loss_mask"] == episode["loss_mask"]
        assert row["rollout_logprobs"] == episode["rollout_logprobs"]
        assert row["weight_versions"] == episode["weight_versions"]


async def test_resubmission_is_idempotent_and_conflicts_are_409(client: httpx.AsyncClient) -> None:
    first = await client.post("/episodes", json=submission(batch_id="same"))
    again = await client.post("/episodes", json=submission(batch_id="same"))
    assert first.status_code == again.status_code == 202
    assert again.json()["episode_ids"] == first.json()["episode_ids"]
    assert again.json()["created"] is False
    conflict = await client.post("/episodes", json=submission(batch_id="same", samples_per_task=3))
    assert conflict.status_code == 409
    assert "same" in conflict.json()["detail"]


async def test_concurrent_resubmissions_create_one_batch(client: httpx.AsyncClient, db: Database) -> None:
    responses = await asyncio.gather(
        *(client.post("/episodes", json=submission(batch_id="race")) for _ in range(5))
    )
    assert {response.status_code for response in responses} == {202}
    assert len({tuple(response.json()["episode_ids"]) for response in responses}) == 1
    async with db.sessionmaker() as session:
        assert await session.scalar(select(func.count()).select_from(Episode)) == 6


@pytest.mark.parametrize(
    ("body", "status", "names"),
    [
        (submission(env="nope"), 422, ["env", "builtin/shop"]),
        (submission(task_split="validation"), 422, ["task_split", "test", "train"]),
        (submission(task_indices=[0, 50]), 422, ["task_indices[1]", "0..49"]),
        (submission(task_indices=[0, -1]), 422, ["task_indices[1]", "greater than or equal to 0"]),
        (submission(task_indices=[]), 422, ["task_indices"]),
        (submission(samples_per_task=0), 422, ["samples_per_task"]),
        (submission(sampling_params={"temprature": 1.0}), 422, ["sampling_params.temprature"]),
        (submission(max_turns=0), 422, ["max_turns"]),
        (submission(batch_id="has space"), 422, ["batch_id"]),
        (submission(max_response_tokens=2**63), 422, ["max_response_tokens"]),
        (submission(sampling_params={"presence_penalty": "NaN"}), 422, ["sampling_params.presence_penalty"]),
        (submission(sampling_params={"stop_token_ids": [-1]}), 422, ["sampling_params.stop_token_ids[0]"]),
        # Booleans are no integers, strings no numbers (an integral 6.0 is JSON's integer 6).
        (submission(samples_per_task=True), 422, ["samples_per_task", "valid integer"]),
        (submission(task_indices=[0, True]), 422, ["task_indices[1]", "valid integer"]),
        (submission(max_turns=2.5), 422, ["max_turns", "valid integer"]),
        (submission(sampling_params={"max_new_tokens": True}), 422, ["sampling_params.max_new_tokens"]),
        (submission(sampling_params={"top_k": "5"}), 422, ["sampling_params.top_k", "valid integer"]),
        (submission(sampling_params={"n": 2}), 422, ["sampling_params.n", "less than or equal to 1"]),
        (submission(sampling_params={"top_k": 0}), 422, ["sampling_params.top_k", "not 0"]),
        (
            submission(sampling_params={"regex": "a+", "ebnf": "root ::= 'a'"}),
            422,
            ["sampling_params.ebnf", "regex and ebnf are set"],
        ),
        (submission(sampling_params={"logit_bias": {"x": 1.0}}), 422, ["sampling_params.logit_bias.x"]),
        (
            submission(sampling_params={"custom_params": {"k": [1, {"a": 1}]}}),
            422,
            ["sampling_params.custom_params"],
        ),
        (submission(sampling_params={"temperature": "0.7"}), 422, ["sampling_params.temperature"]),
        (submission(sampling_params={"ignore_eos": 1}), 422, ["sampling_params.ignore_eos"]),
        (
            submission(sampling_params={"max_new_tokens": 100, "min_new_tokens": 101}),
            422,
            ["sampling_params.min_new_tokens", "min_new_tokens (101) is above max_new_tokens (100)"],
        ),
        (
            submission(sampling_params={"stop": ["x"] * 10_000}),
            422,
            ["sampling_params.stop", "at most 64 items"],
        ),
        (submission(sampling_params={"stop": ["ok", "x" * 257]}), 422, ["sampling_params.stop[1]", "256"]),
        (submission(sampling_params={"stop": [""]}), 422, ["sampling_params.stop[0]", "at least 1"]),
        (submission(metadata={"deep": nested(40)}), 422, ["metadata.deep[0]", "deeper than 32 levels"]),
        (submission(task_indices=list(range(50)), samples_per_task=1000), 413, ["50000 episodes"]),
    ],
)
async def test_bad_input_names_the_field_and_writes_nothing(
    client: httpx.AsyncClient, db: Database, body: dict[str, Any], status: int, names: list[str]
) -> None:
    response = await client.post("/episodes", json=body)
    assert response.status_code == status, response.text
    for name in names:
        assert name in response.json()["detail"]
    async with db.sessionmaker() as session:
        assert await session.scalar(select(func.count()).select_from(Batch)) == 0
        assert await session.scalar(select(func.count()).select_from(Episode)) == 0


UNREADABLE = "not Unicode text"  # what a lone surrogate is told


@pytest.mark.parametrize(
    ("metadata", "stop", "names"),
    [
        ('{"foo": ["a", "b", "\\ud800"]}', None, ["metadata.foo[2]", "lone surrogate \\ud800", UNREADABLE]),
        ('{"a": {"\\udc00x": 1}}', None, ['metadata.a["\\udc00x"]', "key", UNREADABLE]),
        ('{"pair then half": "\\ud83d\\ude00\\ud83d"}', None, ['metadata["pair then half"]', "character 1"]),
        ("{}", '["ok", "\\ud800"]', ["sampling_params.stop[1]", UNREADABLE]),
        ('{"foo": [1, NaN]}', None, ["metadata.foo[1]", "NaN is not a JSON number"]),
        ('{"foo": Infinity}', None, ["metadata.foo", "Infinity is not a JSON number"]),
        ('{"foo": {"bar": -Infinity}}', None, ["metadata.foo.bar", "-Infinity is not a JSON number"]),
        ('{"foo": 1e400}', None, ["metadata.foo", "Infinity is not a JSON number"]),
    ],
    ids=["surrogate", "surrogate-key", "half-pair", "surrogate-stop", "nan", "inf", "-inf", "1e400"],
)
async def test_values_no_answer_could_carry_are_refused_at_submit(
    client: httpx.AsyncClient, db: Database, metadata: str, stop: str | None, names: list[str]
) -> None:
    """A lone surrogate (a JSON \\ud800 escape without its pair) is not text, and NaN or Infinity is no
    JSON number: stored, they made every later read of the batch or episode fail. Refused here."""
    params = "{}" if stop is None else f'{{"stop": {stop}}}'
    body = (
        '{"env": "builtin/shop", "task_indices": [0], "batch_id": "odd", '
        f'"metadata": {metadata}, "sampling_params": {params}}}'
    )
    response = await client.post("/episodes", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    for name in names:
        assert name in response.json()["detail"], (name, response.json()["detail"])
    assert (await client.get("/batches/odd")).status_code == 404
    async with db.sessionmaker() as session:
        assert await session.scalar(select(func.count()).select_from(Batch)) == 0


async def test_what_is_accepted_reads_back(client: httpx.AsyncClient) -> None:
    """Odd but valid values: emoji (a surrogate pair in JSON), NUL, control and private-use
    characters, big integers, the largest float, the deepest nesting allowed."""
    metadata = {
        "emoji \U0001f600": "\U0001f600 \x00 \x1b \uffff \U0010ffff",
        "": [2**80, -(2**63), 1.7976931348623157e308, 5e-324, None, True],
        "deep": nested(31),
    }
    stop = ["\U0001f600", "\x00", "</tool_call>"]
    body = submission(
        batch_id="odd-ok", task_indices=[1], samples_per_task=1, max_turns=6.0, metadata=metadata
    )
    body["sampling_params"]["stop"] = stop
    accepted = await client.post("/episodes", json=body)
    assert accepted.status_code == 202, accepted.text
    batch = await wait_complete(client, "odd-ok")
    assert batch["metadata"] == metadata
    episode = await client.get(f"/episodes/{accepted.json()['episode_ids'][0]}")
    assert episode.status_code == 200, episode.text
    assert episode.json()["sampling_params"]["stop"] == stop
    assert episode.json()["max_turns"] == 6


async def test_malformed_json_and_oversized_bodies(client: httpx.AsyncClient) -> None:
    malformed = await client.post(
        "/episodes", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert malformed.status_code == 422
    assert "JSON" in malformed.json()["detail"]
    huge = {"metadata": {"blob": "x" * 2_000_000}}
    too_large = await client.post("/episodes", json=submission(**huge))
    assert too_large.status_code == 413

    async def chunks() -> Any:
        for _ in range(40):
            yield b" " * 65536

    streamed = await client.post("/episodes", content=chunks(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413


async def test_unknown_ids_are_404(client: httpx.AsyncClient) -> None:
    assert (await client.get("/episodes/nope")).status_code == 404
    missing = await client.get("/batches/nope")
    assert missing.status_code == 404 and "nope" in missing.json()["detail"]


@pytest.mark.parametrize(
    "path", ["/batches/%00", "/batches/a%00b", "/episodes/%00", "/episodes/a%00b", "/episodes/%ED%A0%80"]
)
async def test_ids_no_database_can_hold_are_refused_before_it(client: httpx.AsyncClient, path: str) -> None:
    """PostgreSQL refuses a NUL in a text parameter (it was a 500 there, a 404 on SQLite)."""
    response = await client.get(path)
    assert response.status_code == 422, response.text
    assert "should match pattern" in response.json()["detail"]


async def test_the_query_is_validated_before_the_batch_is_looked_up(client: httpx.AsyncClient) -> None:
    response = await client.get("/batches/nope", params={"wait": "abc"})
    assert response.status_code == 422 and "query.wait" in response.json()["detail"]


@pytest.mark.parametrize(
    ("path", "params"),
    [
        ("/batches/nope", {"include_token": "true"}),  # a typo of include_tokens
        ("/health", {"verbose": "1"}),
        ("/envs", {"x": ""}),
    ],
)
async def test_a_query_parameter_the_route_does_not_take_is_named(
    client: httpx.AsyncClient, path: str, params: dict[str, str]
) -> None:
    """It would otherwise be ignored: a typo must not silently change the answer."""
    response = await client.get(path, params=params)
    assert response.status_code == 422, response.text
    (name,) = params
    assert f"query.{name}" in response.json()["detail"] and "unknown query parameter" in response.text


async def test_envs_and_health(client: httpx.AsyncClient) -> None:
    envs = (await client.get("/envs")).json()
    shop = next(env for env in envs if env["name"] == "builtin/shop")
    assert shop["splits"] == {"train": 200, "test": 50}
    assert not any(env["name"].startswith("tau-bench/") for env in envs if env["name"].startswith("builtin"))
    assert (await client.get("/health")).json() == {"status": "ok", "database": "ok"}
    ready = await client.get("/ready")
    assert ready.status_code == 200 and ready.json()["engine"] == "ok"
    for probe in ("/health", "/ready"):  # HEAD, as some probes send it: GET's status, no body
        head = await client.head(probe)
        assert head.status_code == 200 and head.content == b"", probe
        assert head.headers["content-type"] == "application/json"


async def test_long_poll_returns_when_complete(client: httpx.AsyncClient) -> None:
    await client.post("/episodes", json=submission(batch_id="poll", task_indices=[3]))
    early = (await client.get("/batches/poll")).json()
    assert early["complete"] is False and early["episodes"] == []  # no group is whole yet
    loop = asyncio.get_running_loop()
    started = loop.time()
    batch = await wait_complete(client, "poll", seconds=30)
    assert loop.time() - started < 29
    assert len(batch["episodes"]) == 2


async def test_an_episode_long_polls_until_it_finished(client: httpx.AsyncClient) -> None:
    submitted = await client.post("/episodes", json=submission(batch_id="one", task_indices=[5]))
    episode_id = submitted.json()["episode_ids"][0]
    early = (await client.get(f"/episodes/{episode_id}")).json()
    assert early["status"] in {"queued", "running"}  # the simulated engine takes 10 ms a turn
    episode = (await client.get(f"/episodes/{episode_id}", params={"wait": 30})).json()
    assert episode["status"] in {"completed", "truncated", "aborted"} and episode["response_ids"]
    missing = await client.get("/episodes/nope", params={"wait": 30})  # no wait for what is not there
    assert missing.status_code == 404


async def test_json_batch_with_tokens_matches_episodes(client: httpx.AsyncClient) -> None:
    await client.post("/episodes", json=submission(batch_id="tok", task_indices=[4]))
    await wait_complete(client, "tok")
    batch = (await client.get("/batches/tok", params={"include_tokens": "true"})).json()
    assert len(batch["episodes"]) == 2
    for entry in batch["episodes"]:
        episode = (await client.get(f"/episodes/{entry['id']}")).json()
        for key in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "weight_versions"):
            assert entry[key] == episode[key]
        assert entry["response_length"] == len(episode["response_ids"])
    plain = (await client.get("/batches/tok")).json()
    assert "response_ids" not in plain["episodes"][0]


async def test_pause_and_continue_reach_every_worker(
    client: httpx.AsyncClient, sim: tuple[SimWorker, str]
) -> None:
    workers = (await client.get("/engine/workers")).json()["workers"]
    assert workers == [sim[1]]
    paused = await client.post("/engine/pause", json={"mode": "retract"})
    assert paused.status_code == 200 and paused.json()["workers"] == {sim[1]: "ok"}
    assert sim[0]._paused
    assert (await client.post("/engine/continue")).status_code == 200
    assert not sim[0]._paused
    assert (await client.post("/engine/pause", json={"mode": "sideways"})).status_code == 422


# MAX_PAUSE_SECONDS of the test that waits for the limit to resume the engine.
PAUSE_LIMIT_SECONDS = 1.0
# Of the tests whose continue must come before the limit: under load three requests once took over
# 4 s, so nothing but the pause and the continue is made within it, and they wait it out from the pause.
CONTINUED_PAUSE_LIMIT_SECONDS = 5.0


async def past_the_limit(paused_at: float) -> None:
    """Until a pause made at `paused_at` (time.monotonic()) with CONTINUED_PAUSE_LIMIT_SECONDS has
    reached its limit, and a second more: what the limit does (or not) is done."""
    await asyncio.sleep(paused_at + CONTINUED_PAUSE_LIMIT_SECONDS + 1.0 - time.monotonic())


def paused_gauge(metrics: httpx.Response) -> float:
    line = next(line for line in metrics.text.splitlines() if line.startswith("rollout_engine_paused "))
    return float(line.split()[1])


async def test_a_pause_shows_in_every_process_until_a_continue_through_any(
    database_url: str, sim: tuple[SimWorker, str]
) -> None:
    """Two processes on one database (`serve --workers 2`): a pause through one shows in both
    processes' /ready (503, saying why) and /metrics' rollout_engine_paused, and a continue through
    the other ends it everywhere."""
    settings = service_settings(database_url, sim[1], run_worker=False)  # the limit is far away
    async with (
        serve_app(create_app(settings)) as one,
        serve_app(create_app(settings)) as two,
        httpx.AsyncClient(timeout=30) as http,
    ):
        assert paused_gauge(await http.get(f"{one}/metrics")) == 0
        assert (await http.post(f"{one}/engine/pause", json={"mode": "retract"})).status_code == 200
        assert sim[0]._paused
        for url in (one, two):
            ready = await http.get(f"{url}/ready")
            assert ready.status_code == 503 and ready.headers["retry-after"], ready.text
            assert "generation paused by POST /engine/pause (mode retract)" in ready.json()["detail"]
            assert paused_gauge(await http.get(f"{url}/metrics")) == 1
        assert (await http.post(f"{two}/engine/continue")).status_code == 200
        assert not sim[0]._paused
        for url in (one, two):
            assert (await http.get(f"{url}/ready")).status_code == 200
            assert paused_gauge(await http.get(f"{url}/metrics")) == 0


async def test_a_pause_ends_by_itself_at_the_limit(
    database_url: str, sim: tuple[SimWorker, str], caplog: pytest.LogCaptureFixture
) -> None:
    """A trainer that pauses generation and dies leaves it paused no longer than MAX_PAUSE_SECONDS."""
    caplog.set_level(logging.WARNING, logger="service.engine.pause")
    settings = service_settings(database_url, sim[1], run_worker=False, max_pause_seconds=PAUSE_LIMIT_SECONDS)
    async with serve_app(create_app(settings)) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        assert (await http.post("/engine/pause", json={"mode": "retract"})).status_code == 200
        await until(lambda: not sim[0]._paused, timeout_seconds=10 * PAUSE_LIMIT_SECONDS)
        # The limit resumes the engine, then ends the service's pause: /ready follows within a poll.
        for _ in range(100):
            if (await http.get("/ready")).status_code == 200:
                break
            await asyncio.sleep(0.1)
        assert (await http.get("/ready")).status_code == 200
        assert paused_gauge(await http.get("/metrics")) == 0
    resumed = [r.getMessage() for r in caplog.records if "MAX_PAUSE_SECONDS" in r.getMessage()]
    assert len(resumed) == 1 and "resumed it on 1 workers" in resumed[0]


async def test_continue_ends_the_pause_and_its_limit(
    database_url: str, sim: tuple[SimWorker, str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="service.engine.pause")
    limit = CONTINUED_PAUSE_LIMIT_SECONDS
    settings = service_settings(database_url, sim[1], run_worker=False, max_pause_seconds=limit)
    async with serve_app(create_app(settings)) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        paused_at = time.monotonic()
        assert (await http.post("/engine/pause", json={"mode": "retract"})).status_code == 200
        assert (await http.post("/engine/continue")).status_code == 200
        assert (await http.get("/ready")).status_code == 200
        assert paused_gauge(await http.get("/metrics")) == 0
        await past_the_limit(paused_at)  # it was cancelled: no resume
    assert not any("MAX_PAUSE_SECONDS" in r.getMessage() for r in caplog.records)


async def test_the_limit_of_a_pause_continued_through_another_process_ends_nothing(
    database_url: str, sim: tuple[SimWorker, str], caplog: pytest.LogCaptureFixture
) -> None:
    """`serve --workers 2`: a pause through one process, continued through the other, which then
    pauses again (the trainer's next weight update): the first one's limit finds its pause over and
    leaves the second alone."""
    caplog.set_level(logging.WARNING, logger="service.engine.pause")
    limit = CONTINUED_PAUSE_LIMIT_SECONDS
    settings = service_settings(database_url, sim[1], run_worker=False)
    async with (
        serve_app(create_app(settings.model_copy(update={"max_pause_seconds": limit}))) as one,
        serve_app(create_app(settings)) as two,  # its own limit is far away
        httpx.AsyncClient(timeout=30) as http,
    ):
        paused_at = time.monotonic()
        assert (await http.post(f"{one}/engine/pause", json={"mode": "retract"})).status_code == 200
        assert (await http.post(f"{two}/engine/continue")).status_code == 200
        assert (await http.post(f"{two}/engine/pause", json={"mode": "retract"})).status_code == 200
        await past_the_limit(paused_at)  # the first one's
        assert sim[0]._paused
        assert (await http.get(f"{one}/ready")).status_code == 503
        assert (await http.post(f"{two}/engine/continue")).status_code == 200
    assert not any("MAX_PAUSE_SECONDS" in r.getMessage() for r in caplog.records)


async def test_a_process_that_stops_while_its_pause_holds_resumes_generation(
    database_url: str, sim: tuple[SimWorker, str]
) -> None:
    """A trainer's pause must not outlive the process it went through: that process's shutdown
    resumes generation (and the record of the pause ends with it)."""
    settings = service_settings(database_url, sim[1], run_worker=False)  # the limit is far away
    async with serve_app(create_app(settings)) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        assert (await http.post("/engine/pause", json={"mode": "retract"})).status_code == 200
        assert sim[0]._paused
    assert not sim[0]._paused
    async with serve_app(create_app(settings)) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        assert (await http.get("/ready")).status_code == 200


async def test_context_overflow_is_cut_to_fit_and_engine_refusal_fails(
    client: httpx.AsyncClient, sim: tuple[SimWorker, str]
) -> None:
    """max_new_tokens past the engine's context length (read from it) is cut to what the context
    leaves, no 400 (tests/test_model_info.py has the input that fills it); other 4xx fail the
    episode with SGLang's message."""
    huge = submission(batch_id="ctx", task_indices=[0], samples_per_task=1)
    huge["sampling_params"]["max_new_tokens"] = 40_000  # the sim's context is 32768
    await client.post("/episodes", json=huge)
    batch = await wait_complete(client, "ctx")
    episode = (await client.get(f"/episodes/{batch['episodes'][0]['id']}")).json()
    assert episode["status"] != "failed" and episode["response_ids"], episode["error"]
    sent = [request for request in sim[0].requests if request.rid.startswith(episode["id"])]
    assert sent and all(
        len(request.input_ids) + request.sampling_params["max_new_tokens"] == 32768 - 1 for request in sent
    )

    sim[0].fail_next(1, status_code=400)
    await client.post("/episodes", json=submission(batch_id="bad", task_indices=[0], samples_per_task=1))
    failed = (await wait_complete(client, "bad"))["episodes"][0]
    assert failed["status"] == "failed" and "engine refused the request" in failed["error"]


async def test_an_engine_outage_requeues_the_episode_for_another_attempt(
    client: httpx.AsyncClient, sim: tuple[SimWorker, str]
) -> None:
    """Retries exhausted (e.g. a restarting engine): the episode runs again, not fails."""
    sim[0].fail_next(6, status_code=503)  # the client's 1 try + 5 retries of the first turn
    await client.post("/episodes", json=submission(batch_id="outage", task_indices=[5], samples_per_task=1))
    summary = (await wait_complete(client, "outage"))["episodes"][0]
    assert summary["attempt"] == 1 and summary["status"] != "failed", summary
    assert_stored_episode_matches_sim(sim[0], (await client.get(f"/episodes/{summary['id']}")).json())


async def test_liveness_answers_from_memory_while_the_database_hangs() -> None:
    # A "database" that takes connections into its backlog and never says a word.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        # The tests' connect timeout (60 s), which this database never answers within.
        settings = service_settings(f"postgresql+asyncpg://nobody@127.0.0.1:{port}/none", closed_port_url())
        app = create_app(settings.model_copy(update={"run_worker": False}))
        async with serve_app(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
            started = time.monotonic()
            health = await http.get("/health")
            assert time.monotonic() - started < 1.0  # no query behind it
            assert health.status_code == 200
            assert health.json() == {"status": "ok", "database": "error: TimeoutError: no answer within 5 s"}
            ready = await http.get("/ready")
            assert ready.status_code == 503 and "database error" in ready.json()["detail"]
            stopping = time.monotonic()
        # The stop waits for no connect to time out: the group log's round in flight, stuck on
        # one, is cancelled STOP_WAIT_SECONDS after the stop (it waited out the 60 s before).
        assert time.monotonic() - stopping < STOP_WAIT_SECONDS + 10


# Every name of SGLang's SamplingParams with a valid value; of the grammars (one at most), regex.
EVERY_SGLANG_PARAM: dict[str, Any] = {
    "max_new_tokens": 200, "min_new_tokens": 1, "temperature": 0.5, "top_p": 0.9, "top_k": 20,
    "min_p": 0.05, "frequency_penalty": 0.1, "presence_penalty": -0.1, "repetition_penalty": 1.05,
    "stop": ["\u2603 never sampled"], "stop_token_ids": [], "stop_regex": ["never[0-9]{99}"],
    "ignore_eos": False, "skip_special_tokens": True, "spaces_between_special_tokens": False,
    "no_stop_trim": True, "n": 1, "regex": "(.|\n)*", "structural_tag": '{"type": "none"}',
    "logit_bias": {"5": 0.5}, "custom_params": {"return_top_p_token_ids": True, "k": [1, "a", None]},
    "sampling_seed": 1234, "stream_interval": 4,
}  # fmt: skip


def test_the_api_takes_the_names_sglang_takes() -> None:
    from service.api.schemas import SamplingParams
    from service.sim.worker import SGLANG_SAMPLING_PARAMS

    assert set(SamplingParams.model_fields) == SGLANG_SAMPLING_PARAMS
    assert set(EVERY_SGLANG_PARAM) == SGLANG_SAMPLING_PARAMS - {"json_schema", "ebnf"}


async def test_sampling_params_reach_the_engine_as_given(
    client: httpx.AsyncClient, sim: tuple[SimWorker, str]
) -> None:
    """Every SGLang name is forwarded unchanged on every turn; nulls (slime sends `stop: None`) are
    SGLang's defaults, left out; a single stop string is the list of it SGLang reads."""
    slime_style = {"max_new_tokens": 100, "stop": None, "stop_token_ids": None, "no_stop_trim": True}
    cases = {
        "all-params": (EVERY_SGLANG_PARAM, EVERY_SGLANG_PARAM),
        "slime-style": (slime_style, {"max_new_tokens": 100, "no_stop_trim": True}),
        "one-stop": ({"stop": "</x>"}, {"stop": ["</x>"], "max_new_tokens": 1024}),
    }
    for batch_id, (given, forwarded) in cases.items():
        body = submission(batch_id=batch_id, task_indices=[0], samples_per_task=1, sampling_params=given)
        accepted = await client.post("/episodes", json=body)
        assert accepted.status_code == 202, accepted.text
        await wait_complete(client, batch_id)
        episode_id = accepted.json()["episode_ids"][0]
        sent = [request.sampling_params for request in sim[0].requests if request.rid.startswith(episode_id)]
        assert sent and all(params == forwarded for params in sent), (batch_id, sent[:1])
        stored = (await client.get(f"/episodes/{episode_id}")).json()
        assert stored["sampling_params"] == forwarded
        assert stored["status"] != "failed", stored["error"]  # the engine took them
