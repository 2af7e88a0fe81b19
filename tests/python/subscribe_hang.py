"""Subscribes to a stream and then hangs: the test SIGKILLs this process, so its
connection dies without a close. argv: addr token ca stream"""
import sys
import time

from common import connect

c = connect()
sub = c.subscribe("dev", "default", sys.argv[4], start="latest")
print("subscribed", flush=True)
while True:
    sub.next_event(1.0)
    time.sleep(0.05)
