"""`Authorization: Bearer <key>`, read alike for the API keys (middleware.py, access.py; the table
of keys is config.KeyTable) and for an external agent's episode token (service/agents/deps.py)."""

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


def is_one_of(key: bytes, keys: Sequence[bytes]) -> bool:
    """Whether `key` is one of `keys`: compared against every key, without an early exit, in
    constant time per key."""
    matches = [hmac.compare_digest(key, candidate) for candidate in keys]
    return any(matches)
