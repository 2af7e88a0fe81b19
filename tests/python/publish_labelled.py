"""Publishes `count` records labelled "<stream>:<i>" to each stream named.
argv: addr token ca count stream..."""
import sys

from common import connect

c = connect()
count = int(sys.argv[4])
for stream in sys.argv[5:]:
    for i in range(count):
        c.publish("dev", "default", stream, f"{stream}:{i}".encode())
print("published", flush=True)
