"""The vLLM client: vLLM's token-in/token-out `POST /inference/v1/generate` (served with
`--enable-scale-out`) behind the same transport, retries and `Generation` as SGLang's.

What differs from SGLang, from vLLM 0.32's source (entrypoints/scale_out/token_in_token_out):
- the request is `{"token_ids", "sampling_params", "request_id"}`, and sampling_params take vLLM's
  names (VLLM_NAMES below); a name vLLM lacks is refused (`unsupported_by_vllm`), never dropped;
- the engine's id of a request is `generate-tokens-<request_id>`, and an abort names exact ids
  (`/abort_requests` on a dev server, else `/inference/v1/abort_requests`, `{"request_ids": [...]}`),
  so this client keeps the ids in flight and aborts those under a prefix (SGLang aborts by prefix
  itself); closing the connection aborts too (vLLM's `with_cancellation`);
- an aborted request answers 200 with `finish_reason: "abort"` and what it sampled so far;
- pause and resume are `POST /pause?mode=abort|keep|wait` and `/resume` (the server needs
  `VLLM_SERVER_DEV_MODE=1`); `keep` freezes requests in flight and continues them after the resume;
- vLLM detokenizes each request's output as it samples, for stop strings and a text answer: this
  client asks for tokens only (`output_mode` tokens, vLLM's default), whose answer carries no text
  either way (GenerateTokensChoice), and reads the text from its own tokenizer, so it sends
  `detokenize: false` wherever no stop string is set (vLLM refuses stop strings without it): the
  engine skips its incremental detokenizer for every token, and the answer is byte for byte the
  same;
- logprobs come from the server's `--logprobs-mode`: `raw_logprobs` (vLLM's default) are the
  model's before temperature and penalties; serve with `processed_logprobs` for the distribution
  sampled from (what SGLang returns, and what an importance ratio needs). The service reads the
  mode from the dev server's /server_info and records it on every call (model_info.py);
- there is no router: control calls go to the server itself (or SGLANG_WORKER_URLS), never after
  a `GET /workers`.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

from service.engine.client import (
    EngineRequestError,
    EngineResponseError,
    Generation,
    SGLangClient,
)

logger = logging.getLogger(__name__)

# SGLang's sampling_params names (the service's) -> vLLM SamplingParams' names.
VLLM_NAMES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "no_stop_trim": "include_stop_str_in_output",
    "n": "n",
    "logit_bias": "logit_bias",
    "sampling_seed": "seed",
}
# Grammars go into vLLM's structured_outputs object.
VLLM_STRUCTURED = {
    "json_schema": "json",
    "regex": "regex",
    "ebnf": "grammar",
    "structural_tag": "structural_tag",
}
# SGLang's streaming chunk size: nothing to do with a non-streamed request.
VLLM_IGNORED = frozenset({"stream_interval"})
ENGINE_ID_PREFIX = "generate-tokens-"  # vLLM's id of a request sent with request_id X is this + X
# The dev server's abort (VLLM_SERVER_DEV_MODE=1, which the pause routes need too) answers once the
# engine has dropped the requests; /inference/v1/abort_requests answers at once and aborts in a
# background task, and aborts were seen lost there under load: the latter only where the former is 404.
ABORT_PATHS = ("/abort_requests", "/inference/v1/abort_requests")


def unsupported_by_vllm(sampling_params: dict[str, Any]) -> str | None:
    """The first of `sampling_params` (SGLang's names, set to a value) that vLLM has no counterpart of."""
    for name, value in sampling_params.items():
        if value is None or name in VLLM_NAMES or name in VLLM_STRUCTURED or name in VLLM_IGNORED:
            continue
        return name
    return None


def vllm_sampling_params(sampling_params: dict[str, Any]) -> dict[str, Any]:
    """SGLang-named sampling_params as vLLM's, asking for the sampled tokens' logprobs."""
    unsupported = unsupported_by_vllm(sampling_params)
    if unsupported is not None:
        raise EngineRequestError(f"vLLM has no sampling parameter {unsupported!r}", 422)
    params: dict[str, Any] = {}
    structured: dict[str, Any] = {}
    for name, value in sampling_params.items():
        if value is None or name in VLLM_IGNORED:
            continue
        if name in VLLM_STRUCTURED:
            structured[VLLM_STRUCTURED[name]] = value
        else:
            params[VLLM_NAMES[name]] = value
    if structured:
        params["structured_outputs"] = structured
    params["logprobs"] = 0  # the sampled token's own, no alternatives
    if not params.get("stop"):
        params["detokenize"] = False  # see the module docstring; stop strings need vLLM's text
    return params


def _finish_reason(choice: dict[str, Any], output_ids: list[int]) -> dict[str, Any]:
    """vLLM's finish_reason and stop_reason as SGLang's finish_reason object."""
    reason = choice.get("finish_reason")
    stop_reason = choice.get("stop_reason")
    if reason == "stop":
        if isinstance(stop_reason, (int, str)) and not isinstance(stop_reason, bool):
            return {"type": "stop", "matched": stop_reason}
        return {"type": "stop", "matched": output_ids[-1] if output_ids else None}  # the EOS token
    if reason == "length":
        return {"type": "length", "length": len(output_ids)}
    if reason == "abort":
        return {"type": "abort", "message": "aborted by vLLM"}
    raise EngineResponseError(f"unknown finish_reason {reason!r}")


def parse_vllm_generation(body: Any, logprobs_mode: str | None = None) -> Generation:
    """Parses one non-streaming `/inference/v1/generate` body; raises EngineResponseError if unusable."""
    if not isinstance(body, dict):
        raise EngineResponseError(f"expected a JSON object, got {type(body).__name__}")
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise EngineResponseError("response has not exactly one choice")
    choice = choices[0]
    raw_ids = choice.get("token_ids") or []
    if not isinstance(raw_ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in raw_ids):
        raise EngineResponseError(f"token_ids is not a list of ints: {raw_ids!r}")
    output_ids: list[int] = raw_ids
    logprobs_obj = choice.get("logprobs")
    content = logprobs_obj.get("content") if isinstance(logprobs_obj, dict) else None
    if isinstance(content, list):
        try:
            entry_ids = [entry["token_id"] for entry in content]
            logprobs = [float(entry["logprob"]) for entry in content]
        except (TypeError, KeyError, ValueError) as error:
            raise EngineResponseError(f"unusable logprobs entry: {error!r}") from error
        if entry_ids != output_ids:
            raise EngineResponseError(
                f"token_ids ({len(output_ids)}) disagree with their logprobs' ({len(entry_ids)})"
            )
        has_logprobs = True
    else:
        logger.warning("no logprobs in %s: its logprobs are stored as 0.0", body.get("request_id"))
        logprobs, has_logprobs = [0.0] * len(output_ids), False
    finish_reason = _finish_reason(choice, output_ids)
    spans = choice.get("weight_versions")
    # The oldest weights that sampled any of the tokens: what staleness is measured from.
    weight_version = str(spans[0]["version"]) if isinstance(spans, list) and spans else None
    usage = body.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    prompt_tokens = usage.get("prompt_tokens")
    return Generation(
        output_ids=output_ids,
        logprobs=logprobs,
        finish_type=finish_reason["type"],
        finish_reason=finish_reason,
        weight_version=weight_version,
        prompt_tokens=prompt_tokens if isinstance(prompt_tokens, int) else None,
        cached_tokens=cached if isinstance(cached, int) else None,
        text="",  # the tokens mode sends none: the ids are the truth
        has_logprobs=has_logprobs,
        logprobs_mode=logprobs_mode,
    )


class VLLMClient(SGLangClient):
    """Calls one vLLM OpenAI-compatible server started with `--enable-scale-out` (and, for
    pause/resume, `VLLM_SERVER_DEV_MODE=1`)."""

    GENERATE_PATH = "/inference/v1/generate"
    CONTEXT_RESERVE = 0  # vLLM takes input + max_tokens up to max_model_len

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._live: dict[str, None] = {}  # request ids in flight, for aborts by prefix
        self._abort_path = ABORT_PATHS[0]

    async def generate(
        self,
        input_ids: Any,
        sampling_params: dict[str, Any],
        rid: str,
        *,
        input_ids_json: str | None = None,
    ) -> Generation:
        try:
            return await super().generate(input_ids, sampling_params, rid, input_ids_json=input_ids_json)
        finally:
            # By its ids (the client's retries are `<rid>.retry<n>`), not a scan of every id in
            # flight: at 2,000 in flight a scan cost more than the rest of the turn.
            self._live.pop(rid, None)
            for retry in range(1, self._retries + 1):
                self._live.pop(f"{rid}.retry{retry}", None)

    def _encode_params(self, sampling_params: dict[str, Any]) -> str:
        return orjson.dumps(vllm_sampling_params(sampling_params)).decode()  # as SGLang's: every turn

    def _request_body(self, input_ids_json: str, sampling_params_json: str, rid: str) -> bytes:
        self._live[rid] = None
        return (
            f'{{"token_ids":{input_ids_json},"sampling_params":{sampling_params_json},'
            f'"request_id":{orjson.dumps(rid).decode()}}}'
        ).encode()

    def _parse(self, body: Any) -> Generation:
        return parse_vllm_generation(body, self.model_info.info.logprobs_mode if self.model_info else None)

    async def abort(self, rid: str) -> None:
        """Aborts every request in flight whose id starts with `rid` (vLLM aborts exact ids)."""
        ids = [f"{ENGINE_ID_PREFIX}{live}" for live in self._live if live.startswith(rid)]
        if not ids:
            return
        body = {"request_ids": ids}
        targets = await self._abort_targets()
        for url, problem in (await self.control(self._abort_path, body, targets)).items():
            if problem is not None and problem.startswith("HTTP 404") and self._abort_path == ABORT_PATHS[0]:
                self._abort_path = ABORT_PATHS[1]  # not a dev server
                problem = (await self.control(self._abort_path, body, [url]))[url]
            if problem is not None:
                logger.warning("abort %s at %s: %s", rid, url, problem)

    async def workers(self) -> list[str]:
        """The configured workers, else the server itself: vLLM has no router to ask (a GET
        /workers would be one more request for a server busy generating to answer, before every
        pause and every 10 s of aborts)."""
        return list(self._worker_urls) or [self.base_url]

    async def pause(self, mode: str) -> dict[str, str | None]:
        """vLLM's pause: SGLang's abort is vLLM's abort; retract and in_place keep requests in
        flight (vLLM's keep: frozen, continued by the resume)."""
        return await self.control(f"/pause?mode={'abort' if mode == 'abort' else 'keep'}", {})

    async def resume(self) -> dict[str, str | None]:
        return await self.control("/resume", {})
