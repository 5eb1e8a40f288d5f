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
model_key=$(cat scripts/build_tiny_vllm_model.py service/assets/tokenizer/tokenizer.json \
    service/assets/tokenizer/tokenizer_config.json service/assets/tokenizer/chat_template.jinja \
    | sha256sum | cut -c1-12)
VENV=$CACHE/venv-trl-$TRL_VERSION-torch-$TORCH_VERSION-py311
MODEL=$CACHE/model-$model_key

unavailable() {
    if [ -n "${CI:-}" ]; then
        echo "TRL is unavailable ($1), and CI must test against it" >&2
        exit 1
    fi
    echo "WARNING: TRL is unavailable ($1): the real-TRL test is skipped" >&2
    exit 3
}

python311=""
for candidate in python3.11 "$(pyenv root 2>/dev/null)"/versions/3.11*/bin/python3; do
    if command -v "$candidate" >/dev/null 2>&1 \
        && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
        python311=$(command -v "$candidate"); break
    fi
done

mkdir -p "$CACHE" || unavailable "cannot create $CACHE"
exec 9>"$CACHE/.lock"  # one builder at a time; the others wait for its result
flock 9

if [ ! -f "$VENV/.complete" ]; then
    free_kb=$(df -Pk "$CACHE" | awk 'NR == 2 {print $4}')
    [ "$free_kb" -gt $((4 * 1024 * 1024)) ] || unavailable "less than 4 GB free under $CACHE"
    [ -n "$python311" ] || unavailable "no Python 3.11 (torch==$TORCH_VERSION's CPU wheel is for 3.11)"
    echo "building the TRL virtualenv in $VENV (once; a few minutes)" >&2
    rm -rf "$VENV"
    "$python311" -m venv "$VENV" || exit 1
    pip() { "$VENV/bin/python" -m pip --quiet --disable-pip-version-check "$@"; }
    pip install --upgrade pip || exit 1
    pip install "torch==$TORCH_VERSION" || unavailable "torch==$TORCH_VERSION cannot be installed"
    "$VENV/bin/python" -c 'import torch, sys; sys.exit(torch.version.cuda is not None)' \
        || unavailable "torch==$TORCH_VERSION here is not the CPU build"
    pip install "torch==$TORCH_VERSION" "trl==$TRL_VERSION" requests "httpx>=0.27" "pyarrow>=17" "numpy>=1.26" \
        || unavailable "trl==$TRL_VERSION cannot be installed"
    "$VENV/bin/python" -c 'from trl import GRPOTrainer' || exit 1
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
