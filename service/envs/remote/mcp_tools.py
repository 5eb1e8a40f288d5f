"""MCP tool servers as an environment's tools, through the official `mcp` SDK's client: streamable
HTTP (a pool of URLs) or stdio (a command, one server process per episode). The tasks, the system
prompt and the reward come from a plugin (`tasks`: `module:function` returning McpTasks); each
episode has an MCP session of its own, closed with the episode."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import AsyncExitStack
from typing import Any, Protocol

from mcp import Client
from mcp.client.stdio import StdioServerParameters

from service.envs.base import RESPOND_ACTION_NAME, Action, Reset, Step
from service.envs.checks import check_reset
from service.envs.plugins import load_function
from service.envs.remote.config import RemoteEnvConfig
from service.envs.remote.errors import server_failure
from service.envs.remote.pool import PoolMetrics, Server, ServerPool


class McpTasks(Protocol):
    """What an MCP env's plugin gives: the policy's system prompt, each task's first user turn, and
    the reward of a finished episode (its tool calls, in order, and the policy's final answer)."""

    system_prompt: str

    def task(self, split: str, task_index: int) -> Reset: ...

    def reward(self, split: str, task_index: int, calls: list[dict[str, Any]], answer: str) -> float: ...


def function_schema(tool: Any) -> dict[str, Any]:
    """An mcp.types.Tool as an OpenAI function schema."""
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description or "",
            "parameters": tool.input_schema or {"type": "object", "properties": {}},
        },
    }


def result_text(result: Any) -> str:
    """A CallToolResult as the policy reads it: its text contents (an error's too)."""
    texts = [item.text for item in result.content if getattr(item, "type", "") == "text"]
    text = "\n".join(texts) if texts else json.dumps(result.structured_content)
    return f"Error: {text}" if result.is_error else text


class McpEnv:
    """One MCP env: its config, its tasks plugin, and its pool of URLs (none for stdio)."""

    def __init__(self, config: RemoteEnvConfig, metrics: PoolMetrics) -> None:
        self.config = config
        self.tasks: McpTasks = load_function(config.tasks)()
        servers = config.urls or ["stdio:" + " ".join(config.command)]
        self.pool = ServerPool(
            config.name,
            servers,
            max_sessions_per_server=config.max_sessions_per_server,
            health_check=self._health_check,
            metrics=metrics,
            health_interval_seconds=config.health_interval_seconds,
            placement_timeout_seconds=config.placement_timeout_seconds,
        )

    def _target(self, server: Server) -> str | StdioServerParameters:
        if self.config.command:
            return StdioServerParameters(command=self.config.command[0], args=self.config.command[1:])
        return server.url

    async def _health_check(self, url: str) -> None:
        if self.config.command:
            return  # a process per episode: nothing runs between episodes
        async with asyncio.timeout(self.config.connect_timeout_seconds), Client(url) as client:
            await client.send_ping()

    async def open(self, split: str, episode_key: str) -> McpSession:
        """An MCP session on the least-loaded healthy server (retried elsewhere with jitter while
        it fails to connect: nothing has happened yet; ServerPool.place), its tools listed."""
        config = self.config

        async def attempt(server: Server) -> McpSession:
            stack = AsyncExitStack()
            try:
                async with asyncio.timeout(config.connect_timeout_seconds), self.pool.call(server, "open"):
                    client = await stack.enter_async_context(
                        Client(self._target(server), read_timeout_seconds=config.call_timeout_seconds)
                    )
                    listed = await client.list_tools()
            except BaseException as error:
                await _close(stack)
                if not isinstance(error, Exception):
                    raise
                kind = "timeout" if isinstance(error, TimeoutError) else "connect"
                raise server_failure(
                    server.url, config.name, "open", kind, error, config.connect_timeout_seconds
                ) from error
            return McpSession(self, server, stack, client, [function_schema(t) for t in listed.tools], split)

        return await self.pool.place(
            attempt, retries=config.reset_retries, backoff_seconds=config.retry_backoff_seconds
        )


async def _close(stack: AsyncExitStack) -> None:
    try:
        await stack.aclose()
    except Exception:
        pass


class McpSession:
    """One episode's MCP session (an EnvSession of the runner)."""

    def __init__(
        self,
        env: McpEnv,
        server: Server,
        stack: AsyncExitStack,
        client: Client,
        tools: list[dict[str, Any]],
        split: str,
    ) -> None:
        self.env = env
        self.server = server
        self.stack = stack
        self.client = client
        self.tools = tools
        self.split = split
        self.system_prompt = env.tasks.system_prompt
        self.task_index = -1
        self.calls: list[dict[str, Any]] = []
        self._closed = False

    async def reset(self, task_index: int) -> Reset:
        self.task_index = task_index
        return check_reset(self.env.tasks.task(self.split, task_index))

    async def step(self, action: Action) -> Step:
        if action.name == RESPOND_ACTION_NAME:
            answer = str(action.kwargs.get("content", ""))
            reward = float(self.env.tasks.reward(self.split, self.task_index, self.calls, answer))
            return Step(observation="", reward=reward, done=True)
        pool, server = self.env.pool, self.server
        started = time.perf_counter()
        try:
            async with pool.call(server, "step"), asyncio.timeout(self.env.config.call_timeout_seconds):
                result = await self.client.call_tool(action.name, dict(action.kwargs))
        except Exception as error:
            kind = "timeout" if isinstance(error, TimeoutError) else "closed"
            config = self.env.config
            failure = server_failure(
                server.url, config.name, f"step {action.name!r}", kind, error, config.call_timeout_seconds
            )
            pool.failed(server, kind, failure.how)
            raise failure from error
        text = result_text(result)
        self.calls.append(
            {
                "name": action.name,
                "arguments": dict(action.kwargs),
                "result": text,
                "is_error": result.is_error,
                "seconds": time.perf_counter() - started,
            }
        )
        return Step(observation=text, reward=0.0, done=False)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            async with asyncio.timeout(self.env.config.connect_timeout_seconds):
                await _close(self.stack)
        except TimeoutError:
            pass
        finally:
            await self.env.pool.release(self.server)
