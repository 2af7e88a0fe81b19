"""Many watchers of one busy cache: each sees every change its filter follows, in
order, while writes of keys it does not follow go on beside them."""
import felix
from common import check, connect

T, NS, C = "dev", "default", "busy"
c = connect()

filters = ([("every", felix.CacheWatchFilter.prefix(""), lambda k: True)] * 6
           + [("hot", felix.CacheWatchFilter.key("hot"), lambda k: k == "hot")] * 5
           + [("user", felix.CacheWatchFilter.prefix("user:"), lambda k: k.startswith("user:"))] * 5)
watchers = [(name, c.watch_cache(T, NS, C, f), follows) for name, f, follows in filters]

written = []
for i in range(300):
    key = ["hot", "user:%d" % (i % 7), "other:%d" % (i % 11)][i % 3]
    if i % 10 == 9:
        c.cache_delete(T, NS, C, key)
        written.append((key, None))
    else:
        value = b"%d" % i
        c.cache_put(T, NS, C, key, value)
        written.append((key, value))
# A delete of a key with no value writes nothing, and is no change.
live = set()
changes = []
for key, value in written:
    if value is None and key not in live:
        continue
    (live.add if value is not None else live.discard)(key)
    changes.append((key, value))

for name, w, follows in watchers:
    want = [kv for kv in changes if follows(kv[0])]
    got = []
    while len(got) < len(want):
        ch = w.recv(timeout=5.0)
        if ch is None:
            break
        got.append((ch.key, ch.value))
    check(got == want, "a %s watcher sees its %d changes in order (got %d)" % (name, len(want), len(got)))
    check(w.recv(timeout=0.2) is None, "and nothing else")
print("done")
