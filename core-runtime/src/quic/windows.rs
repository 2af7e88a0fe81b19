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
//! A pool grants each connection its windows from one budget, so that what they may
//! make the endpoint hold together never passes it:
//! - a connection is charged its send window plus the larger of its receive window and
//!   the receive credit it began with: credit advertised before it was trusted (the
//!   untrusted window) cannot be taken back, so it stays charged for the connection's
//!   life;
//! - every connection the endpoint may have is sure of a floor: a send window of
//!   [`WINDOW_FLOOR_BYTES`] and the least receive credit a connection begins with (the
//!   crowded window), kept back for it before anything else is granted; a connection
//!   begins with more credit (the full untrusted window) only while the spare budget
//!   covers it, and is accepted with the crowded one otherwise;
//! - nothing above the floor is granted before the connection is trusted (its receive
//!   window widened), so connections that never authenticate, forged ones included,
//!   hold only their floors; once trusted, a connection takes at most one
//!   [`SPARE_SHARE`]th of what is spare each time it is driven, up to the lesser of the
//!   transport's window and its fair share (the budget over the trusted connections),
//!   so a few busy connections cannot take all that is spare;
//! - a grant never shrinks (receive credit once advertised stays); a connection's grant
//!   returns to the pool when the connection goes.

use std::cell::Cell;
use std::rc::Rc;

use super::{CROWDED_WINDOW_BYTES, UNTRUSTED_WINDOW_BYTES};

/// The send window (and, once trusted, receive window) every connection is sure of.
/// 32 KiB is twenty full datagrams: a connection on a LAN's round trip still moves
/// hundreds of megabytes a second.
pub const WINDOW_FLOOR_BYTES: u64 = 32 << 10;

/// A trusted connection takes, each time it grows, at most this fraction of the spare
/// budget (both directions together).
pub(crate) const SPARE_SHARE: u64 = 16;

/// What a pool keeps back for each connection, both directions together: a send window
/// of [`WINDOW_FLOOR_BYTES`] and the receive credit it may begin with, `first_window`
/// (the crowded window on an endpoint that has one, else the full untrusted one).
pub const fn reserved_per_connection(first_window: u64) -> u64 {
    let recv = if first_window > WINDOW_FLOOR_BYTES {
        first_window
    } else {
        WINDOW_FLOOR_BYTES
    };
    WINDOW_FLOOR_BYTES + recv
}

/// The receive credit a connection begins with, before it is trusted.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Credit {
    /// The full untrusted window ([`UNTRUSTED_WINDOW_BYTES`]).
    Full,
    /// The crowded one ([`CROWDED_WINDOW_BYTES`]).
    Crowded,
}

/// One endpoint's budget for its connections' windows.
#[derive(Debug)]
pub(crate) struct WindowPool {
    budget: u64,
    /// Most a connection's window may be, each way (the transport's).
    max: u64,
    floor: u64,
    /// Kept back for each connection not here yet.
    reserve: u64,
    /// The receive credit a connection begins with untrusted: the full window, or the
    /// crowded one.
    full: u64,
    crowded: u64,
    /// Connections the endpoint may have at once.
    connections: usize,
    /// Charged to live connections.
    granted: Cell<u64>,
    live: Cell<usize>,
    /// Live connections that asked to grow (trusted ones).
    trusted: Cell<usize>,
}

impl WindowPool {
    /// A pool of `budget` bytes for up to `connections` connections whose windows are
    /// at most `max` bytes each way, on an endpoint that has a `crowded` config to fall
    /// back on (each connection's reserve covers the crowded window) or not (it covers
    /// the full untrusted one). A budget below every connection's reserve is taken as
    /// their total (the caller validates it).
    pub(crate) fn new(budget: u64, max: u64, crowded: bool, connections: usize) -> Rc<WindowPool> {
        let window = |w: u32| u64::from(w).min(max);
        let (full, crowded_window) = (window(UNTRUSTED_WINDOW_BYTES), window(CROWDED_WINDOW_BYTES));
        let reserve = reserved_per_connection(if crowded { crowded_window } else { full });
        Rc::new(WindowPool {
            budget: budget.max(reserve.saturating_mul(connections as u64)),
            max,
            floor: WINDOW_FLOOR_BYTES.min(max),
            reserve,
            full,
            crowded: crowded_window,
            connections,
            granted: Cell::new(0),
            live: Cell::new(0),
            trusted: Cell::new(0),
        })
    }

    /// What is neither charged nor kept back for connections not here yet.
    fn spare(&self) -> u64 {
        let absent = self.connections.saturating_sub(self.live.get()) as u64;
        let kept = self.reserve.saturating_mul(absent);
        self.budget
            .saturating_sub(self.granted.get().saturating_add(kept))
    }

    /// Whether a new connection may begin with the full untrusted window: when its
    /// reserve covers it, or the spare budget covers the rest.
    pub(crate) fn may_begin_full(&self) -> bool {
        let charge = self.floor + self.full.max(self.floor);
        charge <= self.reserve || self.spare() >= charge - self.reserve
    }

    /// A trusted connection's fair share of the budget, each way (connections not
    /// trusted, which hold their floors only, do not shrink it).
    fn fair(&self) -> u64 {
        let trusted = self.trusted.get().max(1) as u64;
        (self.budget / (2 * trusted)).clamp(self.floor, self.max)
    }

    /// A new connection's grant: its floor, and the receive `credit` it begins with.
    pub(crate) fn admit(self: &Rc<Self>, credit: Credit) -> Grant {
        self.live.set(self.live.get() + 1);
        let g = Grant {
            pool: self.clone(),
            each: self.floor,
            began_with: match credit {
                Credit::Full => self.full,
                Credit::Crowded => self.crowded,
            },
            trusted: false,
        };
        self.granted.set(self.granted.get() + g.charge());
        g
    }

    /// Charged to live connections, both directions together.
    #[cfg(test)]
    pub(crate) fn granted(&self) -> u64 {
        self.granted.get()
    }
}

/// One connection's windows, given back to the pool when dropped.
#[derive(Debug)]
pub(crate) struct Grant {
    pool: Rc<WindowPool>,
    /// Its send window, and its receive window once trusted.
    each: u64,
    /// The receive credit it was given before it was trusted.
    began_with: u64,
    /// It asked to grow: counted among the trusted connections.
    trusted: bool,
}

impl Grant {
    /// The connection's window, each way.
    pub(crate) fn each(&self) -> u64 {
        self.each
    }

    /// Its receive window once widened to `asked`: its grant, and never below the credit
    /// it began with. (quinn-proto keeps credit it advertised: set lower, the window
    /// owes the difference and, set higher again, adds to the credit still out, which
    /// could then pass the grant.)
    pub(crate) fn receive_window(&self, asked: u64) -> u64 {
        asked.min(self.each).max(self.began_with)
    }

    /// What it holds of the pool: its send window and the most receive credit it can
    /// have out ([`Grant::receive_window`]).
    fn charge(&self) -> u64 {
        self.each + self.each.max(self.began_with)
    }

    /// Takes more from what is spare, when below its fair share and at least a floor's
    /// worth (or the rest of the way there) is offered: true when it grew. Only for a
    /// trusted connection: the caller asks for no other.
    pub(crate) fn grow(&mut self) -> bool {
        let p = &self.pool;
        if !self.trusted {
            self.trusted = true;
            p.trusted.set(p.trusted.get() + 1);
        }
        let target = p.fair();
        if self.each >= target {
            return false;
        }
        let more = (p.spare() / (2 * SPARE_SHARE)).min(target - self.each);
        if more == 0 || (more < p.floor && self.each + more < target) {
            return false;
        }
        let before = self.charge();
        self.each += more;
        p.granted.set(p.granted.get() + self.charge() - before);
        true
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        let p = &self.pool;
        p.granted.set(p.granted.get().saturating_sub(self.charge()));
        p.live.set(p.live.get().saturating_sub(1));
        if self.trusted {
            p.trusted.set(p.trusted.get().saturating_sub(1));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const CROWDED: u64 = 128 << 10;

    /// However connections come, grow and go, what is charged stays within the budget,
    /// every connection has at least its floor, and none grows past its fair share as it
    /// is when it grows, up to the endpoint's limit.
    #[test]
    fn grants_stay_within_the_budget_and_each_has_its_floor() {
        let pool = WindowPool::new(64 * MIB, 8 * MIB, true, 100);
        let mut grants: Vec<Grant> = Vec::new();
        let mut seed = 7u64;
        for step in 0..20_000 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let r = (seed >> 33) % 10;
            let i = (seed >> 40) as usize;
            if r < 4 && grants.len() < 100 {
                let credit = if pool.may_begin_full() {
                    Credit::Full
                } else {
                    Credit::Crowded
                };
                grants.push(pool.admit(credit));
            } else if r < 6 && !grants.is_empty() {
                grants.swap_remove(i % grants.len());
            } else if !grants.is_empty() {
                let n = grants.len();
                if grants[i % n].grow() {
                    let trusted = grants.iter().filter(|g| g.trusted).count() as u64;
                    let fair = (64 * MIB / (2 * trusted)).clamp(WINDOW_FLOOR_BYTES, 8 * MIB);
                    let each = grants[i % n].each();
                    assert!(each <= fair, "step {step}: {each} past {fair}");
                }
            }
            let sum: u64 = grants.iter().map(Grant::charge).sum();
            assert_eq!(sum, pool.granted(), "step {step}");
            let kept = reserved_per_connection(CROWDED) * (100 - grants.len() as u64);
            assert!(sum + kept <= 64 * MIB, "step {step}: {sum} + {kept}");
            assert!(grants.iter().all(|g| g.each() >= WINDOW_FLOOR_BYTES));
        }
    }

    /// A connection is admitted with its floor alone, whatever is spare: the budget
    /// goes to connections once trusted, so ones that never authenticate (forged ones
    /// included) hold their floors only. The first trusted ones of a quiet endpoint grow
    /// to the full window; once the budget is taken, later ones stay near their floor
    /// and grow as others go.
    #[test]
    fn only_trusted_connections_grow_and_later_ones_grow_as_others_go() {
        let pool = WindowPool::new(256 * MIB, 4 * MIB, true, 1_000);
        let half_open: Vec<Grant> = (0..500).map(|_| pool.admit(Credit::Crowded)).collect();
        assert_eq!(pool.granted(), 500 * reserved_per_connection(CROWDED));
        let mut first = pool.admit(Credit::Full);
        assert_eq!(first.each(), WINDOW_FLOOR_BYTES);
        while first.grow() {}
        assert_eq!(first.each(), 4 * MIB);
        let mut busy: Vec<Grant> = (0..200).map(|_| pool.admit(Credit::Crowded)).collect();
        for _ in 0..10 {
            busy.iter_mut().for_each(|g| {
                g.grow();
            });
        }
        let mut late = pool.admit(Credit::Crowded);
        for _ in 0..10 {
            late.grow();
        }
        assert_eq!(late.each(), WINDOW_FLOOR_BYTES, "nothing spare left");
        busy.clear();
        drop(half_open);
        assert!(late.grow());
        while late.grow() {}
        assert_eq!(late.each(), 4 * MIB);
        drop((first, late));
        assert_eq!(pool.granted(), 0);
    }

    /// Past what is spare, a connection begins with the crowded window, which its
    /// reserve always covers.
    #[test]
    fn a_connection_begins_with_the_full_untrusted_window_only_while_spare_covers_it() {
        // 8 connections' reserves (1.25 MiB) and 2 MiB spare.
        let pool = WindowPool::new(3 * MIB + MIB / 4, 32 * MIB, true, 8);
        let mut held = Vec::new();
        while pool.may_begin_full() {
            held.push(pool.admit(Credit::Full));
        }
        assert_eq!(held.len(), 2);
        while held.len() < 8 {
            held.push(pool.admit(Credit::Crowded));
            assert!(pool.granted() <= 3 * MIB + MIB / 4);
        }
        // An endpoint without a crowded config keeps the full window back for each.
        let plain = WindowPool::new(0, 32 * MIB, false, 8);
        let all: Vec<Grant> = (0..8)
            .map(|_| {
                assert!(plain.may_begin_full());
                plain.admit(Credit::Full)
            })
            .collect();
        assert_eq!(plain.granted(), 8 * reserved_per_connection(MIB));
        drop(all);
    }
}
