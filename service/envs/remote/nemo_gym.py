"""NeMo Gym resource servers (nemo-gym, github.com/NVIDIA-NeMo/Gym: read at v0.4.0, d67ad6611cfe,
PyPI's nemo-gym 0.4.0; its HTTP surface is unchanged at 07d6b0d07b22), spoken over plain HTTP: the
service does not import nemo-gym. What its own agent (responses_api_agents/simple_agent) does, one
episode at a time on a server of the pool:

1. POST /seed_session with the task's dataset row. The server's session is Starlette's signed
   session cookie (SimpleServer.setup_session_middleware: a `session_id` in a cookie named after the
   server), re-sent with every answer; the episode carries its own cookies on every call after.
2. Each tool call: POST /<tool> with the call's JSON arguments. The answer's body, whatever its
   status, is the tool message (nemo-gym feeds a tool's error back to the model the same way).
3. The policy's plain answer: POST /verify with the row and `response`, the episode as a Responses
   API response (its function calls, their outputs, the answer message); its `reward` is the
   episode's.

The policy sees the row's `responses_create_params`: its system/developer messages, its user turn,
its function tools. There is no end of session in the protocol: closing frees the pool's slot."""

from __future__ import annotations

import http.cookiejar
import json
import time
from http.cookies import CookieError, SimpleCookie
from typing import Any
from urllib.parse import quote

import httpx

from service.envs.base import RESPOND_ACTION_NAME, Action, Reset, Step
from service.envs.errors import EnvError
from service.envs.remote.config import RemoteEnvConfig
from service.envs.remote.errors import EnvServerDown, EnvServerError, server_failure
from service.envs.remote.nemo_gym_data import DatasetRows, policy_view
from service.envs.remote.pool import PoolMetrics, Server, ServerPool

# Statuses of a seed that did not take effect (the server or a proxy before it took nothing):
# retried on another server.
NOT_SEEDED_STATUSES = frozenset({429, 502, 503, 504})
# Statuses of a proxy in front of a server that is not there: infrastructure, not the env's answer.
GATEWAY_STATUSES = frozenset({502, 503, 504})
JSON_HEADERS = {"content-type": "application/json"}
ROW_KEYS_NOT_ECHOED = ("responses_create_params", "response", "reward")


def refuse_cookies() -> http.cookiejar.CookieJar:
    """A cookie jar that keeps none: the env's shared client must not carry one episode's session
    cookie into another's calls (each episode sends its own). A jar, not httpx.Cookies: the client
    copies a Cookies into a jar of the default policy, which keeps them all."""
    return http.cookiejar.CookieJar(http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))


def set_cookies(response: httpx.Response) -> dict[str, str]:
    """The cookies a response sets, name -> value (as nemo-gym's agent reads them: aiohttp's
    SimpleCookie, no domain rules)."""
    cookies: dict[str, str] = {}
    for header in response.headers.get_list("set-cookie"):
        try:
            parsed = SimpleCookie(header)
        except CookieError:
            continue
        cookies.update((name, morsel.value) for name, morsel in parsed.items())
    return cookies


def failure_kind(error: httpx.TransportError) -> str:
    if isinstance(error, httpx.TimeoutException) and not isinstance(error, httpx.ConnectTimeout):
        return "timeout"
    return "connect" if isinstance(error, httpx.ConnectError | httpx.ConnectTimeout) else "closed"


class NemoGymEnv:
    """One NeMo Gym env: its config, its datasets, its pool, and one HTTP client for its servers."""

    def __init__(self, config: RemoteEnvConfig, metrics: PoolMetrics) -> None:
        self.config = config
        self.datasets = {split: DatasetRows(path) for split, path in config.datasets.items()}
        # Sessions are capped by the pool; the connections follow them (no wait for a connection,
        # which would read as a timeout of the server).
        keep = config.max_sessions_per_server * len(config.urls)
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(config.call_timeout_seconds, connect=config.connect_timeout_seconds),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=keep),
            cookies=refuse_cookies(),
        )
        self.pool = ServerPool.of(config, config.urls, self._health_check, metrics)

    async def _health_check(self, url: str) -> None:
        # nemo-gym's run_webserver serves its liveness at GET / (BaseServer.setup_liveness).
        response = await self.http.get(f"{url}/", timeout=self.config.connect_timeout_seconds)
        response.raise_for_status()

    def session(self, split: str, episode_key: str) -> NemoGymSession:
        return NemoGymSession(self, split, episode_key)

    async def seed(self, row: dict[str, Any]) -> tuple[Server, dict[str, str]]:
        """A seeded session on the least-loaded healthy server: (its server, its cookies). A seed
        that did not answer is retried on another server with jitter (ServerPool.place): nothing
        of the episode has happened yet, and a session seeded there is never reached without its
        cookie."""
        body = json.dumps(row)
        config = self.config

        async def attempt(server: Server) -> tuple[Server, dict[str, str]]:
            try:
                async with self.pool.call(server, "open"):
                    response = await self.http.post(
                        f"{server.url}/seed_session", content=body, headers=JSON_HEADERS
                    )
            except httpx.TransportError as error:
                raise self.failure(server, "seed_session", failure_kind(error), error) from error
            if response.status_code in NOT_SEEDED_STATUSES:
                answer = Exception(f"HTTP {response.status_code}: {response.text[:200]}")
                raise self.failure(server, "seed_session", "capacity", answer)
            if response.is_error:
                self.pool.failed(server, "server", f"HTTP {response.status_code}")
                raise EnvServerError(
                    f"seed_session on env server {server.url}: HTTP {response.status_code}: "
                    f"{response.text[:1000]}"
                )
            return server, set_cookies(response)

        return await self.pool.place(
            attempt, retries=config.reset_retries, backoff_seconds=config.retry_backoff_seconds
        )

    def failure(self, server: Server, doing: str, kind: str, error: BaseException) -> EnvServerDown:
        """The infrastructure error of a call that failed in transit, as OpenEnv's read (a timeout
        is a call's: a connect that timed out is a failure of kind "connect")."""
        config = self.config
        return server_failure(server.url, config.name, doing, kind, error, config.call_timeout_seconds)

    async def close(self) -> None:
        await self.pool.close()
        await self.http.aclose()


class NemoGymSession:
    """One episode's session (an EnvSession of the runner): placed and seeded at its reset."""

    def __init__(self, env: NemoGymEnv, split: str, episode_key: str) -> None:
        self.env = env
        self.split = split
        self.episode_key = episode_key
        self.system_prompt = env.config.system_prompt
        self.tools: list[dict[str, Any]] = []
        self.server: Server | None = None
        self.row: dict[str, Any] = {}
        self.cookies: dict[str, str] = {}
        self.output: list[dict[str, Any]] = []  # the episode as a Responses API response's output
        self._closed = False

    async def reset(self, task_index: int) -> Reset:
        try:
            self.row = self.env.datasets[self.split].row(task_index)
            system, observation, self.tools = policy_view(self.row)
        except ValueError as error:  # the env's own data: aborts the episode as an env error would
            raise EnvError("NemoGymDatasetError", str(error)) from error
        self.system_prompt = system or self.env.config.system_prompt
        self.server, self.cookies = await self.env.seed(self.row)
        return Reset(observation=observation, info={"env_server": self.server.url})

    async def step(self, action: Action) -> Step:
        if action.name == RESPOND_ACTION_NAME:
            return await self._verify(str(action.kwargs.get("content", "")))
        call_id = f"call_{len(self.output)}"
        self.output.append(
            {
                "type": "function_call",
                "id": f"fc_{len(self.output)}",
                "call_id": call_id,
                "name": action.name,
                "arguments": json.dumps(action.kwargs),
                "status": "completed",
            }
        )
        # A tool call may have changed the server's state: never re-sent.
        response = await self._post(
            f"/{quote(action.name, safe='')}", "step", f"step {action.name!r}", action.kwargs
        )
        self.output.append({"type": "function_call_output", "call_id": call_id, "output": response.text})
        return Step(observation=response.text, reward=0.0, done=False)

    async def _verify(self, answer: str) -> Step:
        self.output.append(
            {
                "type": "message",
                "id": f"msg_{len(self.output)}",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": answer, "annotations": []}],
            }
        )
        response = await self._post("/verify", "verify", "verify", {**self.row, "response": self.response()})
        if response.is_error:
            raise EnvServerError(
                f"verify on env server {self.where()}: HTTP {response.status_code}: {response.text[:1000]}"
            )
        try:
            verified = response.json()
            reward = float(verified["reward"])
        except (ValueError, KeyError, TypeError) as error:
            raise EnvServerError(
                f"verify on env server {self.where()} gave no reward: {response.text[:1000]}"
            ) from error
        # What the verifier adds to the row (its judgement, extracted answers): the trainer's records.
        extra = {k: v for k, v in verified.items() if k not in self.row and k not in ROW_KEYS_NOT_ECHOED}
        return Step(observation="", reward=reward, done=True, info={"verify": extra} if extra else {})

    def response(self) -> dict[str, Any]:
        """The episode as the Responses API response /verify reads (nemo-gym's NeMoGymResponse)."""
        params = self.row["responses_create_params"]
        return {
            "id": f"resp_{self.episode_key}",
            "object": "response",
            "created_at": time.time(),
            "model": params.get("model") or "policy",
            "status": "completed",
            "output": self.output,
            "parallel_tool_calls": params.get("parallel_tool_calls", True),
            "tool_choice": params.get("tool_choice", "auto"),
            "tools": params.get("tools") or [],
        }

    def where(self) -> str:
        return self.server.url if self.server is not None else "(none)"

    async def _post(self, path: str, kind: str, doing: str, payload: Any) -> httpx.Response:
        """One call on the episode's server with its cookies; a call that fails in transit is
        infrastructure (the server is down or timed out) and is not re-sent."""
        server, pool = self.server, self.env.pool
        assert server is not None, "a session is reset before its steps"
        headers = JSON_HEADERS | {"cookie": "; ".join(f"{k}={v}" for k, v in self.cookies.items())}
        try:
            async with pool.call(server, kind):
                response = await self.env.http.post(
                    f"{server.url}{path}", content=json.dumps(payload), headers=headers
                )
        except httpx.TransportError as error:
            failure = self.env.failure(server, doing, failure_kind(error), error)
            pool.failed(server, failure.kind, failure.how)
            raise failure from error
        if response.status_code in GATEWAY_STATUSES:
            # A proxy in front of a server that is not there: as a refused connection.
            answer = ConnectionError(f"HTTP {response.status_code} from a proxy")
            failure = self.env.failure(server, doing, "connect", answer)
            pool.failed(server, failure.kind, failure.how)
            raise failure
        self.cookies.update(set_cookies(response))
        return response

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.server is not None:
            await self.env.pool.release(self.server)
