"""Consumer groups across a SIGKILL of the broker.

phase `before FILE`: publishes 300 jobs, then polls and acks until 150 are acked, out of
order and leaving one record of every batch claimed but never settled (unacked records
below acked ones), and a last claim outstanding; writes the acked offsets to FILE.
phase `after FILE`: (the broker was killed and restarted) polls everything the group
still owes; no acked offset may come back, and every unacked one must."""
import sys
import time

from common import check, connect

T, NS, S, SHARD, G = "dev", "default", "restart-jobs", 0, "workers"
phase, path = sys.argv[4], sys.argv[5]
c = connect()

if phase == "before":
    for i in range(300):
        c.publish(T, NS, S, b"job-%d" % i)
    acked = []
    while len(acked) < 150:
        batch = c.group_poll(T, NS, S, SHARD, G, max_records=16, wait=1.0)
        check(batch, "records to claim")
        # Ack every other record first, then the rest: acks arrive out of order. The
        # fourth of each batch is never settled: it must come back after the restart,
        # though records after it were acked.
        for r in batch[::2] + batch[1::2]:
            if len(batch) > 3 and r.offset == batch[3].offset:
                continue
            c.group_ack(T, NS, S, SHARD, G, r.offset)
            acked.append(r.offset)
    held = c.group_poll(T, NS, S, SHARD, G, max_records=5, wait=1.0)
    check(len(held) == 5, "five more claimed and never settled")
    open(path, "w").write(" ".join(str(o) for o in acked))
    print("acked", len(acked))
else:
    acked = {int(o) for o in open(path).read().split()}
    seen = []
    deadline = time.time() + 60
    while time.time() < deadline:
        batch = c.group_poll(T, NS, S, SHARD, G, max_records=64, wait=0.5)
        if not batch:
            break
        for r in batch:
            seen.append(r.offset)
            c.group_ack(T, NS, S, SHARD, G, r.offset)
    again = acked.intersection(seen)
    check(not again, "no acked record is delivered after the restart (%d were)" % len(again))
    check(sorted(seen) == sorted(set(range(300)) - acked), "every unacked record is delivered once after it")
    print("redelivered", len(seen))
