#!/usr/bin/env bash
# What `make test` needs besides .venv (run by its test-setup target), set up on a fresh machine:
# - PostgreSQL on 127.0.0.1:5432 and Redis on 127.0.0.1:6379, started when they do not answer
#   (skipped for a service that TIERGATE_TEST_POSTGRES_URL / TIERGATE_TEST_REDIS_URL points
#   elsewhere), then waited for;
# - promtool (Debian's prometheus package) for the ops/prometheus rule tests and chromium
#   (Debian's chromium package) for the admin console's browser tests, installed with apt-get
#   when missing, and gcc (Debian's gcc package) for the compiled engine core's build. Without
#   root or apt-get a missing tool is an error naming its package.
# Idempotent: when everything is there it only checks (no apt-get update).
set -euo pipefail

fail() {
    echo "test-setup: $*" >&2
    exit 1
}

postgres_up() { pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; }
redis_up() { redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; }

want_postgres=${TIERGATE_TEST_POSTGRES_URL:+no}
want_redis=${TIERGATE_TEST_REDIS_URL:+no}

if [ "${want_postgres:-yes}" = yes ] && ! postgres_up; then
    command -v pg_ctlcluster >/dev/null 2>&1 && [ -d /etc/postgresql ] ||
        fail "PostgreSQL does not answer on 127.0.0.1:5432 and there is no Debian cluster to" \
            "start (package postgresql); start it, or set TIERGATE_TEST_POSTGRES_URL"
    version=$(ls /etc/postgresql | sort -V | tail -n 1)
    echo "test-setup: starting PostgreSQL $version" >&2
    pg_ctlcluster --skip-systemctl-redirect "$version" main start ||
        fail "could not start PostgreSQL $version (pg_ctlcluster; run as root or postgres)"
fi
if [ "${want_redis:-yes}" = yes ] && ! redis_up; then
    command -v redis-server >/dev/null 2>&1 ||
        fail "Redis does not answer on 127.0.0.1:6379 and redis-server (package redis-server)" \
            "is missing; install or start it, or set TIERGATE_TEST_REDIS_URL"
    echo "test-setup: starting Redis" >&2
    redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
fi
for _ in $(seq 30); do
    { [ "${want_postgres:-yes}" = no ] || postgres_up; } &&
        { [ "${want_redis:-yes}" = no ] || redis_up; } && break
    sleep 1
done
[ "${want_postgres:-yes}" = no ] || postgres_up ||
    fail "PostgreSQL does not answer on 127.0.0.1:5432 after 30 s"
[ "${want_redis:-yes}" = no ] || redis_up ||
    fail "Redis does not answer on 127.0.0.1:6379 after 30 s"

apt_updated=no
# need COMMAND PACKAGE PURPOSE: install Debian's PACKAGE when COMMAND is missing.
need() {
    command -v "$1" >/dev/null 2>&1 && return 0
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        fail "$1 is missing ($3): install Debian's $2 package," \
            "apt-get install -y --no-install-recommends $2"
    fi
    echo "test-setup: installing $2 for $1 ($3)" >&2
    if [ "$apt_updated" = no ]; then
        apt-get update -qq
        apt_updated=yes
    fi
    apt-get install -y -qq -o DPkg::Lock::Timeout=300 --no-install-recommends "$2"
    command -v "$1" >/dev/null 2>&1 || fail "$1 is still missing after installing $2"
}

need promtool prometheus "the ops/prometheus rule tests"
need gcc gcc "the compiled engine core's build, make compiled"
# Playwright drives Debian's chromium (no browser download); TIERGATE_CHROMIUM may name another.
if [ ! -x "${TIERGATE_CHROMIUM:-/nonexistent}" ]; then
    need chromium chromium "the admin console's browser tests"
fi
