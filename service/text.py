"""What text every database stores intact, stated once for the request types (service/api/values.py),
the env answer checks (service/envs/checks.py) and the column guard (service/storage/models.py):
Unicode text, so no lone surrogate (half of a \\ud800-\\udfff pair has no UTF-8 form), and, in a text
column, no NUL (PostgreSQL's text cannot hold U+0000; SQLite can, so a NUL would be stored on one
database and fail on the other). In JSON text, no NaN or infinity (json.dumps writes them, SQLite
stores them, PostgreSQL refuses them), checked by `all_finite` for the request types, the env answer
checks and the JSON columns' writer (service/storage/db.py's json_text)."""

from __future__ import annotations

import math
import re
import sys
from typing import Any, Literal

import orjson

_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_OR_NUL = re.compile("[\x00\ud800-\udfff]")

Problem = Literal["lone surrogate", "NUL"]


def unstorable(text: str, *, column: bool) -> tuple[Problem, int, str] | None:
    """The first character of `text` no database stores (in a text column when `column`, NUL too):
    (what it is, its index, the character), or None."""
    match = (_SURROGATE_OR_NUL if column else _SURROGATE).search(text)
    if match is None:
        return None
    char = match.group()
    return ("NUL" if char == "\x00" else "lone surrogate"), match.start(), char


def replace_unstorable(text: str) -> str:
    """`text` with every character a text column cannot hold replaced by U+FFFD."""
    return _SURROGATE_OR_NUL.sub("\ufffd", text)


def all_finite(value: Any, max_depth: int = sys.maxsize, *, json_types_only: bool = False) -> bool:
    """Whether no float in `value` is NaN or infinite and no dict, list or tuple in it nests deeper
    than `max_depth` levels (`value` itself is level 1). Only dicts, lists, tuples and floats of
    those exact types are looked at: parsed JSON has no subclass, and the JSON columns' writer
    hands a value with one to json.dumps. On hot paths: an agent's messages and tools at every call,
    after orjson checked their text (plain_json); a JSON column's value that orjson wrote with a null
    in it. With `json_types_only`, also whether every other value is exactly a str, int, bool or None."""
    return _all_finite(value, max_depth, 1, _JSON_SCALARS if json_types_only else None)


def plain_json(value: Any, max_depth: int, *, json_types_only: bool = False) -> bool:
    """Whether `value` is storable JSON, by the fast way: orjson writes it (which checks every
    string and key at once: no lone surrogate, every key a str) and `all_finite` holds. Most values
    are; False says only that a walk naming the place has to look (orjson also refuses an int past
    64 bits, and `json_types_only` a subclass json.dumps would write). The request types' check of
    free-form JSON (service/api/values.py) and the env answer checks (service/envs/checks.py)."""
    try:
        orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError is one
        return False
    return all_finite(value, max_depth, json_types_only=json_types_only)


_JSON_SCALARS: frozenset[type] = frozenset({str, int, bool, type(None)})


def _all_finite(value: Any, max_depth: int, depth: int, scalars: frozenset[type] | None) -> bool:
    kind = type(value)
    if kind is dict:
        items: Any = value.values()
    elif kind is list or kind is tuple:
        items = value
    elif kind is float:
        return math.isfinite(value)
    else:
        return scalars is None or kind in scalars
    if depth > max_depth:
        return False
    for item in items:
        kind = type(item)
        if kind is float:
            if not math.isfinite(item):
                return False
        elif kind is dict or kind is list or kind is tuple:
            if not _all_finite(item, max_depth, depth + 1, scalars):
                return False
        elif scalars is not None and kind not in scalars:
            return False
    return True
