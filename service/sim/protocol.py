"""What both protocols of the simulated worker share: its HTTP errors, its JSON bytes, its request log."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


class SimHTTPError(Exception):
    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message


def json_bytes(value: Any) -> bytes:
    # SGLang answers with orjson, vLLM with Starlette's JSONResponse: both compact and UTF-8.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


@dataclass
class SimRequest:
    """What one POST /generate carried, and what it was answered (for tests and benchmarks)."""

    body: dict[str, Any]
    rid: str
    input_ids: list[int]
    sampling_params: dict[str, Any]
    response_body: bytes | None = None
