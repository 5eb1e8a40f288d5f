"""What the client raises."""

from __future__ import annotations

from typing import Any


class RolloutError(Exception):
    """Base of the client's errors."""


class RequestError(RolloutError):
    """The service refused the request (4xx): retrying it unchanged cannot help."""

    def __init__(self, status_code: int, message: str, body: Any = None) -> None:
        super().__init__(f"HTTP {status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.body = body


class ServiceUnavailable(RolloutError):
    """The service did not answer (connection errors, 5xx) through every retry."""


class WaitTimeout(RolloutError):
    """The batch was not complete within the wait's timeout."""
