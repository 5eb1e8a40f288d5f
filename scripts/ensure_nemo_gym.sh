#!/usr/bin/env bash
# Makes sure NeMo Gym resource servers can run here, for tests/test_remote_envs_nemo_gym.py. nemo-gym
# pins mcp<2 and openai<=2.7.2, older than the project's venv has, so its servers run in a virtualenv
# of their own, outside the clone and cached between runs (keyed by the versions):
#   $ROLLOUT_NEMO_GYM_CACHE/venv-nemo-gym-<version>-py<python>/  Python 3.12 (else 3.13) with PyPI's
#        nemo-gym==0.4.0 and its requirements: the newest release for the Pythons here (0.5.0 and
#        later require Python >= 3.13.14); its servers speak the same HTTP as the newest commit's.
# Prints one line on stdout, `python=<venv python>`.
# Exit 0: ready. Exit 3: cannot be had here (no Python 3.12+, no disk, no wheel; not allowed on CI).
# Other: it failed.
set -u
cd "$(dirname "$0")/.."
NEMO_GYM_VERSION=0.4.0
CACHE=${ROLLOUT_NEMO_GYM_CACHE:-$HOME/.cache/rollout-service/nemo-gym}

WHAT="NeMo Gym"
SKIPPED="the NeMo Gym resource server tests are"
VENV=""
source scripts/cached_venv.sh

cache_lock
python=$(find_python 3.12 3.13) || unavailable "no Python 3.12 or 3.13 (nemo-gym needs 3.12 or newer)"
VENV=$CACHE/venv-nemo-gym-$NEMO_GYM_VERSION-py$("$python" -c 'import sys; print("%d%d" % sys.version_info[:2])')
if venv_missing; then
    venv_create "$python" 3
    venv_pip install "nemo-gym==$NEMO_GYM_VERSION" || unavailable "nemo-gym==$NEMO_GYM_VERSION cannot be installed"
    "$VENV/bin/python" -c 'import nemo_gym.base_resources_server, uvicorn' || exit 1
    venv_complete
fi
echo "python=$VENV/bin/python"
exit 0
