"""How a /generate request reaches SGLang: one POST of prebuilt bytes, the status and body back.

The hot path of the service. At thousands of episodes in flight, httpx spent several times the
socket's own cost per call (client layers, h11, anyio cancel scopes, pool assignment), and
aiohttp's request machinery was still a fifth of the service's CPU: SocketTransport writes the
request's bytes on a kept-alive asyncio connection and parses the answer with httptools. Tests
may hand the client an httpx client instead (an in-process ASGI app or a mock transport): the
request and its failures are the same.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import httptools
import httpx

from service.call_timeouts import CallTimeouts

CONNECT_TIMEOUT_SECONDS = 10.0
# Idle keep-alive connections are closed after this long: before the server does (uvicorn, which
# serves SGLang, closes them after 5 s), or a request sent on one as the server closes it fails.
KEEPALIVE_SECONDS = 4.0
JSON_HEADERS = {"content-type": "application/json"}


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes


class TransportFailure(Exception):
    """The request got no HTTP answer. `may_be_running`: it may have reached the engine (a read
    timeout, a dropped connection), so the engine may still be running it."""

    def __init__(self, reason: str, *, may_be_running: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.may_be_running = may_be_running


class GenerateTransport(Protocol):
    async def post(
        self, url: str, body: bytes, timeout_seconds: float, headers: dict[str, str] | None = None
    ) -> Reply:
        """POSTs a JSON body (with extra `headers`); raises TransportFailure when no HTTP answer came."""

    async def stream(
        self,
        url: str,
        body: bytes,
        timeout_seconds: float,
        on_body: OnBody,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        """POSTs a JSON body (with extra `headers`) and hands a 200 answer's body to `on_body` piece
        by piece as it arrives (the Reply's body is then empty); any other status comes back whole."""

    async def aclose(self) -> None: ...


OnBody = Callable[[bytes], None]


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection: a request at a time, its answer parsed by httptools.

    The parser calls back into the connection, so the two point at each other: once the connection
    is lost both links are dropped, or every closed connection would be cyclic garbage, freed only
    by a full collection (rare under TUNE_GC) and growing the soak's RSS (docs/benchmarks.md)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self.answer: asyncio.Future[Reply] | None = None
        self.body: list[bytes] = []
        self.reusable = False
        self.closed = False
        self.idle_since = 0.0
        self.stream_to: OnBody | None = None  # a streamed 200 answer's body goes here

    def send(self, request: bytes, on_body: OnBody | None = None) -> asyncio.Future[Reply]:
        assert self.transport is not None and self.answer is None
        self.answer = asyncio.get_running_loop().create_future()
        self.body, self.reusable, self.stream_to = [], False, on_body
        self.transport.write(request)
        return self.answer

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (uvloop's is no subclass)

    def data_received(self, data: bytes) -> None:
        if self.parser is None:  # lost: nothing more is read
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._fail(f"unparseable HTTP response: {error}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(f"connection closed by the server{f': {exc}' if exc else ''}")
        self.parser = self.transport = self.stream_to = None  # no cycle left: see the class's doc

    # httptools callbacks
    def on_body(self, body: bytes) -> None:
        assert self.parser is not None  # called by the parser
        if self.stream_to is not None and self.parser.get_status_code() == 200:
            self.stream_to(body)
        else:
            self.body.append(body)

    def on_message_complete(self) -> None:
        assert self.parser is not None  # called by the parser
        self.reusable = self.parser.should_keep_alive()
        if self.answer is not None and not self.answer.done():
            self.answer.set_result(Reply(self.parser.get_status_code(), b"".join(self.body)))
        self.answer = None

    def _fail(self, reason: str) -> None:
        self.reusable = False
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(ConnectionError(reason))
        self.answer = None
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.abort()


def _time_out(answer: asyncio.Future[Reply], seconds: float) -> None:
    if not answer.done():
        answer.set_exception(TimeoutError(f"no answer within {seconds:g} s"))


class SocketTransport:
    """POSTs over asyncio's sockets with a keep-alive pool per engine URL, the response parsed by
    httptools (C): a request costs a write and a parse.
    Idle connections are reused most recent first and closed past KEEPALIVE_SECONDS."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int, bool], deque[_Connection]] = {}
        self._heads: dict[str, tuple[tuple[str, int, bool], bytes]] = {}  # url -> pool key, request head
        self._ssl: ssl.SSLContext | None = None
        self._timeouts: dict[float, CallTimeouts] = {}  # by length: a client's calls share theirs

    def _head(self, url: str) -> tuple[tuple[str, int, bool], bytes]:
        known = self._heads.get(url)
        if known is None:
            parts = urlsplit(url)
            secure = parts.scheme == "https"
            host = parts.hostname or "127.0.0.1"
            port = parts.port or (443 if secure else 80)
            path = parts.path or "/"
            if parts.query:
                path += f"?{parts.query}"
            head = (
                f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                "Content-Type: application/json\r\nContent-Length: "
            ).encode()
            known = self._heads[url] = ((host, port, secure), head)
        return known

    async def _connection(self, key: tuple[str, int, bool]) -> _Connection:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if not connection.closed and now - connection.idle_since < KEEPALIVE_SECONDS:
                return connection
            connection.close()
        host, port, secure = key
        if secure and self._ssl is None:
            self._ssl = ssl.create_default_context()
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(CONNECT_TIMEOUT_SECONDS):
            _, connection = await loop.create_connection(
                _Connection, host, port, ssl=self._ssl if secure else None
            )
        return connection

    def _release(self, key: tuple[str, int, bool], connection: _Connection) -> None:
        if connection.reusable and not connection.closed:
            connection.idle_since = time.monotonic()
            self._idle.setdefault(key, deque()).append(connection)
        else:
            connection.close()

    async def post(
        self, url: str, body: bytes, timeout_seconds: float, headers: dict[str, str] | None = None
    ) -> Reply:
        return await self.stream(url, body, timeout_seconds, None, headers)

    async def stream(
        self,
        url: str,
        body: bytes,
        timeout_seconds: float,
        on_body: OnBody | None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        headers = headers or {}
        key, head = self._head(url)
        extra = b"".join(b"%s: %s\r\n" % (name.encode(), value.encode()) for name, value in headers.items())
        try:
            connection = await self._connection(key)
        except (OSError, TimeoutError) as error:
            reason = f"cannot connect: {type(error).__name__}: {error}"
            raise TransportFailure(reason, may_be_running=False) from error
        timeouts = self._timeouts.get(timeout_seconds)
        if timeouts is None:
            timeouts = self._timeouts[timeout_seconds] = CallTimeouts(timeout_seconds)
        answer: asyncio.Future[Reply] | None = None
        try:
            answer = connection.send(b"%s%d\r\n%s\r\n%s" % (head, len(body), extra, body), on_body)
            # The answer failed at its deadline by one sweep of all calls of its length, not
            # asyncio.timeout (its Timeout and the task's cancel and uncancel) nor a timer per call:
            # a measured hot path, every generate call (service/call_timeouts.py).
            timeouts.add(answer, functools.partial(_time_out, answer, timeout_seconds))
            reply = await answer
        except BaseException as error:  # a timeout, a dropped connection, a cancellation
            connection.close()  # mid-request: its state is unknown
            if isinstance(error, TimeoutError | ConnectionError | OSError):
                raise TransportFailure(f"{type(error).__name__}: {error}", may_be_running=True) from error
            raise
        finally:
            if answer is not None:
                timeouts.discard(answer)
        self._release(key, connection)
        return reply

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()
        for timeouts in self._timeouts.values():
            timeouts.close()


class HttpxTransport:
    """Over an httpx client the caller owns (and closes): an ASGI app or a mock, in tests."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self._http = http

    async def post(
        self, url: str, body: bytes, timeout_seconds: float, headers: dict[str, str] | None = None
    ) -> Reply:
        try:
            response = await self._http.post(
                url, content=body, headers=JSON_HEADERS | (headers or {}), timeout=timeout_seconds
            )
        except (httpx.ConnectError, httpx.ConnectTimeout) as error:
            raise TransportFailure(f"{type(error).__name__}: {error}", may_be_running=False) from error
        except httpx.TransportError as error:  # read timeouts, dropped connections
            raise TransportFailure(f"{type(error).__name__}: {error}", may_be_running=True) from error
        return Reply(response.status_code, response.content)

    async def stream(
        self,
        url: str,
        body: bytes,
        timeout_seconds: float,
        on_body: OnBody,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        try:
            async with self._http.stream(
                "POST", url, content=body, headers=JSON_HEADERS | (headers or {}), timeout=timeout_seconds
            ) as response:
                if response.status_code != 200:
                    return Reply(response.status_code, await response.aread())
                async for piece in response.aiter_raw():
                    on_body(piece)
        except (httpx.ConnectError, httpx.ConnectTimeout) as error:
            raise TransportFailure(f"{type(error).__name__}: {error}", may_be_running=False) from error
        except httpx.TransportError as error:
            raise TransportFailure(f"{type(error).__name__}: {error}", may_be_running=True) from error
        return Reply(200, b"")

    async def aclose(self) -> None:
        pass
