#!/usr/bin/env bash
# `make demo-vllm`: one batch end to end against a real vLLM on the CPU (scripts/ensure_vllm.sh's
# cached virtualenv and tiny random-weight model; the first run builds them, a few minutes), on SQLite.
# VLLM_PORT (default 30001) is where vLLM listens, with the tests' 128 MiB KV cache
# (tests/support/vllm_server.py: 32 requests at this context); the arguments go to `python -m service demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
paths=$(scripts/ensure_vllm.sh)
python=$(sed -n 's/^python=//p' <<<"$paths")
model=$(sed -n 's/^model=//p' <<<"$paths")
port=${VLLM_PORT:-30001}
log=$(mktemp -t vllm-demo.XXXXXX.log)
echo "starting vLLM on 127.0.0.1:$port (log: $log)"
VLLM_SERVER_DEV_MODE=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 setsid \
    "$python" -m vllm.entrypoints.openai.api_server --model "$model" --served-model-name tiny \
    --dtype float32 --host 127.0.0.1 --port "$port" --enable-scale-out --max-model-len 4096 \
    --enforce-eager --logprobs-mode processed_logprobs --kv-cache-memory-bytes 128M >"$log" 2>&1 &
vllm=$!
trap 'kill -- -$vllm 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    kill -0 "$vllm" 2>/dev/null || { tail -n 40 "$log"; exit 1; }
    sleep 0.5
done
.venv/bin/python -m service demo --engine vllm --engine-url "http://127.0.0.1:$port" --database \
    "sqlite+aiosqlite:///./demo-vllm.db" "$@"
