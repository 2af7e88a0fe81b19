//! Long polls (group polls, cache watches) one core holds waiting at another, shared
//! between tenants.
//!
//! A poll that waits for records holds one of the pair's cross-core request slots for
//! its wait, so a core lets at most [`CROSS_CORE_POLLS_WAITING_MAX`] of them wait at any
//! one other core; past that a poll answers at once with what is there. That bound kept
//! long polls from filling the slots every other request needs, but it was first come,
//! first served: one tenant's consumers (a client with eight connections of 256 waiting
//! polls each) could hold all of them, and every other tenant's cross-core polls were
//! cut for as long as it kept polling.
//!
//! Now the tenants that asked to wait at the pair within [`CONTENDING_FOR`] share the
//! bound: a tenant holding its share (the bound divided among them) or more has its next
//! poll cut, whatever room is left. A tenant alone has the whole bound, as before. One
//! that arrives while another holds everything is cut at first, but counts as
//! contending, so the holder is cut from then on, and the newcomer takes the slots the
//! holder's polls give back as they end (each within its wait, 30 s at most).
//!
//! Sans-IO: the caller passes the time.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::CROSS_CORE_POLLS_WAITING_MAX;

/// How long a tenant that asked to wait counts as contending for the pair's waiting
/// polls. A consumer whose polls are cut asks again within a quarter second
/// (`CUT_POLL_PAUSE`) when nothing was there, at once otherwise.
const CONTENDING_FOR: Duration = Duration::from_secs(2);

/// The waiting polls one core holds at one other core.
#[derive(Debug, Default)]
pub(crate) struct PollShares {
    waiting: usize,
    by_tenant: HashMap<String, usize>,
    /// Tenants that asked to wait, admitted or cut, and when they last did.
    asking: HashMap<String, Instant>,
}

impl PollShares {
    /// Whether a poll of `tenant` asking at `now` may wait: within the pair's bound and
    /// below the tenant's share of it. Counts the tenant as contending either way.
    pub(crate) fn admit(&mut self, tenant: &str, now: Instant) -> bool {
        match self.asking.get_mut(tenant) {
            Some(at) => *at = now,
            None => {
                self.asking
                    .retain(|_, at| now.saturating_duration_since(*at) < CONTENDING_FOR);
                self.asking.insert(tenant.to_owned(), now);
            }
        }
        if self.waiting >= CROSS_CORE_POLLS_WAITING_MAX {
            return false;
        }
        let contending = self
            .asking
            .values()
            .filter(|at| now.saturating_duration_since(**at) < CONTENDING_FOR)
            .count()
            .max(1);
        let share = (CROSS_CORE_POLLS_WAITING_MAX / contending).max(1);
        self.by_tenant.get(tenant).copied().unwrap_or(0) < share
    }

    /// An admitted poll of `tenant` was sent: it waits until [`PollShares::ended`].
    pub(crate) fn started(&mut self, tenant: &str) {
        self.waiting += 1;
        match self.by_tenant.get_mut(tenant) {
            Some(n) => *n += 1,
            None => {
                self.by_tenant.insert(tenant.to_owned(), 1);
            }
        }
    }

    /// A poll counted by [`PollShares::started`] was answered.
    pub(crate) fn ended(&mut self, tenant: &str) {
        self.waiting = self.waiting.saturating_sub(1);
        if let Some(n) = self.by_tenant.get_mut(tenant) {
            *n -= 1;
            if *n == 0 {
                self.by_tenant.remove(tenant);
            }
        }
    }

    /// Polls waiting now.
    #[cfg(test)]
    fn waiting(&self) -> usize {
        self.waiting
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: usize = CROSS_CORE_POLLS_WAITING_MAX;

    /// Admits and starts polls of `tenant` at `now` until one is cut; how many waited.
    fn fill(p: &mut PollShares, tenant: &str, now: Instant) -> usize {
        let mut n = 0;
        while p.admit(tenant, now) {
            p.started(tenant);
            n += 1;
        }
        n
    }

    /// A tenant alone has the whole bound; a second one that arrives while the first
    /// holds it all is cut, but from then on the first is cut too, and the second takes
    /// the slots the first gives back until each holds half.
    #[test]
    fn a_tenant_holding_every_waiting_poll_gives_way_to_a_newcomer() {
        let t0 = Instant::now();
        let mut p = PollShares::default();
        assert_eq!(fill(&mut p, "hog", t0), MAX, "alone, the whole bound");
        let t1 = t0 + Duration::from_millis(100);
        assert!(!p.admit("other", t1), "the bound is full");
        // The hog's polls end one by one; each slot goes to the newcomer, not back to
        // the hog, until they hold half each.
        let mut t = t1;
        let mut other = 0;
        for _ in 0..MAX / 2 {
            p.ended("hog");
            t += Duration::from_millis(1);
            assert!(!p.admit("hog", t), "the hog holds more than its share");
            assert!(p.admit("other", t), "the newcomer is below its share");
            p.started("other");
            other += 1;
        }
        assert_eq!(other, MAX / 2);
        assert_eq!(p.waiting(), MAX);
        p.ended("hog");
        p.ended("other");
        assert!(p.admit("hog", t), "each below half again");
        assert!(p.admit("other", t));
    }

    /// A tenant that stopped asking stops contending: after a while the other has the
    /// whole bound again.
    #[test]
    fn a_tenant_that_stopped_asking_no_longer_takes_a_share() {
        let t0 = Instant::now();
        let mut p = PollShares::default();
        assert!(p.admit("gone", t0));
        assert_eq!(fill(&mut p, "busy", t0), MAX / 2, "two contend: half each");
        let later = t0 + CONTENDING_FOR + Duration::from_millis(1);
        assert_eq!(
            fill(&mut p, "busy", later),
            MAX / 2,
            "alone again: the rest"
        );
        assert!(!p.admit("busy", later), "and no more than the bound");
    }

    /// Three tenants contending get a third each, and the bound is never passed.
    #[test]
    fn contending_tenants_share_the_bound_evenly() {
        let t0 = Instant::now();
        let mut p = PollShares::default();
        for t in ["a", "b", "c"] {
            assert!(p.admit(t, t0));
        }
        let got: Vec<usize> = ["a", "b", "c"]
            .iter()
            .map(|t| fill(&mut p, t, t0))
            .collect();
        assert_eq!(got, vec![MAX / 3; 3]);
        assert!(p.waiting() <= MAX);
        for t in ["a", "b", "c"] {
            p.ended(t);
            assert!(p.admit(t, t0), "{t}: back below its share");
        }
    }
}
