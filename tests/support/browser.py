"""Headless Chromium (Debian's, at /usr/bin/chromium) driven by Playwright, for the viewer's tests and
bench. `make test` installs Chromium where it can (scripts/ensure_chromium.sh); where it cannot, it
sets ROLLOUT_SKIP_BROWSER=1 and the browser tests skip with that reason. CI never skips them."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from playwright.async_api import Browser, Page, async_playwright

CHROMIUM = Path(os.environ.get("ROLLOUT_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
]
SCREENSHOTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "screenshots"
SKIP_BROWSER = os.environ.get("ROLLOUT_SKIP_BROWSER") == "1"


def require_chromium() -> None:
    if CHROMIUM.exists():
        return
    reason = f"Chromium is not installed at {CHROMIUM} (scripts/ensure_chromium.sh installs Debian's)"
    if SKIP_BROWSER:
        pytest.skip(f"{reason}; ROLLOUT_SKIP_BROWSER=1")
    pytest.fail(
        f"{reason}. Install it, or set ROLLOUT_SKIP_BROWSER=1 to skip the browser tests.", pytrace=False
    )


@asynccontextmanager
async def chromium() -> AsyncIterator[Browser]:
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield browser
        finally:
            await browser.close()


class PageErrors:
    """Uncaught errors and console errors of a page: a test asserts there are none."""

    def __init__(self, page: Page) -> None:
        self.messages: list[str] = []
        page.on("pageerror", lambda error: self.messages.append(f"page error: {error}"))
        page.on(
            "console",
            lambda message: (
                self.messages.append(f"console: {message.text}") if message.type == "error" else None
            ),
        )


async def screenshot(page: Page, name: str, *, full_page: bool = True) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    await page.screenshot(path=str(path), full_page=full_page)
    return path
