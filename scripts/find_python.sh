#!/usr/bin/env bash
# The Python the project's venv is made with: 3.12 (tau2-bench needs 3.12+; the image runs 3.12),
# else 3.13, from PATH or pyenv, else python3 (3.11 runs everything but tau2-bench).
set -u
runs() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }
for candidate in python3.12 python3.13; do
    if command -v "$candidate" >/dev/null 2>&1 && runs "$candidate"; then
        command -v "$candidate"; exit 0
    fi
done
if command -v pyenv >/dev/null 2>&1; then
    for candidate in "$(pyenv root)"/versions/3.12*/bin/python3 "$(pyenv root)"/versions/3.13*/bin/python3; do
        if [ -x "$candidate" ] && runs "$candidate"; then
            echo "$candidate"; exit 0
        fi
    done
fi
echo python3
