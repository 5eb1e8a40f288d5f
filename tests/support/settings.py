"""The settings every test service runs with, in-process (tests/conftest.service_settings) or as an
OS process (tests/support/service_process.SERVICE_ENV): no API keys; a short lease and fast sweep
and claim loops, so that recovery happens within a test's timeouts."""

from __future__ import annotations

TEST_SETTINGS: dict[str, object] = {
    "api_keys": "",
    "lease_seconds": 5.0,
    "sweep_interval_seconds": 0.5,
    "claim_interval_seconds": 0.05,
}
