"""A multi-shard stream: keyed publishes spread over shards; subscribe_sharded reads
every record exactly once with per-shard contiguous offsets."""
from collections import defaultdict

from common import check, connect

c = connect()
T, NS, S = "dev", "default", "wide"
check(c.stream_shards(T, NS, S) == 4, "the dev broker created the stream with --shards 4")
N = 200
for i in range(N):
    c.publish(T, NS, S, b"r%d" % i, key=b"key-%d" % (i % 37))
sub = c.subscribe_sharded(T, NS, S, start="earliest")
records = []
while len(records) < N:
    ev = sub.next_event(5.0)
    if ev is None:
        break
    if type(ev).__name__ == "ShardRecord":
        records.append(ev)
check(len(records) == N, "every record arrives (%d of %d)" % (len(records), N))
check(sorted(r.event.payload for r in records) == sorted(b"r%d" % i for i in range(N)), "each exactly once")
by_shard = defaultdict(list)
for r in records:
    by_shard[r.shard].append(r.event.offset)
check(len(by_shard) > 1, "keys spread over more than one shard: %s" % sorted(by_shard))
check(all(v == list(range(len(v))) for v in by_shard.values()), "per-shard offsets are contiguous from 0")
pos = sub.positions()
check(all(pos[s] == len(v) - 1 for s, v in by_shard.items()), "positions() is the last offset per shard")
