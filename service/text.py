"""What text every database stores intact, stated once for the request types (service/api/values.py),
the env answer checks (service/envs/checks.py) and the column guard (service/storage/models.py):
Unicode text, so no lone surrogate (half of a \\ud800-\\udfff pair has no UTF-8 form), and, in a text
column, no NUL (PostgreSQL's text cannot hold U+0000; SQLite can, so a NUL would be stored on one
database and fail on the other)."""

from __future__ import annotations

import re
from typing import Literal

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
