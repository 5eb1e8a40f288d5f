"""OpenEnv environments: one WebSocket session per episode on a server of the pool, through
openenv-core's own client (GenericEnvClient) and protocol types (ListToolsAction, CallToolAction,
their observations). The server's MCP tools are the policy's tools, as OpenAI function schemas; each
tool call is a step; the observation's text, reward and done are the Step's."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation, ListToolsAction
from openenv.core.generic_client import GenericEnvClient
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from service.envs.base import RESPOND_ACTION_NAME, Action, Reset, Step
from service.envs.remote.config import RemoteEnvConfig
from service.envs.remote.errors import EnvServerDown, EnvServerError, EnvServerTimeout
from service.envs.remote.pool import Server, ServerPool, backoff

# The server's error codes (openenv WSErrorCode) of a session that was never made: safe to retry.
NOT_STARTED_CODES = frozenset({"CAPACITY_REACHED", "FACTORY_ERROR", "SESSION_ERROR"})
_ERROR_CODE = re.compile(r"\(code: ([A-Z_]+)\)\s*$")
# Observation fields shown as text, in this order, when the observation has several.
TEXT_FIELDS = ("prompt", "text", "message", "content", "observation", "output", "result")


def function_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """An MCP tool (name, description, input schema) as an OpenAI function schema."""
    schema = tool.get("input_schema") or tool.get("inputSchema") or {"type": "object", "properties": {}}
    return {
        "type": "function",
        "function": {
            "name": tool["name"],
            "description": tool.get("description") or "",
            "parameters": schema,
        },
    }


def observation_text(observation: Any) -> str:
    """The text of an observation as the wire carries it (its fields but reward, done, metadata)."""
    if isinstance(observation, str):
        return observation
    if not isinstance(observation, dict):
        return json.dumps(observation)
    texts = [value for value in observation.values() if isinstance(value, str)]
    if len(observation) == 1 and len(texts) == 1:
        return texts[0]
    for name in TEXT_FIELDS:
        if isinstance(observation.get(name), str):
            return str(observation[name])
    return json.dumps(observation, sort_keys=True)


def tool_result_text(observation: CallToolObservation) -> str:
    """An MCP tool call's result as the policy reads it: its text contents, or the tool's error."""
    if observation.error is not None:
        return f"Error ({observation.error.error_type.value}): {observation.error.message}"
    result = observation.result
    if isinstance(result, dict):
        parts = [item.get("text", "") for item in result.get("content") or [] if isinstance(item, dict)]
        if parts:
            return "\n".join(parts)
        if "data" in result:
            result = result["data"]
    return result if isinstance(result, str) else json.dumps(result)


def classify(error: BaseException) -> tuple[str, str | None]:
    """(error kind, server error code) of a failed call."""
    if isinstance(error, TimeoutError):
        return "timeout", None
    if isinstance(error, ConnectionClosed):
        return "closed", None
    if isinstance(error, ConnectionError | OSError):
        return "connect", None
    match = _ERROR_CODE.search(str(error))
    code = match.group(1) if match else None
    return ("capacity" if code == "CAPACITY_REACHED" else "server"), code


class SessionClient(GenericEnvClient):  # type: ignore[misc]
    """openenv-core's generic client, connecting without permessage-deflate (small JSON messages on
    a fast network: compression cost more CPU than it saved) and without a proxy lookup per session
    (websockets reads the whole process environment for it: 4 ms a connect, profiled). Set
    `proxy` to an http://... proxy URL where env servers are reached through one."""

    proxy: str | None = None

    async def connect(self) -> SessionClient:
        if self._ws is not None:  # type: ignore[has-type]
            return self
        try:
            self._ws = await ws_connect(
                self._ws_url,
                open_timeout=self._connect_timeout,
                max_size=self._max_message_size,
                compression=None,
                proxy=self.proxy,
            )
        except Exception as error:
            raise ConnectionError(f"Failed to connect to {self._ws_url}: {error}") from error
        return self


class OpenEnvSession:
    """One episode's session on one OpenEnv server (an EnvSession of the runner)."""

    def __init__(
        self, config: RemoteEnvConfig, pool: ServerPool, server: Server, client: SessionClient
    ) -> None:
        self.config = config
        self.pool = pool
        self.server = server
        self.client = client
        self.system_prompt = config.system_prompt
        self.tools: list[dict[str, Any]] = []
        self.reward = 0.0
        self._reset: Reset | None = None
        self._closed = False

    @property
    def server_url(self) -> str:
        return self.server.url

    async def reset(self, task_index: int) -> Reset:
        assert self._reset is not None, "opened sessions are reset"
        return self._reset

    async def step(self, action: Action) -> Step:
        if action.name == RESPOND_ACTION_NAME and not self.config.respond_tool:
            # A plain answer ends the episode with the reward the server gave so far.
            return Step(observation="", reward=self.reward, done=True)
        if action.name == RESPOND_ACTION_NAME:
            call = CallToolAction(
                tool_name=self.config.respond_tool,
                arguments={self.config.respond_argument: action.kwargs.get("content", "")},
            )
        else:
            call = CallToolAction(tool_name=action.name, arguments=dict(action.kwargs))
        # A tool call may have changed the server's state: never re-sent.
        result = await self._call(f"step {action.name!r}", "step", call)
        observation = CallToolObservation.model_validate(result.observation)
        if result.reward is not None:
            self.reward = float(result.reward)
        return Step(observation=tool_result_text(observation), reward=self.reward, done=bool(result.done))

    async def _call(self, what: str, kind: str, payload: Any) -> Any:
        async with self.pool.call(self.server, kind):
            try:
                return await self.client.step(payload)
            except Exception as error:
                raise self._failure(what, error) from error

    def _failure(self, what: str, error: BaseException) -> Exception:
        kind, _ = classify(error)
        self.pool.failed(self.server, kind, str(error))
        where = f"{what} on env server {self.server.url}"
        if kind == "timeout":
            return EnvServerTimeout(f"{where} did not answer within {self.config.call_timeout_seconds:g} s")
        if kind in ("closed", "connect"):
            return EnvServerDown(f"{where} failed: {type(error).__name__}: {error}")
        return EnvServerError(f"{where}: {error}")

    async def close(self) -> None:
        """Ends the server's session (its env is destroyed) and frees the slot. Idempotent; never
        raises: a server that is gone has dropped the session with the connection."""
        if self._closed:
            return
        self._closed = True
        try:
            async with asyncio.timeout(self.config.connect_timeout_seconds):
                await self.client.close()
        except Exception:
            pass
        finally:
            await self.pool.release(self.server)


async def open_session(
    config: RemoteEnvConfig, pool: ServerPool, split: str, task_index: int, episode_key: str
) -> OpenEnvSession:
    """A session on the least-loaded healthy server, reset with the task, its tools listed. A
    connect or reset that did not take effect (refused, no capacity, the connection dropped before
    the answer: the server's session dies with it) is retried on another server with jitter."""
    data = {
        **config.reset_kwargs,
        "seed": task_index,
        "task_index": task_index,
        "split": split,
        "episode_id": episode_key,
    }
    tried: set[str] = set()
    last: Exception | None = None
    for attempt in range(config.reset_retries + 1):
        if attempt:
            await backoff(attempt - 1, config.retry_backoff_seconds)
        server = await pool.acquire(frozenset(tried))
        tried.add(server.url)
        client = SessionClient(
            base_url=server.url,
            connect_timeout_s=config.connect_timeout_seconds,
            message_timeout_s=config.call_timeout_seconds,
        )
        session = OpenEnvSession(config, pool, server, client)
        try:
            async with pool.call(server, "open"):
                reset = await client.reset(**data)
            async with pool.call(server, "list_tools"):
                listed = await client.step(ListToolsAction())
        except BaseException as error:
            await session.close()
            if not isinstance(error, Exception):
                raise
            kind, code = classify(error)
            pool.failed(server, kind, str(error))
            if kind == "server" and code not in NOT_STARTED_CODES:
                raise EnvServerError(f"reset on env server {server.url}: {error}") from error
            last = error
            continue
        session.tools = [function_schema(tool) for tool in listed.observation.get("tools") or []]
        session.reward = float(reset.reward or 0.0)
        session._reset = Reset(
            observation=observation_text(reset.observation), info={"env_server": server.url}
        )
        return session
    raise EnvServerDown(
        f"no env server of {config.name!r} took the episode after {config.reset_retries + 1} tries "
        f"(last: {type(last).__name__}: {last}); {pool.describe()}"
    )
