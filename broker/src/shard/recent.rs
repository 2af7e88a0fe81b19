//! The recent changes of a watched cache shard, held in memory so that watchers that
//! keep up are answered without reading the log.
//!
//! Every watcher of a cache waits on the shard's applied end and, once it moves, asks
//! for the changes its filter follows since its position. Read from the log, W watchers
//! of a cache taking R writes a second cost W×R log reads a second. The window holds
//! each put and delete applied since it began, in offset order, up to a bound; a
//! watcher whose position lies inside it is answered from it, one behind it (resuming
//! from an old offset, or fallen back past the bound) from the log, as before.
//!
//! The window exists only while the shard is watched: a watch's start or read makes it,
//! and once [`RECENT_MAX_CHANGES`] changes were held with no watcher reading it goes
//! (nobody watches). Values are copied in, so what the window holds is what it counts
//! (a value sliced from a larger buffer would keep the whole buffer alive).

use std::collections::VecDeque;

use bytes::Bytes;

use super::{CacheRecord, RecordOp, WatchChange, WatchFilter};

/// Most changes the window holds.
pub const RECENT_MAX_CHANGES: usize = 65_536;
/// Most bytes (keys, values and [`ENTRY_OVERHEAD`] each) the window holds.
pub const RECENT_MAX_BYTES: usize = 8 << 20;
/// What one change costs the window beyond its key and value.
const ENTRY_OVERHEAD: usize = 64;

/// The puts and deletes applied to a cache shard from `from` on.
#[derive(Debug)]
pub struct Recent {
    /// Every put and delete at or past this offset applied since the window began is
    /// held (the ones below it may not be).
    from: u64,
    changes: VecDeque<WatchChange>,
    bytes: usize,
    /// Changes held since a watcher last read the window.
    unread: usize,
}

/// What [`Recent::note`] asks of its owner.
#[derive(Debug, PartialEq, Eq)]
pub enum Kept {
    /// Keep the window.
    Yes,
    /// Nobody read it for [`RECENT_MAX_CHANGES`] changes: drop it.
    Unwatched,
}

impl Recent {
    /// An empty window whose changes begin at `end`, the applied end of the index it
    /// follows (everything below it was applied before the window began).
    pub fn new(end: u64) -> Recent {
        Recent {
            from: end,
            changes: VecDeque::new(),
            bytes: 0,
            unread: 0,
        }
    }

    /// Notes `rec`, applied at `offset`; `end` is the index's applied end after it.
    pub fn note(&mut self, rec: &CacheRecord, offset: u64, end: u64) -> Kept {
        let value = match rec.op {
            // A compaction's copy restates a value; it is not a change.
            RecordOp::Put if rec.carried.is_some() => return Kept::Yes,
            RecordOp::Put => Some(Bytes::copy_from_slice(&rec.value)),
            RecordOp::Delete => None,
            RecordOp::Add(_) | RecordOp::Set(_) | RecordOp::Cut(_) => return Kept::Yes,
        };
        if offset < self.from || self.changes.back().is_some_and(|c| c.offset >= offset) {
            // Applied out of offset order, which the index does not do: start over past
            // it rather than hand a watcher changes out of order (behind, it reads the
            // log).
            *self = Recent::new(end);
            return Kept::Yes;
        }
        self.unread += 1;
        if self.unread > RECENT_MAX_CHANGES {
            return Kept::Unwatched;
        }
        self.bytes += cost(&rec.key, value.as_ref());
        self.changes.push_back(WatchChange {
            key: rec.key.clone(),
            value,
            offset,
            expires_at_ms: if rec.op == RecordOp::Put {
                rec.expires_at_ms
            } else {
                0
            },
        });
        while self.bytes > RECENT_MAX_BYTES || self.changes.len() > RECENT_MAX_CHANGES {
            let Some(c) = self.changes.pop_front() else {
                break;
            };
            self.bytes -= cost(&c.key, c.value.as_ref());
            self.from = c.offset + 1;
        }
        Kept::Yes
    }

    /// The changes `filter` follows in `[from, end)`, about `max_bytes` of them at
    /// most, and where the next read starts; `None` when the window does not hold
    /// every change from `from` (read the log). `end` is the applied end: the window
    /// holds nothing past it.
    pub fn read(
        &mut self,
        from: u64,
        end: u64,
        filter: &WatchFilter,
        max_bytes: usize,
    ) -> Option<(Vec<WatchChange>, u64)> {
        if from < self.from {
            return None;
        }
        self.unread = 0;
        let start = self.changes.partition_point(|c| c.offset < from);
        let mut out = Vec::new();
        let mut bytes = 0;
        for c in self.changes.range(start..) {
            if c.offset >= end {
                break;
            }
            if !filter.matches(&c.key) {
                continue;
            }
            if bytes >= max_bytes {
                return Some((out, c.offset));
            }
            bytes += cost(&c.key, c.value.as_ref());
            out.push(c.clone());
        }
        Some((out, end.max(from)))
    }

    /// Marks the window read (a watch began on it).
    pub fn watched(&mut self) {
        self.unread = 0;
    }
}

fn cost(key: &str, value: Option<&Bytes>) -> usize {
    key.len() + value.map_or(0, Bytes::len) + ENTRY_OVERHEAD
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(key: &str, value: &[u8]) -> CacheRecord {
        CacheRecord {
            op: RecordOp::Put,
            expires_at_ms: 0,
            key: key.to_owned(),
            value: Bytes::copy_from_slice(value),
            carried: None,
        }
    }

    fn every() -> WatchFilter {
        WatchFilter::Prefix(String::new())
    }

    /// Puts and deletes are held in order and handed back by filter; counters and a
    /// compaction's copies are not changes; a position before the window is refused.
    #[test]
    fn the_window_holds_puts_and_deletes_from_where_it_began() {
        let mut r = Recent::new(10);
        let del = CacheRecord {
            op: RecordOp::Delete,
            value: Bytes::new(),
            ..put("a", b"")
        };
        let add = CacheRecord {
            op: RecordOp::Add(3),
            ..put("n", b"")
        };
        let copy = CacheRecord {
            carried: Some(4),
            ..put("b", b"old")
        };
        for (rec, at) in [(put("a", b"1"), 10), (add, 11), (put("b", b"2"), 12)] {
            assert_eq!(r.note(&rec, at, at + 1), Kept::Yes);
        }
        r.note(&copy, 13, 14);
        r.note(&del, 14, 15);
        let (all, next) = r.read(10, 15, &every(), 1 << 20).unwrap();
        let seen: Vec<_> = all.iter().map(|c| (c.offset, c.value.is_some())).collect();
        assert_eq!(seen, [(10, true), (12, true), (14, false)]);
        assert_eq!(next, 15);
        let (a, _) = r
            .read(11, 15, &WatchFilter::Key("a".into()), 1 << 20)
            .unwrap();
        assert_eq!(a.iter().map(|c| c.offset).collect::<Vec<_>>(), [14]);
        // Nothing at or past the applied end is handed out.
        let (upto, next) = r.read(10, 13, &every(), 1 << 20).unwrap();
        assert_eq!((upto.len(), next), (2, 13));
        assert!(
            r.read(9, 15, &every(), 1 << 20).is_none(),
            "before the window"
        );
    }

    /// A bounded answer says where to go on from, and going on from there loses none.
    #[test]
    fn an_answer_over_its_bound_goes_on_where_it_stopped() {
        let mut r = Recent::new(0);
        for i in 0..100u64 {
            r.note(&put(&format!("k{i}"), &[7; 100]), i, i + 1);
        }
        let (mut from, mut got) = (0, Vec::new());
        while from < 100 {
            let (page, next) = r.read(from, 100, &every(), 1000).unwrap();
            assert!(page.len() < 100 && next > from);
            got.extend(page.into_iter().map(|c| c.offset));
            from = next;
        }
        assert_eq!(got, (0..100).collect::<Vec<_>>());
    }

    /// Past its bounds the window lets its oldest changes go and refuses positions
    /// before what it still holds; unread for a window's worth of changes, it asks to be
    /// dropped.
    #[test]
    fn the_window_is_bounded_and_dropped_when_nobody_reads_it() {
        let mut r = Recent::new(0);
        let big = vec![1u8; 1 << 20];
        for i in 0..10u64 {
            assert_eq!(r.note(&put("k", &big), i, i + 1), Kept::Yes);
        }
        assert!(r.bytes <= RECENT_MAX_BYTES);
        assert!(r.read(0, 10, &every(), usize::MAX).is_none());
        let (held, _) = r.read(r.from, 10, &every(), usize::MAX).unwrap();
        assert_eq!(held.first().map(|c| c.offset), Some(r.from));
        assert_eq!(held.len() as u64, 10 - r.from);

        let mut r = Recent::new(0);
        let mut at = 0;
        for _ in 0..RECENT_MAX_CHANGES {
            assert_eq!(r.note(&put("k", b"v"), at, at + 1), Kept::Yes);
            at += 1;
        }
        // A read keeps it.
        r.read(at, at, &every(), 1).unwrap();
        for _ in 0..RECENT_MAX_CHANGES {
            assert_eq!(r.note(&put("k", b"v"), at, at + 1), Kept::Yes);
            at += 1;
        }
        assert_eq!(r.note(&put("k", b"v"), at, at + 1), Kept::Unwatched);
    }

    /// A change noted out of offset order starts the window over past it, so no
    /// watcher is handed changes out of order or missing.
    #[test]
    fn a_change_out_of_order_starts_the_window_over() {
        let mut r = Recent::new(0);
        r.note(&put("a", b"1"), 5, 6);
        r.note(&put("a", b"2"), 3, 6);
        assert!(r.read(0, 6, &every(), 1 << 20).is_none());
        assert!(r.read(5, 6, &every(), 1 << 20).is_none());
        assert_eq!(r.read(6, 6, &every(), 1 << 20).unwrap().0.len(), 0);
    }
}
