//! Load following: an unpinned shard moves to the core its requests arrive on.
//!
//! A connection lives on the core the kernel hashed it to, and a shard on the core the
//! placement table names; when they differ, every request crosses the mesh and back,
//! which costs the two cores about three times the CPU of serving it where it arrived
//! (park and wake-up cycles on both; `docs/benchmarks.md`) and adds a wake-up to its
//! latency. Clients cannot choose their core, but the broker can choose the shard's: the
//! common case of a producer (or a cache user) on one connection then runs on one core.
//!
//! Each core counts the small publishes and cache operations it receives per shard, and
//! a shard's owner counts the small deliveries it sends to each core with subscribers (a
//! delivery to another core is a hop too: a producer on one core and its subscriber on
//! the other tie, and the shard stays). Every second the counts go to the core that
//! applies re-pins, which adds them up and, when one core has most of a busy shard's
//! traffic and room, re-pins that shard there through the same steps as an operator's
//! `POST /pins` ([`super::moves`]): nothing is lost or reordered by a move. Batches over
//! [`SMALL_BATCH`] records are not counted: a batching producer wants throughput, and a
//! shard on the other core than its connection shares the work between two cores. What
//! is left alone:
//! - a shard an operator's rule matches (operators' pins always win; an operator rule
//!   added later also wins over an automatic one, being newer);
//! - a shard spread over cores (no core has [`SHARE`] of its traffic), a quiet one
//!   (under [`MIN_REQUESTS`] in a window), or one whose requests come from a core that is
//!   busy already ([`MAX_BUSY`]) — unless that core and the shard's own together use
//!   less than one core: moving it there would trade parallelism for hops, where a core
//!   with room to take all the shard's owner does cannot be overloaded by it (the lone
//!   one-at-a-time producer, whose core is kept busy mostly by the hops themselves);
//! - a shard moved less than [`COOLDOWN`] ago, and any once [`MAX_AUTO_RULES`] shards were
//!   moved (every rule is checked on each lookup);
//! - replicated shards in a cluster (they move only with a restart).
//!
//! A rule names a stream or cache and a shard, so a stream's shard and a cache's shard of
//! the same name and number move together. Automatic rules are never saved: after a
//! restart placement starts from the hash again and follows the load anew.
//! `follow_load: false` turns it off.

use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use felix_core_runtime::CoreId;
use felix_core_runtime::placement::{PinRule, PlacementTable, ShardKey, ShardKind};
use felix_core_runtime::task;

use super::CoreBroker;
use super::moves::RepinJob;

/// How often each core reports, and the coordinator decides.
pub const WINDOW: Duration = Duration::from_secs(1);
/// Requests in a window below which a shard is left where it is.
pub const MIN_REQUESTS: u32 = 100;
/// The share of a shard's requests one core must send for the shard to move there.
pub const SHARE: f64 = 0.8;
/// A destination core busier than this (share of its thread's time) takes no shard,
/// unless it and the cores holding the shard now are busy less than one core together
/// and it is under [`MAX_BUSY_FITTING`].
pub const MAX_BUSY: f64 = 0.6;
/// However little the shard's cores do, a destination this busy takes nothing more: the
/// readings are sampled (every 250 ms, so a second's share is ±25%), and nothing moves a
/// shard away again once its core fills up.
pub const MAX_BUSY_FITTING: f64 = 0.8;
/// A shard moved automatically stays put at least this long.
pub const COOLDOWN: Duration = Duration::from_secs(10);
/// Shards moved automatically, at most (each adds a rule every lookup checks).
pub const MAX_AUTO_RULES: usize = 64;

/// Requests or deliveries carrying more records than this are left out of the counts:
/// batching clients want throughput, which a shard on another core than their
/// connection helps (two cores share the work), where one-at-a-time clients want the
/// shortest path.
pub const SMALL_BATCH: usize = 4;

/// One core's counts over one window.
#[derive(Debug)]
pub struct LoadReport {
    /// Per shard, per core (index): small requests received there, and small
    /// deliveries sent there by the shard's owner.
    pub counts: HashMap<Arc<ShardKey>, Vec<u32>>,
}

/// Where `counts` (traffic per core in one window) say a shard held by the cores
/// `holders` (a stream's and a cache's shard of one name may sit on two) should go,
/// given each core's `busy` share: the core with at least [`SHARE`] of at least
/// [`MIN_REQUESTS`], when it does not hold them all already and has room — under
/// [`MAX_BUSY`], or under [`MAX_BUSY_FITTING`] and busy less than one core together with
/// the other holders (all the work they do, the shard's included, would fit there).
pub fn destination(counts: &[u32], holders: &[CoreId], busy: &[f64]) -> Option<CoreId> {
    let total: u64 = counts.iter().map(|&c| u64::from(c)).sum();
    if total < u64::from(MIN_REQUESTS) {
        return None;
    }
    let (best, &n) = counts.iter().enumerate().max_by_key(|(_, n)| **n)?;
    let load = |c: usize| busy.get(c).copied().unwrap_or(0.0);
    let mut others: Vec<usize> = holders
        .iter()
        .map(|h| h.index())
        .filter(|&h| h != best)
        .collect();
    others.sort_unstable();
    others.dedup();
    let fits = load(best) < MAX_BUSY_FITTING
        && load(best) + others.iter().map(|&h| load(h)).sum::<f64>() < 1.0;
    let room = load(best) < MAX_BUSY || fits;
    (!others.is_empty() && n as f64 >= SHARE * total as f64 && room).then_some(CoreId(best))
}

/// Whether a rule that is not one of `autos` matches the shards `rule` names: an
/// operator pinned them, and load following leaves them alone.
pub fn operator_pinned(table: &PlacementTable, autos: &[PinRule], rule: &PinRule) -> bool {
    let Some(key) = key_of(rule) else {
        return true;
    };
    table
        .rules()
        .iter()
        .any(|r| r.matches(&key) && !autos.iter().any(|a| a == r))
}

/// The shard an automatic rule names (it names one exactly); `kind` does not matter to
/// matching.
fn key_of(rule: &PinRule) -> Option<ShardKey> {
    Some(ShardKey {
        kind: ShardKind::Stream,
        tenant: rule.tenant.clone()?,
        namespace: rule.namespace.clone()?,
        name: rule.name.clone()?,
        shard: rule.shard?,
    })
}

/// The rule that pins exactly `key` to `core`.
pub fn rule_for(key: &ShardKey, core: CoreId) -> PinRule {
    PinRule {
        tenant: Some(key.tenant.clone()),
        namespace: Some(key.namespace.clone()),
        name: Some(key.name.clone()),
        shard: Some(key.shard),
        core,
    }
}

impl CoreBroker {
    /// Counts a request for `key` of `records` received on `core` (this one), or a
    /// delivery of `records` to subscribers on `core`, when it is small (load following).
    pub(super) fn note_load(&self, key: &Arc<ShardKey>, core: CoreId, records: usize) {
        if !self.shared.follow_load || records > SMALL_BATCH {
            return;
        }
        let mut load = self.load.borrow_mut();
        match load.get_mut(key) {
            Some(n) => n[core.index()] += 1,
            None => {
                let mut n = vec![0; self.shared.metrics.len()];
                n[core.index()] = 1;
                load.insert(key.clone(), n);
            }
        }
    }

    /// Starts this core's reports: every [`WINDOW`], its counts go to the coordinator.
    pub fn start_load_reports(self: &Rc<Self>) {
        if !self.shared.follow_load {
            return;
        }
        let this = Rc::downgrade(self);
        task::spawn(async move {
            loop {
                task::sleep(WINDOW).await;
                let Some(core) = this.upgrade() else { return };
                if core.draining() {
                    return;
                }
                let counts = std::mem::take(&mut *core.load.borrow_mut());
                if counts.is_empty() {
                    continue;
                }
                core.shared
                    .load_reports
                    .lock()
                    .expect("load reports lock")
                    .push(LoadReport { counts });
            }
        })
        .detach();
    }

    /// Starts the decisions, on the core that applies re-pins: every [`WINDOW`], add up
    /// the reports and queue at most one automatic re-pin.
    pub(super) fn start_follow_load(self: &Rc<Self>) {
        if !self.shared.follow_load || self.shared.metrics.len() < 2 {
            return;
        }
        let this = Rc::downgrade(self);
        task::spawn(async move {
            let cores = this.upgrade().map_or(0, |c| c.shared.metrics.len());
            let mut moved: HashMap<ShardKey, Instant> = HashMap::new();
            // The window after a move still shows the load from before it: no decision
            // on it (another shard could be sent to a core that just took one).
            let mut settling = false;
            let mut warned_full = false;
            let cpu = |c: &CoreBroker| -> Vec<u64> {
                c.shared
                    .metrics
                    .iter()
                    .map(|m| m.cpu_ns.load(Ordering::Relaxed))
                    .collect()
            };
            let (mut last_cpu, mut last_at) = match this.upgrade() {
                Some(c) => (cpu(&c), Instant::now()),
                None => return,
            };
            loop {
                task::sleep(WINDOW).await;
                let Some(core) = this.upgrade() else { return };
                if core.draining() {
                    return;
                }
                let (now_cpu, now) = (cpu(&core), Instant::now());
                let wall = (now - last_at).as_nanos().max(1) as f64;
                let busy: Vec<f64> = now_cpu
                    .iter()
                    .zip(&last_cpu)
                    .map(|(a, b)| a.saturating_sub(*b) as f64 / wall)
                    .collect();
                (last_cpu, last_at) = (now_cpu, now);
                let reports = std::mem::take(
                    &mut *core.shared.load_reports.lock().expect("load reports lock"),
                );
                if std::mem::take(&mut settling) {
                    continue;
                }
                // A rule moves a stream's shard and a cache's shard of the same name and
                // number together: their counts add up, under the stream's key, with the
                // kinds that had traffic (each is placed by its own hash).
                let mut counts: HashMap<ShardKey, (Vec<u32>, Vec<ShardKind>)> = HashMap::new();
                for r in reports {
                    for (key, n) in r.counts {
                        let pattern = ShardKey {
                            kind: ShardKind::Stream,
                            ..(*key).clone()
                        };
                        let (sum, kinds) = counts
                            .entry(pattern)
                            .or_insert_with(|| (vec![0; cores], Vec::new()));
                        sum.iter_mut().zip(n).for_each(|(s, n)| *s += n);
                        if !kinds.contains(&key.kind) {
                            kinds.push(key.kind);
                        }
                    }
                }
                moved.retain(|_, at| now - *at < COOLDOWN);
                let table = core.shared.placement.load();
                let autos = core
                    .shared
                    .auto_pins
                    .lock()
                    .expect("auto pins lock")
                    .clone();
                if autos.len() >= MAX_AUTO_RULES {
                    if !warned_full {
                        tracing::warn!(
                            rules = autos.len(),
                            "load following stopped: {MAX_AUTO_RULES} shards were moved automatically; it resumes after a restart"
                        );
                        warned_full = true;
                    }
                    continue;
                }
                // The busiest shard first: one move per window.
                let mut candidates: Vec<_> = counts.into_iter().collect();
                candidates.sort_by_key(|(_, (c, _))| std::cmp::Reverse(c.iter().sum::<u32>()));
                for (key, (c, kinds)) in candidates {
                    if moved.contains_key(&key) {
                        continue;
                    }
                    let placed = |kind| table.core_for(&ShardKey { kind, ..key.clone() });
                    let holders: Vec<CoreId> = kinds.iter().map(|&k| placed(k)).collect();
                    let Some(to) = destination(&c, &holders, &busy) else {
                        continue;
                    };
                    let rule = rule_for(&key, to);
                    if operator_pinned(&table, &autos, &rule) {
                        continue;
                    }
                    // Either kind under this name that is replicated keeps both in place.
                    let replicated = [true, false].into_iter().any(|stream| {
                        core.shared
                            .catalog
                            .spec(stream, &key.tenant, &key.namespace, &key.name)
                            .is_some_and(|s| s.replicated())
                    });
                    if core.shared.cluster.is_some() && replicated {
                        continue;
                    }
                    moved.insert(key.clone(), now);
                    settling = true;
                    let (answer, outcome) = futures_channel::oneshot::channel();
                    let job = RepinJob {
                        rule,
                        auto: true,
                        answer,
                    };
                    if core.shared.repins.unbounded_send(job).is_err() {
                        return;
                    }
                    drop(outcome);
                    break;
                }
            }
        })
        .detach();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shard_moves_to_the_core_that_sends_most_of_its_requests_when_it_has_room() {
        let idle = [0.1, 0.1];
        let on = |c: usize| [CoreId(c)];
        // One connection on core 1, the shard on core 0.
        assert_eq!(destination(&[0, 500], &on(0), &idle), Some(CoreId(1)));
        // Already there.
        assert_eq!(destination(&[0, 500], &on(1), &idle), None);
        // Quiet: not worth a move.
        assert_eq!(destination(&[0, MIN_REQUESTS - 1], &on(0), &idle), None);
        assert_eq!(
            destination(&[0, MIN_REQUESTS], &on(0), &idle),
            Some(CoreId(1))
        );
        // Spread over both cores: it stays.
        assert_eq!(destination(&[300, 700], &on(0), &idle), None);
        assert_eq!(destination(&[150, 850], &on(0), &idle), Some(CoreId(1)));
        // The destination is busy and so is the owner: moving would trade parallelism
        // for hops.
        assert_eq!(destination(&[0, 500], &on(0), &[0.5, 0.7]), None);
        // Busy, but with room for everything the owner does: a lone producer whose
        // core is kept busy by the hops themselves (measured: 0.63 and 0.33).
        assert_eq!(
            destination(&[0, 500], &on(0), &[0.33, 0.63]),
            Some(CoreId(1))
        );
        assert_eq!(destination(&[0, 500], &on(0), &[0.1, 0.7]), Some(CoreId(1)));
        // Never past MAX_BUSY_FITTING, however idle the owner.
        assert_eq!(destination(&[0, 500], &on(0), &[0.0, 0.85]), None);
        // A stream's and a cache's shard of one name on two cores: moved unless both
        // are there already; the other holder's load counts.
        assert_eq!(
            destination(&[0, 0, 500], &[CoreId(0), CoreId(2)], &[0.1, 0.1, 0.1]),
            Some(CoreId(2))
        );
        assert_eq!(
            destination(&[0, 0, 500], &[CoreId(0), CoreId(1)], &[0.3, 0.3, 0.65]),
            None
        );
    }

    #[test]
    fn only_rules_load_following_added_leave_a_shard_movable() {
        let key = ShardKey {
            kind: ShardKind::Cache,
            tenant: "t".into(),
            namespace: "ns".into(),
            name: "c".into(),
            shard: 3,
        };
        let auto = rule_for(&key, CoreId(1));
        let table = PlacementTable::new(2, vec![auto.clone()], 1).unwrap();
        assert!(!operator_pinned(&table, std::slice::from_ref(&auto), &auto));
        // The same rule, not made by load following: an operator's.
        assert!(operator_pinned(&table, &[], &auto));
        // An operator's wildcard over the tenant pins it too, behind or ahead of ours.
        let wide: PinRule = "t/*/*/*=0".parse().unwrap();
        let table = table.with_rule(wide).unwrap();
        assert!(operator_pinned(
            &table,
            std::slice::from_ref(&auto),
            &rule_for(&key, CoreId(0))
        ));
        // Another tenant's shard is not.
        let other = ShardKey {
            tenant: "u".into(),
            ..key
        };
        assert!(!operator_pinned(
            &table,
            std::slice::from_ref(&auto),
            &rule_for(&other, CoreId(1))
        ));
    }
}
