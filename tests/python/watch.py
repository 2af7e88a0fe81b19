"""Cache watches: a key watch sees every put and delete in order; a prefix watch sees the
prefix only; a retained watch starts with the current values; a watch from an offset
replays; counters are not cache changes."""
import felix
from common import check, connect

T, NS, C = "dev", "default", "rooms"
c = connect()


def changes(w, n, timeout=3.0):
    got = []
    while len(got) < n:
        ch = w.recv(timeout=timeout)
        if ch is None:
            break
        got.append(ch)
    return got


w = c.watch_cache(T, NS, C, felix.CacheWatchFilter.key("room-1"))
c.cache_put(T, NS, C, "room-1", b"ada")
c.cache_put(T, NS, C, "room-2", b"not watched")
c.counter_add(T, NS, C, "room-1", 5)
c.cache_put(T, NS, C, "room-1", b"grace")
c.cache_delete(T, NS, C, "room-1")
got = changes(w, 3)
check([(x.key, x.value) for x in got] == [("room-1", b"ada"), ("room-1", b"grace"), ("room-1", None)],
      "a key watch sees each put and the delete, in order: %r" % [(x.key, x.value) for x in got])
check(got[0].offset < got[1].offset < got[2].offset, "at increasing offsets")
check(w.recv(timeout=0.5) is None, "and nothing else (not the counter, not other keys)")
first_offset = got[0].offset

p = c.watch_cache(T, NS, C, felix.CacheWatchFilter.prefix("user:"))
c.cache_put(T, NS, C, "user:1", b"a")
c.cache_put(T, NS, C, "other", b"x")
c.cache_put(T, NS, C, "user:2", b"b")
got = changes(p, 2)
check([x.key for x in got] == ["user:1", "user:2"], "a prefix watch sees its prefix only")

r = c.watch_cache(T, NS, C, felix.CacheWatchFilter.prefix("user:"), retained=True)
got = changes(r, 2)
check(sorted((x.key, x.value) for x in got) == [("user:1", b"a"), ("user:2", b"b")],
      "a retained watch starts with the current values")
check(r.retained_count == 2, "and says how many (%r)" % r.retained_count)
c.cache_put(T, NS, C, "user:3", b"c")
got = changes(r, 1)
check([(x.key, x.value) for x in got] == [("user:3", b"c")], "then goes on live")

h = c.watch_cache(T, NS, C, felix.CacheWatchFilter.key("room-1"), start=first_offset)
got = changes(h, 3)
check([x.value for x in got] == [b"ada", b"grace", None], "a watch from an offset replays from there")
# Expiry is a delete in the log: a watcher sees it; a key written again meanwhile stays.
e = c.watch_cache(T, NS, C, felix.CacheWatchFilter.prefix("session:"))
c.cache_put(T, NS, C, "session:a", b"short", ttl=0.3)
c.cache_put(T, NS, C, "session:b", b"short too", ttl=0.3)
c.cache_put(T, NS, C, "session:b", b"refreshed")
got = changes(e, 4, timeout=4.0)
check([(x.key, x.value) for x in got] == [("session:a", b"short"), ("session:b", b"short too"),
                                         ("session:b", b"refreshed"), ("session:a", None)],
      "an expired value is deleted and the watch sees it; a refreshed one is kept: %r"
      % [(x.key, x.value) for x in got])
check(e.recv(timeout=1.5) is None, "and nothing else")
check(c.cache_get(T, NS, C, "session:b") == b"refreshed", "the refreshed value is still there")
# A watch from past the log's end (after a failover of a Leader cache cut writes a
# watcher saw; new writes take their offsets) starts over from the current values, or
# it would skip the writes that land below where it asked to start.
far = c.watch_cache(T, NS, C, felix.CacheWatchFilter.key("session:b"), start=first_offset + 10**6)
check(far.resnapshot, "a watch from past the end resnapshots")
got = changes(far, 1)
check([(x.key, x.value) for x in got] == [("session:b", b"refreshed")],
      "from the current values: %r" % [(x.key, x.value) for x in got])
c.cache_put(T, NS, C, "session:b", b"again")
got = changes(far, 1)
check([(x.key, x.value) for x in got] == [("session:b", b"again")], "then live")
# A retained watch over more values than one page (the broker encodes and writes its
# snapshot 1 MiB at a time): every current value once, the overwritten ones as they are
# now, then live.
N = 2500
for i in range(N):
    c.cache_put(T, NS, C, "big:%04d" % i, b"%04d" % i + b"." * 1020)
for i in range(0, N, 7):
    c.cache_put(T, NS, C, "big:%04d" % i, b"new %04d" % i + b"." * 1016)
big = c.watch_cache(T, NS, C, felix.CacheWatchFilter.prefix("big:"), retained=True)
got = changes(big, N, timeout=10.0)
check(big.retained_count == N, "the snapshot says %d values (%r)" % (N, big.retained_count))
seen = {x.key: x.value for x in got}
check(len(got) == N and len(seen) == N, "each value once, over several pages (%d, %d)"
      % (len(got), len(seen)))
want = {"big:%04d" % i: (b"new %04d" % i + b"." * 1016 if i % 7 == 0 else b"%04d" % i + b"." * 1020)
        for i in range(N)}
check(seen == want, "as they are now (%d differ)" % sum(seen.get(k) != v for k, v in want.items()))
c.cache_put(T, NS, C, "big:live", b"after")
got = changes(big, 1)
check([(x.key, x.value) for x in got] == [("big:live", b"after")], "then live")
print("done")
