"""Reads the `durable` stream from earliest until `count` records arrived (or it goes
quiet) and prints `offset payload` per record."""
import sys

from common import connect, drain

c = connect()
want = int(sys.argv[4])
sub = c.subscribe("dev", "default", "durable", start="earliest")
for e in drain(sub, want, timeout=10.0):
    print(e.offset, e.payload.decode())
