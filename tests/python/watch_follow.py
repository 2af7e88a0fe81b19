"""A cache watch follows its shard across leadership moves (the Rust test moves the
cache's leader while this runs): every put arrives once, in order, and the SDK is told
of each move with a shard-moved notice, not a lagged end.

argv: comma-separated seed addresses, token file, CA file, put count
"""
import os
import sys
import threading
import time

import felix

addrs, token_path, ca, n = sys.argv[1].split(","), sys.argv[2], sys.argv[3], int(sys.argv[4])
token = open(token_path).read().strip()
T, NS, C = "acme", "payments", "moving-cache"


def check(cond, what):
    if not cond:
        print("FAILED:", what)
        sys.exit(1)
    print("ok:", what)


writer = felix.Client(addrs, tenant_id=T, token=token, ca_file=ca)
watcher = felix.Client(addrs, tenant_id=T, token=token, ca_file=ca)
for _attempt in range(100):
    try:
        writer.cache_put(T, NS, C, "warm", b"up")
        break
    except Exception:  # noqa: BLE001 - the new cache's first generation starts
        time.sleep(0.1)
w = watcher.watch_cache(T, NS, C, felix.CacheWatchFilter.key("k"))
# The Rust test moves the cache once the watch is live (the first generation can take
# seconds on a loaded machine, and moves made before the watch tell it nothing).
open(os.path.join(os.path.dirname(token_path), "watch_follow.started"), "w").close()
put, errors = [], []


def write():
    for i in range(n):
        for _attempt in range(50):
            try:
                writer.cache_put(T, NS, C, "k", b"v-%d" % i)
                put.append(i)
                break
            except Exception as e:  # noqa: BLE001 - retried, then reported
                errors.append(repr(e))
                time.sleep(0.1)
        time.sleep(0.02)


t = threading.Thread(target=write)
t.start()
seen, moves, lagged = [], 0, None
deadline = time.time() + 120
while time.time() < deadline:
    ch = w.recv(timeout=2.0)
    if ch is None:
        # Done once every put arrived and a move was told (a move that takes long on a
        # loaded machine may come after the last put).
        if w.closed or (not t.is_alive() and len(seen) >= len(put) and moves >= 1):
            break
        continue
    if isinstance(ch, felix.CacheWatchShardMoved):
        moves += 1
        continue
    if isinstance(ch, felix.CacheWatchLagged):
        lagged = ch
        break
    seen.append(int(ch.value.split(b"-")[1]))
t.join()
print("put %d (errors %d), seen %d, moves %d" % (len(put), len(errors), len(seen), moves))
check(lagged is None, "the watch did not end lagged (%r)" % lagged)
check(len(put) == n, "every put was acknowledged in the end")
check(sorted(set(seen)) == put, "every put arrives (missing %r)" % sorted(set(put) - set(seen)))
check(seen == sorted(seen), "in order")
# A put retried after an error may have applied twice: its value then arrives twice.
check(len(seen) - len(set(seen)) <= len(errors), "once (or once more for each retried put)")
check(moves >= 1, "the SDK was told of a move")
