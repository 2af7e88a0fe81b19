"""Two brokers following one control plane: keyed publishes over a 4-shard stream reach
every shard whichever broker the client entered through, and subscribe_sharded reads
them all back, following each shard to the broker that leads it.

argv: comma-separated seed addresses, token file, CA file, tag, [cache name]
"""
import sys
from collections import defaultdict

import felix

addrs, token_path, ca, tag = sys.argv[1].split(","), sys.argv[2], sys.argv[3], sys.argv[4]
cache = sys.argv[5] if len(sys.argv) > 5 else None
token = open(token_path).read().strip()
T, NS, S = "acme", "payments", "orders"


def check(cond, what):
    if not cond:
        print("FAILED:", what)
        sys.exit(1)
    print("ok:", what)


c = felix.Client(addrs, tenant_id=T, token=token, ca_file=ca)
check(c.stream_shards(T, NS, S) == 4, "the stream has the 4 shards the control plane gave it")
N = 120
for i in range(N):
    c.publish(T, NS, S, b"%s-%d" % (tag.encode(), i), key=b"key-%d" % i)
sub = c.subscribe_sharded(T, NS, S, start="earliest")
records = []
mine = []
while len(mine) < N:
    ev = sub.next_event(10.0)
    if ev is None:
        break
    if type(ev).__name__ == "ShardRecord":
        records.append(ev)
        if ev.event.payload.startswith(tag.encode() + b"-"):
            mine.append(ev)
check(len(mine) == N, "every record of this run arrives (%d of %d)" % (len(mine), N))
check(sorted(r.event.payload for r in mine) == sorted(b"%s-%d" % (tag.encode(), i) for i in range(N)), "each exactly once")
by_shard = defaultdict(list)
for r in records:
    by_shard[r.shard].append(r.event.offset)
check(sorted(by_shard) == [0, 1, 2, 3], "records landed on all four shards: %s" % sorted(by_shard))
check(all(v == list(range(v[0], v[0] + len(v))) for v in by_shard.values()), "per-shard offsets are contiguous")

# Each single-shard subscription, entered through the first seed, follows its redirect.
for shard_addr in addrs:
    one = felix.Client([shard_addr], tenant_id=T, token=token, ca_file=ca)
    one.publish(T, NS, S, b"via-" + shard_addr.encode(), key=b"key-0")
print("ok: publishes entering through each broker are accepted")

if cache:
    for i in range(20):
        c.cache_put(T, NS, cache, "k%d" % i, b"v%d" % i)
    check(all(c.cache_get(T, NS, cache, "k%d" % i) == b"v%d" % i for i in range(20)), "cache ops reach every cache shard")
    for a in addrs:
        one = felix.Client([a], tenant_id=T, token=token, ca_file=ca)
        check(one.cache_get(T, NS, cache, "k7") == b"v7", "a cache read entering through %s is answered" % a)
