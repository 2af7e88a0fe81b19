"""One healthy subscriber next to a subscriber that never reads (held open by the
harness): the healthy one receives every record, with contiguous offsets."""
import sys
import time

from common import check, connect, drain

c = connect()
n = int(sys.argv[4])
sub = c.subscribe("dev", "default", "fan", start="latest")
payload = b"x" * 4096
t = time.time()
for i in range(n):
    c.publish("dev", "default", "fan", payload, ack="per_message")
evs = drain(sub, n, timeout=10.0)
offs = [e.offset for e in evs]
check(len(evs) == n, "the healthy subscriber got all %d records (got %d)" % (n, len(evs)))
check(offs == list(range(offs[0], offs[0] + n)), "with contiguous offsets")
print("elapsed %.2fs" % (time.time() - t))
