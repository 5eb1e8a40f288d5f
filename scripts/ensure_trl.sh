#!/usr/bin/env bash
# Makes sure TRL's real GRPOTrainer can run one step here on the CPU, for tests/test_trl_real.py.
# It keeps, outside the clone and cached between runs (keyed by the versions and the model's recipe):
#   $ROLLOUT_TRL_CACHE/venv-<key>/   a Python 3.11 virtualenv with torch==2.13.0 (the CPU build pip
#        takes from this machine's disk), PyPI's trl==1.10.0 (the release of the commit
#        rollout_client.trl follows, f2cd5771, 1.10.0.dev0) with its requirements, requests (its
#        GRPOTrainer imports it) and the client's own requirements (the client comes from the clone)
#   $ROLLOUT_TRL_CACHE/model-<key>/  the tiny random-weight model of scripts/build_tiny_vllm_model.py
# Prints two lines on stdout, `python=<venv python>` and `model=<model dir>`.
# Exit 0: ready. Exit 3: cannot be had here (no Python 3.11, no disk, no wheel; not allowed on CI).
# Other: it failed.
set -u
cd "$(dirname "$0")/.."
TRL_VERSION=1.10.0
TORCH_VERSION=2.13.0
CACHE=${ROLLOUT_TRL_CACHE:-$HOME/.cache/rollout-service/trl}
VENV=$CACHE/venv-trl-$TRL_VERSION-torch-$TORCH_VERSION-py311

WHAT=TRL
SKIPPED="the real-TRL test is"
source scripts/cached_venv.sh
MODEL=$CACHE/model-$(tiny_model_key)

cache_lock
if venv_missing; then
    python311=$(find_python 3.11) || unavailable "no Python 3.11 (torch==$TORCH_VERSION's CPU wheel is for 3.11)"
    venv_create "$python311" 4
    venv_cpu_torch "$TORCH_VERSION"
    venv_pip install "torch==$TORCH_VERSION" "trl==$TRL_VERSION" requests "httpx>=0.27" "pyarrow>=17" "numpy>=1.26" \
        || unavailable "trl==$TRL_VERSION cannot be installed"
    "$VENV/bin/python" -c 'from trl import GRPOTrainer' || exit 1
    venv_complete
fi

tiny_model "$MODEL"
echo "python=$VENV/bin/python"
echo "model=$MODEL"
exit 0
