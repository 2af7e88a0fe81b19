//! The flow-control windows of one endpoint's connections, drawn from one budget.
//!
//! quinn-proto buffers, per connection, up to its *send window* of data written and not
//! yet acknowledged by the peer, and up to its *receive window* of data received and
//! not yet read (out-of-order data and data on streams the application is not reading
//! included). Neither is seen by the broker's own bounds, which count what its
//! sessions hold: a peer that acknowledges nothing, or sends past a stream the broker
//! stopped reading, pins both windows for as long as it keeps the connection alive.
//! At 32 MiB each way and 10,000 connections a core, that was hundreds of GiB a peer
//! with a token could make a core hold.
//!
//! A pool grants each connection its windows (the same number of bytes each way) from
//! one budget, so their sum never passes it:
//! - every connection the endpoint may have is sure of a floor ([`WINDOW_FLOOR_BYTES`]
//!   each way), kept back for it before anything else is granted;
//! - a new connection gets, above its floor, at most one [`SPARE_SHARE`]th of what is
//!   left spare, up to the transport's window; the first connections of a quiet core
//!   get the full window, later ones less as the budget fills;
//! - no grant grows past a fair share (the budget over the live connections), so a
//!   few busy connections cannot take all that is spare;
//! - a grant never shrinks (a window handed to a peer cannot be taken back from it:
//!   receive credit once advertised stays, data buffered stays until acknowledged); a
//!   connection below the full window asks again as it works, for its share of what
//!   connections that went gave back.

use std::cell::Cell;
use std::rc::Rc;

/// The window every connection is sure of, each way. 32 KiB is twenty full datagrams:
/// a connection on a LAN's round trip still moves hundreds of megabytes a second, and
/// 10,000 connections hold 625 MiB at most.
pub const WINDOW_FLOOR_BYTES: u64 = 32 << 10;

/// A connection takes, above its floor, at most this fraction of the spare budget (both
/// directions together).
pub const SPARE_SHARE: u64 = 16;

/// One endpoint's budget for its connections' windows.
#[derive(Debug)]
pub(crate) struct WindowPool {
    budget: u64,
    /// Most a connection's window may be, each way (the transport's).
    max: u64,
    floor: u64,
    /// Connections the endpoint may have at once: each one's floor is kept back.
    connections: usize,
    /// Granted to live connections, both directions.
    granted: Cell<u64>,
    live: Cell<usize>,
}

impl WindowPool {
    /// A pool of `budget` bytes for up to `connections` connections whose windows are
    /// at most `max` bytes each way. A budget below every connection's floor is taken as
    /// that floor's total (the caller validates it).
    pub(crate) fn new(budget: u64, max: u64, connections: usize) -> Rc<WindowPool> {
        let floor = WINDOW_FLOOR_BYTES.min(max);
        Rc::new(WindowPool {
            budget: budget.max(floor * 2 * connections as u64),
            max,
            floor,
            connections,
            granted: Cell::new(0),
            live: Cell::new(0),
        })
    }

    /// What is neither granted nor kept back for connections not here yet.
    fn spare(&self) -> u64 {
        let kept = self.floor * 2 * self.connections.saturating_sub(self.live.get()) as u64;
        self.budget.saturating_sub(self.granted.get() + kept)
    }

    /// A live connection's fair share of the budget, each way: no grant grows past it
    /// (nor past the full window), so a few busy connections do not take all that is
    /// spare while others sit at their floor.
    fn fair(&self) -> u64 {
        let live = self.live.get().max(1) as u64;
        (self.budget / (2 * live)).clamp(self.floor, self.max)
    }

    /// The most a grant may take now above what it has, each way.
    fn offer(&self, each: u64) -> u64 {
        (self.spare() / (2 * SPARE_SHARE)).min(self.fair().saturating_sub(each))
    }

    /// A new connection's windows.
    pub(crate) fn grant(self: &Rc<Self>) -> Grant {
        self.live.set(self.live.get() + 1);
        self.granted.set(self.granted.get() + 2 * self.floor);
        let mut g = Grant {
            pool: self.clone(),
            each: self.floor,
        };
        let more = self.offer(g.each);
        g.take(more);
        g
    }

    /// A connection's full window, each way.
    pub(crate) fn max(&self) -> u64 {
        self.max
    }

    /// Bytes granted to live connections, both directions together.
    pub(crate) fn granted(&self) -> u64 {
        self.granted.get()
    }
}

/// One connection's windows (each way), given back to the pool when dropped.
#[derive(Debug)]
pub(crate) struct Grant {
    pool: Rc<WindowPool>,
    each: u64,
}

impl Grant {
    /// The connection's window, each way.
    pub(crate) fn each(&self) -> u64 {
        self.each
    }

    fn take(&mut self, more: u64) {
        self.each += more;
        self.pool.granted.set(self.pool.granted.get() + 2 * more);
    }

    /// Takes more from what is spare, when below its fair share and at least a floor's
    /// worth (or the rest of the way there) is offered: true when it grew.
    pub(crate) fn grow(&mut self) -> bool {
        let p = &self.pool;
        let fair = p.fair();
        if self.each >= fair {
            return false;
        }
        let more = p.offer(self.each);
        if more == 0 || (more < p.floor && self.each + more < fair) {
            return false;
        }
        self.take(more);
        true
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        let p = &self.pool;
        p.granted.set(p.granted.get().saturating_sub(2 * self.each));
        p.live.set(p.live.get().saturating_sub(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// However connections come and go, what is granted stays within the budget and
    /// every connection has at least its floor, up to the endpoint's limit.
    #[test]
    fn grants_stay_within_the_budget_and_each_has_its_floor() {
        let pool = WindowPool::new(64 * MIB, 8 * MIB, 100);
        let mut grants: Vec<Grant> = Vec::new();
        let mut seed = 7u64;
        for step in 0..5_000 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let r = (seed >> 33) % 10;
            if r < 5 && grants.len() < 100 {
                grants.push(pool.grant());
            } else if r < 8 && !grants.is_empty() {
                let i = (seed >> 40) as usize % grants.len();
                grants.swap_remove(i);
            } else if let Some(g) = grants.iter_mut().next() {
                g.grow();
            }
            let sum: u64 = grants.iter().map(|g| 2 * g.each()).sum();
            assert_eq!(sum, pool.granted(), "step {step}");
            let kept = WINDOW_FLOOR_BYTES * 2 * (100 - grants.len() as u64);
            assert!(sum + kept <= 64 * MIB, "step {step}: {sum} + {kept}");
            assert!(grants.iter().all(|g| g.each() >= WINDOW_FLOOR_BYTES));
            assert!(grants.iter().all(|g| g.each() <= 8 * MIB));
        }
    }

    /// The first connections of a quiet endpoint get the full window; once the budget is
    /// taken, new ones get their floor; those that stay grow back as others go.
    #[test]
    fn early_connections_get_the_full_window_and_later_ones_grow_as_others_go() {
        let pool = WindowPool::new(256 * MIB, 4 * MIB, 1_000);
        let first = pool.grant();
        assert_eq!(first.each(), 4 * MIB);
        let mut many: Vec<Grant> = (0..200).map(|_| pool.grant()).collect();
        let mut late = pool.grant();
        assert!(late.each() < MIB, "late: {}", late.each());
        assert!(!late.grow(), "nothing spare yet");
        many.clear();
        assert!(late.grow());
        while late.grow() {}
        assert_eq!(late.each(), 4 * MIB);
        drop((first, late));
        assert_eq!(pool.granted(), 0);
    }
}
