"""The settings every test service runs with, in-process (tests/conftest.service_settings) or as an
OS process (tests/support/service_process.SERVICE_ENV): no API keys; a short lease and fast sweep
and claim loops, so that recovery happens within a test's timeouts; a connect timeout a loaded
machine does not reach."""

from __future__ import annotations

# How long the tests' PostgreSQL connections may take to open: the service's 10 s default ran out at
# load 20 on 2 cores (tests/test_api.py), where the test process (the service, its simulated engine
# and the test in one interpreter) and the server's new backend wait for a core; the admin
# connections that create and drop databases saw more than 5 s before.
CONNECT_TIMEOUT_SECONDS = 60.0

TEST_SETTINGS: dict[str, object] = {
    "api_keys": "",
    "lease_seconds": 5.0,
    "sweep_interval_seconds": 0.5,
    "claim_interval_seconds": 0.05,
    "database_connect_timeout_seconds": CONNECT_TIMEOUT_SECONDS,
}
