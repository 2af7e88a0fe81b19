"""Cache put / get / delete / TTL."""
import time

from common import check, connect

c = connect()
T, NS, C = "dev", "default", "sessions"
check(c.cache_get(T, NS, C, "missing") is None, "a missing key reads as None")
c.cache_put(T, NS, C, "a", b"1")
check(c.cache_get(T, NS, C, "a") == b"1", "put then get")
c.cache_put(T, NS, C, "a", b"2")
check(c.cache_get(T, NS, C, "a") == b"2", "the last write wins")
check(c.cache_delete(T, NS, C, "a") == b"2", "delete returns the removed value")
check(c.cache_get(T, NS, C, "a") is None, "a deleted key reads as None")
check(c.cache_delete(T, NS, C, "a") is None, "deleting a missing key returns None")
c.cache_put(T, NS, C, "ttl", b"soon gone", ttl=0.5)
check(c.cache_get(T, NS, C, "ttl") == b"soon gone", "a TTL'd value is readable before it expires")
time.sleep(0.8)
check(c.cache_get(T, NS, C, "ttl") is None, "and gone after")
for i in range(50):
    c.cache_put(T, NS, C, "k%d" % i, b"v%d" % i)
check(all(c.cache_get(T, NS, C, "k%d" % i) == b"v%d" % i for i in range(50)), "many keys over every shard")
