"""On a stream of several shards an entity's commits land where its keyed records do
(the SDK sends the entity key base64-encoded, as every byte field), and its state is
read there; a prefix cache watch on a cache of several shards must name its shard."""
import felix
from felix import CommitOp
from common import check, connect

c = connect()
T, NS, S, C = "dev", "default", "entities", "spread"
N = 8
for e in range(N):
    key = b"acct-%d" % e
    c.publish(T, NS, S, b"record-%d" % e, key=key)
    c.commit(T, NS, key, [CommitOp.publish(S, b"event-%d" % e), CommitOp.put(S, "n", b"%d" % e)])
    v = c.state_get(T, NS, S, key, "n")
    check(v.value == b"%d" % e, "entity %d's state reads back (%r)" % (e, v.value))
check(c.stream_shards(T, NS, S) == 4, "the stream has 4 shards")
sub = c.subscribe_sharded(T, NS, S, start="earliest")
records = []
while len(records) < 2 * N:
    ev = sub.next_event(5.0)
    if ev is None:
        break
    if type(ev).__name__ == "ShardRecord":
        records.append(ev)
check(len(records) == 2 * N, "every record and event arrives (%d of %d)" % (len(records), 2 * N))
shards = {}
for r in records:
    entity = r.event.payload.split(b"-")[1]
    shards.setdefault(entity, set()).add(r.shard)
check(all(len(s) == 1 for s in shards.values()),
      "each entity's record and commit event on one shard: %r" % shards)
check(len({min(s) for s in shards.values()}) > 1, "entities spread over shards")

c.cache_put(T, NS, C, "user:1", b"a")
try:
    w = c.watch_cache(T, NS, C, felix.CacheWatchFilter.prefix("user:"))
    got = w.recv(timeout=1.0)
    check(False, "a prefix watch naming no shard of a 4-shard cache is refused (got %r)" % got)
except felix.FelixError as e:
    check("shard" in str(e), "a prefix watch naming no shard of a 4-shard cache is refused: %s" % e)
