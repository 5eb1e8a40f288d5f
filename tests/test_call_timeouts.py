"""service/call_timeouts.py: many calls' timeouts of one length, on one timer."""

from __future__ import annotations

import asyncio
import logging

import pytest

from service.call_timeouts import CallTimeouts


async def test_a_call_expires_once_its_length_has_passed_and_not_after_it_ended() -> None:
    timeouts = CallTimeouts(0.2)
    expired: list[str] = []
    loop = asyncio.get_running_loop()
    started = loop.time()
    timeouts.add("slow", lambda: expired.append(f"slow {loop.time() - started:.2f}"))
    timeouts.add("done", lambda: expired.append("done"))
    await asyncio.sleep(0.05)
    timeouts.discard("done")  # it ended in time
    timeouts.add("later", lambda: expired.append("later"))
    await asyncio.sleep(0.18)
    assert [entry.split()[0] for entry in expired] == ["slow"] and len(timeouts) == 1
    assert 0.2 <= float(expired[0].split()[1]) <= 0.2 + timeouts.period + 0.05
    await asyncio.sleep(0.1)
    assert [entry.split()[0] for entry in expired] == ["slow", "later"]
    assert len(timeouts) == 0 and timeouts._sweep is None  # no timer while nothing runs


async def test_one_expiry_that_raises_spares_the_others(caplog: pytest.LogCaptureFixture) -> None:
    timeouts = CallTimeouts(0.05)
    expired: list[int] = []

    def broken() -> None:
        raise RuntimeError("cannot stop")

    timeouts.add(1, broken)
    timeouts.add(2, lambda: expired.append(2))
    with caplog.at_level(logging.ERROR, logger="service.call_timeouts"):
        await asyncio.sleep(0.12)
    assert expired == [2] and "cannot stop" in caplog.text
    timeouts.add(3, lambda: expired.append(3))  # the sweep goes on
    await asyncio.sleep(0.12)
    assert expired == [2, 3]


async def test_close_stops_the_sweep() -> None:
    timeouts = CallTimeouts(0.05)
    expired: list[int] = []
    timeouts.add(1, lambda: expired.append(1))
    timeouts.close()
    await asyncio.sleep(0.1)
    assert expired == [] and timeouts._sweep is None


def test_a_length_must_be_positive() -> None:
    with pytest.raises(ValueError, match="must be > 0 s"):
        CallTimeouts(0)


def test_calls_on_a_later_event_loop_expire_too() -> None:
    """A long-lived owner (an env host, an engine transport) may outlive the loop it was first used
    on: the first loop's sweep is gone with it, so the next loop's first call starts its own."""
    timeouts = CallTimeouts(0.05)
    expired: list[str] = []

    async def call(name: str, seconds: float) -> None:
        timeouts.add(name, lambda: expired.append(name))
        await asyncio.sleep(seconds)

    asyncio.run(call("ended", 0.0))  # its loop closes with the sweep still scheduled
    assert timeouts._sweep is not None
    timeouts.discard("ended")
    asyncio.run(call("second loop", 0.12))
    assert expired == ["second loop"]
