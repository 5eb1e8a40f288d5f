"""Runs a scripts/ensure_*.sh that keeps a cached virtualenv of its own (scripts/cached_venv.sh) and
reads the `key=value` lines it prints (`python=...`, ...)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def ensure_cached_venv(script: str, what: str, timeout_seconds: float) -> dict[str, str]:
    """What scripts/`script` printed; skips the test with its reason where `what` cannot be had
    here (exit 3), and fails instead on CI (the script exits 1 there)."""
    done = subprocess.run(
        [str(ROOT / "scripts" / script)],
        capture_output=True,
        text=True,
        timeout=timeout_seconds,
        check=False,
    )
    if done.returncode == 3:
        pytest.skip(f"{what} unavailable: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, f"scripts/{script} failed ({done.returncode}):\n{done.stderr[-4000:]}"
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
