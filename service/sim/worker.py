"""A simulated SGLang worker: the protocol of docs/sglang.md, played by an oracle of `builtin/shop`;
it also answers vLLM 0.32's token-in/token-out routes (/inference/v1/generate, aborts, pause).

The policy (policy.py) decodes the ChatML prompt and plays the task's oracle plan with seeded
mistakes, returning token ids the way real sampling does. This module is the worker's state and
HTTP surface. Used by the demo, the tests and the benchmarks; `main()` serves it with uvicorn.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from service.sim.policy import PlannedOutput, SimConfig, SimTokens, latency_factor, plan_output
from service.sim.prefix_cache import PrefixCache
from service.sim.protocol import SimHTTPError, SimRequest, json_bytes
from service.sim.vllm import (
    VLLM_ID_PREFIX,
    sglang_body_of_vllm,
    vllm_error,
    vllm_response,
    vllm_server_info,
)
from service.sockets import listen

__all__ = ["SimConfig", "SimRequest", "SimWorker", "create_sim_app", "main", "serve_in_thread"]

SERVER_START_TIMEOUT_SECONDS = 10.0


# The names SGLang's SamplingParams takes from a request (python/sglang/srt/sampling/sampling_params.py).
SGLANG_SAMPLING_PARAMS = frozenset(
    {
        "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
        "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
        "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
        "spaces_between_special_tokens", "no_stop_trim", "custom_params", "stream_interval",
        "logit_bias", "sampling_seed",
    }
)  # fmt: skip


@dataclass
class _Running:
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    abort_message: str = ""
    # The output it samples and when it started to (after any pause), for a stream to pace.
    planned: tuple[PlannedOutput, float] | None = None
    streamed: int = 0  # the tokens its stream sent: an abort keeps at least these


_json_bytes = json_bytes


def _error(status_code: int, message: str) -> Response:
    return Response(_json_bytes({"error": {"message": message}}), status_code, media_type="application/json")


# ---- the worker ----


class SimWorker:
    """The state of one simulated worker: request log, running requests (for aborts), weight version."""

    def __init__(self, config: SimConfig | None = None) -> None:
        self.config = config or SimConfig()
        self.tokens = SimTokens(self.config.tokenizer_path)
        self.weight_version = self.config.weight_version
        self.model_path = self.config.model_path
        self.requests: list[SimRequest] = []
        self.aborts: list[dict[str, Any]] = []
        self.healthy = True
        self.peak_running = 0  # most requests in flight at once
        self.aborted = 0  # requests cut by an abort, a weight update or a pause (each counted once)
        self._running: dict[str, _Running] = {}
        self._failures: list[int] = []
        self.prefix_cache = PrefixCache(self.config.prefix_cache_tokens, self.config.prefix_page_tokens)
        self._paused = False
        self._resumed = asyncio.Event()

    def fail_next(self, count: int, status_code: int = 503) -> None:
        """The next `count` generate requests answer `status_code` (faults for retry tests)."""
        self._failures.extend([status_code] * count)

    @property
    def running(self) -> int:
        return len(self._running)

    def abort(
        self, rid: str, abort_all: bool = False, message: str = "Aborted by AbortReq.", *, exact: bool = False
    ) -> int:
        """Aborts running requests whose rid starts with `rid` (is `rid`, with `exact`: vLLM's
        aborts; all with abort_all); returns how many."""
        matched = [
            running
            for key, running in self._running.items()
            if abort_all or (rid and (key == rid if exact else key.startswith(rid)))
        ]
        for running in matched:
            if not running.aborted.is_set():
                self.aborted += 1
            running.abort_message = message
            running.aborted.set()
        return len(matched)

    def update_weights(self, weight_version: str, *, abort_all: bool = True) -> int:
        """A weight update as a trainer makes one: every request in flight is aborted (each answers
        what it sampled so far, finish_reason abort) and later ones report the new version.
        Returns how many were aborted."""
        aborted = self.abort("", abort_all=True, message="Aborted by update_weights.") if abort_all else 0
        self.weight_version = weight_version
        self.flush_cache()
        return aborted

    @property
    def waiting(self) -> int:
        """Requests held by a pause (SGLang counts them as waiting)."""
        return self.running if self._paused else 0

    def pause(self, mode: str) -> None:
        self._paused = True
        self._resumed = asyncio.Event()
        if mode == "abort":
            self.abort("", abort_all=True, message="Aborted by pause_generation.")

    def resume(self) -> None:
        self._paused = False
        self._resumed.set()

    def flush_cache(self) -> None:
        self.prefix_cache.clear()

    def _validate(self, body: Any) -> tuple[list[int], dict[str, Any], str]:
        if not isinstance(body, dict):
            raise SimHTTPError(400, "The request body must be a JSON object.")
        inputs = [key for key in ("text", "input_ids", "input_embeds") if body.get(key) is not None]
        if len(inputs) != 1:
            raise SimHTTPError(400, "Either text, input_ids or input_embeds should be provided.")
        if inputs[0] == "input_embeds":
            raise SimHTTPError(400, "input_embeds is not supported by the simulated worker.")
        if inputs[0] == "text":
            if not isinstance(body["text"], str):
                raise SimHTTPError(400, "The simulated worker takes one text, not a batch.")
            input_ids = self.tokens.encode(body["text"])
        else:
            input_ids = body["input_ids"]
            if not isinstance(input_ids, list) or not all(
                isinstance(token, int) and not isinstance(token, bool) for token in input_ids
            ):
                raise SimHTTPError(400, "input_ids must be a list of ints (batches are not simulated).")
        vocab_size = self.tokens.tokenizer.get_vocab_size()
        if not input_ids or any(not 0 <= token < vocab_size for token in input_ids):
            raise SimHTTPError(400, f"input_ids must be non-empty token ids below {vocab_size}.")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise SimHTTPError(400, "sampling_params must be an object.")
        unknown = sorted(params.keys() - SGLANG_SAMPLING_PARAMS)
        if unknown:  # SGLang builds its SamplingParams struct from the dict: a stray name is a TypeError
            raise SimHTTPError(400, f"Unexpected keyword argument {unknown[0]!r}")
        max_new_tokens = params.get("max_new_tokens", 128)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise SimHTTPError(400, "max_new_tokens must be a non-negative int.")
        if params.get("n", 1) != 1:
            raise SimHTTPError(400, "The simulated worker supports n == 1 only.")
        context = self.config.context_length
        if len(input_ids) >= context:
            raise SimHTTPError(
                400,
                f"The input ({len(input_ids)} tokens) is longer than the model's context length "
                f"({context} tokens).",
            )
        if len(input_ids) + max_new_tokens > context:
            raise SimHTTPError(
                400,
                f"Requested token count exceeds the model's maximum context length of {context} tokens. "
                f"You requested a total of {len(input_ids) + max_new_tokens} tokens: {len(input_ids)} tokens "
                f"from the input messages and {max_new_tokens} tokens for the completion.",
            )
        rid = body.get("rid")
        return input_ids, params, rid if isinstance(rid, str) and rid else f"sim-{time.monotonic_ns()}"

    def _admit(self, body: Any) -> tuple[SimRequest, _Running]:
        input_ids, params, rid = self._validate(body)
        request = SimRequest(body, rid, input_ids, params)
        self.requests.append(request)
        if len(self.requests) > self.config.request_log_limit:
            del self.requests[: len(self.requests) - self.config.request_log_limit]
        if self._failures:
            raise SimHTTPError(self._failures.pop(0), "Injected failure of the simulated worker.")
        limit = self.config.max_queued_requests
        if limit is not None and len(self._running) >= limit:
            raise SimHTTPError(503, "The request queue is full.")
        if rid in self._running:
            raise SimHTTPError(400, f"Duplicate request ID {rid}.")
        running = _Running()
        self._running[rid] = running
        self.peak_running = max(self.peak_running, len(self._running))
        return request, running

    async def run(self, request: SimRequest, running: _Running) -> tuple[PlannedOutput, dict[str, Any]]:
        """Plays one request to its end (or its abort): the output and the meta_info."""
        start = time.monotonic()
        weight_version = self.weight_version  # the weights that sample it: an update aborts it first
        meta: dict[str, Any] = {"id": request.rid}
        try:
            queued = not await self._wait_resumed(running)
            output = plan_output(
                self.tokens, self.config, request.input_ids, request.sampling_params, request.rid
            )
            running.planned = output, time.monotonic()
            if not queued:
                # The prompt is cached once prefilled (a group's later samples share it); what was
                # sampled is cached when the request ends, aborted or not.
                cached, keys = 0, list[int]()
                if self.config.prefix_cache_tokens:  # 0: no prefix cache (and none of its CPU)
                    cached, keys = self.prefix_cache.match(request.input_ids)
                    keys = self.prefix_cache.insert(request.input_ids, keys)
                meta |= {"prompt_tokens": len(request.input_ids), "cached_tokens": cached}
                decode_seconds = self.config.per_token_latency_seconds * len(output.ids)
                slower = latency_factor(request.rid, self.config)
                try:
                    await asyncio.wait_for(
                        running.aborted.wait(),
                        timeout=(self.config.latency_seconds + decode_seconds) * slower,
                    )
                except asyncio.TimeoutError:  # noqa: UP041 (Python 3.10 raises the asyncio one)
                    pass
            if running.aborted.is_set():
                elapsed = (time.monotonic() - start) / latency_factor(request.rid, self.config)
                # What the clock says was sampled, and never less than what the stream already
                # sent, as SGLang's last frame holds every token it streamed: the stream's timer
                # may fire a hair early (uvloop's count whole milliseconds), and a last frame
                # that took a token back was an engine fault to the service.
                produced = 0 if queued else max(running.streamed, self._produced(elapsed, len(output.ids)))
                output = PlannedOutput(
                    output.ids[:produced],
                    output.logprobs[:produced],
                    {"type": "abort", "message": running.abort_message},
                )
            if not queued and output.ids and self.config.prefix_cache_tokens:
                self.prefix_cache.insert(request.input_ids + output.ids, keys)
        finally:
            self._running.pop(request.rid, None)
        meta |= {
            "finish_reason": output.finish_reason,
            "completion_tokens": len(output.ids),
            "e2e_latency": time.monotonic() - start,
            "weight_version": weight_version,
        }
        meta.setdefault("cached_tokens", 0)
        return output, meta

    async def _wait_resumed(self, running: _Running) -> bool:
        """Waits out a pause; False if the request was aborted while queued."""
        while self._paused and not running.aborted.is_set():
            resumed = asyncio.ensure_future(self._resumed.wait())
            aborted = asyncio.ensure_future(running.aborted.wait())
            await asyncio.wait({resumed, aborted}, return_when=asyncio.FIRST_COMPLETED)
            resumed.cancel()
            aborted.cancel()
        return not running.aborted.is_set()

    def _produced(self, elapsed: float, total: int) -> int:
        per_token = self.config.per_token_latency_seconds
        decoding = elapsed - self.config.latency_seconds
        if per_token <= 0 or decoding <= 0:
            return 0
        return min(total - 1, int(decoding / per_token))

    def response(self, request: SimRequest, output: PlannedOutput, meta: dict[str, Any]) -> dict[str, Any]:
        params = request.sampling_params
        text_ids = output.ids
        if output.finish_reason.get("type") == "stop" and text_ids and text_ids[-1] == self.tokens.eos_id:
            text_ids = text_ids[:-1]  # the matched stop token is trimmed from the text
        text = self.tokens.decode(text_ids, skip_special_tokens=bool(params.get("skip_special_tokens", True)))
        if request.body.get("return_logprob"):
            with_text = bool(request.body.get("return_text_in_logprobs"))
            decode = self.tokens.decode
            meta["output_token_logprobs"] = [
                [logprob, token, decode([token], skip_special_tokens=False) if with_text else None]
                for logprob, token in zip(output.logprobs, output.ids, strict=True)
            ]
        return {"text": text, "output_ids": output.ids, "meta_info": meta}


# ---- the HTTP surface ----


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except ValueError as error:
        raise SimHTTPError(400, f"Invalid JSON body: {error}") from error


async def _abort_on_disconnect(request: Request, running: _Running) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            running.abort_message = "Request is disconnected from the client side. Abort request."
            running.aborted.set()
            return


def create_sim_app(config: SimConfig | None = None, *, worker: SimWorker | None = None) -> Starlette:
    """The ASGI app of one simulated worker; pass `worker` to inspect its request log."""
    sim = worker or SimWorker(config)

    async def generate(request: Request) -> Response:
        try:
            body = await _json_body(request)
            sim_request, running = sim._admit(body)
        except SimHTTPError as error:
            return _error(error.status_code, error.message)
        if body.get("stream"):
            return StreamingResponse(_stream(sim, sim_request, running), media_type="text/event-stream")
        # SGLang aborts a request whose client went away (e.g. timed out), as this watcher does.
        watcher = asyncio.ensure_future(_abort_on_disconnect(request, running))
        try:
            output, meta = await sim.run(sim_request, running)
        finally:
            watcher.cancel()
        sim_request.response_body = _json_bytes(sim.response(sim_request, output, meta))
        return Response(sim_request.response_body, media_type="application/json")

    async def vllm_generate(request: Request) -> Response:
        """vLLM's POST /inference/v1/generate (non-streaming, output_mode tokens)."""
        try:
            body = await _json_body(request)
            sglang_body = sglang_body_of_vllm(body)
            prompt, context = len(sglang_body["input_ids"]), sim.config.context_length
            if prompt > context:
                raise SimHTTPError(
                    400,
                    f"The decoder prompt (length {prompt}) is longer than the maximum model length of "
                    f"{context}. Make sure that `max_model_len` is no smaller than the number of text "
                    "tokens.",
                )
            params = sglang_body["sampling_params"]  # vLLM cuts what does not fit instead of refusing
            params["max_new_tokens"] = min(int(params["max_new_tokens"]), context - prompt)
            sim_request, running = sim._admit(sglang_body)
        except SimHTTPError as error:
            return vllm_error(error.status_code, error.message)
        sim_request.body = body
        watcher = asyncio.ensure_future(_abort_on_disconnect(request, running))
        try:
            output, meta = await sim.run(sim_request, running)
        finally:
            watcher.cancel()
        sim_request.response_body = _json_bytes(
            vllm_response(sim_request, output, meta, eos_id=sim.tokens.eos_id, model=sim.model_path)
        )
        return Response(sim_request.response_body, media_type="application/json")

    async def vllm_abort_requests(request: Request) -> Response:
        """vLLM's abort by the engine's ids: /inference/v1/abort_requests answers at once, empty
        (the abort runs in the background); the dev server's /abort_requests counts the ids it was
        given (known or not), and aborts everything without any."""
        try:
            body = await _json_body(request)
        except SimHTTPError as error:
            return vllm_error(error.status_code, error.message)
        ids = body.get("request_ids") if isinstance(body, dict) else None
        if ids is None and request.url.path.startswith("/inference"):
            return JSONResponse({"detail": "Missing 'request_ids' in request body"}, 400)
        sim.aborts.append(body)
        for engine_id in ids or []:
            rid = str(engine_id).removeprefix(VLLM_ID_PREFIX)
            sim.abort(rid, message="Aborted by abort_requests.", exact=True)
        if request.url.path.startswith("/inference"):
            return Response(status_code=200)
        count = len(ids) if ids else sim.abort("", abort_all=True, message="Aborted by abort_requests.")
        return JSONResponse({"status": "aborted", "aborted": count})

    async def vllm_pause(request: Request) -> Response:
        """vLLM's POST /pause?mode=abort|keep|wait (the simulated worker's requests in flight run
        on through keep and wait alike; new ones wait for the resume)."""
        mode = request.query_params.get("mode", "abort")
        if mode not in ("abort", "keep", "wait"):
            return JSONResponse({"error": f"Unknown pause mode {mode!r}."}, 400)
        sim.pause("abort" if mode == "abort" else "in_place")
        return JSONResponse({"status": "paused"})

    async def vllm_resume(request: Request) -> Response:
        sim.resume()
        return JSONResponse({"status": "resumed"})

    async def vllm_is_paused(request: Request) -> Response:
        return JSONResponse({"is_paused": sim._paused})

    async def health(request: Request) -> Response:
        # SGLang's own /health is an empty 200; this says what answers, for people trying it out.
        body = {
            "status": "ok" if sim.healthy else "unhealthy",
            "simulated": True,
            "model_path": sim.model_path,
            "weight_version": sim.weight_version,
            "policy": policy_name(sim.config),
            "running": sim.running,
            "requests": len(sim.requests),
        }
        return JSONResponse(body, status_code=200 if sim.healthy else 503)

    async def model_info(request: Request) -> Response:
        return JSONResponse(
            {
                "model_path": sim.model_path,
                "tokenizer_path": sim.config.tokenizer_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": sim.weight_version,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "qwen2",
                "architectures": ["Qwen2ForCausalLM"],
            }
        )

    async def server_info(request: Request) -> Response:
        if "config_format" in request.query_params:  # vLLM's dev-mode /server_info (SGLang has none)
            return JSONResponse(vllm_server_info(sim.config.context_length))
        return JSONResponse(
            {
                "model_path": sim.model_path,
                "tokenizer_path": sim.config.tokenizer_path,
                "context_length": sim.config.context_length,
                "max_queued_requests": sim.config.max_queued_requests,
                "weight_version": sim.weight_version,
                "dp_size": 1,
                "tp_size": 1,
                "version": "sim",
                "internal_states": [
                    {"max_total_num_tokens": sim.config.prefix_cache_tokens, "last_gen_throughput": 0.0}
                ],
            }
        )

    async def load(request: Request) -> Response:
        return JSONResponse([{"dp_rank": 0, "num_reqs": sim.running, "num_waiting_reqs": 0, "num_tokens": 0}])

    async def loads(request: Request) -> Response:
        """GET /v1/loads as SGLang answers it (entrypoints/v1_loads.py), one DP rank: what slime's
        abort_servers_until_idle polls until no request is left."""
        waiting = sim.waiting
        load = {
            "dp_rank": 0,
            "num_running_reqs": sim.running - waiting,
            "num_waiting_reqs": waiting,
            "num_used_tokens": 0,
            "max_total_num_tokens": sim.config.context_length,
            "token_usage": 0.0,
        }
        return JSONResponse(
            {
                "timestamp": datetime.now(UTC).isoformat(),
                "version": "sim",
                "accelerator": None,
                "num_accelerators": 1,
                "loads": [load],
            }
        )

    async def weight_version(request: Request) -> Response:
        return JSONResponse({"weight_version": sim.weight_version})

    async def abort_request(request: Request) -> Response:
        try:
            body = await _json_body(request)
        except SimHTTPError as error:
            return _error(error.status_code, error.message)
        if not isinstance(body, dict):
            return _error(400, "The request body must be a JSON object.")
        sim.aborts.append(body)
        sim.abort(str(body.get("rid") or ""), bool(body.get("abort_all", False)))
        return Response(status_code=200)

    async def pause_generation(request: Request) -> Response:
        try:
            body = await _json_body(request)
        except SimHTTPError as error:
            return _error(error.status_code, error.message)
        mode = body.get("mode", "abort") if isinstance(body, dict) else "abort"
        if mode not in ("abort", "retract", "in_place"):
            return _error(400, f"Unknown pause mode {mode!r}.")
        sim.pause(mode)
        return JSONResponse({"status": "ok"})

    async def continue_generation(request: Request) -> Response:
        try:
            await _json_body(request)
        except SimHTTPError as error:
            return _error(error.status_code, error.message)
        sim.resume()
        return JSONResponse({"status": "ok"})

    async def update_weights_from_disk(request: Request) -> Response:
        try:
            body = await _json_body(request)
        except SimHTTPError as error:
            return _error(error.status_code, error.message)
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            return _error(400, "model_path is required.")
        sim.model_path = body["model_path"]
        version = body.get("weight_version")
        sim.update_weights(
            sim.weight_version if version is None else str(version),
            abort_all=bool(body.get("abort_all_requests")),
        )
        return JSONResponse(
            {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        )

    async def flush_cache(request: Request) -> Response:
        sim.flush_cache()
        message = "Cache flushed.\nPlease check backend logs for more details."
        return Response(message, media_type="text/plain")

    async def models(request: Request) -> Response:
        model = {
            "id": sim.model_path,
            "object": "model",
            "created": 0,
            "owned_by": "sglang",
            "root": sim.model_path,
            "max_model_len": sim.config.context_length,
        }
        return JSONResponse({"object": "list", "data": [model]})

    routes = [
        Route("/generate", generate, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/get_load", load, methods=["GET"]),
        Route("/v1/loads", loads, methods=["GET"]),
        Route("/get_weight_version", weight_version, methods=["GET"]),
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/pause_generation", pause_generation, methods=["POST"]),
        Route("/continue_generation", continue_generation, methods=["POST"]),
        Route("/update_weights_from_disk", update_weights_from_disk, methods=["POST"]),
        Route("/flush_cache", flush_cache, methods=["POST", "GET"]),
        Route("/v1/models", models, methods=["GET"]),
        # vLLM's (--enable-scale-out; the pause routes with VLLM_SERVER_DEV_MODE=1)
        Route("/inference/v1/generate", vllm_generate, methods=["POST"]),
        Route("/inference/v1/abort_requests", vllm_abort_requests, methods=["POST"]),
        Route("/abort_requests", vllm_abort_requests, methods=["POST"]),
        Route("/pause", vllm_pause, methods=["POST"]),
        Route("/resume", vllm_resume, methods=["POST"]),
        Route("/is_paused", vllm_is_paused, methods=["GET"]),
    ]
    return Starlette(routes=routes)


async def _stream(sim: SimWorker, request: SimRequest, running: _Running) -> AsyncIterator[bytes]:
    """SSE frames with the cumulative text, ids and logprobs so far, sent as the tokens are
    sampled (the first token alone, then every `stream_interval`); finish_reason null until the
    last frame. A client that goes away aborts the request, as SGLang does."""
    run = asyncio.ensure_future(sim.run(request, running))
    step = max(1, sim.config.stream_interval)
    per_token = sim.config.per_token_latency_seconds * latency_factor(request.rid, sim.config)
    first = sim.config.latency_seconds * latency_factor(request.rid, sim.config)
    try:
        await asyncio.sleep(0)  # run plans its output on its first step
        while not run.done():
            if running.planned is None:  # paused before it started
                await asyncio.wait({run}, timeout=0.01)
                continue
            planned, started = running.planned
            count = 1 if running.streamed == 0 else running.streamed + step
            if count >= len(planned.ids):  # the rest comes with the last frame
                await run
                break
            delay = started + first + count * per_token - time.monotonic()
            if delay > 0:
                await asyncio.wait({run}, timeout=delay)
                if run.done():
                    break
            partial = PlannedOutput(planned.ids[:count], planned.logprobs[:count], {})
            meta = {"id": request.rid, "finish_reason": None, "completion_tokens": count}
            running.streamed = count
            yield b"data: " + _json_bytes(sim.response(request, partial, meta)) + b"\n\n"
        output, meta = await run
    finally:
        if not run.done():  # the client went away mid-stream
            running.abort_message = "Request is disconnected from the client side. Abort request."
            running.aborted.set()
    request.response_body = _json_bytes(sim.response(request, output, meta))
    yield b"data: " + request.response_body + b"\n\n"
    yield b"data: [DONE]\n\n"


@contextmanager
def serve_in_thread(app: Starlette, host: str = "127.0.0.1") -> Iterator[str]:
    """Serves `app` with uvicorn on a free port in a daemon thread; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    # The router probes connection modes with bytes uvicorn logs as invalid: only errors are logged.
    config = uvicorn.Config(app, log_level="error", lifespan="off", ws="none")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + SERVER_START_TIMEOUT_SECONDS
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            sock.close()
            raise RuntimeError("the simulated worker did not start")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=SERVER_START_TIMEOUT_SECONDS)
        sock.close()


def main(
    host: str = "127.0.0.1", port: int = 30000, config: SimConfig | None = None, **overrides: Any
) -> None:
    """Serves one simulated worker until interrupted (`python -m service sim-worker`)."""
    sim_config = replace(config or SimConfig(), **overrides)
    app = create_sim_app(sim_config)
    try:
        sock = listen(host, port)
    except OSError as error:
        print(f"error: cannot listen on {host}:{port}: {error} (choose another --port)", file=sys.stderr)
        raise SystemExit(2) from None
    url = f"http://{host}:{port}"
    print(
        f"simulated SGLang (and vLLM) worker listening on {url}: policy {policy_name(sim_config)}, "
        f"{sim_config.latency_seconds:g} s a request; point the service at it with SGLANG_URL={url} "
        "(Ctrl-C stops it)",
        flush=True,
    )
    uvicorn.Server(uvicorn.Config(app, log_level="warning", ws="none")).run(sockets=[sock])


def policy_name(config: SimConfig) -> str:
    """The policy, as people read it: a function's module:name, or the built-in one."""
    if config.policy is None:
        return "built-in: builtin/shop's oracle; other envs: each tool once with valid args, then answers"
    module = getattr(config.policy, "__module__", "?")
    return f"{module}:{getattr(config.policy, '__qualname__', config.policy)}"
