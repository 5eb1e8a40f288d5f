"""The simulated worker's vLLM side: vLLM 0.32's /inference/v1/generate bodies, read as the
SGLang requests the simulated policy plays, and its answers written as vLLM writes them."""

from __future__ import annotations

import time
from typing import Any

from starlette.responses import Response

from service.sim.policy import PlannedOutput
from service.sim.protocol import SimHTTPError, SimRequest, json_bytes

VLLM_ID_PREFIX = "generate-tokens-"  # vLLM's id of a /inference/v1/generate request
# vLLM's SamplingParams names the simulated policy reads -> SGLang's (the policy's own).
VLLM_TO_SGLANG = {"max_tokens": "max_new_tokens", "stop_token_ids": "stop_token_ids", "stop": "stop"}
VLLM_DEFAULT_MAX_TOKENS = 16
# SamplingParams._verify_args: vLLM matches stop strings in the text it detokenizes as it samples.
VLLM_STOP_NEEDS_TEXT = (
    "stop strings are only supported when detokenize is True. Set detokenize=True to use stop."
)


def vllm_finish(finish_reason: dict[str, Any], eos_id: int) -> tuple[str, int | str | None]:
    """SGLang's finish_reason object as vLLM's finish_reason and stop_reason (None for EOS)."""
    finish_type = str(finish_reason.get("type"))
    matched = finish_reason.get("matched")
    if finish_type != "stop" or matched == eos_id or not isinstance(matched, (int, str)):
        return finish_type, None
    return finish_type, matched


def sglang_body_of_vllm(body: Any) -> dict[str, Any]:
    """A vLLM /inference/v1/generate body as the SGLang body the simulated worker plays. vLLM
    ignores sampling parameters it does not know, and so does this."""
    if not isinstance(body, dict):
        raise SimHTTPError(400, "The request body must be a JSON object.")
    token_ids = body.get("token_ids")
    if not isinstance(token_ids, list) or not token_ids:
        raise SimHTTPError(400, "token_ids: List should have at least 1 item after validation")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise SimHTTPError(400, "sampling_params must be an object.")
    # `detokenize: false` changes nothing else here: a tokens-mode answer carries no text either way.
    if params.get("stop") and params.get("detokenize") is False:
        raise SimHTTPError(400, VLLM_STOP_NEEDS_TEXT)
    sglang = {VLLM_TO_SGLANG[name]: value for name, value in params.items() if name in VLLM_TO_SGLANG}
    sglang.setdefault("max_new_tokens", VLLM_DEFAULT_MAX_TOKENS)
    rid = body.get("request_id")
    return {
        "input_ids": token_ids,
        "sampling_params": sglang,
        "rid": rid if isinstance(rid, str) and rid else f"sim-{time.monotonic_ns()}",
        "return_logprob": params.get("logprobs") is not None,
    }


def vllm_error(status_code: int, message: str) -> Response:
    error = {"message": message, "type": "BadRequestError", "param": None, "code": status_code}
    return Response(json_bytes({"error": error}), status_code, media_type="application/json")


def vllm_response(
    request: SimRequest, output: PlannedOutput, meta: dict[str, Any], *, eos_id: int, model: str
) -> dict[str, Any]:
    """The body vLLM 0.32's /inference/v1/generate answers (output_mode tokens, logprobs 0),
    field for field in its order (GenerateTokensResponse.model_dump())."""
    ids = output.ids
    prompt_tokens = len(request.input_ids)
    logprobs = None
    if (request.body.get("sampling_params") or {}).get("logprobs") is not None:
        content = []
        for token, logprob in zip(ids, output.logprobs, strict=True):
            entry = {"token_id": token, "logprob": logprob, "rank": 1}
            content.append(entry | {"top_logprobs": [dict(entry)]})
        logprobs = {"content": content}
    finish_type, stop_reason = vllm_finish(output.finish_reason, eos_id)
    choice = {
        "index": 0,
        "finish_reason": finish_type,
        "stop_reason": stop_reason,
        "token_ids": ids,
        "routed_experts": None,
        "sampling_mask": None,
        "weight_versions": [{"version": meta["weight_version"], "start": 0, "end": len(ids)}]
        if ids
        else None,
        "logprobs": logprobs,
    }
    usage = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + len(ids),
        "completion_tokens": len(ids),
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    return {
        "request_id": f"{VLLM_ID_PREFIX}{request.rid}",
        "model": model,
        "created": int(time.time()),
        "usage": usage,
        "prompt_logprobs": None,
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": None,
        "mm_placeholders": None,
        "metrics": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "output_mode": "tokens",
        "choices": [choice],
    }


def vllm_server_info(max_model_len: int) -> dict[str, Any]:
    """vLLM's dev-mode `GET /server_info?config_format=json`, the part the service reads: the
    engine's config, here a server started with `--logprobs-mode processed_logprobs`."""
    model_config = {"max_model_len": max_model_len, "logprobs_mode": "processed_logprobs"}
    return {"vllm_config": {"model_config": model_config}, "vllm_env": {}, "system_env": {}}
