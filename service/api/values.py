"""What the fields of a request may hold: Unicode text and finite JSON numbers, nested a bounded
depth. Whatever is accepted is stored and read back intact on every database; the rest is a 422
naming the field.

Two rules, each stated once here:
- `Text`, every str field a request names: Unicode text (no lone surrogate, which has no UTF-8
  form). Free-form JSON (`storable_json`: metadata, info, agents' messages) keeps the same rule at
  any depth, and refuses NaN, infinities and nesting past the bound. NUL is text: JSON escapes it.
- `Label`, a `Text` the service keeps in a text column of its own (an env name, a split, a query
  filter on them, an agent's error): no NUL either. PostgreSQL's text cannot hold U+0000 (SQLite
  can), so a NUL there would be a 500 on one database and stored on the other; both refuse it.
  service/storage/models.py's `TextColumn` keeps the same rule at the columns themselves."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BeforeValidator, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from service.text import plain_json, unstorable

MAX_JSON_DEPTH = 32  # nesting of a free-form JSON value (metadata): objects and arrays


def field_error(location: Sequence[str | int], kind: str, message: str, value: Any) -> ValidationError:
    """A validation error at `location` (relative to the field or model validated), for validators
    whose problem lies deeper than the value pydantic handed them."""
    detail = InitErrorDetails(type=PydanticCustomError(kind, message), loc=tuple(location), input=value)
    return ValidationError.from_exception_data("request", [detail])


def text_problem(text: str) -> str | None:
    """Why `text` cannot be part of a stored JSON value, or None."""
    found = unstorable(text, column=False)
    if found is None:
        return None
    _, at, char = found
    return (
        f"lone surrogate \\u{ord(char):04x} at character {at}: not Unicode text "
        "(a \\ud800-\\udfff escape is half of a pair)"
    )


def label_problem(text: str) -> tuple[str, str] | None:
    """(error type, message) of why `text` cannot be kept in a text column, or None."""
    problem = text_problem(text)
    if problem is not None:
        return "lone_surrogate", problem
    found = unstorable(text, column=True)
    if found is None:
        return None
    return "nul_character", f"NUL (\\u0000) at character {found[1]}: text fields cannot hold it"


def escaped(text: str) -> str:
    """`text` with any lone surrogate written as its escape (\\ud800), for error messages."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _check_text(text: str) -> str:
    problem = text_problem(text)
    if problem is not None:
        raise PydanticCustomError("lone_surrogate", problem)
    return text


def _check_label(text: str) -> str:
    problem = label_problem(text)
    if problem is not None:
        raise PydanticCustomError(*problem)
    return text


Text = Annotated[str, AfterValidator(_check_text)]  # every str field of a request (module docstring)
Label = Annotated[str, AfterValidator(_check_label)]  # a str the service keeps in a text column


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


J = TypeVar("J", dict[str, Any], list[dict[str, Any]])


def storable_json(value: J) -> J:
    """Validator of a free-form JSON object (or list of them): refuses lone surrogates (in keys and values),
    NaN and infinities, and nesting past MAX_JSON_DEPTH, naming where. Most values have no problem:
    orjson checks their every text at once and a walk without locations the rest (an agent's
    messages and tools, every call: the walk that names where was a twentieth of the service's
    CPU per call in bench/verifiers_envs.py); the walk that names where runs on the others."""
    if plain_json(value, MAX_JSON_DEPTH):
        return value
    found = _problem(value, [], 1)
    if found is not None:
        location, kind, message = found
        raise field_error(location, kind, message, value)
    return value
