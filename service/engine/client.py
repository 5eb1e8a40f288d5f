"""The SGLang client: native `/generate` with token ids in and token ids plus logprobs out.

Speaks docs/sglang.md: requests carry only fields the router keeps, responses are parsed
defensively, and control calls (abort) go to every worker because the router does not proxy them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt

from service.engine.model_info import ModelInfoCache, output_room
from service.engine.placement import ROUTING_KEY_HEADER, Placement, route_of, routing_key
from service.engine.status import ENGINE_DOWN_STATUSES, PROBE_TIMEOUT_SECONDS, EngineStatus
from service.engine.transport import (
    CONNECT_TIMEOUT_SECONDS,
    KEEPALIVE_SECONDS,
    GenerateTransport,
    HttpxTransport,
    Reply,
    TransportFailure,
)
from service.retries import backoff, failed_attempt

logger = logging.getLogger(__name__)

FINISH_TYPES = frozenset({"stop", "length", "abort"})
# HTTP statuses worth another try: the server or the router is overloaded or restarting.
RETRYABLE_STATUS = frozenset({408, 429})
CONTROL_TIMEOUT_SECONDS = 10.0
# Aborts go to the workers the router listed at most this long ago: asking it before every abort
# costs a request each, and an episode is rarely aborted right as the fleet changes.
ABORT_WORKERS_TTL_SECONDS = 10.0
ABORT_QUIET_SECONDS = 1.0  # see AbortQuiet
ABORT_QUIET_GROWTH = 16  # the longest quiet window, in first windows
BACKOFF_MAX_SECONDS = 30.0  # the longest pause between two generate attempts


class AbortQuiet:
    """After the engine aborts requests of ours (a weight update's abort-all, pause_generation with
    mode abort), no generate call goes to it for a quiet window: a trainer that aborts until the
    workers report no load (slime's abort_servers_until_idle) sees them idle, and resumed turns do
    not land in the middle of its update. A wave of aborts that follows soon after the last window
    doubles it (up to `max_seconds`); one that comes later starts again from `seconds`."""

    def __init__(self, seconds: float, max_seconds: float | None = None) -> None:
        self.seconds = seconds
        self.max_seconds = seconds * ABORT_QUIET_GROWTH if max_seconds is None else max_seconds
        self._window = seconds
        self._until = 0.0  # monotonic time the current window ends

    def aborted(self) -> None:
        now = time.monotonic()
        if now < self._until:
            return  # the same wave
        if now - self._until < self._window * 2:
            self._window = min(self._window * 2, self.max_seconds)
        else:
            self._window = self.seconds
        self._until = now + self._window

    async def wait(self) -> None:
        # A deadline, not an event: a wave that comes meanwhile moves it.
        while (delay := self._until - time.monotonic()) > 0:  # noqa: ASYNC110
            await asyncio.sleep(delay)


def make_control_client(timeout_seconds: float) -> httpx.AsyncClient:
    """The client of the engine's own questions (the router's workers, health, pauses): off the hot
    path. Its idle connections close before the engine's uvicorn closes them (KEEPALIVE_SECONDS)."""
    limits = httpx.Limits(
        max_connections=100, max_keepalive_connections=20, keepalive_expiry=KEEPALIVE_SECONDS
    )
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_seconds, connect=CONNECT_TIMEOUT_SECONDS),
        transport=_ResendsUnansweredReads(httpx.AsyncHTTPTransport(limits=limits)),
    )


class _ResendsUnansweredReads(httpx.AsyncBaseTransport):
    """Sends a GET or HEAD once more where the kept-alive connection it went out on was closed
    under it without an answer (nothing was processed, and the request is idempotent): the engine's
    uvicorn closes idle connections, and a client whose event loop stalled past its own shorter
    expiry (KEEPALIVE_SECONDS) can still pick one up as it closes. /ready answered 503 for a live
    engine so (schemathesis, load 25). Anything else, a pause or an abort, is sent once."""

    def __init__(self, transport: httpx.AsyncBaseTransport) -> None:
        self._transport = transport

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await self._transport.handle_async_request(request)
        except (httpx.RemoteProtocolError, httpx.ReadError):
            if request.method not in ("GET", "HEAD"):
                raise
            return await self._transport.handle_async_request(request)

    async def aclose(self) -> None:
        await self._transport.aclose()


class EngineError(Exception):
    """A failed engine call. `retryable`: the same request may succeed later (the episode may be retried)."""

    def __init__(self, message: str, *, retryable: bool, status_code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = retryable
        self.status_code = status_code


class EngineRequestError(EngineError):
    """SGLang refused the request (HTTP 4xx, e.g. input longer than the context): never retried."""

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message, retryable=False, status_code=status_code)


class EngineUnavailableError(EngineError):
    """Connection errors, timeouts or 5xx persisted through every retry. `engine_down`: the last
    attempt found no engine at all (its connection refused, or a router's 502/503/504): an outage,
    which the worker waits out instead of charging it to the episode's attempts."""

    def __init__(self, message: str, status_code: int | None = None, *, engine_down: bool = False) -> None:
        super().__init__(message, retryable=True, status_code=status_code)
        self.engine_down = engine_down


class EngineResponseError(EngineError):
    """SGLang answered 200 with a body this client cannot use (e.g. ids and logprobs of different lengths)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False, status_code=None)


@dataclass(frozen=True)
class Generation:
    """One `/generate` result, as SGLang sampled it."""

    output_ids: list[int]
    logprobs: list[float]  # one per output id; 0.0 each only when SGLang sent no logprobs
    finish_type: str  # "stop" | "length" | "abort"
    finish_reason: dict[str, Any]  # as SGLang sent it
    weight_version: str | None
    prompt_tokens: int | None
    cached_tokens: int | None
    text: str  # SGLang's detokenized text, for reference only: the ids are the truth
    has_logprobs: bool = True  # False: SGLang sent none, `logprobs` are placeholders (0.0)
    # The distribution `logprobs` come from, as the engine reports it (model_info.py): "processed"
    # (sampled from: after temperature and the rest) or "raw" (the model's); None: unknown.
    logprobs_mode: str | None = None

    @property
    def interrupted(self) -> bool:
        """Aborted by the engine's operator (abort_request, a weight update, pause_generation),
        not refused as a request (an abort with a 4xx status_code): worth resuming."""
        if self.finish_type != "abort":
            return False
        status = self.finish_reason.get("status_code")
        return not (isinstance(status, int) and 400 <= status < 500)


@dataclass(frozen=True)
class _Failure:
    """A retryable failure of one generate attempt."""

    reason: str
    status_code: int | None = None
    may_be_running: bool = False  # the request may have reached the engine (timeout, dropped connection)


class _Retry(Exception):
    """A failed attempt, raised for tenacity to retry."""

    def __init__(self, failure: _Failure) -> None:
        super().__init__(failure.reason)
        self.failure = failure


def _log_retry(rid: str, state: RetryCallState) -> None:
    error, delay = failed_attempt(state)
    reason = error.failure.reason if isinstance(error, _Retry) else repr(error)
    logger.info("generate %s: %s; retry %d in %.2fs", rid, reason, state.attempt_number, delay)


def _error_message(status: int, content: bytes) -> str:
    text = content.decode(errors="replace").strip()
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        return text or f"HTTP {status}"
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        for key in ("message", "detail", "error"):
            if isinstance(body.get(key), str):
                return str(body[key])
    return text


def _optional_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _token_id(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise EngineResponseError(f"token id is not an int: {value!r}")
    return value


def _logprob(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise EngineResponseError(f"logprob is not a number: {value!r}")
    return float(value)


def parse_generation(body: Any, logprobs_mode: str | None = None) -> Generation:
    """Parses one non-streaming `/generate` response body; raises EngineResponseError if unusable."""
    if not isinstance(body, dict):
        raise EngineResponseError(f"expected a JSON object, got {type(body).__name__}")
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        raise EngineResponseError("response has no meta_info object")

    finish_reason = meta.get("finish_reason")
    if isinstance(finish_reason, str):  # some builds and the OpenAI API send the bare type
        finish_reason = {"type": finish_reason}
    if not isinstance(finish_reason, dict) or not isinstance(finish_reason.get("type"), str):
        raise EngineResponseError(f"response has no finish_reason type: {finish_reason!r}")
    finish_type = finish_reason["type"]
    if finish_type not in FINISH_TYPES:
        logger.warning("unknown finish_reason type %r treated as abort", finish_type)
        finish_type = "abort"

    raw_ids = body.get("output_ids")
    token_logprobs = meta.get("output_token_logprobs")
    if token_logprobs is not None:
        # slime's reading: [logprob, token_id, text_or_null] per output token.
        logprob_ids, logprobs = _token_logprobs(_list(token_logprobs, "output_token_logprobs"))
        # Their ids are the ones kept: output_ids are only compared with them, as sent (checking
        # each of them first was a per-token call on a measured hot path, every turn).
        output_ids = None if raw_ids is None else _list(raw_ids, "output_ids")
        if output_ids is not None and output_ids != logprob_ids:
            logger.warning(
                "output_ids (%d) disagree with output_token_logprobs (%d) of %s; using the latter",
                len(output_ids),
                len(logprob_ids),
                meta.get("id"),
            )
        output_ids = logprob_ids
    elif raw_ids is not None:
        output_ids = [_token_id(token) for token in _list(raw_ids, "output_ids")]
        # No logprobs although they were asked for: the turn records it (TurnRecord.has_logprobs),
        # so a trainer never takes these zeros for the sampler's logprobs.
        logger.warning("no output_token_logprobs in %s: its logprobs are stored as 0.0", meta.get("id"))
        logprobs = [0.0] * len(output_ids)
    elif finish_type == "abort":  # aborted before the first token
        output_ids, logprobs = [], []
    else:
        raise EngineResponseError("response has neither output_ids nor output_token_logprobs")
    if len(logprobs) != len(output_ids):
        raise EngineResponseError(f"{len(output_ids)} output ids but {len(logprobs)} logprobs")

    weight_version = meta.get("weight_version")
    text = body.get("text")
    return Generation(
        output_ids=output_ids,
        logprobs=logprobs,
        finish_type=finish_type,
        finish_reason=finish_reason,
        weight_version=None if weight_version is None else str(weight_version),
        prompt_tokens=_optional_int(meta.get("prompt_tokens")),
        cached_tokens=_optional_int(meta.get("cached_tokens")),
        text=text if isinstance(text, str) else "",
        has_logprobs=token_logprobs is not None,
        logprobs_mode=logprobs_mode,
    )


def _token_logprobs(items: list[Any]) -> tuple[list[int], list[float]]:
    """The ids and logprobs of output_token_logprobs items. Hand-written hot path: every call's
    every token. The exact types of the whole lists are checked at once (what orjson makes of JSON
    ints and floats), in C (map, set, zip: 2.3x faster than a generator per check); per-token
    function calls remain for the rest."""
    if not items:
        return [], []
    if set(map(type, items)) == {list} and min(map(len, items)) >= 2:
        # Every item has two fields or more, so the first two columns are whole (strict would refuse
        # SGLang's three fields beside a two-field item).
        columns = list(zip(*items, strict=False))
        logprobs, ids = list(columns[0]), list(columns[1])
        if set(map(type, ids)) == {int} and set(map(type, logprobs)) == {float}:
            return ids, logprobs
    pairs = [_list(item, "output_token_logprobs item") for item in items]
    if any(len(pair) < 2 for pair in pairs):
        raise EngineResponseError("an output_token_logprobs item has fewer than 2 fields")
    return [_token_id(pair[1]) for pair in pairs], [_logprob(pair[0]) for pair in pairs]


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise EngineResponseError(f"{what} is not a list: {type(value).__name__}")
    return value


def generate_body(input_ids_json: str, sampling_params_json: str, rid: str, *, stream: bool = False) -> bytes:
    """The /generate request body, from already-encoded ids and parameters. Only fields the
    router's typed schema keeps: anything else would be dropped on the way."""
    streamed = ',"stream":true' if stream else ""
    return (
        f'{{"input_ids":{input_ids_json},"sampling_params":{sampling_params_json},'
        f'"return_logprob":true,"rid":{orjson.dumps(rid).decode()}{streamed}}}'
    ).encode()


OnTokens = Callable[[list[int]], None]


class _StreamFrames:
    """SGLang's streamed /generate answer, fed as its body arrives: server-sent `data: {json}`
    frames, each with the output so far (SGLang's default: not `--incremental-streaming-output`),
    `finish_reason` null until the last; `data: [DONE]` ends it."""

    def __init__(self, on_tokens: OnTokens, logprobs_mode: str | None) -> None:
        self.on_tokens = on_tokens
        self.logprobs_mode = logprobs_mode
        self._buffer = b""
        self.sampled: list[int] = []
        self.logprobs: list[float] = []
        self.last: Generation | None = None
        self.error: EngineError | None = None
        self._error_body: list[bytes] = []

    def feed(self, piece: bytes) -> None:
        """Called by the transport as the body arrives: never raises (an error is kept for outcome)."""
        self._buffer += piece
        *frames, self._buffer = self._buffer.split(b"\n\n")
        for frame in frames:
            if self.error is None and self.last is None:
                try:
                    self._frame(frame)
                except EngineError as error:
                    self.error = error

    def _frame(self, frame: bytes) -> None:
        data = frame.removeprefix(b"data:").strip()
        if not data or data == b"[DONE]" or not frame.startswith(b"data:"):
            return
        try:
            body = orjson.loads(data)
        except orjson.JSONDecodeError as error:
            raise EngineResponseError(f"a streamed frame is not JSON: {error}") from error
        meta = body.get("meta_info") if isinstance(body, dict) else None
        if isinstance(meta, dict) and meta.get("finish_reason") is None:
            items = meta.get("output_token_logprobs")
            if isinstance(items, list):  # a frame before the last: its ids (and logprobs) only
                ids, logprobs = _token_logprobs(items)
            else:
                meta = {**meta, "finish_reason": {"type": "length"}}  # parsed for its ids only
                partial = parse_generation({**body, "meta_info": meta})
                ids, logprobs = partial.output_ids, partial.logprobs
        else:
            self.last = parse_generation(body, self.logprobs_mode)
            ids, logprobs = self.last.output_ids, self.last.logprobs
        sampled = len(self.sampled)
        if ids[:sampled] != self.sampled:
            raise EngineResponseError("a streamed frame does not extend the output before it")
        new = ids[sampled:]
        self.sampled, self.logprobs = ids, logprobs
        if new:
            self.on_tokens(new)

    def outcome(self, reply: Reply | _Failure) -> Generation | _Failure:
        """The generation the stream ended with, or a retryable failure; raises as generate()."""
        if isinstance(reply, _Failure):
            return reply
        status = reply.status
        if status >= 500 or status in RETRYABLE_STATUS:
            return _Failure(f"HTTP {status}: {_error_message(status, reply.body)}", status_code=status)
        if status >= 400:
            raise EngineRequestError(_error_message(status, reply.body), status)
        if self.error is not None:
            raise self.error
        if self.last is None:
            return _Failure("the stream ended before its last frame", may_be_running=True)
        return self.last

    def broken(self, reason: str) -> Generation:
        """What a stream that broke after its first tokens sampled, as an abort to resume."""
        return Generation(
            output_ids=self.sampled,
            logprobs=self.logprobs,
            finish_type="abort",
            finish_reason={"type": "abort", "message": f"the stream broke: {reason}"},
            weight_version=None,
            prompt_tokens=None,
            cached_tokens=None,
            text="",
        )


class SGLangClient:
    """Calls one SGLang worker or the SGLang router.

    `/generate` and control calls (abort, pause) go over `transport`; `http` (also the default
    transport) asks the router for its workers and the engine for its health. The engine's own
    protocol is in GENERATE_PATH, _encode_params, _request_body, _parse, abort, pause and resume
    (vllm.py's VLLMClient overrides them).
    """

    GENERATE_PATH = "/generate"
    CONTEXT_RESERVE = 1  # SGLang refuses input + max_new_tokens >= its context length

    def __init__(
        self,
        http: httpx.AsyncClient,
        base_url: str,
        *,
        max_inflight: int,
        retries: int,
        backoff_seconds: float,
        timeout_seconds: float,
        worker_urls: list[str] | None = None,
        transport: GenerateTransport | None = None,
        abort_quiet: AbortQuiet | None = None,
        model_info: ModelInfoCache | None = None,
        placement: Placement | None = None,
    ) -> None:
        self._http = http
        self._transport = transport or HttpxTransport(http)
        self.base_url = base_url.rstrip("/")
        self._generate_url = f"{self.base_url}{self.GENERATE_PATH}"
        self._inflight = asyncio.BoundedSemaphore(max_inflight)
        self._max_inflight = max_inflight
        self._retries = retries
        self._backoff = backoff(backoff_seconds, BACKOFF_MAX_SECONDS)
        self._timeout_seconds = timeout_seconds
        self._worker_urls = [url.rstrip("/") for url in worker_urls or []]
        self._abort_workers: tuple[float, list[str]] | None = None  # (when listed, urls)
        self._abort_workers_lock = asyncio.Lock()
        self.abort_quiet = abort_quiet or AbortQuiet(ABORT_QUIET_SECONDS)
        self.status = EngineStatus(self.base_url, self._health_problem)
        self.model_info = model_info  # None: nothing read from the engine (max_new_tokens as asked)
        # None: every call goes to base_url (one worker, or the router, told the routing key).
        self.placement = placement

    @property
    def inflight(self) -> int:
        """Generate calls holding a slot now (waiting ones excluded)."""
        return self._max_inflight - self._inflight._value

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        rid: str,
        *,
        input_ids_json: str | None = None,
    ) -> Generation:
        """One generation from exactly `input_ids`. Retries transient failures with exponential backoff.

        `input_ids_json`, the ids already encoded as a JSON array, spares re-encoding a long
        conversation on every turn (see Trajectory.input_ids_json).
        """
        if self.model_info is not None:
            sampling_params = await self._fit_context(len(input_ids), sampling_params, self.model_info)
        encoded_ids = input_ids_json if input_ids_json is not None else json.dumps(list(input_ids))
        encoded_params = self._encode_params(sampling_params)
        result = await self._attempt(encoded_ids, encoded_params, rid)
        if isinstance(result, Generation):
            return result
        return await self._retried(encoded_ids, encoded_params, rid, result)

    async def _fit_context(
        self, input_tokens: int, sampling_params: dict[str, Any], model_info: ModelInfoCache
    ) -> dict[str, Any]:
        """`sampling_params` with max_new_tokens cut to what the engine's context length leaves, so
        that the last turns of a long episode sample up to the context instead of being refused;
        an input that leaves no room is refused here, as the engine would."""
        context_length = (await model_info.get()).context_length
        room = output_room(context_length, input_tokens, self.CONTEXT_RESERVE)
        if room is None:
            return sampling_params
        if room < 1:
            raise EngineRequestError(
                f"the input ({input_tokens} tokens) leaves no room in the model's context length "
                f"({context_length} tokens)",
                400,
            )
        asked = sampling_params.get("max_new_tokens")
        if isinstance(asked, int) and asked > room:
            return sampling_params | {"max_new_tokens": room}
        return sampling_params

    async def _attempt(self, encoded_ids: str, encoded_params: str, rid: str) -> Generation | _Failure:
        await self.abort_quiet.wait()
        body = self._request_body(encoded_ids, encoded_params, rid)
        url, worker, headers = self._destination(rid)
        result: Generation | _Failure | None = None
        try:
            result = await self._post_generate(url, body, headers)
        finally:  # a refused request (4xx) or a cancel is no failure of the worker's
            self._placed_call_ended(worker, failed=isinstance(result, _Failure))
        if isinstance(result, Generation):
            if result.interrupted:
                self.abort_quiet.aborted()
        elif result.may_be_running:
            await self.abort(rid)  # free the engine's slot before asking again
        return result

    def _destination(self, rid: str) -> tuple[str, str | None, dict[str, str] | None]:
        """Where a generate call of `rid` goes: (its URL, the worker placed on, or None when the
        call goes to SGLANG_URL, its headers: the router is told the routing key)."""
        route = route_of(rid)
        if self.placement is None:
            return self._generate_url, None, {ROUTING_KEY_HEADER: routing_key(route)}
        worker = self.placement.pick(route)
        self.placement.started(worker)
        return f"{worker}{self.GENERATE_PATH}", worker, None

    def _placed_call_ended(self, worker: str | None, *, failed: bool) -> None:
        if worker is None or self.placement is None:
            return
        self.placement.finished(worker)
        if failed:  # its episodes move on, this call's retry first
            self.placement.failed(worker)

    async def _retried(
        self, encoded_ids: str, encoded_params: str, rid: str, failure: _Failure
    ) -> Generation:
        """The retries after a first attempt failed, at tenacity's jittered backoff. Off the hot
        path: a retrying object costs ~20 us a call, 300 times a bare first attempt's bookkeeping."""
        attempt_rid = rid
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self._retries + 1),
            wait=self._backoff,
            retry=retry_if_exception_type(_Retry),
            before_sleep=lambda state: _log_retry(rid, state),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    if attempt.retry_state.attempt_number > 1:
                        if failure.may_be_running:
                            # The abort may land after the retry: a new rid cannot collide with the
                            # old request. The suffix keeps the rid's prefix, so aborting the
                            # episode's prefix still reaches it.
                            attempt_rid = f"{rid}.retry{attempt.retry_state.attempt_number - 1}"
                        result = await self._attempt(encoded_ids, encoded_params, attempt_rid)
                        if isinstance(result, Generation):
                            return result
                        failure = result
                    raise _Retry(failure)
        except _Retry as last:
            raise EngineUnavailableError(
                f"generate {rid} failed after {self._retries + 1} attempts: {last.failure.reason}",
                status_code=last.failure.status_code,
                engine_down=self.status.down,
            ) from None
        raise AssertionError("unreachable: tenacity either returns an attempt or raises")

    async def _post_generate(
        self, url: str, body: bytes, headers: dict[str, str] | None
    ) -> Generation | _Failure:
        """One attempt: the Generation, or a retryable failure."""
        async with self._inflight:
            try:
                reply = await self._transport.post(url, body, self._timeout_seconds, headers)
            except TransportFailure as failure:
                if not failure.may_be_running:  # it never reached an engine: there is none
                    self.status.unreachable(failure.reason)
                return _Failure(failure.reason, may_be_running=failure.may_be_running)
        status = reply.status
        if status in ENGINE_DOWN_STATUSES:
            self.status.unreachable(f"HTTP {status}: {_error_message(status, reply.body)[:200]}")
        else:
            self.status.answered()
        if status >= 500 or status in RETRYABLE_STATUS:
            return _Failure(f"HTTP {status}: {_error_message(status, reply.body)}", status_code=status)
        if status >= 400:
            raise EngineRequestError(_error_message(status, reply.body), status)
        try:
            parsed = orjson.loads(reply.body)
        except orjson.JSONDecodeError as error:
            raise EngineResponseError(f"response is not JSON: {error}") from error
        return self._parse(parsed)

    async def generate_streamed(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        rid: str,
        on_tokens: OnTokens,
        *,
        input_ids_json: str | None = None,
    ) -> Generation:
        """generate(), with SGLang's streaming `/generate`: `on_tokens` gets the newly sampled ids
        as the engine sends them; the Generation returned is the one generate() would return (the
        stream's last frame). A stream that breaks after its first tokens ends as an abort with
        what it sampled (the caller resumes it); one that fails before is retried as generate()'s.
        An engine without a streaming /generate (vLLM's) hands everything over at the end."""
        if self.GENERATE_PATH != SGLangClient.GENERATE_PATH:
            generation = await self.generate(input_ids, sampling_params, rid, input_ids_json=input_ids_json)
            on_tokens(generation.output_ids)
            return generation
        if self.model_info is not None:
            sampling_params = await self._fit_context(len(input_ids), sampling_params, self.model_info)
        encoded_ids = input_ids_json if input_ids_json is not None else json.dumps(list(input_ids))
        encoded_params = self._encode_params(sampling_params)
        await self.abort_quiet.wait()
        frames = _StreamFrames(on_tokens, self.model_info.info.logprobs_mode if self.model_info else None)
        body = generate_body(encoded_ids, encoded_params, rid, stream=True)
        reply: Reply | _Failure | None = None
        url, worker, headers = self._destination(rid)
        try:
            async with self._inflight:
                try:
                    reply = await self._transport.stream(
                        url, body, self._timeout_seconds, frames.feed, headers
                    )
                except TransportFailure as failure:
                    if not failure.may_be_running:  # it never reached an engine: there is none
                        self.status.unreachable(failure.reason)
                    reply = _Failure(failure.reason, may_be_running=failure.may_be_running)
        finally:
            failed = isinstance(reply, _Failure) or (reply is not None and reply.status >= 500)
            self._placed_call_ended(worker, failed=failed)
        if not isinstance(reply, _Failure):
            if reply.status in ENGINE_DOWN_STATUSES:
                self.status.unreachable(
                    f"HTTP {reply.status}: {_error_message(reply.status, reply.body)[:200]}"
                )
            else:
                self.status.answered()
        result = frames.outcome(reply)
        if isinstance(result, Generation):
            if result.interrupted:
                self.abort_quiet.aborted()
            return result
        if result.may_be_running:
            await self.abort(rid)
        if frames.sampled:  # the agent saw these tokens: they are the turn's, resumed after
            return frames.broken(result.reason)
        return await self._retried(encoded_ids, encoded_params, rid, result)

    def _encode_params(self, sampling_params: dict[str, Any]) -> str:
        return orjson.dumps(sampling_params).decode()  # a tenth of json.dumps' CPU, every turn

    def _request_body(self, input_ids_json: str, sampling_params_json: str, rid: str) -> bytes:
        return generate_body(input_ids_json, sampling_params_json, rid)

    def _parse(self, body: Any) -> Generation:
        return parse_generation(body, self.model_info.info.logprobs_mode if self.model_info else None)

    async def pause(self, mode: str) -> dict[str, str | None]:
        """Pauses generation on every worker (SGLang's modes: abort, retract, in_place)."""
        return await self.control("/pause_generation", {"mode": mode})

    async def resume(self) -> dict[str, str | None]:
        """Resumes generation on every worker after pause()."""
        return await self.control("/continue_generation", {})

    async def abort(self, rid: str) -> None:
        """Aborts `rid` (and every rid it prefixes) on each worker; the router does not proxy aborts."""
        body = {"rid": rid, "abort_all": False}
        for url, problem in (await self.control("/abort_request", body, await self._abort_targets())).items():
            if problem is not None:
                logger.warning("abort %s at %s: %s", rid, url, problem)

    async def _abort_targets(self) -> list[str]:
        """The workers, as listed at most ABORT_WORKERS_TTL_SECONDS ago; one listing at a time,
        however many aborts wait for it (a dropped connection can abort hundreds at once)."""
        async with self._abort_workers_lock:
            listed = self._abort_workers
            if listed is None or time.monotonic() - listed[0] > ABORT_WORKERS_TTL_SECONDS:
                listed = self._abort_workers = (time.monotonic(), await self.workers())
            return listed[1]

    async def control(
        self, path: str, body: dict[str, Any], urls: list[str] | None = None
    ) -> dict[str, str | None]:
        """POSTs a control call (abort, pause_generation, continue_generation) to every worker
        (`urls`, or those listed now), always with a JSON body (recent builds answer 400 to a
        bodyless POST). Returns each worker's problem, None where it succeeded."""
        urls = urls if urls is not None else await self.workers()
        results = await asyncio.gather(*(self._control_post(f"{url}{path}", body) for url in urls))
        return dict(zip(urls, results, strict=True))

    async def _control_post(self, url: str, body: dict[str, Any]) -> str | None:
        # Over the generate transport: aborts come in bursts, at the cost of a bare request each.
        try:
            reply = await self._transport.post(url, orjson.dumps(body), CONTROL_TIMEOUT_SECONDS)
        except TransportFailure as failure:
            return failure.reason
        if reply.status >= 400:
            return f"HTTP {reply.status}: {_error_message(reply.status, reply.body)}"
        return None

    async def workers(self) -> list[str]:
        """Worker URLs for control calls: the configured list, else the router's, else the base URL."""
        if self._worker_urls:
            return list(self._worker_urls)
        try:
            response = await self._http.get(f"{self.base_url}/workers", timeout=CONTROL_TIMEOUT_SECONDS)
        except httpx.TransportError as error:
            logger.warning("GET %s/workers: %s; using the base URL", self.base_url, error)
            return [self.base_url]
        if response.status_code != 200:  # a plain worker has no /workers
            return [self.base_url]
        try:
            urls = _worker_list(response.json())
        except ValueError:
            urls = []
        return urls or [self.base_url]

    async def _health_problem(self) -> str | None:
        """None if the engine's /health answers (a 4xx too: an engine without that route), else why not."""
        try:
            response = await self._http.get(f"{self.base_url}/health", timeout=PROBE_TIMEOUT_SECONDS)
        except httpx.TransportError as error:
            return f"{type(error).__name__}: {error}".rstrip(": ")
        if response.status_code >= 500:
            return f"GET /health answers HTTP {response.status_code}"
        return None

    async def health(self) -> bool:
        try:
            response = await self._http.get(f"{self.base_url}/health", timeout=CONTROL_TIMEOUT_SECONDS)
        except httpx.TransportError:
            return False
        return response.status_code == 200


def _worker_list(body: Any) -> list[str]:
    """URLs from the router's GET /workers: `{"workers": [{"url": ...}, ...]}` or a list of URLs."""
    entries = body.get("workers", body.get("urls")) if isinstance(body, dict) else body
    if not isinstance(entries, list):
        return []
    urls = []
    for entry in entries:
        url = entry.get("url") if isinstance(entry, dict) else entry
        if isinstance(url, str) and url:
            urls.append(url.rstrip("/"))
    return urls
