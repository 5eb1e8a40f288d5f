#!/usr/bin/env bash
# Makes sure Debian's PgBouncer is installed for the transaction-pooling tests (tests/test_pgbouncer.py
# starts its own on a free port), installing it with apt-get where this runs as root. The Debian
# service it comes with is not used.
# Exit 0: it is there. Exit 3: it cannot be installed here (its tests are skipped). Other: install failed.
set -u
command -v pgbouncer >/dev/null 2>&1 && exit 0
[ -x /usr/sbin/pgbouncer ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "WARNING: PgBouncer is not installed and cannot be (needs root and apt-get): its tests are skipped" >&2
    exit 3
fi
echo "installing Debian's pgbouncer for the transaction-pooling tests" >&2
install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends pgbouncer >&2; }
install || { apt-get update -q >&2 && install; } || exit 1
