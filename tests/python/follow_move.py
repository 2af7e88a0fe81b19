"""A subscriber follows its shard across leadership moves (the Rust test moves the leader
while this runs): every published record arrives once, in offset order, and the SDK is
told of each move with shard_moved.

argv: comma-separated seed addresses, token file, CA file, record count
"""
import sys
import threading
import time

import felix

addrs, token_path, ca, n = sys.argv[1].split(","), sys.argv[2], sys.argv[3], int(sys.argv[4])
token = open(token_path).read().strip()
T, NS, S = "acme", "payments", "moving"


def check(cond, what):
    if not cond:
        print("FAILED:", what)
        sys.exit(1)
    print("ok:", what)


pub = felix.Client(addrs, tenant_id=T, token=token, ca_file=ca)
sub_client = felix.Client(addrs, tenant_id=T, token=token, ca_file=ca)
sub = sub_client.subscribe_sharded(T, NS, S, start="earliest")
published, errors = [], []


def publish():
    for i in range(n):
        for _attempt in range(50):
            try:
                published.append(pub.publish(T, NS, S, b"m-%d" % i, at_least_once=True))
                break
            except Exception as e:  # noqa: BLE001 - retried, then reported
                errors.append(repr(e))
                time.sleep(0.1)
        time.sleep(0.02)


t = threading.Thread(target=publish)
t.start()
seen, moves = [], 0
deadline = time.time() + 120
while time.time() < deadline:
    ev = sub.next_event(2.0)
    if ev is None:
        if not t.is_alive() and len(seen) >= len(published):
            break
        continue
    if isinstance(ev, felix.ShardMoved):
        moves += 1
        print("shard_moved:", ev.node_id, "resume_from", ev.resume_from, "generation", ev.generation)
        continue
    if isinstance(ev, felix.ShardRecord):
        seen.append((ev.event.offset, ev.event.payload))
t.join()
print("moves", moves, "published", len(published), "seen", len(seen), "publish retries", len(errors))
offsets = [o for o, _ in seen]
check(len(published) == n, "every record was published (acknowledged)")
check(offsets == sorted(set(offsets)), "no record twice, in offset order")
payloads = {p for _, p in seen}
check(all(b"m-%d" % i in payloads for i in range(n)), "every published record was delivered")
check(moves >= 1, "the subscriber was told the shard moved (%d times)" % moves)
