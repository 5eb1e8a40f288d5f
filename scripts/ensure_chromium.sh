#!/usr/bin/env bash
# Makes sure Debian's Chromium is at /usr/bin/chromium for the viewer's browser tests, installing it
# with apt-get where this runs as root (Playwright's own browser download is not used).
# Exit 0: it is there. Exit 3: it cannot be installed here (not allowed on CI). Other: install failed.
set -u
chromium=${ROLLOUT_CHROMIUM:-/usr/bin/chromium}
[ -x "$chromium" ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    if [ -n "${CI:-}" ]; then
        echo "Chromium is not installed and cannot be (needs root and apt-get), and CI must run the browser tests" >&2
        exit 1
    fi
    echo "WARNING: Chromium is not installed and cannot be (needs root and apt-get): the browser tests are skipped" >&2
    exit 3
fi
echo "installing Debian's chromium for the browser tests" >&2
install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >&2; }
install || { apt-get update -q >&2 && install; } || exit 1
[ -x "$chromium" ] || { echo "chromium was installed but $chromium is missing" >&2; exit 1; }
