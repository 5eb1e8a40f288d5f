"""Viewer: how fast the trajectory viewer shows real sizes in headless Chromium.

A finished batch of 2,000 episodes (250 groups x 8) and one episode of 30,000+ response tokens are
stored in a fresh database (as the loop stores them: tests/support/stored.py); the API alone serves
them in this process. Debian's Chromium (/usr/bin/chromium) then loads, `--repeat` times each:

- `batch_page`: /ui/#/batches/<2,000 episodes> until its first page of groups is on screen, against
  the baseline of the same page's data alone (`fetch` of GET /batches/{id}/episodes in the page);
- `token_view`: the episode's token view until every token is laid out (the page's own
  `data-render-ms`, from its request to the frame after), against the baseline of fetching
  GET /episodes/{id}/tokens alone;
- `longest_task_ms`: the longest main-thread task while either renders (the page "freezes" that long).

Run from the repo root:
    .venv/bin/python bench/viewer.py [--groups 250] [--tokens 30400] [--repeat 5]
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import fresh_database  # noqa: E402
from service.app import create_app  # noqa: E402
from service.config import Settings  # noqa: E402
from service.serving import serve_app  # noqa: E402
from service.storage.db import Database  # noqa: E402
from tests.support.browser import chromium  # noqa: E402
from tests.support.stored import store_finished_batch  # noqa: E402

SAMPLES = 8
TURNS = 40
GOAL = "a 2,000-episode batch lists without freezing; a 30,000-token view renders in under a second"
# Long main-thread tasks (over 50 ms, Chrome's Long Tasks API), collected from the page's start.
LONG_TASKS = """
window.longTasks = [];
new PerformanceObserver((list) => {
  for (const entry of list.getEntries()) window.longTasks.push(entry.duration);
}).observe({ type: "longtask", buffered: true });
"""
FETCH_MS = """async (path) => {
  const started = performance.now();
  const response = await fetch(path);
  await response.json();
  return performance.now() - started;
}"""


async def measure(url: str, batch_id: str, episode_id: str, repeat: int) -> dict[str, Any]:
    runs: dict[str, list[float]] = {
        name: [] for name in ("batch_page", "batch_fetch", "token_view", "token_fetch", "longest_task")
    }
    async with chromium() as browser:
        for _ in range(repeat):
            page = await browser.new_page(viewport={"width": 1280, "height": 900})
            await page.add_init_script(LONG_TASKS)
            await page.goto(f"{url}/ui/")
            await page.locator("#main table").wait_for()
            runs["batch_fetch"].append(await page.evaluate(FETCH_MS, f"/batches/{batch_id}/episodes"))
            started = await page.evaluate("performance.now()")
            await page.evaluate(f"location.hash = '#/batches/{batch_id}'")
            await page.locator(".group-row").first.wait_for()
            await page.evaluate("new Promise(requestAnimationFrame)")
            runs["batch_page"].append(await page.evaluate("performance.now()") - started)

            runs["token_fetch"].append(await page.evaluate(FETCH_MS, f"/episodes/{episode_id}/tokens"))
            await page.evaluate(f"location.hash = '#/episodes/{episode_id}?tab=tokens'")
            rendered = page.locator("#tokens[data-render-ms]")
            await rendered.wait_for(timeout=60_000)
            runs["token_view"].append(float(await rendered.get_attribute("data-render-ms") or "nan"))
            runs["longest_task"].append(max(await page.evaluate("window.longTasks"), default=0.0))
            await page.close()
    median = {name: round(statistics.median(values), 1) for name, values in runs.items()}
    return {
        "batch_page_ms": median["batch_page"],
        "batch_fetch_ms": median["batch_fetch"],
        "batch_page_vs_fetch": round(median["batch_page"] / median["batch_fetch"], 2),
        "token_view_ms": median["token_view"],
        "token_fetch_ms": median["token_fetch"],
        "token_view_vs_fetch": round(median["token_view"] / median["token_fetch"], 2),
        "longest_task_ms": median["longest_task"],
        "runs": {name: [round(value, 1) for value in values] for name, values in runs.items()},
    }


async def bench(url: str, groups: int, tokens: int, repeat: int) -> dict[str, Any]:
    database = Database.open(url)
    try:
        batch_id, _ = await store_finished_batch(database, groups, SAMPLES, tokens=120, turns=3)
        _, (episode_id,) = await store_finished_batch(database, 1, 1, tokens=tokens, turns=TURNS, seed=1)
    finally:
        await database.dispose()
    app = create_app(Settings(database_url=url, run_worker=False, api_keys="", tune_gc=False))
    async with serve_app(app) as served:
        return await measure(served, batch_id, episode_id, repeat)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=250, help="of 8 episodes each")
    parser.add_argument("--tokens", type=int, default=30_400, help="the long episode's response, about")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, fresh_database("sqlite", Path(tmp), migrate=True) as url:
        figures = asyncio.run(bench(url, args.groups, args.tokens, args.repeat))
    result = {
        "bench": "viewer",
        "episodes": args.groups * SAMPLES,
        "response_tokens": args.tokens,
        "goal": GOAL,
        **figures,
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
