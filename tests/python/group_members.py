"""Named group members as a user drives them with the standard SDK (`consumer=`,
`reclaim=`): a member's claims are its own; a member that restarts reclaims them at
once, on the same attempt, instead of waiting out their visibility (30 s here); other
members and unnamed polls never get them meanwhile; acks settle reclaimed records; a
name over 128 bytes is refused invalid_request."""
import felix
from common import check, connect

T, NS, S, SHARD, G = "dev", "default", "members", 0, "workers"
first_life, b = connect(), connect()


def poll(client, n, **kw):
    return client.group_poll(T, NS, S, SHARD, G, max_records=n, wait=0.5, **kw)


offsets = [first_life.publish(T, NS, S, b"m-%d" % i) for i in range(12)]
check(offsets == list(range(12)), "12 records published at offsets 0..11")

held = poll(first_life, 4, consumer="worker-a")
check([r.offset for r in held] == [0, 1, 2, 3], "worker-a claims 0..3")
theirs = poll(b, 4, consumer="worker-b")
check([r.offset for r in theirs] == [4, 5, 6, 7], "worker-b claims the next four")
check([r.offset for r in poll(first_life, 1, consumer="worker-a")] == [8],
      "without reclaim a member gets new records, not its own claims")

# worker-a restarts: a new connection under the same name reclaims what it held.
second_life = connect()
back = poll(second_life, 7, consumer="worker-a", reclaim=True)
check([r.offset for r in back] == [0, 1, 2, 3, 8, 9, 10],
      "a restarted member gets its own claims back first, then new ones: %s" % [r.offset for r in back])
check([r.attempts for r in back[:5]] == [1] * 5, "reclaimed records are on the same attempt")
check(all(r.payload == b"m-%d" % r.offset for r in back), "payloads match their offsets")

mine = poll(b, 10, consumer="worker-b", reclaim=True)
check([r.offset for r in mine] == [4, 5, 6, 7, 11],
      "worker-b reclaims only its own, then the last new one: %s" % [r.offset for r in mine])
check(poll(b, 10) == [], "an unnamed poll gets nothing while every record is held")

for r in back:
    second_life.group_ack(T, NS, S, SHARD, G, r.offset)
check(poll(second_life, 10, consumer="worker-a", reclaim=True) == [],
      "acked reclaimed records are finished: nothing left to reclaim or claim")

# (The SDK sends `reclaim` only with a consumer; the broker's refusal of a bare
# reclaim is a unit test in broker/src/session/dispatch.rs.)
try:
    poll(second_life, 1, consumer="x" * 200)
    check(False, "a 200-byte consumer name is refused")
except felix.FelixError as e:
    check(e.code == "invalid_request", "a 200-byte consumer name is refused invalid_request (%s)" % e.code)
print("group members OK")
