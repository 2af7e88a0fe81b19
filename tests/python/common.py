"""Shared setup for the interop scripts: argv is (addr, token file, CA file, ...)."""
import sys

import felix


def connect(tenant="dev", token=None):
    addr, token_path, ca = sys.argv[1], sys.argv[2], sys.argv[3]
    if token is None:
        token = open(token_path).read().strip()
    return felix.Client(addr, tenant_id=tenant, token=token, ca_file=ca)


def drain(sub, n, timeout=5.0):
    """Reads n events (or fewer if the stream goes quiet for `timeout`)."""
    got = []
    while len(got) < n:
        ev = sub.next_event(timeout)
        if ev is None:
            break
        got.append(ev)
    return got


def check(cond, what):
    if not cond:
        print("FAILED:", what)
        sys.exit(1)
    print("ok:", what)
