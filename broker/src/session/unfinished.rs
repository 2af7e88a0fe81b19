//! The bytes of frames a core's connections have begun and not finished, bounded per
//! connection and per core.
//!
//! A stream's reader holds a frame's bytes until the frame is whole (up to 16 MiB), and
//! a connection has up to 1,024 streams: without a bound, one client could make the
//! broker hold 16 GiB. Holding back reads is no bound: a stream left unread keeps its
//! bytes in the connection's QUIC window, and a stream let through then waits for the
//! rest of its frame for ever (`bounds::large_frames_interleaved_…`). So every stream is
//! read, and past a bound a connection is closed (QUIC application error 3): the one
//! that crossed its own bound, or, when the core's connections together cross the core's
//! bound, the one holding the most. Closing loses nothing acknowledged.
//!
//! Sans-IO: the caller reports each reader's bytes and closes what this names.

use std::hash::Hash;

use rustc_hash::FxHashMap;

/// What a core's connections hold in unfinished frames. `H` closes a connection.
#[derive(Debug)]
pub struct UnfinishedFrames<I, H> {
    per_connection: usize,
    per_core: usize,
    total: usize,
    conns: FxHashMap<I, (usize, H)>,
}

impl<I: Copy + Eq + Hash, H: Clone> UnfinishedFrames<I, H> {
    /// Bounds: what one connection may hold, and what a core's connections may hold
    /// together.
    pub fn new(per_connection: usize, per_core: usize) -> Self {
        UnfinishedFrames {
            per_connection,
            per_core,
            total: 0,
            conns: FxHashMap::default(),
        }
    }

    /// A connection begins; `close` ends it.
    pub fn open(&mut self, id: I, close: H) {
        self.conns.insert(id, (0, close));
    }

    /// A connection ended (or was closed here): what its readers hold no longer counts,
    /// and their later reports are ignored.
    pub fn forget(&mut self, id: I) {
        if let Some((bytes, _)) = self.conns.remove(&id) {
            self.total -= bytes;
        }
    }

    /// One of `id`'s readers holds `now` bytes where it held `before`. Returns the
    /// connection to close, if a growth crosses a bound; it is forgotten at once.
    pub fn counted(&mut self, id: I, before: usize, now: usize) -> Option<(I, H)> {
        let (bytes, _) = self.conns.get_mut(&id)?;
        *bytes = *bytes + now - before;
        self.total = self.total + now - before;
        if now <= before {
            return None;
        }
        if *bytes > self.per_connection {
            return self.close(id);
        }
        if self.total > self.per_core {
            let largest = self
                .conns
                .iter()
                .max_by_key(|(_, (bytes, _))| *bytes)
                .map(|(id, _)| *id)?;
            return self.close(largest);
        }
        None
    }

    /// Bytes held by `id`'s readers (0 once forgotten).
    pub fn held(&self, id: I) -> usize {
        self.conns.get(&id).map_or(0, |(bytes, _)| *bytes)
    }

    /// Bytes held by all of the core's connections.
    pub fn total(&self) -> usize {
        self.total
    }

    fn close(&mut self, id: I) -> Option<(I, H)> {
        let (bytes, close) = self.conns.remove(&id)?;
        self.total -= bytes;
        Some((id, close))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames() -> UnfinishedFrames<u32, &'static str> {
        let mut u = UnfinishedFrames::new(100, 250);
        for (id, name) in [(1, "a"), (2, "b"), (3, "c")] {
            u.open(id, name);
        }
        u
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
