"""The examples run: examples/grpo_loop.py starts its own service and simulated SGLang worker, runs
two steps and prints their statistics."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "examples"
STEP_LINE = re.compile(
    r"^step (\d): 6 episodes in 3 groups \(\d with a reward spread\), reward mean [0-9.]+ std [0-9.]+, "
    r"\|advantage\| mean [0-9.]+, tokens (\d+) \((\d+) trained\), \{.*\}, [0-9.]+ s$"
)


@pytest.mark.slow
def test_grpo_loop_runs_against_a_local_service() -> None:
    command = [
        sys.executable,
        str(EXAMPLES_DIR / "grpo_loop.py"),
        "--steps",
        "2",
        "--tasks",
        "3",
        "--samples",
        "2",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=EXAMPLES_DIR.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [match for line in done.stdout.splitlines() if (match := STEP_LINE.match(line))]
    assert [int(match.group(1)) for match in steps] == [0, 1], done.stdout
    assert all(0 < int(match.group(3)) < int(match.group(2)) for match in steps)  # some tokens are context
