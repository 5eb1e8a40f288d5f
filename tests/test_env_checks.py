"""What the service accepts of an environment's `info`, transcript and tools as storable JSON, and
what it says of the rest: the same answer whether or not the fast path (orjson's encode, then a walk
of exact JSON types) takes the value."""

from __future__ import annotations

import dataclasses
import enum
import uuid
from typing import Any

import pytest

from service.envs.checks import MAX_INFO_DEPTH, json_problem


class Colour(enum.Enum):
    RED = 1


class Level(enum.IntEnum):
    HIGH = 2


class Name(str):
    pass


@dataclasses.dataclass
class Point:
    x: int = 1


def nested(levels: int) -> Any:
    value: Any = "leaf"
    for _ in range(levels):
        value = [value]
    return value


ACCEPTED = {
    "JSON's own types": {"a": [1, 2.5, True, None, "text"], "b": ("tuple", {"c": {}})},
    "an int past 64 bits (orjson refuses it)": {"big": 2**70},
    "subclasses of int and str (as json.dumps writes them)": {"level": Level.HIGH, "name": Name("x")},
    "a str subclass as a key": {Name("key"): 1},
    "nested as deep as allowed": nested(MAX_INFO_DEPTH),
}
REFUSED = {  # the value, and what the check says of it
    "NaN": ({"score": float("nan")}, "w['score'] is nan: only finite numbers are stored"),
    "infinity in a list": ([1.0, float("inf")], "w[1] is inf: only finite numbers are stored"),
    "a lone surrogate": ({"t": ["ok", "a\ud800"]}, "w['t'][1] holds a lone surrogate \\ud800"),
    "a lone surrogate in a key": ({"k\udc00": 1}, "w key 'k\\udc00' holds a lone surrogate \\udc00"),
    "an int key": ({1: "one"}, "w has a key 1 of type int: JSON keys are strings"),
    "an enum (orjson writes its value)": ({"c": Colour.RED}, "w['c'] is a tests.test_env_checks.Colour"),
    "a dataclass (orjson writes it)": ([Point()], "w[0] is a tests.test_env_checks.Point, not JSON"),
    "a UUID (orjson writes it)": ({"id": uuid.UUID(int=1)}, "w['id'] is a uuid.UUID, not JSON"),
    "bytes": ({"raw": b"x"}, "w['raw'] is a builtins.bytes, not JSON"),
    "nested too deep": (nested(MAX_INFO_DEPTH + 1), f"is nested deeper than {MAX_INFO_DEPTH} levels"),
}


@pytest.mark.parametrize("case", ACCEPTED)
def test_storable_json_is_accepted(case: str) -> None:
    assert json_problem(ACCEPTED[case], "w") is None


@pytest.mark.parametrize("case", REFUSED)
def test_anything_else_is_refused_naming_where(case: str) -> None:
    value, said = REFUSED[case]
    problem = json_problem(value, "w")
    assert problem is not None and said in problem, problem
