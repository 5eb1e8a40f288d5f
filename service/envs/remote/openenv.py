"""OpenEnv environments: an episode holds a WebSocket session on one server of the pool, through
openenv-core's own client (GenericEnvClient) and wire protocol (its reset/step messages, MCP
list_tools/call_tool actions). A server whose environment is an MCP environment shows the policy
its MCP tools, as OpenAI function schemas, each call a step; any other server's action (from its
/schema) is one tool whose arguments are the action (openenv_actions.py). The observation's text,
reward and done are the Step's. A session whose episode ended cleanly is kept for the server's
next episode, which resets it (openenv_idle.py), as OpenEnv's own clients reuse one session."""

from __future__ import annotations

import asyncio
import re
import secrets
import struct
import sys
from collections.abc import Iterator
from typing import Any

import orjson
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, ConnectionClosedError
from websockets.frames import DATA_OPCODES, OP_TEXT, Frame
from websockets.protocol import Event, Protocol, State
from websockets.streams import StreamReader
from websockets.typing import BytesLike

from service.call_timeouts import CallTimeouts
from service.envs.base import RESPOND_ACTION_NAME, Action, Reset, Step
from service.envs.remote.config import RemoteEnvConfig
from service.envs.remote.errors import EnvServerError, server_failure
from service.envs.remote.openenv_actions import (
    ActionSpace,
    call_tool_payload,
    observation_text,
    tool_result_text,
)
from service.envs.remote.openenv_idle import IdleSessions
from service.envs.remote.pool import PoolMetrics, Server, ServerPool

try:  # the C masking websockets itself uses where it was built, else its Python one (as it does)
    from websockets.speedups import apply_mask
except ImportError:
    from websockets.utils import apply_mask

# openenv-core's GenericEnvClient, imported without gradio: importing the client imports the
# package's server side, which imports its web interface (gradio) unless gradio is missing, a case
# it allows for (env_server/__init__.py catches the ModuleNotFoundError). A client needs no web UI,
# and gradio was about 3 of the 5 s of CPU the import cost (python -X importtime), at every start of
# a service process with an OpenEnv env. gradio is importable again afterwards, for any other code of
# the process that uses it; where it was already imported, nothing is blocked.
_BLOCK_GRADIO = "gradio" not in sys.modules
if _BLOCK_GRADIO:
    sys.modules["gradio"] = None  # type: ignore[assignment]  # the import system's "missing"
try:
    from openenv.core.generic_client import GenericEnvClient
finally:
    if _BLOCK_GRADIO:
        del sys.modules["gradio"]

# The server's error codes (openenv WSErrorCode) of a session that was never made: safe to retry.
NOT_STARTED_CODES = frozenset({"CAPACITY_REACHED", "FACTORY_ERROR", "SESSION_ERROR"})
_ERROR_CODE = re.compile(r"\(code: ([A-Z_]+)\)\s*$")


def classify(error: BaseException) -> tuple[str, str | None]:
    """(error kind, server error code) of a failed call: "timeout", "closed" (the connection
    dropped), "connect" (it could not be made), "capacity" or "server" (the server answered with
    an error). The cause chain is read: the client wraps a refused or timed-out connect in its own
    ConnectionError."""
    seen: BaseException | None = error
    kind = None
    while seen is not None:
        if isinstance(seen, TimeoutError):
            return "timeout", None
        if isinstance(seen, ConnectionClosed):
            return "closed", None
        if isinstance(seen, ConnectionError | OSError) and kind is None:
            kind = "connect"
        seen = seen.__cause__ or seen.__context__
    if kind is not None:
        return kind, None
    match = _ERROR_CODE.search(str(error))
    code = match.group(1) if match else None
    return ("capacity" if code == "CAPACITY_REACHED" else "server"), code


class SessionClient(GenericEnvClient):  # type: ignore[misc]
    """openenv-core's generic client, connecting without permessage-deflate (small JSON messages on
    a fast network: compression cost more CPU than it saved), without keepalive pings of its own
    (see below) and without a proxy lookup per session
    (websockets reads the whole process environment for it: 4 ms a connect, profiled), its frames
    coded by orjson (the same JSON text; json's encoder and decoder were a measured share of the
    service's CPU per call). No client pings: a ping per session every 20 s was a tenth of the
    service's CPU per env call with 500 sessions open (profiled), and its 20 s pong timeout dropped
    sessions of a slow but live server mid-call (177 of 1,000 episodes at load 37); the call timeout
    bounds a call, health checks take a dead server out of placement, and the server's own pings
    (uvicorn's, every 20 s) are still answered, by websockets as frames arrive, so that an idle
    session stays open. Set `proxy` to an http://... proxy URL where env servers are reached
    through one."""

    proxy: str | None = None
    tools: list[dict[str, Any]] | None = None  # the session's tools, listed once per session
    timeouts: CallTimeouts  # the env's: each answer awaited within its call timeout
    expired = False  # whether a call outlived its timeout (its connection was then aborted)

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
                ping_interval=None,
                create_connection=AnswerConnection,
            )
        except Exception as error:
            raise ConnectionError(f"Failed to connect to {self._ws_url}: {error}") from error
        return self

    async def request(self, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        """The answer's data to an openenv `reset` or `step` message (`{"type": kind, "data":
        data}`), as EnvClient.reset and .step send it and read its answer (_send_and_receive: a
        server's error raised as openenv raises it), without the StepResult that GenericEnvClient
        builds around the data: its "observation", "reward" and "done" are read where they are
        used. Hand-written on a measured hot path (every env call): openenv's step, its payload
        and result parsing and the StepResult were 6% of the service's CPU per remote env call
        (perf, bench/remote_envs.py)."""
        answer: dict[str, Any] = (await self._send_and_receive({"type": kind, "data": data})).get("data", {})
        return answer

    async def _send(self, message: dict[str, Any]) -> None:
        if self._ws is None:
            await self.connect()
        ws = self._ws
        data = orjson.dumps(message)  # UTF-8 bytes, sent as a text frame: not decoded to be encoded again
        if (
            ws.protocol.state is State.OPEN
            and ws.send_in_progress is None
            and not ws.paused
            and not ws.transport.is_closing()
        ):
            # Hand-written on a measured hot path: the frame written as Connection.send writes it,
            # without its context manager and drain (a third of the service's CPU per call over a
            # kept session, profiled), and serialized here (text_frame). Nothing to drain: one
            # small message, then its answer is awaited; a connection that is closing, paused or
            # mid-message takes the full path.
            try:
                ws.transport.write(text_frame(data))
            except Exception as error:
                ws.transport.abort()
                raise ConnectionClosedError(None, None) from error
            return
        await ws.send(data, text=True)

    async def _receive(self) -> dict[str, Any]:
        ws = self._ws
        assert isinstance(ws, AnswerConnection), "connected by connect()"
        timeouts = self.timeouts
        timeouts.add(self, self._expire)
        try:
            raw = None
            if ws.protocol.state is State.OPEN and not ws.queued:
                # The answer handed over as it comes (AnswerConnection).
                waiter = ws.answer = ws.loop.create_future()
                try:
                    raw = await waiter
                finally:
                    ws.answer = None
            if raw is None:  # a message in websockets' queue, or a connection closing or closed
                raw = await ws.recv(decode=False)  # orjson reads the UTF-8 bytes: not decoded twice
                ws.queued = max(0, ws.queued - 1)
        except ConnectionClosed as closed:
            if self.expired:
                raise TimeoutError(f"no answer within {timeouts.seconds:g} s") from closed
            raise
        finally:
            timeouts.discard(self)
        answer: dict[str, Any] = orjson.loads(raw)
        return answer

    def _expire(self) -> None:
        """A call outlived its timeout: its connection is dropped (the server ends the session
        with it), and the call raises TimeoutError."""
        self.expired = True
        self._ws.transport.abort()

    @property
    def open(self) -> bool:
        return self._ws is not None and self._ws.state is State.OPEN


class AnswerConnection(ClientConnection):
    """websockets' client connection, a session's answer handed to the call awaiting it: read from
    the socket's bytes where it came as one whole frame in one read (data_received), else as
    websockets' parser hands its frame on (process_event). Hand-written on a measured hot path
    (every env call): the message assembler's queue and its get and put were 6-8% of the service's
    CPU per remote env call (perf, bench/remote_envs.py). A call awaits `answer`, which a final
    text frame fulfils with its payload. Every other message (one in fragments, one that arrives
    while no call awaits: the protocol's answers each follow their call) goes to websockets' own
    queue, counted in `queued`, and a call reads it from there, as recv() would: an awaiting call
    is woken with None to do so. Everything else (pings, close frames) is websockets' own path."""

    answer: asyncio.Future[BytesLike | None] | None = None  # the awaiting call's, while one awaits
    queued = 0  # whole messages in websockets' queue, ahead of the next answer
    _waiting_parser: Any = None  # websockets' parser, while it is known to wait for a new frame

    def data_received(self, data: bytes) -> None:
        """A chunk that is exactly one final text frame, come while a call awaits its answer and
        websockets' parser waits for a new frame, is that answer: read here. Hand-written on a
        measured hot path (every env call): websockets' parser (its generators, stream reader and
        frame checks) was 12-13% of the service's CPU per remote env call (perf,
        bench/remote_envs.py). A frame unmasked, without reserved bits, within the size limits:
        what the parser would accept and hand on unchanged, leaving its state as it was. Any other
        chunk (part of a frame, several frames, a control frame) is websockets' to parse."""
        answer = self.answer
        if (
            answer is not None
            and len(data) > 1
            and data[0] == FIN_TEXT
            and data[1] < 0x80
            and self._between_frames()
        ):
            length, start = data[1], 2
            if length == 126:
                length, start = int.from_bytes(data[2:4]), 4
            elif length == 127:
                length, start = int.from_bytes(data[2:10]), 10
            if start + length == len(data) and self._within_limits(length) and not self.queued:
                self.answer = None
                answer.set_result(data[start:])
                return
        self._waiting_parser = None  # the parser reads this chunk: its state is its own again
        super().data_received(data)

    def eof_received(self) -> None:
        self._waiting_parser = None
        super().eof_received()

    def _within_limits(self, length: int) -> bool:
        most_message, most_fragment = self.protocol.max_message_size, self.protocol.max_fragment_size
        return (most_message is None or length <= most_message) and (
            most_fragment is None or length <= most_fragment
        )

    def _between_frames(self) -> bool:
        """Whether websockets' parser waits for a new frame with nothing buffered: its frame
        parser (Protocol.parse, under the client's handshake parser) suspended in the stream
        reader's at_eof(), in an open connection. A parser of any other shape (another
        websockets) says no: its own path. Once seen so, the parser stays so until it is fed a
        chunk or the end of the stream (data_received, eof_received) or is replaced (websockets
        swaps in a discarding parser when the connection fails): remembered until then, the
        generators' walk was 4% of the service's CPU per remote env call (perf)."""
        protocol = self.protocol
        if protocol.state is not State.OPEN:
            return False
        parser: Any = protocol.parser
        if parser is self._waiting_parser:
            return True
        if protocol.reader.buffer:
            return False
        try:
            frames = parser.gi_yieldfrom
            waiting = frames.gi_code is _PARSE_CODE and frames.gi_yieldfrom.gi_code is _AT_EOF_CODE
        except AttributeError:
            return False
        if waiting:
            self._waiting_parser = parser
        return bool(waiting)

    def process_event(self, event: Event) -> None:
        answer = self.answer
        if not isinstance(event, Frame) or event.opcode not in DATA_OPCODES:
            super().process_event(event)  # the handshake's response, control frames
        elif answer is not None and event.opcode is OP_TEXT and event.fin and not self.queued:
            self.answer = None
            answer.set_result(event.data)
        else:
            super().process_event(event)
            if event.fin:
                self.queued += 1
                if answer is not None:
                    self.answer = None
                    answer.set_result(None)  # read it from the queue

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)  # (the protocol is closed)
        answer, self.answer = self.answer, None
        if answer is not None:
            closed = self.protocol.close_exc
            closed.__cause__ = self.recv_exc
            answer.set_exception(closed)


FIN_TEXT = 0b10000000 | OP_TEXT  # a final text frame's first byte, without reserved bits
_PARSE_CODE = Protocol.parse.__code__
_AT_EOF_CODE = StreamReader.at_eof.__code__


def text_frame(payload: bytes) -> bytes:
    """A client's final text frame of `payload`, as websockets' Protocol.send_text serializes it on
    a connection without extensions (this client's: no compression): masked, its key from the
    OS's random source as websockets draws it (_mask_keys; RFC 6455 asks a client for an
    unpredictable key).

    Hand-written on a measured hot path (every env call): websockets' Frame dataclass, its checks,
    its serialization through a BytesIO and the protocol's write queue were 5% of the service's CPU
    per remote env call (perf, bench/remote_envs.py). Nothing of the protocol's state changes when
    a whole data frame is sent."""
    length = len(payload)
    if length < 126:
        head = _HEAD_SHORT.pack(FIN_TEXT, _MASKED | length)
    elif length < 65536:
        head = _HEAD_16.pack(FIN_TEXT, _MASKED | 126, length)
    else:
        head = _HEAD_64.pack(FIN_TEXT, _MASKED | 127, length)
    mask = next(_MASK_KEYS)
    return b"".join((head, mask, apply_mask(payload, mask)))


def _mask_keys() -> Iterator[bytes]:
    """Masking keys, 4 bytes each, from the OS's random source (websockets' `secrets`: the same),
    drawn 1,024 keys at a time: a `getrandom` per frame was 1.6% of the service's CPU per remote
    env call (perf), and a drawn key is as unpredictable to the server as one drawn per frame.
    One generator for the process: only the event loop's thread, which runs the remote sessions,
    draws from it."""
    while True:
        block = secrets.token_bytes(4 * _MASK_KEYS_DRAWN)
        yield from [block[at : at + 4] for at in range(0, len(block), 4)]


_MASK_KEYS_DRAWN = 1024
_MASK_KEYS = _mask_keys()
_MASKED = 0b10000000
_HEAD_SHORT, _HEAD_16, _HEAD_64 = struct.Struct("!BB"), struct.Struct("!BBH"), struct.Struct("!BBQ")


class OpenEnvSession:
    """One episode's session on one OpenEnv server (an EnvSession of the runner)."""

    def __init__(self, env: OpenEnvEnv, server: Server, client: SessionClient, reset: Reset) -> None:
        self.env = env
        self.config = env.config
        self.server = server
        self.client = client
        self.system_prompt = env.config.system_prompt
        self.tools: list[dict[str, Any]] = client.tools or []
        self.reward = 0.0
        self._reset = reset
        self._closed = False
        # False while a call is under way (or failed): a session left mid-call is never reused.
        self._settled = True

    @property
    def server_url(self) -> str:
        return self.server.url

    async def reset(self, task_index: int) -> Reset:
        return self._reset

    async def step(self, action: Action) -> Step:
        config, actions = self.config, self.env.actions
        assert actions is not None, "sessions are opened after the server's actions are known"
        name, arguments = action.name, action.kwargs
        if name == RESPOND_ACTION_NAME:
            if not config.respond_tool:
                # A plain answer ends the episode with the reward the server gave so far.
                return Step(observation="", reward=self.reward, done=True)
            name, arguments = config.respond_tool, {config.respond_argument: arguments.get("content", "")}
        if actions.mcp:
            payload = call_tool_payload(name, arguments)
        elif name == actions.tool_name:
            payload = dict(arguments)
        else:
            unknown = f"Error: unknown tool {name!r}; the tool is {actions.tool_name!r}"
            return Step(observation=unknown, reward=self.reward, done=False)
        # A tool call may have changed the server's state: never re-sent.
        result = await self._call(f"step {name!r}", "step", payload)
        reward = result.get("reward")
        if reward is not None:
            self.reward = float(reward)
        observation = result.get("observation", {})
        text = tool_result_text(observation) if actions.mcp else observation_text(observation)
        return Step(observation=text, reward=self.reward, done=bool(result.get("done", False)))

    async def _call(self, what: str, kind: str, payload: dict[str, Any]) -> dict[str, Any]:
        self._settled = False
        with self.env.pool.call(self.server, kind):
            try:
                result = await self.client.request("step", payload)
            except Exception as error:
                raise self._failure(what, error) from error
        self._settled = True
        return result

    def _failure(self, what: str, error: BaseException) -> Exception:
        kind, _ = classify(error)
        if kind in ("timeout", "closed", "connect"):
            failure = server_failure(
                self.server.url, self.config.name, what, kind, error, self.config.call_timeout_seconds
            )
            self.env.pool.failed(self.server, kind, failure.how)
            return failure
        self.env.pool.failed(self.server, kind, str(error))
        return EnvServerError(f"{what} on env server {self.server.url}: {error}")

    async def close(self) -> None:
        """Frees the slot; the server's session is kept for its next episode if the episode left
        it between calls, else ended (its env destroyed). Idempotent; never raises: a server that
        is gone has dropped the session with the connection."""
        if self._closed:
            return
        self._closed = True
        try:
            if not (self._settled and self.env.idle.keep(self.server, self.client)):
                await close_client(self.client, self.config.connect_timeout_seconds)
        finally:
            await self.env.pool.release(self.server)


async def close_client(client: SessionClient, timeout_seconds: float) -> None:
    """Ends a server session (openenv's close message, then the WebSocket close); never raises."""
    try:
        async with asyncio.timeout(timeout_seconds):
            await client.close()
    except Exception:
        pass


class OpenEnvEnv:
    """One OpenEnv env: its config, its pool of servers, what its servers' actions are (learnt
    from the first server that answers /schema: all servers of a pool serve the same env), and the
    sessions kept open between episodes."""

    def __init__(self, config: RemoteEnvConfig, metrics: PoolMetrics, http: Any) -> None:
        self.config = config
        self.http = http  # an httpx.AsyncClient: the /schema request and the health checks
        self.pool = ServerPool.of(config, config.urls, self._health_check, metrics)
        self.actions: ActionSpace | None = None
        self.timeouts = CallTimeouts(config.call_timeout_seconds)  # every session's call timeout
        self._learning = asyncio.Lock()
        self.idle = IdleSessions(
            self.pool,
            config.reuse_idle_seconds,
            lambda client: close_client(client, config.connect_timeout_seconds),
        )

    async def _health_check(self, url: str) -> None:
        response = await self.http.get(f"{url}/health")
        response.raise_for_status()

    async def _learn_actions(self, server: Server) -> ActionSpace:
        if self.actions is not None:
            return self.actions
        async with self._learning:  # one /schema request, not one per episode of a first batch
            if self.actions is None:
                timeout = self.config.connect_timeout_seconds
                response = await self.http.get(f"{server.url}/schema", timeout=timeout)
                response.raise_for_status()
                self.actions = ActionSpace.from_schema(response.json()["action"], self.config.action_tool)
            return self.actions

    def _new_client(self, server: Server) -> SessionClient:
        client = SessionClient(
            base_url=server.url,
            connect_timeout_s=self.config.connect_timeout_seconds,
            message_timeout_s=self.config.call_timeout_seconds,
        )
        client.timeouts = self.timeouts
        return client

    async def open(self, split: str, task_index: int, episode_key: str) -> OpenEnvSession:
        """A session on the least-loaded healthy server, reset with the task, its tools listed. A
        connect or reset that did not take effect (refused, no capacity, the connection dropped
        before the answer: the server's session dies with it) is retried on another server with
        jitter (ServerPool.place); a kept session the server has since ended is replaced at once."""
        config = self.config
        data = {
            **config.reset_kwargs,
            "seed": task_index,
            "task_index": task_index,
            "split": split,
            "episode_id": episode_key,
        }

        async def attempt(server: Server) -> OpenEnvSession:
            while (client := self.idle.take(server)) is not None:
                try:
                    return await self._open_on(server, client, data, reused=True)
                except _KeptSessionEnded:
                    continue  # the server ended the kept session: not the server's failure
            return await self._open_on(server, self._new_client(server), data, reused=False)

        return await self.pool.place(
            attempt, retries=config.reset_retries, backoff_seconds=config.retry_backoff_seconds
        )

    async def _open_on(
        self, server: Server, client: SessionClient, data: dict[str, Any], reused: bool
    ) -> OpenEnvSession:
        """A session reset with the task on `client` (a kept session or a new one), its tools
        listed; the client is closed if that fails (EnvServerDown where it did not take effect)."""
        config = self.config
        doing = "the /schema request"
        try:
            # Known after the env's first session: no coroutine per episode to return it.
            actions = self.actions if self.actions is not None else await self._learn_actions(server)
            doing = "reset"
            with self.pool.call(server, "reset" if reused else "open"):
                reset = await client.request("reset", data)
            if client.tools is None:
                doing = "the tool list"
                with self.pool.call(server, "list_tools"):
                    client.tools = await actions.tools(client)
        except BaseException as error:
            await close_client(client, config.connect_timeout_seconds)
            if not isinstance(error, Exception):
                raise
            kind, code = classify(error)
            if reused and kind in ("closed", "connect"):
                raise _KeptSessionEnded from error
            if kind == "server" and code not in NOT_STARTED_CODES:
                self.pool.failed(server, kind, str(error))
                raise EnvServerError(f"{doing} on env server {server.url}: {error}") from error
            raise server_failure(
                server.url, config.name, doing, kind, error, config.connect_timeout_seconds
            ) from error
        session = OpenEnvSession(self, server, client, opened_reset(reset, server))
        session.reward = float(reset.get("reward") or 0.0)
        return session

    async def close(self) -> None:
        """Closes the sessions kept for reuse and stops the health checks."""
        await self.idle.close()
        await self.pool.close()
        self.timeouts.close()


class _KeptSessionEnded(Exception):
    """A kept session's connection was gone when its next episode reset it."""


def opened_reset(reset: dict[str, Any], server: Server) -> Reset:
    """The Reset of a reset's answer data."""
    return Reset(observation=observation_text(reset.get("observation", {})), info={"env_server": server.url})
