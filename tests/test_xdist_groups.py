"""The suite's xdist grouping (tests/conftest.py): a test sharing a module-scoped fixture carries
its module's xdist_group, and under `-n N --dist=loadgroup` (make test) xdist has named that group
in its node id, which is what sends the module's tests to one worker (a vLLM server started once)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import shared_group


@pytest.fixture(scope="module")
def shared() -> Iterator[str]:
    yield "built once per worker"


def test_a_test_sharing_a_module_fixture_is_grouped_with_its_module(
    shared: str, request: pytest.FixtureRequest
) -> None:
    group = request.module.__name__
    mark = request.node.get_closest_marker("xdist_group")
    assert mark is not None and mark.args == (group,)
    if hasattr(request.config, "workerinput") and request.config.getvalue("loadgroup"):  # on a worker
        assert request.node.nodeid.endswith(f"@{group}"), request.node.nodeid


def test_a_test_sharing_nothing_is_not_grouped(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("xdist_group") is None
    assert "@" not in request.node.nodeid


@pytest.fixture(scope="session")
@shared_group
def shared_across_modules() -> Iterator[str]:
    yield "built once per run"


def test_a_test_sharing_a_shared_group_fixture_is_in_its_group_whatever_its_module(
    shared_across_modules: str, shared: str, request: pytest.FixtureRequest
) -> None:
    """The fixture's group, not the module's (its module-scoped fixture notwithstanding): the other
    modules using the fixture join the same group."""
    mark = request.node.get_closest_marker("xdist_group")
    assert mark is not None and mark.args == ("shared_across_modules",)
    if hasattr(request.config, "workerinput") and request.config.getvalue("loadgroup"):
        assert request.node.nodeid.endswith("@shared_across_modules"), request.node.nodeid


def test_the_long_tests_come_first(request: pytest.FixtureRequest) -> None:
    """Every test, or group, with a slow test in it comes before the others in the collection (whose
    order xdist follows once the groups of several tests are handed out; tests/conftest.py)."""
    slow_groups = {
        mark.args[0]
        for item in request.session.items
        if item.get_closest_marker("slow") and (mark := item.get_closest_marker("xdist_group"))
    }
    slow = [
        bool(item.get_closest_marker("slow"))
        or getattr(item.get_closest_marker("xdist_group"), "args", (None,))[0] in slow_groups
        for item in request.session.items
    ]
    assert slow == sorted(slow, reverse=True)
