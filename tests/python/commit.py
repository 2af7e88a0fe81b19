"""Atomic commit and state: one event plus state changes as one record; state_get agrees
with the commit's offset; subscribers and groups see the event only. `check` (after a
restart) reads the state back."""
import sys

import felix
from felix import CommitOp
from common import check, connect, drain

T, NS, S = "dev", "default", "accounts"
phase = sys.argv[4] if len(sys.argv) > 4 else "run"
c = connect()

if phase == "run":
    c.publish(T, NS, S, b"plain record")
    r1 = c.commit(T, NS, b"acct-1", [
        CommitOp.publish(S, b"opened"),
        CommitOp.put(S, "balance", b"100"),
        CommitOp.put(S, "owner", b"ada"),
    ])
    check(r1.offset == 1, "the commit's event takes the next offset (%r)" % r1.offset)
    v = c.state_get(T, NS, S, b"acct-1", "balance")
    check(v.value == b"100" and v.version == r1.offset, "state_get reads the value at the commit's version")
    check(v.as_of is not None and v.as_of >= r1.offset + 1, "as_of covers the commit (%r)" % v.as_of)
    r2 = c.commit(T, NS, b"acct-1", [
        CommitOp.publish(S, b"withdrew 30"),
        CommitOp.put(S, "balance", b"70"),
        CommitOp.delete(S, "owner"),
    ])
    check(r2.offset == r1.offset + 1, "a second commit follows")
    v = c.state_get(T, NS, S, b"acct-1", "balance")
    check((v.value, v.version) == (b"70", r2.offset), "every key a commit writes has its offset as version")
    check(c.state_get(T, NS, S, b"acct-1", "owner").value is None, "a deleted key reads as None")
    check(c.state_get(T, NS, S, b"acct-1", "never").value is None, "an unknown key reads as None")
    r3 = c.commit(T, NS, b"acct-1", [CommitOp.enqueue(S, b"audit me")])
    check(r3.offset == r2.offset + 1, "a commit with an event and no changes is a commit")

    # Readers of the stream see the events only, at the commits' offsets.
    sub = c.subscribe(T, NS, S, start=0)
    events = drain(sub, 4, timeout=3.0)
    check([e.payload for e in events] == [b"plain record", b"opened", b"withdrew 30", b"audit me"],
          "a subscriber sees each commit's event and nothing else: %r" % [e.payload for e in events])
    check([e.offset for e in events] == [0, 1, 2, 3], "at the commits' offsets")
    got = c.group_poll(T, NS, S, 0, "auditors", max_records=10, wait=1.0)
    check([r.payload for r in got] == [b"plain record", b"opened", b"withdrew 30", b"audit me"],
          "a group sees the events too")

    # A live subscriber gets a commit's event as it is committed.
    live = c.subscribe(T, NS, S, start="latest")
    r4 = c.commit(T, NS, b"acct-2", [CommitOp.publish(S, b"live event"), CommitOp.put(S, "k", b"v")])
    got = drain(live, 1, timeout=3.0)
    check([(e.offset, e.payload) for e in got] == [(r4.offset, b"live event")], "a live subscriber sees the event only")

    # The SDK refuses a commit without exactly one event, before sending it.
    try:
        c.commit(T, NS, b"acct-1", [CommitOp.put(S, "balance", b"0")])
        check(False, "a commit without an event is refused")
    except felix.EventCountError:
        check(True, "a commit without an event is refused (EventCountError)")
    check(c.state_get(T, NS, S, b"acct-1", "balance").value == b"70", "and changes nothing")
else:
    v = c.state_get(T, NS, S, b"acct-1", "balance")
    check((v.value, v.version) == (b"70", 2), "after a restart: the state is rebuilt from the log")
    check(c.state_get(T, NS, S, b"acct-1", "owner").value is None, "after a restart: the delete holds")
    sub = c.subscribe(T, NS, S, start=0)
    events = drain(sub, 4, timeout=3.0)
    check([e.payload for e in events] == [b"plain record", b"opened", b"withdrew 30", b"audit me"],
          "after a restart: history still shows events only")
