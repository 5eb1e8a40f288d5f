"""Token arrays as compact little-endian binary: ids int32, loss mask uint8, logprobs float64.
An EpisodeTokens is stored as four blobs, in columns named as its fields (TOKEN_BLOBS).

Everything round-trips exactly: logprobs are kept as the float64 values SGLang sent (float32
would round them, and the trainer contract says stored logprobs EQUAL the engine's).
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterable
from dataclasses import fields
from typing import Any

from service.records import EpisodeTokens

_INT32 = "i"
_UINT8 = "B"
_FLOAT64 = "d"
_NEEDS_SWAP = sys.byteorder != "little"

# The array typecodes above are 4/1/8 bytes on every platform CPython supports; the stored
# format depends on it, so check once rather than trust it.
ID_BYTES, MASK_BYTES, LOGPROB_BYTES = 4, 1, 8
assert array(_INT32).itemsize == ID_BYTES and array(_UINT8).itemsize == MASK_BYTES
assert array(_FLOAT64).itemsize == LOGPROB_BYTES
# The same formats as numpy dtypes, for reading blobs without a Python object per item.
ID_DTYPE, MASK_DTYPE, LOGPROB_DTYPE = "<i4", "u1", "<f8"
# The columns of an episode (and of a segment) that hold its EpisodeTokens, named as its fields.
TOKEN_BLOBS = tuple(field.name for field in fields(EpisodeTokens))


def _encode(typecode: str, values: Iterable[int] | Iterable[float]) -> bytes:
    """`values` packed as `typecode`'s items, little-endian. A list or tuple goes through struct
    (the result's arrays, once an episode: array() parses each item with a format string, about 3x
    struct's time for int32 and uint8 ids and masks, and 1.2x for float64); what struct refuses, or
    anything else, through array, so that what array refuses raises the same error as always."""
    if type(values) is list or type(values) is tuple:
        try:
            if typecode == _UINT8:
                return bytes(values)
            return struct.pack(f"<{len(values)}{typecode}", *values)
        except (struct.error, TypeError, ValueError, OverflowError):
            pass  # array raises its own error for it, as before
    packed = array(typecode, values)
    if _NEEDS_SWAP:
        packed.byteswap()
    return packed.tobytes()


def _decode(typecode: str, data: bytes) -> list[Any]:
    unpacked: array[Any] = array(typecode)
    if len(data) % unpacked.itemsize:
        raise ValueError(f"{len(data)} bytes is not a whole number of {unpacked.itemsize}-byte items")
    unpacked.frombytes(data)
    if _NEEDS_SWAP:
        unpacked.byteswap()
    return unpacked.tolist()


def encode_ids(ids: Iterable[int]) -> bytes:
    """Token ids as int32; raises OverflowError for an id outside the int32 range."""
    return _encode(_INT32, ids)


def decode_ids(data: bytes) -> list[int]:
    return _decode(_INT32, data)


def encode_mask(mask: Iterable[int]) -> bytes:
    """Loss mask (0 or 1 per response token) as uint8; raises OverflowError outside 0..255."""
    return _encode(_UINT8, mask)


def decode_mask(data: bytes) -> list[int]:
    return _decode(_UINT8, data)


def encode_logprobs(logprobs: Iterable[float]) -> bytes:
    """Logprobs as float64, exactly as given."""
    return _encode(_FLOAT64, logprobs)


def decode_logprobs(data: bytes) -> list[float]:
    return _decode(_FLOAT64, data)


def encode_tokens(tokens: EpisodeTokens) -> dict[str, bytes]:
    """The blobs to store, by column name (TOKEN_BLOBS): what `decode_tokens` reads back."""
    return {
        "prompt_ids": encode_ids(tokens.prompt_ids),
        "response_ids": encode_ids(tokens.response_ids),
        "loss_mask": encode_mask(tokens.loss_mask),
        "rollout_logprobs": encode_logprobs(tokens.rollout_logprobs),
    }


def decode_tokens(
    prompt_ids: bytes, response_ids: bytes, loss_mask: bytes | None, rollout_logprobs: bytes | None
) -> EpisodeTokens:
    """From the stored blobs, in TOKEN_BLOBS' order."""
    return EpisodeTokens(
        prompt_ids=decode_ids(prompt_ids),
        response_ids=decode_ids(response_ids),
        loss_mask=decode_mask(loss_mask or b""),
        rollout_logprobs=decode_logprobs(rollout_logprobs or b""),
    )
