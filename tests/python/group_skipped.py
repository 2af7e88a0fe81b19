"""`skipped_before` on group records as the standard SDK reads it: a group's own events
(its creation, acks, nacks) take offsets in the shard's log, and the record after them
says how many, so a consumer taking every record in order finds no drop by the SDK's
rule (dropped = offset - previous - 1 - skipped_before), on a first delivery and on a
redelivery alike, over a run of 300 such offsets as over one."""
from common import check, connect

T, NS, S, SHARD, G = "dev", "default", "skips", 0, "g"
c = connect()


def poll(n):
    return c.group_poll(T, NS, S, SHARD, G, max_records=n, wait=0.5)


def no_drops(previous, records):
    seen = []
    for r in records:
        seen.append((r.offset, previous, r.skipped_before))
        previous = r.offset
    drops = [s for s in seen if s[0] - s[1] - 1 - s[2] != 0]
    check(not drops, "no drop by the SDK's rule over offsets %d..%d (offset, previous, "
          "skipped_before where one shows: %s)" % (seen[0][0], seen[-1][0], drops[:3]))
    return previous


first = [c.publish(T, NS, S, b"r-%d" % i) for i in range(3)]
got = poll(10)
check([r.offset for r in got] == first, "the first poll takes the three records")
check([r.skipped_before for r in got] == [0, 0, 0], "nothing lies below or between them")
last = no_drops(-1, got)

for run in (3, 300):
    # `run` records taken and acked: the group's events for them follow in the log.
    if run > 3:
        taken = [c.publish(T, NS, S, b"bulk") for _ in range(run)]
        got = []
        while len(got) < run:
            got += poll(run - len(got))
        check([r.offset for r in got] == taken, "%d records taken in order" % run)
        last = no_drops(last, got)
    for r in got:
        c.group_ack(T, NS, S, SHARD, G, r.offset)
    after = c.publish(T, NS, S, b"after")
    (one,) = poll(10)
    check(one.offset == after, "the next record is delivered")
    check(one.skipped_before >= run, "it counts the %d acks below it (%d)" % (run, one.skipped_before))
    no_drops(last, [one])
    # Handed back and delivered again: the same count, found by looking back.
    c.group_nack(T, NS, S, SHARD, G, one)
    (again,) = poll(10)
    check((again.offset, again.attempts) == (after, 2), "the nacked record comes back, attempt 2")
    check(again.skipped_before == one.skipped_before,
          "a redelivery reports the same count (%d)" % again.skipped_before)
    c.group_ack(T, NS, S, SHARD, G, again.offset)
    last = after
print("group skipped OK")
