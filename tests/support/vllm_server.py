"""A real vLLM server on the CPU for tests/test_vllm_real.py: scripts/ensure_vllm.sh's cached
virtualenv and tiny random-weight model, served on a free loopback port for the test session."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.cached_venv import ensure_cached_venv
from tests.support.ports import free_port

START_TIMEOUT_SECONDS = 300.0  # seen here: 26 s on an idle machine, about a minute under load
ENSURE_TIMEOUT_SECONDS = 1800.0  # a first build downloads about 1 GB
# 131,072 tokens of this model: 16 requests at the full context. vLLM allocates and zeroes it at
# start: with 1 GiB (VLLM_CPU_KVCACHE_SPACE=1) its engine init took 4.3 s on a busy machine,
# 0.5 s with this.
KV_CACHE_BYTES = "128M"
MAX_MODEL_LEN = 8192  # the context test fills it with a prompt of 8,100 tokens
# A call seeded with PACED_SEED samples at most one token each PACE_SECONDS (tests/support/vllm_pacing.py).
PACED_SEED = 20_291
PACE_SECONDS = 0.01


@dataclass(frozen=True)
class VLLMServer:
    url: str
    model: str  # the model directory (its tokenizer is the service's test tokenizer)
    log: Path  # its output: --enable-log-requests logs "Added request <engine id>" as each arrives

    def added(self, engine_id_part: str) -> int:
        """How many requests whose engine id holds `engine_id_part` the engine has taken so far."""
        text = self.log.read_text(errors="replace")
        return sum(1 for line in text.splitlines() if "Added request" in line and engine_id_part in line)


def ensure_vllm() -> tuple[str, str]:
    """(the vLLM venv's python, the model directory) from scripts/ensure_vllm.sh; skips the test
    with its reason where vLLM cannot be had here, and fails instead on CI."""
    values = ensure_cached_venv("ensure_vllm.sh", "real vLLM", ENSURE_TIMEOUT_SECONDS)
    return values["python"], values["model"]


@contextmanager
def vllm_server(log_path: Path) -> Iterator[VLLMServer]:
    """`python -m vllm.entrypoints.openai.api_server` with the generate and abort routes
    (--enable-scale-out), the pause routes (VLLM_SERVER_DEV_MODE=1), float32 weights (so that its
    own scoring is a tight check), the logprobs of the distribution it samples from, and the pacing
    of calls seeded with PACED_SEED."""
    python, model = ensure_vllm()
    port = free_port()
    env = os.environ | {
        "VLLM_SERVER_DEV_MODE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_LOGGING_LEVEL": "INFO",
        # Its uvicorn keeps an idle connection 5 s by default: on a loaded machine (its event loop
        # stalled, the timer late) it closed one as a test's /metrics poll reused it ("Server
        # disconnected without sending a response", the keep-mode pause test). Longer than any pause
        # between a test's calls; the service's own control client drops idle ones after 4 s.
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "75",
        "PYTHONPATH": str(Path(__file__).parent),  # vllm_pacing, alone: vLLM's venv has nothing of ours
        "ROLLOUT_TEST_PACED_SEED": str(PACED_SEED),
        "ROLLOUT_TEST_PACE_SECONDS": str(PACE_SECONDS),
        # The model runs in the engine-core process on one thread, not in a worker process of its own
        # (vLLM's CPU default, there to bind OpenMP threads to cores; it bound one here too): one
        # interpreter less to import torch and vLLM into, and no hand-over between two processes at
        # every step. tests/test_vllm_real.py's CPU, its processes included: 109 s -> 55 s.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "OMP_NUM_THREADS": "1",
    }
    command = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--served-model-name", "tiny", "--dtype", "float32",
        "--host", "127.0.0.1", "--port", str(port),
        "--enable-scale-out", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
        "--logprobs-mode", "processed_logprobs", "--enable-log-requests",
        "--kv-cache-memory-bytes", KV_CACHE_BYTES, "--logits-processors", "vllm_pacing:Pacer",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while True:
            assert process.poll() is None, f"vLLM exited ({process.returncode}):\n{_tail(log_path)}"
            assert time.monotonic() < deadline, (
                f"vLLM did not answer in {START_TIMEOUT_SECONDS:g} s:\n{_tail(log_path)}"
            )
            try:
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        yield VLLMServer(url, model, log_path)
    finally:
        _stop(process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """The server and its engine-core child: its own process group (start_new_session)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
    try:  # a child left behind in the group
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
