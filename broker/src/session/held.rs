//! Bytes a core's connections make it hold, bounded per connection and per core: the
//! frames their streams have begun and not finished, and the answers written to a
//! stream QUIC has not yet taken (a client that does not read them), subscription
//! and cache-watch events among them.
//!
//! A stream's reader holds a frame's bytes until the frame is whole (up to 16 MiB), and
//! a connection has up to 1,024 streams: without a bound, one client could make the
//! broker hold 16 GiB. Holding back reads is no bound: a stream left unread keeps its
//! bytes in the connection's QUIC window, and a stream let through then waits for the
//! rest of its frame for ever (`bounds::large_frames_interleaved_…`). Answers are the
//! same the other way: a stream read answer is up to 4 MiB, and a client that never
//! reads leaves one waiting on each of its streams, with the answers worked out ahead
//! of their turn behind it (counted at once). So past a bound a connection is
//! closed, as Redis closes a client past its output buffer limit: the one that crossed
//! its own bound, or, when the core's connections together cross the core's bound, the
//! one holding the most. Closing loses nothing acknowledged.
//!
//! Sans-IO: the caller reports what each stream holds and closes what this names.

use std::hash::Hash;

use rustc_hash::FxHashMap;

/// What a core's connections make it hold, of one kind. `H` closes a connection.
#[derive(Debug)]
pub struct HeldBytes<I, H> {
    per_connection: usize,
    per_core: usize,
    total: usize,
    conns: FxHashMap<I, Conn<H>>,
}

/// Bytes a connection with no authenticated stream may hold (its frames are 64 KiB at
/// most, and a client that authenticates first holds next to nothing before).
pub const UNTRUSTED_MAX: usize = 1 << 20;

#[derive(Debug)]
struct Conn<H> {
    bytes: usize,
    close: H,
    /// One of its streams authenticated.
    trusted: bool,
}

impl<I: Copy + Eq + Hash, H: Clone> HeldBytes<I, H> {
    /// Bounds: what one connection may hold, and what a core's connections may hold
    /// together.
    pub fn new(per_connection: usize, per_core: usize) -> Self {
        HeldBytes {
            per_connection,
            per_core,
            total: 0,
            conns: FxHashMap::default(),
        }
    }

    /// A connection begins; `close` ends it. Until [`HeldBytes::trust`] it may hold
    /// [`UNTRUSTED_MAX`] at most.
    pub fn open(&mut self, id: I, close: H) {
        self.conns.insert(
            id,
            Conn {
                bytes: 0,
                close,
                trusted: false,
            },
        );
    }

    /// One of `id`'s streams authenticated: its own bound is the per-connection one now.
    pub fn trust(&mut self, id: I) {
        if let Some(c) = self.conns.get_mut(&id) {
            c.trusted = true;
        }
    }

    /// A connection ended (or was closed here): what its streams hold no longer counts,
    /// and their later reports are ignored.
    pub fn forget(&mut self, id: I) {
        if let Some(c) = self.conns.remove(&id) {
            self.total -= c.bytes;
        }
    }

    /// One of `id`'s streams holds `now` bytes where it held `before`. Returns the
    /// connection to close, if a growth crosses a bound; it is forgotten at once. Past
    /// the core's bound, of the connections holding anything, one with no authenticated
    /// stream goes first, then the one holding the most.
    pub fn counted(&mut self, id: I, before: usize, now: usize) -> Option<(I, H)> {
        let c = self.conns.get_mut(&id)?;
        c.bytes = c.bytes + now - before;
        self.total = self.total + now - before;
        if now <= before {
            return None;
        }
        let own = if c.trusted {
            self.per_connection
        } else {
            self.per_connection.min(UNTRUSTED_MAX)
        };
        if c.bytes > own {
            return self.close(id);
        }
        if self.total > self.per_core {
            let first = self
                .conns
                .iter()
                .filter(|(_, c)| c.bytes > 0)
                .max_by_key(|(_, c)| (!c.trusted, c.bytes))
                .map(|(id, _)| *id)?;
            return self.close(first);
        }
        None
    }

    /// Whether `id` is counted here: open, not closed for a bound nor ended.
    pub fn is_open(&self, id: I) -> bool {
        self.conns.contains_key(&id)
    }

    /// Bytes held for `id` (0 once forgotten).
    pub fn held(&self, id: I) -> usize {
        self.conns.get(&id).map_or(0, |c| c.bytes)
    }

    /// Bytes held by all of the core's connections.
    pub fn total(&self) -> usize {
        self.total
    }

    fn close(&mut self, id: I) -> Option<(I, H)> {
        let c = self.conns.remove(&id)?;
        self.total -= c.bytes;
        Some((id, c.close))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames() -> HeldBytes<u32, &'static str> {
        let mut u = HeldBytes::new(100, 250);
        for (id, name) in [(1, "a"), (2, "b"), (3, "c")] {
            u.open(id, name);
            u.trust(id);
        }
        u
    }

    #[test]
    fn a_connection_with_no_authenticated_stream_is_bounded_tighter_and_goes_first() {
        let mut u = HeldBytes::new(4 * UNTRUSTED_MAX, 6 * UNTRUSTED_MAX);
        u.open(1, "unauthenticated");
        assert_eq!(u.counted(1, 0, UNTRUSTED_MAX), None);
        assert_eq!(u.counted(1, 0, 1), Some((1, "unauthenticated")));
        // Past the core's bound, one with no authenticated stream is closed before a
        // larger authenticated one.
        u.open(2, "small, unauthenticated");
        u.open(3, "large");
        u.trust(3);
        assert_eq!(u.counted(2, 0, UNTRUSTED_MAX / 2), None);
        assert_eq!(u.counted(3, 0, 4 * UNTRUSTED_MAX), None);
        u.open(4, "the one crossing");
        u.trust(4);
        assert_eq!(
            u.counted(4, 0, 2 * UNTRUSTED_MAX),
            Some((2, "small, unauthenticated"))
        );
        // One holding nothing is no candidate: closing it would free nothing.
        u.open(5, "new, holding nothing");
        assert_eq!(
            u.counted(4, 2 * UNTRUSTED_MAX, 3 * UNTRUSTED_MAX),
            Some((3, "large"))
        );
    }

    #[test]
    fn a_connection_past_its_own_bound_is_closed_and_forgotten() {
        let mut u = frames();
        assert_eq!(u.counted(1, 0, 60), None);
        assert_eq!(u.counted(1, 0, 40), None, "two readers: 100 is within");
        assert_eq!(u.held(1), 100);
        assert_eq!(u.counted(1, 40, 41), Some((1, "a")));
        assert_eq!((u.held(1), u.total()), (0, 0));
        // Its readers' later reports (the bytes they free as they end) are ignored.
        assert_eq!(u.counted(1, 60, 0), None);
        assert_eq!(u.total(), 0);
    }

    #[test]
    fn past_the_cores_bound_the_connection_holding_the_most_is_closed() {
        let mut u = frames();
        assert_eq!(u.counted(1, 0, 90), None);
        assert_eq!(u.counted(2, 0, 95), None);
        // The connection that crosses the core's bound is not the largest: the largest
        // is closed, whoever pushed the total over.
        assert_eq!(u.counted(3, 0, 70), Some((2, "b")));
        assert_eq!(u.total(), 160);
        assert_eq!(u.counted(3, 70, 0), None);
        assert_eq!((u.held(1), u.held(3), u.total()), (90, 0, 90));
    }

    #[test]
    fn frames_that_finish_give_their_bytes_back() {
        let mut u = frames();
        for _ in 0..1000 {
            assert_eq!(u.counted(2, 0, 100), None);
            assert_eq!(u.counted(3, 0, 100), None);
            assert_eq!(u.counted(2, 100, 0), None);
            assert_eq!(u.counted(3, 100, 0), None);
        }
        assert_eq!(u.total(), 0);
        u.forget(2);
        assert_eq!(
            u.counted(2, 0, 1000),
            None,
            "a forgotten connection is not counted"
        );
        assert_eq!(u.total(), 0);
    }
}
