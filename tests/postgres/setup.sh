#!/usr/bin/env bash
# Starts a throwaway Postgres for the control-plane tests and prints its URL.
# Installs the server with apt-get when no initdb is found. Idempotent (a running
# cluster is reused) and serialised with flock so parallel test binaries do not race.
# Listens on 127.0.0.1 only, trust auth: test data, never production.
# TLS is on, with a certificate for localhost/127.0.0.1 from a test CA made here:
# `setup.sh --ca` prints that CA's file, for tests that connect with sslmode=verify-full.
set -euo pipefail
port="${FELIX_PG_PORT:-55432}"
dir="${FELIX_PG_DIR:-/var/tmp/felix-pg-$port}"
mkdir -p "$(dirname "$dir")"
exec 9>"$dir.lock"
flock 9

find_bin() {
    local b
    for b in "$(command -v initdb 2>/dev/null || true)" /usr/lib/postgresql/*/bin/initdb; do
        if [ -n "$b" ] && [ -x "$b" ]; then
            dirname "$b"
            return 0
        fi
    done
    return 1
}
if ! bin="$(find_bin)"; then
    if [ "$(id -u)" != 0 ]; then
        echo "no Postgres server found and not root to install one" >&2
        exit 1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >&2
    bin="$(find_bin)"
fi

# Postgres refuses to run as root: run it as the postgres user.
as_pg=()
if [ "$(id -u)" = 0 ]; then
    id postgres >/dev/null 2>&1 || useradd --system --home-dir /var/lib/postgresql postgres
    as_pg=(runuser -u postgres --)
fi
if [ ! -f "$dir/PG_VERSION" ]; then
    mkdir -p "$dir"
    [ ${#as_pg[@]} -eq 0 ] || chown postgres: "$dir"
    chmod 700 "$dir"
    "${as_pg[@]}" "$bin/initdb" -D "$dir" -U postgres --auth=trust -E UTF8 >&2
fi
# A test CA and a server certificate it signs (made once per data directory).
if ! command -v openssl >/dev/null && [ "$(id -u)" = 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssl >&2
fi
if [ ! -f "$dir/server.crt" ]; then
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 3650 \
        -subj "/CN=felix test postgres CA" -keyout "$dir/ca.key" -out "$dir/ca.crt" 2>/dev/null
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
        -subj "/CN=localhost" -keyout "$dir/server.key" -out "$dir/server.csr" 2>/dev/null
    printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' > "$dir/server.ext"
    openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" \
        -CAcreateserial -days 3650 -extfile "$dir/server.ext" -out "$dir/server.crt" 2>/dev/null
    chmod 600 "$dir/server.key"
    [ ${#as_pg[@]} -eq 0 ] || chown postgres: "$dir/server.key" "$dir/server.crt"
fi
if [ "${1:-}" = "--ca" ]; then
    echo "$dir/ca.crt"
    exit 0
fi
if ! grep -q "^ssl = on" "$dir/postgresql.auto.conf" 2>/dev/null; then
    printf "ssl = on\nssl_cert_file = '%s'\nssl_key_file = '%s'\n" \
        "$dir/server.crt" "$dir/server.key" >> "$dir/postgresql.auto.conf"
    # A cluster already running (started before TLS was added) takes it on reload.
    if "${as_pg[@]}" "$bin/pg_ctl" -D "$dir" status >/dev/null 2>&1; then
        "${as_pg[@]}" "$bin/pg_ctl" -D "$dir" reload >&2
        sleep 1
    fi
fi
if ! "${as_pg[@]}" "$bin/pg_ctl" -D "$dir" status >/dev/null 2>&1; then
    "${as_pg[@]}" "$bin/pg_ctl" -D "$dir" -l "$dir/server.log" -w -t 60 \
        -o "-h 127.0.0.1 -p $port -k $dir -c fsync=off -c max_connections=200" start \
        </dev/null >&2 9>&- 2>"$dir/pg_ctl.log" || { cat "$dir/pg_ctl.log" >&2; exit 1; }
fi
echo "postgres://postgres@127.0.0.1:$port/postgres"
