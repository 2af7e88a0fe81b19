"""Consumer groups (queues) as a user drives them: poll, ack, nack, visibility expiry,
the attempt limit, dead letters, redrive, discard, independent groups, a waiting poll
woken by a publish. The broker runs with group_visibility_ms 1000, group_max_attempts 3."""
import threading
import time

import felix
from common import check, connect

T, NS, S, SHARD = "dev", "default", "jobs", 0
c = connect()
c2 = connect()


def poll(client, group, n, wait=1.0):
    return client.group_poll(T, NS, S, SHARD, group, max_records=n, wait=wait)


offsets = [c.publish(T, NS, S, b"job-%d" % i) for i in range(20)]
check(offsets == list(range(20)), "20 jobs published at offsets 0..19")

# Two consumers poll at once: each record goes to exactly one of them.
a, b = poll(c, "workers", 10), poll(c2, "workers", 10)
got_a, got_b = {r.offset for r in a}, {r.offset for r in b}
check(len(a) == 10 and len(b) == 10, "two polls of 10 take 10 each")
check(got_a.isdisjoint(got_b), "no record is claimed by both consumers")
check(got_a | got_b == set(offsets), "together they hold every job")
check(all(r.attempts == 1 for r in a + b), "first deliveries are attempt 1")
check(all(r.payload == b"job-%d" % r.offset for r in a + b), "payloads match their offsets")
check(poll(c, "workers", 10, wait=0.2) == [], "nothing is left to claim while all are held")

# The first consumer finishes its records; the second goes silent: after the
# visibility timeout its records go out again, on attempt 2.
for r in a:
    c.group_ack(T, NS, S, SHARD, "workers", r.offset)
time.sleep(1.3)
again = poll(c, "workers", 20)
check({r.offset for r in again} == got_b, "lapsed claims are delivered again, acked ones never")
check(all(r.attempts == 2 for r in again), "a redelivery counts an attempt")

# A nack hands a record back at once; it comes back on its next attempt.
first = again[0]
c.group_nack(T, NS, S, SHARD, "workers", first)
back = poll(c, "workers", 5)
check([(r.offset, r.attempts) for r in back] == [(first.offset, 3)], "a nacked record comes straight back, attempt 3")

# At the attempt limit (3) the next hand-back dead-letters it instead.
c.group_nack(T, NS, S, SHARD, "workers", back[0])
for r in again[1:]:
    c.group_ack(T, NS, S, SHARD, "workers", r.offset)
check(poll(c, "workers", 5, wait=0.3) == [], "a record past the attempt limit is not delivered")
check(list(c.group_dead_letters(T, NS, S, SHARD, "workers")) == [first.offset], "it is listed as a dead letter")

# Redrive brings it back with its attempts reset; then it is finished.
c.group_redrive(T, NS, S, SHARD, "workers", first.offset)
check(list(c.group_dead_letters(T, NS, S, SHARD, "workers")) == [], "a redriven record leaves the dead letters")
back = poll(c, "workers", 5)
check([(r.offset, r.attempts) for r in back] == [(first.offset, 1)], "a redriven record is delivered again, attempt 1")
c.group_ack(T, NS, S, SHARD, "workers", first.offset)

# An offset this group never handed out cannot be acked.
try:
    c.group_ack(T, NS, S, SHARD, "workers", 10_000)
    check(False, "acking an offset never handed out is refused")
except felix.FelixError as e:
    check(True, "acking an offset never handed out is refused: %s" % type(e).__name__)

# Redriving what is not a dead letter is refused; discard drops a dead letter.
try:
    c.group_redrive(T, NS, S, SHARD, "workers", 3)
    check(False, "redriving a record that is not a dead letter is refused")
except felix.FelixError:
    check(True, "redriving a record that is not a dead letter is refused")

# A second group reads the same log independently, from the start.
seen = []
while True:
    batch = poll(c2, "audit", 7, wait=0.3)
    if not batch:
        break
    seen += [r.offset for r in batch]
    for r in batch:
        c2.group_ack(T, NS, S, SHARD, "audit", r.offset)
check(sorted(seen) == offsets, "a second group gets every record once")

# A waiting poll wakes when a record is published.
def publish_later():
    time.sleep(0.5)
    c2.publish(T, NS, S, b"late")


threading.Thread(target=publish_later).start()
t0 = time.time()
woke = poll(c, "workers", 5, wait=5.0)
waited = time.time() - t0
check([r.payload for r in woke] == [b"late"], "a waiting poll returns the new record")
check(waited < 3.0, "it wakes on the publish, not at its deadline (%.2f s)" % waited)
c.group_ack(T, NS, S, SHARD, "workers", woke[0].offset)

# Dead-lettering then discarding: the record stays finished, the list empties.
late_dead = None
c.publish(T, NS, S, b"poison")
for attempt in range(4):
    got = poll(c, "workers", 1, wait=1.0)
    if not got:
        break
    late_dead = got[0].offset
    c.group_nack(T, NS, S, SHARD, "workers", got[0])
poll(c, "workers", 1, wait=0.2)
check(list(c.group_dead_letters(T, NS, S, SHARD, "workers")) == [late_dead], "a poison record ends as a dead letter")
c.group_discard(T, NS, S, SHARD, "workers", late_dead)
check(list(c.group_dead_letters(T, NS, S, SHARD, "workers")) == [], "discard drops it from the list")
check(poll(c, "workers", 5, wait=0.3) == [], "a discarded dead letter is not delivered again")
print("done")
