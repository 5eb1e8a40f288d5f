"""What the engine says of the model it serves: its context length and which distribution its
logprobs come from, read once from the engine (and again after a failed read), never only from a
setting that can drift from the server.

- Context length: `GET /v1/models`' `max_model_len`, which vLLM and SGLang both report (SGLang:
  its model config's `context_len`); else SGLang's `GET /get_server_info` `context_length`.
- Logprobs mode, "processed" (the distribution sampled from: after temperature, penalties and
  top-k/top-p, what an importance ratio needs) or "raw" (the model's, before them): vLLM reports
  its `--logprobs-mode` in the dev server's `GET /server_info?config_format=json`
  (VLLM_SERVER_DEV_MODE=1, which pause needs too). SGLang reports none: its logprobs are processed
  (after temperature) unless the server runs with SGLANG_RETURN_ORIGINAL_LOGPROB=1, which only
  the ENGINE_LOGPROBS_MODE setting can tell.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx

logger = logging.getLogger(__name__)

READ_TIMEOUT_SECONDS = 10.0
SERVER_INFO_TIMEOUT_SECONDS = 120.0  # vLLM's /server_info collects its environment once: 10 s seen here
RETRY_AFTER_SECONDS = 30.0  # a failed read (the engine down at start) is tried again this much later
# vLLM's --logprobs-mode -> the service's word for it; the *_logits modes return no logprobs at all.
VLLM_LOGPROBS_MODES = {"processed_logprobs": "processed", "raw_logprobs": "raw"}
SGLANG_LOGPROBS_MODE = "processed"  # SGLang's default; SGLANG_RETURN_ORIGINAL_LOGPROB=1 makes it raw


@dataclass(frozen=True)
class ModelInfo:
    context_length: int | None  # the longest input + output the engine takes; None: not reported
    logprobs_mode: str | None  # "processed" or "raw" (or vLLM's logits modes as named); None: unknown


def context_length_of_models(body: Any) -> int | None:
    """`max_model_len` of the first model in a `GET /v1/models` body (vLLM's and SGLang's)."""
    data = body.get("data") if isinstance(body, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict):
        length = data[0].get("max_model_len")
        if isinstance(length, int) and not isinstance(length, bool) and length > 0:
            return length
    return None


def vllm_logprobs_mode(server_info: Any) -> str | None:
    """The service's word for vLLM's `--logprobs-mode` in a `GET /server_info?config_format=json` body."""
    config = server_info.get("vllm_config") if isinstance(server_info, dict) else None
    model = config.get("model_config") if isinstance(config, dict) else None
    mode = model.get("logprobs_mode") if isinstance(model, dict) else None
    if not isinstance(mode, str):
        return None
    if mode not in VLLM_LOGPROBS_MODES:
        logger.warning("vLLM's --logprobs-mode is %s: it returns logits, not the sampler's logprobs", mode)
    return VLLM_LOGPROBS_MODES.get(mode, mode)


async def _get_json(http: httpx.AsyncClient, url: str, timeout_seconds: float = READ_TIMEOUT_SECONDS) -> Any:
    """The JSON body of a 200 answer to GET `url`; None for anything else."""
    try:
        response = await http.get(url, timeout=timeout_seconds)
    except httpx.HTTPError as error:
        logger.info("GET %s: %s", url, error)
        return None
    if response.status_code != 200:
        return None
    try:
        return response.json()
    except ValueError:
        return None


async def read_context_length(http: httpx.AsyncClient, base_url: str, engine: str) -> int | None:
    length = context_length_of_models(await _get_json(http, f"{base_url}/v1/models"))
    if length is None and engine == "sglang":
        server_info = await _get_json(http, f"{base_url}/get_server_info")
        found = server_info.get("context_length") if isinstance(server_info, dict) else None
        length = found if isinstance(found, int) and not isinstance(found, bool) and found > 0 else None
    return length


def known_logprobs_mode(engine: str, setting: str) -> str | None:
    """The logprobs mode known without asking the engine: the setting's, or SGLang's default."""
    if setting != "auto":
        return setting
    return SGLANG_LOGPROBS_MODE if engine == "sglang" else None


async def read_logprobs_mode(http: httpx.AsyncClient, base_url: str, engine: str, setting: str) -> str | None:
    """The logprobs mode: `setting` ("auto": what the engine reports, SGLang's default for SGLang)."""
    known = known_logprobs_mode(engine, setting)
    if known is not None or engine != "vllm":
        return known
    url = f"{base_url}/server_info?config_format=json"
    return vllm_logprobs_mode(await _get_json(http, url, SERVER_INFO_TIMEOUT_SECONDS))


async def read_model_info(http: httpx.AsyncClient, base_url: str, engine: str, setting: str) -> ModelInfo:
    return ModelInfo(
        await read_context_length(http, base_url, engine),
        await read_logprobs_mode(http, base_url, engine, setting),
    )


def output_room(context_length: int | None, input_tokens: int, reserve: int) -> int | None:
    """Tokens the engine may sample after `input_tokens` of input: what the context leaves, less
    `reserve` (SGLang refuses input + max_new_tokens reaching its context length, vLLM beyond it);
    None where the context length is unknown."""
    return None if context_length is None else context_length - input_tokens - reserve


class ModelInfoCache:
    """The engine's ModelInfo, read once by one caller while the others wait (the service starts the
    read as it starts: `warm_up`); a failed read (the engine not up yet) is kept for
    RETRY_AFTER_SECONDS, then read again. Generations wait for it, so that every call records the
    logprobs mode it was sampled under: vLLM's /server_info takes seconds the first time."""

    def __init__(self, http: httpx.AsyncClient, base_url: str, engine: str, setting: str) -> None:
        self._http = http
        self._base_url = base_url
        self._engine = engine
        self._setting = setting
        self._lock = asyncio.Lock()
        self._expires = 0.0  # monotonic time the info is read again; inf once read
        self._warm_up: asyncio.Task[ModelInfo] | None = None
        self.info = ModelInfo(None, known_logprobs_mode(engine, setting))

    async def get(self) -> ModelInfo:
        if self._expires > time.monotonic():
            return self.info
        async with self._lock:
            if self._expires <= time.monotonic():
                self.info = await read_model_info(self._http, self._base_url, self._engine, self._setting)
                # Read once the engine answered: a server with no mode to report (no dev mode)
                # will not report one later.
                read = self.info.context_length is not None
                self._expires = float("inf") if read else time.monotonic() + RETRY_AFTER_SECONDS
                logger.info(
                    "the engine's context length: %s; its logprobs: %s",
                    self.info.context_length,
                    self.info.logprobs_mode or "unknown (vLLM without VLLM_SERVER_DEV_MODE=1?)",
                )
        return self.info

    def warm_up(self) -> None:
        """Starts the read in the background, so that the first generations need not wait for it."""
        self._warm_up = asyncio.get_running_loop().create_task(self.get())

    async def aclose(self) -> None:
        if self._warm_up is not None and not self._warm_up.done():
            self._warm_up.cancel()
        if self._warm_up is not None:
            await asyncio.gather(self._warm_up, return_exceptions=True)
