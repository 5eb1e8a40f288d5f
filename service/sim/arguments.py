"""Arguments valid for a tool's JSON Schema, drawn from a seeded RNG: what the simulated worker's
generic policy sends to any environment's tools. Covers the schema keywords tools use (type, enum,
const, properties/required, items/minItems/maxItems, minimum/maximum, minLength/maxLength, anyOf/
oneOf/allOf); `pattern` and `format` are not honoured."""

from __future__ import annotations

import random
from typing import Any

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")
MAX_DEPTH = 8  # nested objects and arrays generated; deeper optional parts are left out


def value_for(schema: Any, rng: random.Random, depth: int = 0) -> Any:
    """A value valid for `schema` (a JSON Schema dict; True or {} accept anything)."""
    if not isinstance(schema, dict):
        return "x"
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return rng.choice(schema["enum"])
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            return value_for(schema[key][0], rng, depth)
    if schema.get("allOf"):
        merged: dict[str, Any] = {}
        for part in schema["allOf"]:
            if isinstance(part, dict):
                merged |= part
        return value_for(merged | {k: v for k, v in schema.items() if k != "allOf"}, rng, depth)
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"] or ["null"]
        kind = kinds[0]
    if kind is None:
        kind = "object" if "properties" in schema else "array" if "items" in schema else "string"
    if kind == "object":
        return _object(schema, rng, depth)
    if kind == "array":
        return _array(schema, rng, depth)
    if kind == "integer":
        return _integer(schema, rng)
    if kind == "number":
        return float(_integer(schema, rng))
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    return _string(schema, rng)


def arguments_for(parameters: Any, rng: random.Random) -> dict[str, Any]:
    """Arguments of a tool call: a JSON object valid for the tool's `parameters` schema."""
    value = value_for(parameters if isinstance(parameters, dict) else {"type": "object"}, rng)
    return value if isinstance(value, dict) else {}


def _object(schema: dict[str, Any], rng: random.Random, depth: int) -> dict[str, Any]:
    properties = schema.get("properties") or {}
    required = [name for name in schema.get("required") or [] if isinstance(name, str)]
    chosen = list(required)
    if depth < MAX_DEPTH:
        chosen += [name for name in properties if name not in required and rng.random() < 0.5]
    return {name: value_for(properties.get(name, {}), rng, depth + 1) for name in chosen}


def _array(schema: dict[str, Any], rng: random.Random, depth: int) -> list[Any]:
    low = int(schema.get("minItems", 0))
    high = int(schema.get("maxItems", max(low, 2)))
    count = low if depth >= MAX_DEPTH else rng.randint(low, max(low, min(high, low + 2)))
    items = schema.get("items", {})
    if schema.get("uniqueItems"):
        values: list[Any] = []
        for _ in range(100 * (count + 1)):
            if len(values) == count:
                break
            candidate = value_for(items, rng, depth + 1)
            if candidate not in values:
                values.append(candidate)
        return values
    return [value_for(items, rng, depth + 1) for _ in range(count)]


def _integer(schema: dict[str, Any], rng: random.Random) -> int:
    low, high = schema.get("minimum"), schema.get("maximum")
    if (exclusive := schema.get("exclusiveMinimum")) is not None and not isinstance(exclusive, bool):
        low = exclusive + 1 if low is None else max(low, exclusive + 1)
    if (exclusive := schema.get("exclusiveMaximum")) is not None and not isinstance(exclusive, bool):
        high = exclusive - 1 if high is None else min(high, exclusive - 1)
    low = int(-(-low // 1)) if low is not None else (0 if high is None or high >= 0 else int(high) - 10)
    high = int(high // 1) if high is not None else low + 10
    value = rng.randint(low, max(low, high))
    step = schema.get("multipleOf")
    if isinstance(step, int) and step > 0:
        value = -(-low // step) * step
    return value


def _string(schema: dict[str, Any], rng: random.Random) -> str:
    low = int(schema.get("minLength", 0))
    high = int(schema.get("maxLength", max(low, 16)))
    text = rng.choice(WORDS)
    while len(text) < low:
        text += f" {rng.choice(WORDS)}"
    return text[:high] if high >= low else text
