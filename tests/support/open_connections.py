"""A test that closes an event loop while a connection of that loop is still open fails, naming
the connection and where it was opened; so does one that closes a loop with a task still pending.

Nothing closes such a connection but the garbage collector, whose ResourceWarning ("unclosed
transport", or "unclosed <socket.socket ...>" when it finalizes the socket first) is an error under
the suite's warnings filter and fails whichever test is running when it collects: a test of
another module, at random. Here the test that left it fails, every time. (The hooks' client of
tests/test_slime_hooks.py was one: kept per event loop, its connections stayed open in each test's
closed loop.)

It watches asyncio's selector event loops (pytest-asyncio's, and any a test makes); uvloop's are
not (the benches' smoke tests run theirs, in the test's process, on uvloop). Registered by
tests/conftest.py.
"""

from __future__ import annotations

import asyncio
import sys
import weakref
from asyncio import selector_events
from collections.abc import Iterator
from typing import Any

import pytest

# Where each transport was made: the test that was running, and the innermost frames (those of the
# suite and the service first: a connection opened by a library's own task, anyio's connect for
# httpx, has no frame of ours). The transport keeps no record of it. Frames walked by hand, not
# traceback.extract_stack: that reads every frame's source line, at every connection the suite makes.
_made_at: weakref.WeakKeyDictionary[Any, tuple[str, list[str]]] = weakref.WeakKeyDictionary()
_left_open: list[str] = []
_running = ["(no test)"]
SITE_FRAMES = 4


def _opened_here() -> tuple[str, list[str]]:
    ours, theirs = [], []
    frame = sys._getframe(2)
    while frame is not None and len(ours) < SITE_FRAMES:
        filename = frame.f_code.co_filename
        where = f"{filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        if "/site-packages/" not in filename and "/asyncio/" not in filename and "<frozen" not in filename:
            ours.append(where)
        elif len(theirs) < SITE_FRAMES and "/asyncio/" not in filename:
            theirs.append(where)
        frame = frame.f_back
    return _running[0], ours or theirs


def _watch() -> None:
    # asyncio's own classes, patched: the loop and transport expose no hook for this.
    transport_init = selector_events._SelectorTransport.__init__
    loop_close = selector_events.BaseSelectorEventLoop.close

    def init(self: Any, loop: Any, sock: Any, *args: Any, **kwargs: Any) -> None:
        transport_init(self, loop, sock, *args, **kwargs)
        _made_at[self] = _opened_here()

    def close(self: asyncio.AbstractEventLoop) -> None:
        if not self.is_running() and not self.is_closed():
            # A task still pending is dropped mid-way: whatever it was connecting or holding stays
            # open (asyncio.run and pytest-asyncio cancel them first and let them clean up).
            for task in asyncio.all_tasks(self):
                _left_open.append(f"a task still pending, during {_running[0]}: {task!r}\n")
            for transport, made_at in list(_made_at.items()):
                sock = transport._sock
                if transport._loop is self and sock is not None:
                    try:
                        peer = sock.getpeername()
                    except OSError:
                        peer = "(not connected)"
                    test, frames = made_at
                    site = "".join(f"  {frame}\n" for frame in frames)
                    _left_open.append(
                        f"a connection to {peer}, opened during {test} at (innermost first):\n{site}"
                    )
        loop_close(self)

    selector_events._SelectorTransport.__init__ = init  # type: ignore[method-assign]
    selector_events.BaseSelectorEventLoop.close = close  # type: ignore[method-assign]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """Fails the test's teardown (after its fixtures' own, which close its loop) if a loop closed
    during the test with a connection or a task of it still open."""
    yield
    if _left_open:
        found = "\n".join(_left_open)
        _left_open.clear()
        pytest.fail(f"an event loop was closed with this still open in it:\n{found}", pytrace=False)


def pytest_runtest_setup(item: pytest.Item) -> None:
    _running[0] = item.nodeid
    _left_open.clear()  # a loop closed between tests is no test's


_watch()
