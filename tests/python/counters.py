"""Counters: never-written is None, an add returns the sum including it, four concurrent
writers stay exact. `check` (after a restart) reads the sums back."""
import sys
import threading

from common import check, connect

T, NS, C = "dev", "default", "metrics"
phase = sys.argv[4] if len(sys.argv) > 4 else "run"
c = connect()

if phase == "run":
    check(c.counter_get(T, NS, C, "never") is None, "a counter never written reads None, not 0")
    check(c.counter_add(T, NS, C, "visits", 5) == 5, "the first add returns its delta")
    check(c.counter_add(T, NS, C, "visits", -2) == 3, "an add returns the sum including it")
    check(c.counter_get(T, NS, C, "visits") == 3, "get reads the sum")
    c.cache_put(T, NS, C, "visits", b"a cache value")
    check(c.counter_get(T, NS, C, "visits") == 3, "a cache value with the same key is unrelated")
    check(c.cache_get(T, NS, C, "visits") == b"a cache value", "and the cache value is intact")

    errors = []

    def writer(i):
        try:
            w = connect()
            for n in range(250):
                w.counter_add(T, NS, C, "shared", 3 if n % 2 else -1)
                w.counter_add(T, NS, C, "w%d" % i, 1)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    check(not errors, "no writer failed: %r" % errors[:1])
    check(c.counter_get(T, NS, C, "shared") == 4 * 125 * 2, "four concurrent writers sum exactly (1000)")
    check(all(c.counter_get(T, NS, C, "w%d" % i) == 250 for i in range(4)), "each writer's own counter is 250")
    try:
        c.counter_add(T, NS, C, "big", 2**63 - 1)
        c.counter_add(T, NS, C, "big", 1)
        check(False, "an add that would overflow i64 is refused")
    except Exception as e:  # noqa: BLE001
        check("overflow" in str(e), "an add that would overflow i64 is refused: %s" % e)
    check(c.counter_get(T, NS, C, "big") == 2**63 - 1, "and the counter keeps its sum")
else:
    check(c.counter_get(T, NS, C, "visits") == 3, "after a restart: visits is 3")
    check(c.counter_get(T, NS, C, "shared") == 1000, "after a restart: shared is 1000")
    check(all(c.counter_get(T, NS, C, "w%d" % i) == 250 for i in range(4)), "after a restart: every writer's counter")
    check(c.counter_get(T, NS, C, "never") is None, "after a restart: never-written is still None")
