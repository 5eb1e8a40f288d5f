"""How a /generate request reaches SGLang: one POST of prebuilt bytes, the status and body back.

The hot path of the service. At thousands of episodes in flight, httpx spent several times the
socket's own cost per call (client layers, h11, anyio cancel scopes, pool assignment); aiohttp's
keep-alive connector costs close to the bare request. Tests hand the client an httpx client
instead (an in-process ASGI app or a mock transport): the request and its failures are the same.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

import aiohttp
import httpx

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
    async def post(self, url: str, body: bytes, timeout_seconds: float) -> Reply:
        """POSTs a JSON body; raises TransportFailure when no HTTP answer came."""

    async def aclose(self) -> None: ...


class AiohttpTransport:
    """One aiohttp session: a keep-alive pool of at most `max_connections` (per engine URL too).
    No TLS context is built for http:// URLs; https:// ones share aiohttp's default one."""

    def __init__(self, max_connections: int) -> None:
        connector = aiohttp.TCPConnector(
            limit=max_connections, limit_per_host=max_connections, keepalive_timeout=KEEPALIVE_SECONDS
        )
        # Never a cookie jar nor proxy lookups from the environment: each request is one POST.
        self._session = aiohttp.ClientSession(
            connector=connector, cookie_jar=aiohttp.DummyCookieJar(), headers=JSON_HEADERS
        )
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {}

    async def post(self, url: str, body: bytes, timeout_seconds: float) -> Reply:
        timeout = self._timeouts.get(timeout_seconds)
        if timeout is None:
            timeout = aiohttp.ClientTimeout(total=timeout_seconds, connect=CONNECT_TIMEOUT_SECONDS)
            self._timeouts[timeout_seconds] = timeout
        try:
            async with self._session.post(url, data=body, timeout=timeout) as response:
                return Reply(response.status, await response.read())
        except (aiohttp.ConnectionTimeoutError, aiohttp.ClientConnectorError) as error:
            raise TransportFailure(f"{type(error).__name__}: {error}", may_be_running=False) from error
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:  # noqa: UP041 (aiohttp raises this one)
            raise TransportFailure(f"{type(error).__name__}: {error}", may_be_running=True) from error

    async def aclose(self) -> None:
        await self._session.close()


class HttpxTransport:
    """Over an httpx client the caller owns (and closes): an ASGI app or a mock, in tests."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self._http = http

    async def post(self, url: str, body: bytes, timeout_seconds: float) -> Reply:
        try:
            response = await self._http.post(url, content=body, headers=JSON_HEADERS, timeout=timeout_seconds)
        except (httpx.ConnectError, httpx.ConnectTimeout) as error:
            raise TransportFailure(f"{type(error).__name__}: {error}", may_be_running=False) from error
        except httpx.TransportError as error:  # read timeouts, dropped connections
            raise TransportFailure(f"{type(error).__name__}: {error}", may_be_running=True) from error
        return Reply(response.status_code, response.content)

    async def aclose(self) -> None:
        pass
