"""What the free-form fields of a request may hold: Unicode text and finite JSON numbers, nested a
bounded depth. Whatever is accepted is stored, and read back as JSON, on every database."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

MAX_JSON_DEPTH = 32  # nesting of a free-form JSON value (metadata): objects and arrays

# A lone surrogate: JSON's "\ud800" escape without its pair. It is no character, so a str holding
# one has no UTF-8 form: it can be stored, but no answer that contains it can be encoded.
_SURROGATE = re.compile("[\ud800-\udfff]")


def field_error(location: Sequence[str | int], kind: str, message: str, value: Any) -> ValidationError:
    """A validation error at `location` (relative to the field or model validated), for validators
    whose problem lies deeper than the value pydantic handed them."""
    detail = InitErrorDetails(type=PydanticCustomError(kind, message), loc=tuple(location), input=value)
    return ValidationError.from_exception_data("request", [detail])


def text_problem(text: str) -> str | None:
    match = _SURROGATE.search(text)
    if match is None:
        return None
    return (
        f"lone surrogate \\u{ord(match.group()):04x} at character {match.start()}: not Unicode text "
        "(a \\ud800-\\udfff escape is half of a pair)"
    )


def escaped(text: str) -> str:
    """`text` with any lone surrogate written as its escape (\\ud800), for error messages."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _check_text(text: str) -> str:
    problem = text_problem(text)
    if problem is not None:
        raise PydanticCustomError("lone_surrogate", problem)
    return text


Text = Annotated[str, AfterValidator(_check_text)]  # a str field of a request


def _json_integer(value: Any) -> Any:
    # JSON Schema's integer is a number without a fraction, 6.0 too; the strict int validation after
    # this refuses the rest: booleans, strings, fractions.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# An int of a (strict) request model. Its constraints go before it: Annotated[int, Field(ge=0),
# JSON_INTEGER], else pydantic leaves them out of the JSON schema of a list item or an optional.
JSON_INTEGER = BeforeValidator(_json_integer)
Integer = Annotated[int, JSON_INTEGER]


def _problem(value: Any, location: list[str | int], depth: int) -> tuple[list[str | int], str, str] | None:
    """The first unstorable part of a JSON value: (where, error type, message)."""
    if isinstance(value, str):
        problem = text_problem(value)
        return None if problem is None else (location, "lone_surrogate", problem)
    if isinstance(value, float) and not math.isfinite(value):
        name = "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
        return location, "finite_number", f"{name} is not a JSON number: only finite numbers are stored"
    if isinstance(value, dict | list):
        if depth > MAX_JSON_DEPTH:
            return location, "too_deep", f"nested deeper than {MAX_JSON_DEPTH} levels"
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str) and (problem := text_problem(key)) is not None:
                return [*location, escaped(key)], "lone_surrogate", f"key: {problem}"
            found = _problem(item, [*location, key], depth + 1)
            if found is not None:
                return found
    return None


def storable_json(value: dict[str, Any]) -> dict[str, Any]:
    """Validator of a free-form JSON object: refuses lone surrogates (in keys and values),
    NaN and infinities, and nesting past MAX_JSON_DEPTH, naming where."""
    found = _problem(value, [], 1)
    if found is not None:
        location, kind, message = found
        raise field_error(location, kind, message, value)
    return value
