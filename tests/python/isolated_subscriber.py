"""Subscribes to one stream and checks every event it receives belongs to it.
argv: addr token ca stream expected_count. Prints "subscribed" once registered, then
exits 0 after `expected_count` events whose payloads all start with "<stream>:", or 1
on the first event that does not (another stream's record) or a missing event."""
import sys

from common import check, connect

stream, want = sys.argv[4], int(sys.argv[5])
c = connect()
sub = c.subscribe("dev", "default", stream, start="latest")
print("subscribed", flush=True)
got = []
while len(got) < want:
    ev = sub.next_event(20.0)
    if ev is None:
        break
    payload = bytes(ev.payload)
    check(payload.startswith(stream.encode() + b":"),
          f"{stream} received {payload[:40]!r} at offset {ev.offset}")
    got.append(payload)
check(len(got) == want, f"{stream} received {len(got)} of {want} events")
# Nothing else arrives.
extra = sub.next_event(0.5)
check(extra is None or bytes(extra.payload).startswith(stream.encode() + b":"),
      f"{stream}: no stray event after the last one")
