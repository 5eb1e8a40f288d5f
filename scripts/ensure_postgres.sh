#!/usr/bin/env bash
# Makes sure the local PostgreSQL answers on 127.0.0.1:5432 for the tests.
# Exit 0: it answers. Exit 3: PostgreSQL is not installed here (not allowed on CI). Other: it failed to start.
set -u
ready() { pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null || (exec 3<>/dev/tcp/127.0.0.1/5432) 2>/dev/null; }
ready && exit 0
if ! command -v pg_ctlcluster >/dev/null 2>&1 || [ -z "$(ls /etc/postgresql 2>/dev/null)" ]; then
    if [ -n "${CI:-}" ]; then
        echo "PostgreSQL is not installed, and CI must test on it" >&2
        exit 1
    fi
    echo "WARNING: PostgreSQL is not installed: its tests are skipped (SQLite only)" >&2
    exit 3
fi
version=$(ls /etc/postgresql | sort -V | tail -n 1)
echo "starting PostgreSQL $version" >&2
pg_ctlcluster --skip-systemctl-redirect "$version" main start || exit 1
for _ in $(seq 1 60); do
    ready && exit 0
    sleep 0.5
done
echo "PostgreSQL did not come up on 127.0.0.1:5432 within 30 s" >&2
exit 1
