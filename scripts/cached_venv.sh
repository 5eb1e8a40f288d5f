# Sourced by the scripts/ensure_*.sh that keep a virtualenv of their own outside the clone, cached
# between runs under ~/.cache/rollout-service/ (keyed by what it holds), for tests of packages whose
# requirements conflict with the project's venv (or need another Python). The caller sets, before
# sourcing it:
#   WHAT     what is unavailable where it cannot be built ("vLLM"), for messages
#   SKIPPED  what is skipped then ("the real-engine tests are")
#   CACHE    its cache folder
#   VENV     the virtualenv's folder under CACHE
# and then uses:
#   unavailable REASON      exit 3 (cannot be had here: the tests skip with REASON), or exit 1 on CI
#   cache_lock              one builder at a time (parallel CI runs, a developer's run); the others
#                           wait for its result
#   find_python VERSION...  the path of a Python of one of the versions (3.11, ...), from PATH or
#                           pyenv, in that order of preference; status 1 if there is none
#   venv_missing            true while VENV has not been built to the end (it has no stamp)
#   venv_create PYTHON GB   checks GB free under CACHE, makes VENV anew with an up-to-date pip
#   venv_pip ARGS...        pip in VENV
#   venv_cpu_torch VERSION  torch==VERSION in VENV, the CPU build (pip takes it from this disk)
#   venv_complete           stamps VENV built
#   tiny_model_key          the key of scripts/build_tiny_vllm_model.py's recipe and the tokenizer
#   tiny_model DIR          that tiny random-weight model in DIR, built once by VENV's Python
# Its callers print `key=value` lines on stdout (tests/support/cached_venv.py reads them) and exit
# 0: ready; 3: cannot be had here (not allowed on CI); other: it failed.

unavailable() {
    if [ -n "${CI:-}" ]; then
        echo "$WHAT is unavailable ($1), and CI must test against it" >&2
        exit 1
    fi
    echo "WARNING: $WHAT is unavailable ($1): $SKIPPED skipped" >&2
    exit 3
}

cache_lock() {
    mkdir -p "$CACHE" || unavailable "cannot create $CACHE"
    exec 9>"$CACHE/.lock"
    flock 9
}

find_python() {
    local version candidate
    for version in "$@"; do
        for candidate in "python$version" "$(pyenv root 2>/dev/null)"/versions/"$version".*/bin/python3; do
            if command -v "$candidate" >/dev/null 2>&1 \
                && "$candidate" -c "import sys; sys.exit(sys.version_info[:2] != (${version/./, }))" 2>/dev/null; then
                command -v "$candidate"
                return 0
            fi
        done
    done
    return 1
}

venv_missing() {
    [ ! -f "$VENV/.complete" ]
}

venv_create() {
    local free_kb
    free_kb=$(df -Pk "$CACHE" | awk 'NR == 2 {print $4}')
    [ "$free_kb" -gt $(($2 * 1024 * 1024)) ] || unavailable "less than $2 GB free under $CACHE"
    echo "building the $WHAT virtualenv in $VENV (once; a few minutes)" >&2
    rm -rf "$VENV"
    "$1" -m venv "$VENV" || exit 1
    venv_pip install --upgrade pip || exit 1
}

venv_pip() {
    "$VENV/bin/python" -m pip --quiet --disable-pip-version-check "$@"
}

venv_cpu_torch() {
    venv_pip install "torch==$1" || unavailable "torch==$1 cannot be installed"
    "$VENV/bin/python" -c 'import torch, sys; sys.exit(torch.version.cuda is not None)' \
        || unavailable "torch==$1 here is not the CPU build"
}

venv_complete() {
    touch "$VENV/.complete"
}

tiny_model_key() {
    cat scripts/build_tiny_vllm_model.py service/assets/tokenizer/tokenizer.json \
        service/assets/tokenizer/tokenizer_config.json service/assets/tokenizer/chat_template.jinja \
        | sha256sum | cut -c1-12
}

tiny_model() {
    [ -f "$1/.complete" ] && return 0
    echo "building the tiny model in $1" >&2
    rm -rf "$1"
    "$VENV/bin/python" scripts/build_tiny_vllm_model.py service/assets/tokenizer "$1" || exit 1
    touch "$1/.complete"
}
