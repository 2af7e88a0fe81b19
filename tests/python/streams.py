"""Publish with every ack mode and with keys; subscribe from earliest, latest and an
offset; every record arrives once, in order, with its offset."""
from common import check, connect, drain

c = connect()
T, NS, S = "dev", "default", "single"

offsets = [c.publish(T, NS, S, b"m%d" % i, ack="per_message") for i in range(20)]
check(offsets == list(range(20)), "per_message acks carry contiguous offsets 0..19")
o = c.publish(T, NS, S, b"m20", ack="per_batch")
check(o == 20, "per_batch ack carries the offset")
check(c.publish(T, NS, S, b"m21", ack="none") is None, "ack none returns no offset")
# An unacked publish is not confirmed; a later acked one on the same stream is ordered after it.
o = c.publish(T, NS, S, b"m22", ack="per_message")
check(o == 22, "offsets stay contiguous after an unacked publish")
keyed = [c.publish(T, NS, S, b"m%d" % i, key=b"user-%d" % i) for i in range(23, 30)]
check(keyed == list(range(23, 30)), "keyed publishes on a one-shard stream take the next offsets")

sub = c.subscribe(T, NS, S, start="earliest")
evs = drain(sub, 30)
check([e.offset for e in evs] == list(range(30)), "earliest replays every offset once, in order")
check([e.payload for e in evs] == [b"m%d" % i for i in range(30)], "payloads match what was published")

mid = c.subscribe(T, NS, S, start=25)
evs = drain(mid, 5)
check([e.offset for e in evs] == [25, 26, 27, 28, 29], "start at an offset is inclusive")

live = c.subscribe(T, NS, S, start="latest")
for i in range(30, 33):
    c.publish(T, NS, S, b"m%d" % i)
evs = drain(live, 3)
check([(e.offset, e.payload) for e in evs] == [(30, b"m30"), (31, b"m31"), (32, b"m32")],
      "latest delivers only what is published after it")
more = drain(sub, 3)
check([e.offset for e in more] == [30, 31, 32], "the earliest subscription continues live without a gap")

try:
    c.subscribe(T, NS, S, start=10_000).next_event(1.0)
    check(False, "an offset beyond the tail is refused")
except Exception as e:  # the SDK raises CursorError
    check(type(e).__name__ == "CursorError", "an offset beyond the tail is a CursorError (%s)" % type(e).__name__)
