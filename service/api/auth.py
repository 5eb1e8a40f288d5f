"""`Authorization: Bearer <key>`, checked alike for the API keys (middleware.py) and for an
external agent's episode token (service/agents/deps.py)."""

from __future__ import annotations

import hmac
from collections.abc import Sequence


def bearer_key(authorization: bytes) -> bytes | None:
    """The key of a Bearer authorization header; None for another scheme or no key."""
    scheme, _, key = authorization.partition(b" ")
    key = key.strip()
    if scheme.lower() != b"bearer" or not key:
        return None
    return key


def authorized(authorization: bytes, keys: Sequence[bytes]) -> bool:
    """Whether the header carries one of `keys`: compared against every key, without an early
    exit, in constant time per key."""
    key = bearer_key(authorization)
    if key is None:
        return False
    matches = [hmac.compare_digest(key, candidate) for candidate in keys]
    return any(matches)
