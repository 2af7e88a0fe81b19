#!/usr/bin/env bash
# Creates a virtualenv with the standard Felix SDK from PyPI (felix-client==0.6.2) and
# prints its python's path. Idempotent; serialised with flock so parallel test binaries
# do not race.
set -euo pipefail
venv="${FELIX_VENV:-${HOME:-/root}/.cache/felix-venv}"
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if ! "$venv/bin/python" -c 'import felix' >/dev/null 2>&1; then
    python3 -m venv "$venv" >&2
    "$venv/bin/pip" install --quiet --disable-pip-version-check felix-client==0.6.2 >&2
fi
echo "$venv/bin/python"
