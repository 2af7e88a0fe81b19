"""Publishes acked records until killed, printing `offset payload` for each ack the
moment it is returned (so a harness that kills the broker knows what was acknowledged)."""
import sys

from common import connect

c = connect()
tag = sys.argv[4]
i = 0
while True:
    payload = b"%s-%d" % (tag.encode(), i)
    try:
        off = c.publish("dev", "default", "durable", payload, ack="per_message")
    except Exception as e:  # the broker died: stop
        print("error", type(e).__name__, flush=True)
        sys.exit(0)
    print(off, payload.decode(), flush=True)
    i += 1
