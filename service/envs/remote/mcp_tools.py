"""MCP tool servers as an environment's tools, through the official `mcp` SDK's client: streamable
HTTP (a pool of URLs) or stdio (a command, one server process per episode). The tasks, the system
prompt and the reward come from a plugin (`tasks`: `module:function` returning McpTasks); each
episode has an MCP session of its own, closed with the episode."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any, Protocol

from mcp import Client
from mcp.client import Transport
from mcp.client.stdio import StdioServerParameters, stdio_client

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
        self.pool = ServerPool.of(config, servers, self._health_check, metrics)
        self.sessions: set[McpSession] = set()  # open now: shutdown closes them

    def _target(self, server: Server) -> str | Transport:
        if self.config.command:
            # The command's stderr is this process's stderr as it is now: the SDK's own default is
            # the sys.stderr of when mcp was first imported (a default argument), which fails every
            # launch (UnsupportedOperation: fileno) where that was a stream of no file, as a test's
            # captured output.
            command = StdioServerParameters(command=self.config.command[0], args=self.config.command[1:])
            return stdio_client(command, errlog=sys.stderr)
        return server.url

    async def _health_check(self, url: str) -> None:
        if self.config.command:
            return  # a process per episode: nothing runs between episodes
        # The connect's handshake (discover, or initialize for an older server) is the probe: mcp
        # 2's ping works only in its legacy mode, and failed every server's check otherwise.
        async with asyncio.timeout(self.config.connect_timeout_seconds), Client(url):
            pass

    async def open(self, split: str, episode_key: str) -> McpSession:
        """An MCP session on the least-loaded healthy server (retried elsewhere with jitter while
        it fails to connect: nothing has happened yet; ServerPool.place), its tools listed."""
        config = self.config

        async def attempt(server: Server) -> McpSession:
            connection = McpConnection(self._target(server), config.call_timeout_seconds)
            try:
                async with asyncio.timeout(config.connect_timeout_seconds), self.pool.call(server, "open"):
                    listed = await connection.open()
            except BaseException as error:
                await connection.close(config.connect_timeout_seconds)
                if not isinstance(error, Exception):
                    raise
                kind = "timeout" if isinstance(error, TimeoutError) else "connect"
                raise server_failure(
                    server.url, config.name, "open", kind, error, config.connect_timeout_seconds
                ) from error
            tools = [function_schema(tool) for tool in listed.tools]
            return McpSession(self, server, connection, tools, split)

        session = await self.pool.place(
            attempt, retries=config.reset_retries, backoff_seconds=config.retry_backoff_seconds
        )
        self.sessions.add(session)
        return session

    async def close(self) -> None:
        """Closes the sessions still open (shutdown) and stops the health checks."""
        await asyncio.gather(*(session.close() for session in list(self.sessions)))
        await self.pool.close()


class McpConnection:
    """An MCP client held open by a task of its own, from open to close. The SDK's transports run
    anyio task groups whose cancel scopes must be exited by the task that entered them, last in
    first out; an episode's task (or shutdown's) opens and closes sessions in any order, and one
    closed out of order cancelled the closing task and tore down the other session's transport."""

    def __init__(self, target: str | Transport, call_timeout_seconds: float) -> None:
        self.target = target
        self.call_timeout_seconds = call_timeout_seconds
        self.client: Client | None = None
        self._stop = asyncio.Event()
        self._holder: asyncio.Task[None] | None = None

    async def open(self) -> Any:
        """Connects and lists the server's tools (an mcp ListToolsResult)."""
        loop = asyncio.get_running_loop()
        opened: asyncio.Future[Any] = loop.create_future()
        self._holder = loop.create_task(self._hold(opened))
        self._holder.add_done_callback(_retrieve)  # its failure is the opener's or the calls'
        return await opened

    async def _hold(self, opened: asyncio.Future[Any]) -> None:
        try:
            async with Client(self.target, read_timeout_seconds=self.call_timeout_seconds) as client:
                listed = await client.list_tools()
                if opened.done():  # the opener gave up (cancelled, timed out)
                    return
                self.client = client
                opened.set_result(listed)
                await self._stop.wait()
        except BaseException as error:
            if not opened.done():
                if isinstance(error, Exception):
                    opened.set_exception(error)
                else:
                    opened.cancel()
            raise

    async def close(self, timeout_seconds: float) -> None:
        """Ends the session (its transport exits in its own task); never raises."""
        holder = self._holder
        if holder is None:
            return
        self._stop.set()
        done, _ = await asyncio.wait({holder}, timeout=timeout_seconds)
        if not done:
            holder.cancel()
            await asyncio.wait({holder}, timeout=timeout_seconds)


def _retrieve(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()


class McpSession:
    """One episode's MCP session (an EnvSession of the runner)."""

    def __init__(
        self,
        env: McpEnv,
        server: Server,
        connection: McpConnection,
        tools: list[dict[str, Any]],
        split: str,
    ) -> None:
        self.env = env
        self.server = server
        self.connection = connection
        assert connection.client is not None, "a session is made of an open connection"
        self.client = connection.client
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
        self.env.sessions.discard(self)
        try:
            await self.connection.close(self.env.config.connect_timeout_seconds)
        finally:
            await self.env.pool.release(self.server)
