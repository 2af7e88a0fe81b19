//! The bound on the current values that starting cache watches hold together.
//!
//! A retained watch, or one starting over, begins with a copy of every key of its cache
//! that it follows: the key and its entry (the values are shared with the cache). The
//! copy is built whole on the cache's core before the first page of it is written, and
//! is held on the watcher's core until the watcher has taken its last page. Bounds on
//! unread answers count what is left of it only once a page has waited a second, so
//! before this bound, one connection starting 1,024 watches of a cache of a million keys
//! had the broker build about 136 MiB per watch at once.
//!
//! The bound is the process's, as the copies are built on one core and held on another:
//! one atomic count, taken once per watch start and given back page by page as the
//! watcher takes them, never on a publish's path. A copy larger than the bound is taken
//! when nothing else is held, so a cache larger than the bound can still be watched, one
//! watch at a time.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::shard::WatchChange;

/// Why a watch start is refused while the copies held fill the bound (`overloaded`):
/// the watch's task asks again for a while before the client is answered so.
pub const SNAPSHOTS_FULL: &str = "watch snapshots held past max_watch_snapshot_bytes";

/// The bytes of current values the starting watches of this process may hold together.
#[derive(Debug)]
pub struct SnapshotBudget {
    limit: usize,
    held: AtomicUsize,
}

impl SnapshotBudget {
    /// A budget of `limit` bytes (at least 1).
    pub fn new(limit: usize) -> Self {
        SnapshotBudget {
            limit: limit.max(1),
            held: AtomicUsize::new(0),
        }
    }

    /// Whether a copy could be taken now: looked at before one is built.
    pub fn has_room(&self) -> bool {
        self.held.load(Ordering::Relaxed) < self.limit
    }

    /// Bytes held now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    /// Charges `bytes` if they fit with what is held, or if nothing is held.
    pub fn take(self: &Arc<Self>, bytes: usize) -> Option<SnapshotCharge> {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                (held == 0 || held.saturating_add(bytes) <= self.limit).then(|| held + bytes)
            })
            .ok()?;
        Some(SnapshotCharge {
            budget: Some(self.clone()),
            bytes,
        })
    }
}

/// What a held copy is charged; given back as its pages are taken, the rest when
/// dropped.
#[derive(Debug, Default)]
pub struct SnapshotCharge {
    budget: Option<Arc<SnapshotBudget>>,
    bytes: usize,
}

impl SnapshotCharge {
    /// Gives back `bytes` of the charge (at most what is left of it).
    pub fn give_back(&mut self, bytes: usize) {
        let bytes = bytes.min(self.bytes);
        self.bytes -= bytes;
        if let Some(b) = &self.budget {
            b.held.fetch_sub(bytes, Ordering::AcqRel);
        }
    }

    /// What is left of the charge.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for SnapshotCharge {
    fn drop(&mut self) {
        self.give_back(self.bytes);
    }
}

/// What one change of a copy is charged: itself and its key (its value is the cache's).
pub fn charged_bytes(c: &WatchChange) -> usize {
    std::mem::size_of::<WatchChange>() + c.key.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_are_taken_while_they_fit_and_one_alone_whatever_its_size() {
        let budget = Arc::new(SnapshotBudget::new(100));
        let mut a = budget.take(60).expect("fits");
        assert!(budget.take(50).is_none(), "60 + 50 is past 100");
        let b = budget.take(40).expect("60 + 40 fits");
        assert!(!budget.has_room());
        drop(b);
        a.give_back(30);
        assert_eq!(budget.held(), 30);
        assert!(budget.take(71).is_none());
        let c = budget.take(70).expect("30 + 70 fits");
        drop((a, c));
        assert_eq!(budget.held(), 0, "each charge gives back what it took");
        let big = budget
            .take(1_000)
            .expect("alone, a copy past the bound is taken");
        assert!(budget.take(1).is_none());
        drop(big);
        assert_eq!(budget.held(), 0);
    }

    #[test]
    fn a_charge_gives_back_no_more_than_it_holds() {
        let budget = Arc::new(SnapshotBudget::new(100));
        let _other = budget.take(10).unwrap();
        let mut c = budget.take(20).unwrap();
        c.give_back(50);
        assert_eq!((c.bytes(), budget.held()), (0, 10));
        drop(c);
        assert_eq!(budget.held(), 10);
    }
}
