"""Every text field of every operation in openapi.yaml, sent a NUL and a lone surrogate, on both
databases: the answer is a 4xx naming the field, or the request is taken and the value reads back
intact (or, where it is not stored, is echoed or sent on intact). Never a 5xx, and never an answer
that differs between SQLite and PostgreSQL (PostgreSQL's text cannot hold NUL; no database can
encode a lone surrogate).

The fields come from the contract, so a field added later is covered or this test names it: each
operation has example requests here, and together they must hold a string at every place the
contract's schema has one."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import yaml
from sqlalchemy import String, Text
from sqlalchemy.dialects import postgresql, sqlite

from service.app import create_app
from service.serving import serve_app
from service.sim.worker import SimWorker
from service.storage.models import Base, DiagnosticText, TextColumn
from tests.conftest import service_settings

# libyaml's loader: at collection, on every pytest-xdist worker (PyYAML's own took 0.3 s of CPU)
SPEC = yaml.load((Path(__file__).resolve().parents[1] / "openapi.yaml").read_text(), Loader=yaml.CSafeLoader)
NUL, SURROGATE = "a\x00b", "a\ud800b"
# In a URL, text is UTF-8 percent-escaped; a lone surrogate has no UTF-8 form, so its three bytes
# (as CESU-8 would write them) are what a client could send.
URL_FORMS = {NUL: quote(NUL), SURROGATE: "a%ED%A0%80b"}
ITEM, ANY_KEY = "[]", "{}"  # a path's list item and free-form object key
# Header parameters: HTTP cannot carry a NUL in a header, and h11 refuses one.
HEADERS = {"accept", "authorization", "x-api-key"}

Path_ = tuple[str | int, ...]


def _resolve(schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        node: Any = SPEC
        for part in schema["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def schema_text_paths(schema: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Where a schema holds a string: object properties by name, list items as ITEM, the values of a
    free-form object as ANY_KEY."""
    schema = _resolve(schema)
    for branch in schema.get("anyOf", []) + schema.get("oneOf", []):
        yield from schema_text_paths(branch, path)
    kind = schema.get("type")
    if kind == "string":
        yield path
    elif kind == "array":
        yield from schema_text_paths(schema.get("items", {}), (*path, ITEM))
    elif kind == "object" or "properties" in schema:
        for name, child in schema.get("properties", {}).items():
            yield from schema_text_paths(child, (*path, name))
        extra = schema.get("additionalProperties")
        free_form = kind == "object" and "properties" not in schema and extra is None
        if extra is True or extra == {} or free_form:
            yield (*path, ANY_KEY)
        elif isinstance(extra, dict):
            yield from schema_text_paths(extra, (*path, ANY_KEY))


def string_leaves(value: Any, path: Path_ = ()) -> Iterator[Path_]:
    if isinstance(value, str):
        yield path
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from string_leaves(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from string_leaves(item, (*path, index))


def covers(leaf: Path_, wanted: tuple[str, ...]) -> bool:
    """Whether a concrete leaf (keys and indices) is at the schema's place `wanted`. A free-form
    object's value may be any JSON, so ANY_KEY covers a string anywhere under that key."""
    for position, part in enumerate(wanted):
        if position >= len(leaf):
            return False
        if part == ANY_KEY:
            return isinstance(leaf[position], str)
        if part == ITEM:
            if not isinstance(leaf[position], int):
                return False
        elif leaf[position] != part:
            return False
    return len(leaf) == len(wanted)


def replaced(value: Any, path: Path_, text: str) -> Any:
    if not path:
        return text
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: replaced(value[head], rest, text)}
    return [replaced(item, rest, text) if index == head else item for index, item in enumerate(value)]


def texts_in(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from texts_in(item)
    elif isinstance(value, list):
        for item in value:
            yield from texts_in(item)


TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Looks a word up.",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
    },
}


def submission(**extra: Any) -> dict[str, Any]:
    return {
        "batch_id": f"b-{uuid.uuid4().hex}",
        "env": "external",
        "task_split": "words",
        "task_indices": [0],
        "samples_per_task": 1,
        **extra,
    }


# Example bodies of each operation that takes one; together they hold a string at every place the
# operation's schema has one (test_the_examples_cover_the_contract).
BODIES: dict[str, list[dict[str, Any]]] = {
    "POST /episodes": [
        submission(
            metadata={"note": "x", "nested": [{"deep": "y"}]},
            sampling_params={
                "stop": ["x", "y"],
                "regex": "x+",
                "structural_tag": "{}",
                "custom_params": {"k": "x", "l": ["y"], "m": {"n": "z"}},
                "logit_bias": {"11": 1.0},
            },
        ),
        submission(sampling_params={"stop": "x", "stop_regex": ["x+"], "json_schema": '{"type": "string"}'}),
        submission(sampling_params={"ebnf": 'root ::= "x"'}),
    ],
    "POST /v1/episodes/{episode_id}/chat/completions": [
        {
            "model": "policy",
            "messages": [
                {"role": "system", "content": "You look words up."},
                {"role": "user", "content": "What is a word?"},
            ],
            "tools": [TOOL],
            "stop": ["x"],
            "max_tokens": 8,
        },
        {"messages": [{"role": "user", "content": "Hi"}], "stop": "x", "max_tokens": 8},
    ],
    "POST /v1/episodes/{episode_id}/messages": [
        {
            "model": "policy",
            "max_tokens": 8,
            "system": [{"type": "text", "text": "You look words up."}],
            "messages": [
                {"role": "user", "content": "What is a word?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "Look it up."},
                        {"type": "redacted_thinking"},
                        {"type": "text", "text": "Looking."},
                        {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"word": "x"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "A unit."}],
                        },
                        {"type": "text", "text": "Thanks."},
                    ],
                },
            ],
            "tools": [
                {
                    "type": "custom",
                    "name": "lookup",
                    "description": "Looks a word up.",
                    "input_schema": TOOL["function"]["parameters"],  # type: ignore[index]
                }
            ],
            "tool_choice": {"type": "tool"},
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "stop_sequences": ["x"],
        },
        {
            "max_tokens": 8,
            "system": "Be brief.",
            "messages": [
                {"role": "user", "content": "Hi"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "lookup", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t", "content": '{"a": 1}', "is_error": True}
                    ],
                },
            ],
        },
    ],
    "POST /v1/episodes/{episode_id}/responses": [
        {
            "model": "policy",
            "instructions": "You look words up.",
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "What is a word?"}],
                },
                {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Look it up."}]},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [
                        {"type": "output_text", "text": "Looking."},
                        {"type": "refusal", "refusal": "No."},
                    ],
                },
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "lookup",
                    "arguments": '{"word": "x"}',
                },
                {
                    "type": "function_call_output",
                    "call_id": "call_1",
                    "output": [
                        {"type": "input_text", "text": "A unit."},
                        {"type": "refusal", "refusal": "x"},
                    ],
                },
            ],
            "tools": [{"type": "function", **TOOL["function"]}],  # type: ignore[dict-item]
            "tool_choice": {"type": "function", "name": "lookup"},
            "max_output_tokens": 8,
        },
        {
            "input": [
                {"role": "user", "content": "Hi"},
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Greet."}]},
                {"type": "function_call_output", "call_id": "c", "output": "x"},
            ],
            "tool_choice": "auto",
            "max_output_tokens": 8,
        },
        {"input": "Hi", "max_output_tokens": 8},
        {"input": [], "previous_response_id": "resp_0", "max_output_tokens": 8},  # no other text: refused
    ],
    "POST /v1/episodes/{episode_id}/finish": [
        {"status": "completed", "reward": 1.0, "info": {"note": "x", "list": ["y"]}, "error": "x"},
    ],
    "POST /engine/pause": [{"mode": "retract"}],
}
# Example query strings of each operation with text parameters, and the parameters' example values.
QUERIES: dict[str, dict[str, str]] = {
    "GET /groups": {"env": "builtin/shop", "batch_id": "b-1"},
    "GET /batches": {"before": "b-1"},
    "GET /batches/{batch_id}/episodes": {"status": "completed"},
}


def operations() -> Iterator[tuple[str, str, dict[str, Any]]]:
    for route, methods in SPEC["paths"].items():
        for method, operation in methods.items():
            yield f"{method.upper()} {route}", route, operation


def text_parameters(operation: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        (parameter["name"], parameter["in"])
        for parameter in operation.get("parameters", [])
        if parameter["name"] not in HEADERS and any(schema_text_paths(parameter.get("schema", {})))
    ]


def body_schema(operation: dict[str, Any]) -> dict[str, Any] | None:
    content = operation.get("requestBody", {}).get("content", {})
    return content["application/json"]["schema"] if "application/json" in content else None


def test_the_examples_cover_the_contract() -> None:
    """A text field added to the contract without an example here fails this test, naming it."""
    missing = []
    for label, _, operation in operations():
        schema = body_schema(operation)
        if schema is not None:
            leaves = [leaf for body in BODIES.get(label, []) for leaf in string_leaves(body)]
            for wanted in schema_text_paths(schema):
                if not any(covers(leaf, wanted) for leaf in leaves):
                    missing.append(f"{label} body {'.'.join(wanted)}")
        for name, where in text_parameters(operation):
            if where == "query" and name not in QUERIES.get(label, {}):
                missing.append(f"{label} query {name}")
    assert not missing, f"no example holds these text fields; add them to BODIES or QUERIES: {missing}"
    assert set(BODIES) <= {label for label, _, operation in operations() if body_schema(operation)}
    assert set(QUERIES) <= {label for label, _, _ in operations()}


@pytest.fixture
async def http(database_url: str, sim: tuple[SimWorker, str]) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(service_settings(database_url, sim[1], external_idle_seconds=600))
    async with serve_app(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
        yield client


async def open_episode(http: httpx.AsyncClient) -> dict[str, Any]:
    response = await http.post("/episodes", json=submission())
    assert response.status_code == 202, response.text
    agent: dict[str, Any] = response.json()["agents"][0]
    return agent


async def read_back(http: httpx.AsyncClient, batch_id: str | None, episode_id: str | None) -> list[str]:
    """Every text of what the service answers about the batch and its episodes."""
    answers = []
    if batch_id is not None:
        answers.append((await http.get(f"/batches/{batch_id}")).json())
        episodes = (await http.get(f"/batches/{batch_id}/episodes")).json()
        answers.append(episodes)
        episode_ids = [episode["id"] for episode in episodes["episodes"]]
    else:
        episode_ids = [episode_id]
    for id_ in episode_ids:
        answers.append((await http.get(f"/episodes/{id_}")).json())
    return [text for answer in answers for text in texts_in(answer)]


def assert_refused_naming(response: httpx.Response, field: Path_, where: str) -> None:
    assert response.status_code == 422, (where, field, response.status_code, response.text)
    locations = [problem["loc"] for problem in response.json()["errors"]]
    names = [part for part in field if isinstance(part, str)]
    assert any(location[0] == where and set(names) <= set(map(str, location)) for location in locations), (
        field,
        locations,
    )


@pytest.mark.parametrize("text", [NUL, SURROGATE], ids=["nul", "lone-surrogate"])
async def test_every_body_text_is_refused_or_reads_back(
    http: httpx.AsyncClient, sim: tuple[SimWorker, str], text: str
) -> None:
    engine = sim[0]
    accepted = []
    for label, bodies in BODIES.items():
        method, route = label.split(" ", 1)
        for body in bodies:
            for leaf in string_leaves(body):
                sent = replaced(body, leaf, text)
                headers = {"content-type": "application/json"}
                batch_id = episode_id = None
                if "{episode_id}" in route:
                    agent = await open_episode(http)
                    episode_id = agent["episode_id"]
                    headers["authorization"] = f"Bearer {agent['api_key']}"
                if label == "POST /episodes" and leaf != ("batch_id",):
                    batch_id = sent["batch_id"] = f"b-{uuid.uuid4().hex}"  # a new batch each time
                path = route.replace("{episode_id}", episode_id or "")
                # json.dumps writes a lone surrogate as its \ud800 escape, as a client's JSON would.
                response = await http.request(method, path, content=json.dumps(sent), headers=headers)
                assert response.status_code < 500, (label, leaf, response.text)
                if response.status_code >= 400:
                    assert_refused_naming(response, leaf, "body")
                    continue
                if label == "POST /engine/pause":
                    await http.post("/engine/continue")
                    continue
                # Stored and read back; or, not stored, echoed in the answer (an agent's `model`) or
                # sent to the engine as given (an agent's `stop`).
                sent_to_engine = [text for request in engine.requests for text in texts_in(request.body)]
                texts = [
                    *texts_in(response.json()),
                    *await read_back(http, batch_id, episode_id),
                    *sent_to_engine,
                ]
                assert any(text in stored for stored in texts), (label, leaf, "taken but not read back")
                accepted.append((label, leaf))
    if text == SURROGATE:
        assert not accepted, f"a lone surrogate has no UTF-8 form, yet these took one: {accepted}"
    else:  # NUL is text JSON holds: free-form values keep it
        assert ("POST /episodes", ("metadata", "note")) in accepted
        assert ("POST /v1/episodes/{episode_id}/chat/completions", ("messages", 1, "content")) in accepted


@pytest.mark.parametrize("text", [NUL, SURROGATE], ids=["nul", "lone-surrogate"])
async def test_every_parameter_text_is_refused_or_answered(http: httpx.AsyncClient, text: str) -> None:
    """Query filters and path ids: a 422 naming the parameter, or an answer (a filter that matches
    nothing), the same on both databases."""
    agent = await open_episode(http)
    for label, route, operation in operations():
        method = label.split(" ", 1)[0]
        if method not in ("GET", "HEAD"):
            continue
        for name, where in text_parameters(operation):
            query = dict(QUERIES.get(label, {}))
            path = route.replace("{episode_id}", agent["episode_id"]).replace("{batch_id}", "b-1")
            if where == "path":
                path = path.replace(agent["episode_id"] if "episode" in name else "b-1", URL_FORMS[text])
            else:
                query[name] = text
            url = (
                path
                + "?"
                + "&".join(
                    f"{key}={URL_FORMS[value] if value == text else quote(value)}"
                    for key, value in query.items()
                )
            )
            response = await http.request(method, url)
            assert response.status_code < 500, (label, name, response.text)
            if text == NUL or response.status_code == 422:
                assert_refused_naming(response, (name,), where)
            else:  # the URL's bytes are not UTF-8: read as U+FFFD, which is text, and answered
                assert response.status_code in (200, 404), (label, name, response.text)


def test_every_text_column_keeps_one_rule_on_every_database() -> None:
    """The columns themselves refuse what a database could not hold the same on both (NUL, lone
    surrogates) before any statement runs; the service's own diagnostics replace it instead."""
    loose = [
        f"{table.name}.{column.name}"
        for table in Base.metadata.tables.values()
        for column in table.columns
        if isinstance(column.type, String | Text) and not isinstance(column.type, TextColumn | DiagnosticText)
    ]
    assert not loose, f"text columns without the storage rule: {loose}"
    column, diagnostic = TextColumn(16), DiagnosticText()
    for dialect in (sqlite.dialect(), postgresql.dialect()):
        for text in (NUL, SURROGATE):
            with pytest.raises(ValueError, match=r"service/api/values\.py"):
                column.process_bind_param(text, dialect)
            assert diagnostic.process_bind_param(f"env said {text}", dialect) == "env said a\ufffdb"
        assert column.process_bind_param("ok é 日本", dialect) == "ok é 日本"
