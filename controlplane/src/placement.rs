//! Placement: a timed pass that marks silent nodes down, places new shards on the
//! ready nodes, promotes a successor when a leader is gone, and restores replica sets
//! whose members stay down.
//!
//! Ranking is rendezvous (highest-random-weight) hashing: each node gets a score per
//! shard and the highest leads, the next best replicate. The shard key and the node id
//! are hashed separately and then mixed; hashing their concatenation skews badly.
//! A pass only moves what it must: a shard keeps its leader while that leader may still
//! hold its lease, so adding a node does not reshuffle a settled cluster. Every write is
//! conditional on the version the pass read, so a pass racing an operator's move loses
//! and replans.
//!
//! What a pass may do to an existing shard, and why:
//!
//! - **Nothing while the leader may hold its lease.** A broker keeps its lease for
//!   `expiry − expiry/4` from the heartbeat it sent; a node is down only after
//!   `expiry + regrant_margin` of silence, so a successor is never named while the old
//!   leader may still write.
//! - **Promote within the set** when the leader is gone and the set has other members:
//!   the ready, unhalted member reported furthest ahead (ties: rendezvous rank) leads at
//!   generation + 1, and the set is kept as it is, dead leader included, so majorities
//!   are counted over the same members the acknowledged Quorum records live on. The
//!   promoted broker fences a majority before serving, which keeps Quorum streams safe
//!   whichever member is chosen; the choice matters for Leader streams (their loss
//!   window is what the promoted member lacks) and for how soon the shard serves.
//! - **Promote at once when the leader cannot lead**: a leader that lost its copy
//!   (found damaged at open, rebuilt from the other members) reports `cannot_lead`
//!   and never writes at its generation again, so no lease needs to run out.
//! - **Renew the generation** (same leader, same set) under a ready leader serving
//!   this generation whose report names a member rebuilding a lost copy: that member
//!   counts in no election until it verified a generation elected without it. Not
//!   while a staged move is staging or retiring (its own writes start generations).
//! - **Wait for the owner** when the leader is gone and nobody else holds the shard's
//!   durable log (RF 1): reopening it elsewhere would reopen it empty. Only
//!   `POST /v1/placement/abandon` does that, and says it lost data.
//! - **Restore the set** under a ready leader that has reported at its generation: a
//!   member down for `replica_restore_after` is replaced by the best-ranked ready
//!   non-member, through a staged copy as a move is (below): the copy joins, then the
//!   member leaves; and a set shorter than the replication factor is filled, one
//!   member a write. Never in the same write as a promotion (the new leader must fence
//!   over the set the records live on first), never the leader. Never a swap in one
//!   write: the simulator loses acknowledged records when a member that is only
//!   silent to the control plane (still acknowledging the leader's shipments) is
//!   swapped out and a failover follows before the leader's new generation commits.
//! - **Finish a staged move** (`POST /v1/shard-moves` to a broker outside the set
//!   writes `staging`): once the leader, serving this generation, reports the staged
//!   copy within [`STAGED_MAX_LAG`] records of its log, cut over: the destination
//!   leads and joins the set, and the old leader stays a member (`retiring`), so the
//!   new leader's fence, a majority of the enlarged set, meets every majority the
//!   acknowledged records live on. Once the new leader reports its own generation
//!   committed over the enlarged set (every committed record is then on a majority of
//!   it, so on a majority of it less one member), the old leader leaves the set;
//!   "serving" alone is not enough (the simulator finds records lost when a failover
//!   leader that shares the only copy with the retiring member is trusted). A
//!   staged destination that stops being ready is dropped (the move is abandoned); a
//!   failover abandons it too.

use std::collections::{BTreeMap, HashSet};

use felix_wire::routing::ShardRouting;

use crate::api::{ApiConfig, liveness_ms};
use crate::model::{Assignment, AssignmentKey, Cache, Handoff, Lifecycle, Node, Stream};
use crate::replication::{ReplicaReports, StoredReport};
use crate::store::{Doc, Expect, Kind, Op, Store, StoreError};

/// A node's score for a shard; the highest leads.
pub fn score(shard_key: &str, node_id: &str) -> u64 {
    use felix_wire::routing::{finalize, fnv1a64};
    finalize(finalize(fnv1a64(shard_key.as_bytes())) ^ fnv1a64(node_id.as_bytes()))
}

/// Node ids best first for `shard_key` (ties broken by id, so the order is total).
pub fn rank<'a>(shard_key: &str, nodes: impl IntoIterator<Item = &'a str>) -> Vec<&'a str> {
    let mut scored: Vec<(u64, &str)> = nodes
        .into_iter()
        .map(|n| (score(shard_key, n), n))
        .collect();
    scored.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(b.1)));
    scored.into_iter().map(|(_, n)| n).collect()
}

/// What one pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PassReport {
    /// Nodes marked down.
    pub nodes_down: Vec<String>,
    /// Assignments created.
    pub created: usize,
    /// Assignments whose leader changed (promotions).
    pub moved: usize,
    /// Assignments whose replica set changed (down members replaced, short sets filled).
    pub restored: usize,
    /// Assignments removed (stream or cache gone, or shard count shrank).
    pub removed: usize,
    /// Shards no ready node (or no ready member of their set) could take.
    pub unplaced: usize,
    /// Durable shards left with their down owner, the only node with their log.
    pub waiting_for_owner: usize,
    /// Assignments rewritten unchanged at a new generation for a member rebuilding its
    /// copy.
    pub renewed: usize,
}

/// How a node stands at an instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Standing {
    /// May take new roles: live, heard from within the expiry, with a client address.
    pub ready: bool,
    /// May still hold its lease: live or draining, and silent for less than
    /// `expiry + regrant_margin`. Its shards stay with it.
    pub holds: bool,
    /// Time since its last heartbeat, counted from no earlier than the floor given to
    /// [`standing`].
    pub silent_ms: u64,
}

/// How `n` stands at `now_ms`. Whether it may still hold its lease counts its silence
/// from no earlier than `heard_floor_ms`: this process's start on the liveness clock
/// ([`crate::api::liveness_started_ms`]) where the stamps may come from an earlier
/// process. Its clock, the wall clock read once plus a monotonic clock, may have run
/// behind ours (a suspended host: the monotonic clock stands still meanwhile), and its
/// stamps then read older than they are: a broker heartbeating until the restart would
/// be declared down while its lease still runs, and its shards given to a second
/// leader. Every live broker heartbeats this process within its interval.
pub fn standing(n: &Node, config: &ApiConfig, now_ms: u64, heard_floor_ms: u64) -> Standing {
    let silent_ms = now_ms.saturating_sub(n.last_heartbeat_ms);
    let heartbeating = matches!(n.lifecycle, Lifecycle::Live | Lifecycle::Draining);
    let silent_here_ms = now_ms.saturating_sub(n.last_heartbeat_ms.max(heard_floor_ms));
    Standing {
        ready: n.lifecycle == Lifecycle::Live
            && silent_ms < config.expiry_timeout.as_millis() as u64
            && n.registration.client_addr.is_some(),
        holds: heartbeating && silent_here_ms < config.down_after().as_millis() as u64,
        silent_ms: silent_here_ms,
    }
}

struct Target {
    key: AssignmentKey,
    replication: u32,
    /// Has a log that outlives the process (caches are projections over one).
    durable: bool,
    routing: Option<ShardRouting>,
}

fn targets(streams: &[Stream], caches: &[Cache]) -> BTreeMap<String, Target> {
    let mut out = BTreeMap::new();
    for s in streams {
        for shard in 0..s.spec.shards {
            let key = AssignmentKey {
                tenant_id: s.tenant_id.clone(),
                namespace: s.namespace.clone(),
                kind: "stream".into(),
                name: s.spec.stream.clone(),
                shard,
            };
            let routing = (s.spec.routing == ShardRouting::JumpHash).then_some(s.spec.routing);
            out.insert(
                key.store_key(),
                Target {
                    key,
                    replication: s.spec.replication_factor,
                    durable: s.spec.durable,
                    routing,
                },
            );
        }
    }
    for c in caches {
        for shard in 0..c.spec.shards {
            let key = AssignmentKey {
                tenant_id: c.tenant_id.clone(),
                namespace: c.namespace.clone(),
                kind: "cache".into(),
                name: c.spec.cache.clone(),
                shard,
            };
            out.insert(
                key.store_key(),
                Target {
                    key,
                    replication: c.spec.replication_factor,
                    durable: true,
                    routing: None,
                },
            );
        }
    }
    out
}

fn decode<T: serde::de::DeserializeOwned>(d: &Doc) -> Result<T, StoreError> {
    serde_json::from_value(d.value.clone())
        .map_err(|e| StoreError::Unavailable(format!("stored {} is unreadable: {e}", d.key)))
}

fn encode<T: serde::Serialize>(v: &T) -> serde_json::Value {
    serde_json::to_value(v).expect("model types serialize")
}

/// A leader and replicas for a shard placed from scratch: the best-ranked node that
/// `may_lead` (falling back to any that `may_lead_at_all`), then the next best ready
/// nodes, `replication` in all.
pub fn fresh_set(
    store_key: &str,
    replication: u32,
    ready: &[&str],
    may_lead: impl Fn(&str) -> bool,
    may_lead_at_all: impl Fn(&str) -> bool,
) -> Option<(String, Vec<String>)> {
    let ranked = rank(store_key, ready.iter().copied());
    let leader = ranked
        .iter()
        .copied()
        .find(|n| may_lead(n))
        .or_else(|| ranked.iter().copied().find(|n| may_lead_at_all(n)))?;
    let mut replicas = vec![leader.to_owned()];
    replicas.extend(
        ranked
            .iter()
            .filter(|n| **n != leader)
            .take(replication.saturating_sub(1) as usize)
            .map(|n| (*n).to_owned()),
    );
    Some((leader.to_owned(), replicas))
}

/// The cluster as one pass sees it.
struct View<'a> {
    nodes: &'a BTreeMap<String, Standing>,
    /// Down this long (not ready past the expiry, plus `replica_restore_after`), a
    /// member is replaced.
    replace_after_ms: u64,
}

impl View<'_> {
    fn ready(&self, n: &str) -> bool {
        self.nodes.get(n).is_some_and(|s| s.ready)
    }

    fn holds(&self, n: &str) -> bool {
        self.nodes.get(n).is_some_and(|s| s.holds)
    }

    /// Not ready, and silent past the expiry plus `replica_restore_after`; a node no
    /// longer in the catalog has been gone long enough.
    fn long_down(&self, n: &str) -> bool {
        self.nodes
            .get(n)
            .is_none_or(|s| !s.ready && s.silent_ms >= self.replace_after_ms)
    }

    fn ready_ids(&self) -> impl Iterator<Item = &str> {
        self.nodes
            .iter()
            .filter(|(_, s)| s.ready)
            .map(|(n, _)| n.as_str())
    }
}

/// How far behind the leader's log a staged copy may be for the cut-over: the new
/// leader fetches the rest while it takes over (writes are held meanwhile). Safety does
/// not depend on it; it bounds that hold. A busy leader keeps up to 4 messages of up to
/// 1 MiB in flight to each copy, thousands of small records: 1,000 would never be met.
pub const STAGED_MAX_LAG: u64 = 10_000;

/// What a pass does to an existing assignment.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Decision {
    /// Leave it.
    Keep,
    /// A staged copy holds the log: it joins the set (leading, for a move) and the
    /// member it replaces stays until the next write (retiring).
    CutOver(String),
    /// The leader's generation committed over the enlarged set: the retiring member
    /// leaves it.
    Retire,
    /// The staged copy is gone or halted: drop it.
    Unstage,
    /// A new leader from within the set; the set is kept.
    Promote(String),
    /// Stage a copy on the first node to replace the second (down too long).
    Stage(String, String),
    /// Add a member to a short set.
    Grow(String),
    /// The same leader and set at a new generation: a member rebuilding a lost copy
    /// is whole again once it verified a generation elected without it.
    Renew,
    /// A fresh leader and set (only for shards without a durable log).
    Replace(String, Vec<String>),
    /// The leader is gone and is the only node with the shard's log.
    WaitForOwner,
    /// The leader is gone and no member can take over.
    Unplaced,
}

/// The member to promote: ready, not halted in the latest report, allowed to lead;
/// the furthest reported position wins (an unreported member counts as behind every
/// reported one), ties go to the better rendezvous rank.
fn successor(
    store_key: &str,
    a: &Assignment,
    view: &View<'_>,
    report: Option<&StoredReport>,
    may_lead: &dyn Fn(&str) -> bool,
) -> Option<String> {
    let mut positions = report.map(StoredReport::positions).unwrap_or_default();
    // A member rebuilding a lost copy holds less than its position says until it is
    // whole: behind every reported one.
    positions.retain(|m, _| !report.is_some_and(|r| r.rebuilding(m)));
    let candidates = a.replicas.iter().map(String::as_str).filter(|m| {
        *m != a.leader && view.ready(m) && may_lead(m) && !report.is_some_and(|r| r.halted(m))
    });
    let mut best: Option<(&str, Option<u64>)> = None;
    for m in rank(store_key, candidates) {
        let at = positions.get(m).copied();
        if best.is_none_or(|(_, b)| at > b) {
            best = Some((m, at));
        }
    }
    best.map(|(m, _)| m.to_owned())
}

/// The next step of restoring the set: `(replaced, spare)`, the best-ranked ready
/// non-member to stage in place of the first long-down follower, or (`replaced` None)
/// to add to a set shorter than `replication`; `None` when nothing is to be done.
fn restore_step(
    store_key: &str,
    a: &Assignment,
    replication: u32,
    view: &View<'_>,
) -> Option<(Option<String>, String)> {
    let outside = view
        .ready_ids()
        .filter(|n| !a.replicas.iter().any(|m| m == n));
    let spare = rank(store_key, outside).into_iter().next()?.to_owned();
    if let Some(gone) = a
        .replicas
        .iter()
        .find(|m| **m != a.leader && view.long_down(m))
    {
        return Some((Some(gone.clone()), spare));
    }
    (a.replicas.len() < replication as usize).then_some((None, spare))
}

/// Decides what becomes of an existing assignment (see the module docs).
fn decide(
    target: &Target,
    store_key: &str,
    a: &Assignment,
    view: &View<'_>,
    report: Option<&StoredReport>,
    may_lead: &dyn Fn(&str) -> bool,
    may_lead_at_all: &dyn Fn(&str) -> bool,
) -> Decision {
    let cannot_lead = report.is_some_and(|r| {
        r.from == a.leader && r.report.generation == a.generation && r.report.cannot_lead
    });
    if cannot_lead {
        // The leader lost its copy and will not lead this generation (it rebuilds it
        // from the others, and writing under this generation's label again could give
        // an offset two values): promote now, as for a leader that is gone. It never
        // writes at this generation, so no lease of its needs to run out.
        return successor(store_key, a, view, report, may_lead_at_all)
            .map_or(Decision::Keep, Decision::Promote);
    }
    if view.holds(&a.leader) {
        // The set changes only under a ready leader that has reported serving this
        // generation: until then it may still be fencing over the current set.
        let serving =
            report.is_some_and(|r| r.from == a.leader && r.report.generation == a.generation);
        if !(view.ready(&a.leader) && serving) {
            return Decision::Keep;
        }
        // A record of this generation is on a majority of the set: everything before it
        // is too. The set changes by one member only from there (as Raft's one change
        // at a time, committed before the next): two changes before the first
        // committed (say `[a]` grown to `[a,b]` while b still copied the backlog, then
        // to `[a,b,c]`) let a majority of the newest set (b, c) elect a leader without
        // records only a held.
        let committed = report.is_some_and(|r| r.report.generation_committed);
        if let Some(d) = &a.staging {
            let copy = report.and_then(|r| r.report.followers.iter().find(|f| f.node_id == *d));
            if !view.ready(d) || copy.is_some_and(|f| f.halted) {
                return Decision::Unstage;
            }
            // Holding something (it was fenced and shipped to), and near the end.
            let caught_up = report.zip(copy).is_some_and(|(r, f)| {
                (f.durable_end > 0 || r.report.log_end == 0)
                    && f.durable_end.saturating_add(STAGED_MAX_LAG) >= r.report.log_end
            });
            // Holding the leader's whole log, the copy may join an uncommitted set: every
            // acknowledged record is in that log (nothing is acknowledged past it while
            // the set cannot commit), so every majority of the enlarged set meets a
            // whole copy. Without this a two-member set whose second member died part
            // way through copying the backlog could never commit, nor be restored.
            let whole = report
                .zip(copy)
                .is_some_and(|(r, f)| f.durable_end >= r.report.log_end);
            // The enlarged set's next election needs a majority of it up: joining while
            // members are down could leave its leader unable to fence (say 2 of 3
            // followers down); the copy keeps up meanwhile, and joins when one returns.
            let up = a.replicas.iter().filter(|m| view.ready(m)).count() + 1;
            // A majority of the len + 1 members: (len + 1) / 2 + 1.
            let majority = a.replicas.len().div_ceil(2) + 1;
            return if caught_up && up >= majority && (committed || whole) {
                Decision::CutOver(d.clone())
            } else {
                Decision::Keep
            };
        }
        if a.retiring.is_none() && report.is_some_and(StoredReport::any_rebuilding) {
            // A new generation lets a rebuilding copy become whole, but its election
            // counts no rebuilding member: without a majority of ready, whole members
            // (the leader with them) the leader never serves it again, and the copy
            // waits for a leader of a later generation that never comes. Serving this
            // generation on meanwhile (its followers' copies count for the commit) is
            // better; it is renewed once enough are back. (A member that never comes
            // back is not replaced meanwhile: that waits for the renewal too.)
            let whole = a
                .replicas
                .iter()
                .filter(|m| view.ready(m) && !report.is_some_and(|r| r.rebuilding(m)))
                .count();
            return if whole > a.replicas.len() / 2 {
                Decision::Renew
            } else {
                Decision::Keep
            };
        }
        if a.retiring.is_some() {
            return if committed {
                Decision::Retire
            } else {
                Decision::Keep
            };
        }
        return match restore_step(store_key, a, target.replication, view) {
            Some((Some(gone), spare)) => Decision::Stage(spare, gone),
            // Growing a set by one keeps every old majority meeting every new one, once
            // the last change committed.
            Some((None, spare)) if committed => Decision::Grow(spare),
            Some((None, _)) | None => Decision::Keep,
        };
    }
    if a.replicas.iter().all(|m| *m == a.leader) {
        if target.durable {
            return Decision::WaitForOwner;
        }
        // Nothing outlives the process: the shard may start over anywhere.
        let ready: Vec<&str> = view.ready_ids().collect();
        return fresh_set(
            store_key,
            target.replication,
            &ready,
            may_lead,
            may_lead_at_all,
        )
        .map_or(Decision::Unplaced, |(l, r)| Decision::Replace(l, r));
    }
    successor(store_key, a, view, report, may_lead_at_all)
        .map_or(Decision::Unplaced, Decision::Promote)
}

/// Runs one placement pass at `now_ms` (on the liveness clock, [`liveness_ms`]),
/// judging reports in `reports`, counting silence from no earlier than
/// `heard_floor_ms` (see [`standing`]).
pub async fn pass_at(
    store: &dyn Store,
    config: &ApiConfig,
    reports: &ReplicaReports,
    (now_ms, heard_floor_ms): (u64, u64),
) -> Result<PassReport, StoreError> {
    let down_after = config.down_after().as_millis() as u64;
    let mut report = PassReport::default();
    let mut ops = Vec::new();

    // 1. Nodes silent past the expiry plus the regrant margin go down; a heartbeat
    //    never revives them. A draining one too: a broker drains itself at SIGTERM
    //    and exits, and left draining it could never be deleted, stayed every broker's
    //    peer, and its copies were never replaced.
    let mut nodes: BTreeMap<String, Standing> = BTreeMap::new();
    let mut leading: BTreeMap<String, u32> = BTreeMap::new();
    let mut caps: BTreeMap<String, Option<u32>> = BTreeMap::new();
    // Nodes this pass writes nothing to, as read: a promotion away from one is written
    // only if its record did not change meanwhile (see `guard_node`).
    let mut unwritten_nodes: BTreeMap<String, Doc> = BTreeMap::new();
    for d in store.list(Kind::Node, "").await? {
        let mut n: Node = decode(&d)?;
        let s = standing(&n, config, now_ms, heard_floor_ms);
        if matches!(n.lifecycle, Lifecycle::Live | Lifecycle::Draining) && s.silent_ms >= down_after
        {
            n.lifecycle = Lifecycle::Down;
            report.nodes_down.push(n.registration.node_id.clone());
            ops.push(Op::Put {
                kind: Kind::Node,
                key: d.key.clone(),
                value: encode(&n),
                expect: Expect::Version(d.version),
            });
        } else {
            unwritten_nodes.insert(n.registration.node_id.clone(), d);
        }
        if s.ready {
            caps.insert(
                n.registration.node_id.clone(),
                n.registration.capacity.max_shards,
            );
        }
        nodes.insert(n.registration.node_id, s);
    }
    let view = View {
        nodes: &nodes,
        replace_after_ms: (config.expiry_timeout + config.replica_restore_after).as_millis() as u64,
    };
    let latest = reports.snapshot(now_ms, config.report_ttl().as_millis() as u64);

    // 2. What should be placed; the kept shard total mended from the same lists (read
    //    before them, see `limits::mend`).
    let fence = crate::limits::fence_outside_turns(store).await?;
    let streams: Vec<Stream> = store
        .list(Kind::Stream, "")
        .await?
        .iter()
        .map(decode)
        .collect::<Result<_, _>>()?;
    let caches: Vec<Cache> = store
        .list(Kind::Cache, "")
        .await?
        .iter()
        .map(decode)
        .collect::<Result<_, _>>()?;
    let shards = streams
        .iter()
        .map(|s| u64::from(s.spec.shards))
        .sum::<u64>()
        + caches.iter().map(|c| u64::from(c.spec.shards)).sum::<u64>();
    // A failed mend holds up no placement: tried again next pass.
    if let Err(e) = crate::limits::mend(store, fence, shards, crate::api::now_ms() / 1000).await {
        tracing::warn!(error = %e, "mending the kept shard and denial totals failed");
    }
    let mut wanted = targets(&streams, &caches);

    // 3. Existing assignments: drop the orphaned, keep or fix the rest.
    let existing = store.list(Kind::Assignment, "").await?;
    let mut current: BTreeMap<String, (Doc, Assignment)> = BTreeMap::new();
    for d in existing {
        let a: Assignment = decode(&d)?;
        if !wanted.contains_key(&d.key) {
            report.removed += 1;
            ops.push(Op::Delete {
                kind: Kind::Assignment,
                key: d.key.clone(),
                expect: Expect::Version(d.version),
            });
            continue;
        }
        if view.ready(&a.leader) {
            *leading.entry(a.leader.clone()).or_default() += 1;
        }
        current.insert(d.key.clone(), (d, a));
    }

    // A node may not lead past its `max_shards` (hard) and, when a new shard needs a
    // leader, should not pass its fair share (soft): hashing alone can put all of a
    // small stream on one node.
    let ready_count = nodes.values().filter(|s| s.ready).count();
    let share = (wanted.len() as u32)
        .div_ceil(ready_count.max(1) as u32)
        .max(1);
    let ready_ids: Vec<&str> = view.ready_ids().collect();
    for (key, target) in std::mem::take(&mut wanted) {
        let led = |n: &str| leading.get(n).copied().unwrap_or(0);
        let under_cap = |n: &str| {
            caps.get(n)
                .copied()
                .flatten()
                .is_none_or(|cap| led(n) < cap)
        };
        let under_share = |n: &str| under_cap(n) && led(n) < share;
        let Some((doc, mut a)) = current.remove(&key) else {
            let Some((leader, replicas)) =
                fresh_set(&key, target.replication, &ready_ids, under_share, under_cap)
            else {
                report.unplaced += 1;
                continue;
            };
            *leading.entry(leader.clone()).or_default() += 1;
            report.created += 1;
            ops.push(Op::Put {
                kind: Kind::Assignment,
                key,
                value: encode(&Assignment {
                    key: target.key,
                    leader,
                    replicas,
                    generation: 1,
                    state: "active".into(),
                    routing: target.routing,
                    staging: None,
                    replaces: None,
                    retiring: None,
                    abandoned: None,
                    handoff: None,
                }),
                expect: Expect::Absent,
            });
            continue;
        };
        let decision = decide(
            &target,
            &key,
            &a,
            &view,
            latest.get(&key),
            &under_share,
            &under_cap,
        );
        // Staging a copy or dropping one changes no member: the same generation (the
        // leader takes the copy on without an election, which a set missing a
        // majority could not hold).
        let new_generation = !matches!(decision, Decision::Stage(..) | Decision::Unstage);
        match decision {
            Decision::Keep => continue,
            Decision::WaitForOwner => {
                report.waiting_for_owner += 1;
                continue;
            }
            Decision::Unplaced => {
                report.unplaced += 1;
                continue;
            }
            Decision::Promote(leader) => {
                // (A leader that may still hold its lease, one that cannot lead its
                // copy, is promoted away from at once: it writes no more at this
                // generation, and its heartbeats would fail every pass's batch.)
                if !view.holds(&a.leader) {
                    guard_node(&mut ops, &mut unwritten_nodes, &a.leader);
                }
                *leading.entry(leader.clone()).or_default() += 1;
                // A failover abandons a staged move; a retiring member that now leads
                // stays.
                (a.staging, a.replaces) = (None, None);
                if a.retiring.as_ref() == Some(&leader) {
                    a.retiring = None;
                }
                a.leader = leader;
                report.moved += 1;
            }
            Decision::CutOver(to) => {
                a.replicas.push(to.clone());
                a.staging = None;
                match a.replaces.take() {
                    // A move: the copy leads.
                    Some(r) if r == a.leader => {
                        *leading.entry(to.clone()).or_default() += 1;
                        a.retiring = Some(std::mem::replace(&mut a.leader, to));
                        a.handoff = Some(Handoff {
                            from: r,
                            generation: a.generation + 1,
                        });
                        report.moved += 1;
                    }
                    Some(r) => {
                        a.retiring = Some(r);
                        report.restored += 1;
                    }
                    None => report.restored += 1,
                }
            }
            Decision::Retire => {
                // (Never the leader: a promotion or drain to the retiring member clears
                // it.)
                let gone = a.retiring.take().filter(|g| *g != a.leader);
                a.replicas.retain(|m| Some(m) != gone.as_ref());
                report.restored += 1;
            }
            Decision::Unstage => {
                a.staging = None;
                a.replaces = None;
            }
            Decision::Stage(spare, gone) => {
                a.staging = Some(spare);
                a.replaces = Some(gone);
                report.restored += 1;
            }
            Decision::Grow(spare) => {
                a.replicas.push(spare);
                report.restored += 1;
            }
            Decision::Renew => report.renewed += 1,
            Decision::Replace(leader, replicas) => {
                if !view.holds(&a.leader) {
                    guard_node(&mut ops, &mut unwritten_nodes, &a.leader);
                }
                *leading.entry(leader.clone()).or_default() += 1;
                a.leader = leader;
                a.replicas = replicas;
                (a.staging, a.replaces, a.retiring) = (None, None, None);
                report.moved += 1;
            }
        }
        // Every other write of an assignment is a new generation.
        if new_generation {
            a.generation += 1;
        }
        ops.push(Op::Put {
            kind: Kind::Assignment,
            key,
            value: encode(&a),
            expect: Expect::Version(doc.version),
        });
    }
    if !ops.is_empty() {
        store.batch(ops).await?;
    }
    Ok(report)
}

/// Makes the pass's writes conditional on `node`'s record being as the pass read it
/// (written back unchanged, at its version), once: a leader marked down in the same
/// batch is already guarded so, but one draining, or down since an earlier pass, could
/// register or renew between this pass's read and its write, and the promotion would
/// be written over a lease it had just renewed (two leaders acknowledging at once).
fn guard_node(ops: &mut Vec<Op>, unwritten: &mut BTreeMap<String, Doc>, node: &str) {
    if let Some(d) = unwritten.remove(node) {
        ops.push(Op::Put {
            kind: Kind::Node,
            key: d.key,
            value: d.value,
            expect: Expect::Version(d.version),
        });
    }
}

/// Runs one placement pass now.
pub async fn pass(
    store: &dyn Store,
    config: &ApiConfig,
    reports: &ReplicaReports,
) -> Result<PassReport, StoreError> {
    let now = liveness_ms();
    pass_at(
        store,
        config,
        reports,
        (now, crate::api::liveness_started_ms()),
    )
    .await
}

/// Leaders per node, for balance checks and the docs.
pub fn leaders_per_node(assignments: &[Assignment]) -> BTreeMap<&str, usize> {
    let mut out = BTreeMap::new();
    for a in assignments {
        *out.entry(a.leader.as_str()).or_default() += 1;
    }
    out
}

/// Whether every node in `ids` is distinct.
pub fn distinct(ids: &[String]) -> bool {
    ids.iter().collect::<HashSet<_>>().len() == ids.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rendezvous_spreads_leadership_evenly() {
        let nodes = ["node-a", "node-b", "node-c", "node-d"];
        let mut counts = BTreeMap::new();
        for shard in 0..400 {
            let key = format!("stream/t/ns/orders/{shard}");
            *counts.entry(rank(&key, nodes)[0]).or_insert(0) += 1;
        }
        // 100 each on average; a skewed hash (one hash over the concatenation) lands
        // far outside this band.
        for (n, c) in &counts {
            assert!((70..=130).contains(c), "{n} leads {c} of 400: {counts:?}");
        }
    }

    #[test]
    fn removing_a_node_moves_only_its_shards() {
        let all = ["a", "b", "c"];
        let without_c = ["a", "b"];
        for shard in 0..200 {
            let key = format!("stream/t/ns/s/{shard}");
            let before = rank(&key, all)[0];
            let after = rank(&key, without_c)[0];
            if before != "c" {
                assert_eq!(
                    before, after,
                    "shard {shard} moved although its leader stayed"
                );
            }
        }
    }

    #[test]
    fn a_fresh_set_leads_with_the_best_allowed_node_and_fills_replicas() {
        let any = |_: &str| true;
        let (l, r) = fresh_set("k", 2, &["a", "b", "c"], any, any).unwrap();
        assert_eq!(l, rank("k", ["a", "b", "c"])[0]);
        assert_eq!(r.len(), 2);
        assert_eq!(r[0], l);
        assert!(distinct(&r));
        assert!(fresh_set("k", 1, &[], any, any).is_none());
        // Nobody under their share: fall back to anyone under their cap.
        let (l, _) = fresh_set("k", 1, &["a", "b"], |_| false, |n| n == "b").unwrap();
        assert_eq!(l, "b");
        assert!(fresh_set("k", 1, &["a", "b"], |_| false, |_| false).is_none());
    }

    /// Pass tests over the memory store, on a virtual clock: node heartbeats are
    /// written with the stamp a test wants, and passes are judged at a chosen instant.
    mod passes {
        use super::*;
        use crate::model::{Capacity, NodeRegistration, Retention, StreamCreate};
        use crate::replication::{FollowerReport, ShardReport, Verdict};
        use crate::store::MemoryStore;
        use std::time::Duration;

        const T0: u64 = 1_000_000;

        struct Fixture {
            store: MemoryStore,
            reports: ReplicaReports,
            config: ApiConfig,
            /// What leaders' reports say of their generation being committed.
            committed: std::cell::Cell<bool>,
            /// What leaders' reports say of their leading at all (`cannot_lead`).
            cannot_lead: std::cell::Cell<bool>,
            /// The follower reports name as rebuilding a lost copy.
            rebuilding: std::cell::Cell<Option<&'static str>>,
        }

        fn fixture() -> Fixture {
            Fixture {
                store: MemoryStore::new(),
                reports: ReplicaReports::new(),
                config: ApiConfig {
                    heartbeat_interval: Duration::from_millis(200),
                    // Down after 1000 + 250 ms of silence.
                    expiry_timeout: Duration::from_millis(1000),
                    regrant_margin: None,
                    // Replaced after 1000 + 5000 ms of silence.
                    replica_restore_after: Duration::from_millis(5000),
                    ..ApiConfig::default()
                },
                committed: std::cell::Cell::new(false),
                cannot_lead: std::cell::Cell::new(false),
                rebuilding: std::cell::Cell::new(None),
            }
        }

        fn key(name: &str) -> String {
            format!("stream/t/ns/{name}/0")
        }

        impl Fixture {
            async fn put(&self, kind: Kind, key: String, value: serde_json::Value) {
                self.store
                    .batch(vec![Op::Put {
                        kind,
                        key,
                        value,
                        expect: Expect::Any,
                    }])
                    .await
                    .unwrap();
            }

            /// A live node with a client address, last heard at `heard_ms`.
            async fn node(&self, id: &str, heard_ms: u64) {
                let n = Node {
                    registration: NodeRegistration {
                        node_id: id.into(),
                        client_addr: Some("127.0.0.1:1".into()),
                        advertise_addr: None,
                        region: "default".into(),
                        capacity: Capacity::default(),
                        instance_id: None,
                    },
                    lifecycle: Lifecycle::Live,
                    incarnation: 1,
                    last_heartbeat_ms: heard_ms,
                };
                self.put(Kind::Node, id.into(), encode(&n)).await;
            }

            /// A one-shard stream led by `replicas[0]`.
            async fn stream(&self, name: &str, replicas: &[&str], durable: bool, generation: u64) {
                let s = Stream {
                    tenant_id: "t".into(),
                    namespace: "ns".into(),
                    spec: StreamCreate {
                        stream: name.into(),
                        kind: "Stream".into(),
                        shards: 1,
                        replication_factor: replicas.len() as u32,
                        retention: Retention::default(),
                        consistency: crate::model::Consistency::Quorum,
                        delivery: "AtLeastOnce".into(),
                        durable,
                        routing: ShardRouting::default(),
                    },
                    version: 0,
                    incarnation: String::new(),
                };
                self.put(Kind::Stream, format!("t/ns/{name}"), encode(&s))
                    .await;
                let a = Assignment {
                    key: AssignmentKey {
                        tenant_id: "t".into(),
                        namespace: "ns".into(),
                        kind: "stream".into(),
                        name: name.into(),
                        shard: 0,
                    },
                    leader: replicas[0].into(),
                    replicas: replicas.iter().map(|r| (*r).to_owned()).collect(),
                    generation,
                    state: "active".into(),
                    routing: None,
                    staging: None,
                    replaces: None,
                    retiring: None,
                    abandoned: None,
                    handoff: None,
                };
                self.put(Kind::Assignment, key(name), encode(&a)).await;
            }

            async fn get(&self, name: &str) -> Assignment {
                decode(
                    &self
                        .store
                        .get(Kind::Assignment, &key(name))
                        .await
                        .unwrap()
                        .unwrap(),
                )
                .unwrap()
            }

            /// The leader `from` reports `(follower, durable_end, halted)` at `at_ms`.
            async fn report(
                &self,
                from: &str,
                name: &str,
                generation: u64,
                log_end: u64,
                followers: &[(&str, u64, bool)],
                at_ms: u64,
            ) -> Verdict {
                let r = ShardReport {
                    kind: "stream".into(),
                    tenant_id: "t".into(),
                    namespace: "ns".into(),
                    name: name.into(),
                    shard: 0,
                    generation,
                    log_end,
                    commit: 0,
                    generation_committed: self.committed.get(),
                    followers: followers
                        .iter()
                        .map(|(n, d, h)| FollowerReport {
                            node_id: (*n).into(),
                            durable_end: *d,
                            halted: *h,
                            staged: false,
                            rebuilding: self.rebuilding.get() == Some(*n),
                        })
                        .collect(),
                    cannot_lead: self.cannot_lead.get(),
                };
                let a = self
                    .store
                    .get(Kind::Assignment, &key(name))
                    .await
                    .unwrap()
                    .map(|d| decode::<Assignment>(&d).unwrap());
                self.reports.offer(from, r, a.as_ref(), at_ms, 10_000)
            }

            async fn pass(&self, now: u64) -> PassReport {
                pass_at(&self.store, &self.config, &self.reports, (now, 0))
                    .await
                    .unwrap()
            }
        }

        /// A node name that outranks every one of `others` for `store_key`.
        fn outranking(store_key: &str, others: &[&str]) -> String {
            (0..)
                .map(|i| format!("n{i}"))
                .find(|n| {
                    let mut all: Vec<&str> = others.to_vec();
                    all.push(n);
                    rank(store_key, all)[0] == n
                })
                .unwrap()
        }

        #[tokio::test]
        async fn an_unreplicated_durable_shard_waits_for_its_owner() {
            let f = fixture();
            let now = T0 + 10_000;
            f.node("a", T0).await;
            f.node("b", now).await;
            f.stream("kept", &["a"], true, 1).await;
            // Not durable: nothing outlives the process, so it may start over on b.
            f.stream("scratch", &["a"], false, 1).await;
            let r = f.pass(now).await;
            assert_eq!(r.nodes_down, ["a"]);
            assert_eq!((r.waiting_for_owner, r.moved), (1, 1), "{r:?}");
            let kept = f.get("kept").await;
            assert_eq!((kept.leader.as_str(), kept.generation), ("a", 1));
            let scratch = f.get("scratch").await;
            assert_eq!(
                (
                    scratch.leader.as_str(),
                    scratch.replicas.as_slice(),
                    scratch.generation
                ),
                ("b", ["b".to_owned()].as_slice(), 2)
            );
            // It keeps waiting, pass after pass.
            assert_eq!(f.pass(now + 1).await.waiting_for_owner, 1);
            assert_eq!(f.get("kept").await.leader, "a");
        }

        #[tokio::test]
        async fn the_member_reported_furthest_ahead_is_promoted_and_the_set_kept() {
            let f = fixture();
            let now = T0 + 10_000;
            let k = key("s");
            let ranked = rank(&k, ["b", "c"]);
            // The better-ranked member is behind: only positions can pick the other.
            let (behind, ahead) = (ranked[0], ranked[1]);
            let outsider = outranking(&k, &["b", "c"]);
            for n in ["b", "c", outsider.as_str()] {
                f.node(n, now).await;
            }
            f.node("a", T0).await;
            f.stream("s", &["a", "b", "c"], true, 4).await;
            let v = f
                .report(
                    "a",
                    "s",
                    4,
                    100,
                    &[(behind, 60, false), (ahead, 90, false)],
                    now,
                )
                .await;
            assert_eq!(v, Verdict::Accepted);
            let r = f.pass(now).await;
            assert_eq!((r.moved, r.unplaced), (1, 0), "{r:?}");
            let a = f.get("s").await;
            assert_eq!(a.leader, ahead);
            assert_eq!(
                a.replicas,
                ["a", "b", "c"],
                "the set is kept, dead leader included"
            );
            assert_eq!(a.generation, 5);
            assert_eq!(
                f.pass(now + 1).await,
                PassReport::default(),
                "settled: the new leader keeps it"
            );
        }

        /// A live leader that lost its copy (its report says it cannot lead) is
        /// replaced at once, though its older report was further ahead, and only then.
        #[tokio::test]
        async fn a_live_leader_that_cannot_lead_is_replaced_at_once() {
            let f = fixture();
            let now = T0 + 10_000;
            for n in ["a", "b", "c"] {
                f.node(n, now).await;
            }
            f.stream("s", &["a", "b", "c"], true, 4).await;
            let before = f
                .report("a", "s", 4, 100, &[("b", 90, false), ("c", 90, false)], now)
                .await;
            assert_eq!(before, Verdict::Accepted);
            assert_eq!(f.pass(now).await.moved, 0, "a live serving leader stays");
            f.cannot_lead.set(true);
            let v = f.report("a", "s", 4, 0, &[], now + 1).await;
            assert_eq!(
                v,
                Verdict::Accepted,
                "a rebuilt copy's report replaces the old one"
            );
            let r = f.pass(now + 1).await;
            assert_eq!(r.moved, 1, "{r:?}");
            let a = f.get("s").await;
            assert_ne!(a.leader, "a");
            assert_eq!(a.generation, 5);
            assert_eq!(a.replicas, ["a", "b", "c"], "the set is kept");
        }

        use crate::store::{BoxFut, Change};

        /// A store whose node `node` registers again between a pass's reads and its
        /// write (the write lands just after).
        #[derive(Debug)]
        struct Registers<'a> {
            inner: &'a MemoryStore,
            node: &'static str,
        }

        impl Store for Registers<'_> {
            fn get<'b>(&'b self, kind: Kind, key: &'b str) -> BoxFut<'b, Option<Doc>> {
                self.inner.get(kind, key)
            }
            fn list<'b>(&'b self, kind: Kind, prefix: &'b str) -> BoxFut<'b, Vec<Doc>> {
                self.inner.list(kind, prefix)
            }
            fn batch(&self, ops: Vec<Op>) -> BoxFut<'_, Vec<Doc>> {
                Box::pin(async move {
                    let d = self.inner.get(Kind::Node, self.node).await?.expect("node");
                    let mut n: Node = decode(&d)?;
                    n.lifecycle = Lifecycle::Live;
                    n.incarnation += 1;
                    self.inner
                        .batch(vec![Op::Put {
                            kind: Kind::Node,
                            key: d.key,
                            value: encode(&n),
                            expect: Expect::Version(d.version),
                        }])
                        .await?;
                    self.inner.batch(ops).await
                })
            }
            fn changes(
                &self,
                kind: Kind,
                since: u64,
                limit: usize,
                wait: Duration,
            ) -> BoxFut<'_, (Vec<Change>, u64)> {
                self.inner.changes(kind, since, limit, wait)
            }
            fn head(&self) -> BoxFut<'_, u64> {
                self.inner.head()
            }
            fn trimmed(&self) -> BoxFut<'_, u64> {
                self.inner.trimmed()
            }
            fn ping(&self) -> BoxFut<'_, ()> {
                self.inner.ping()
            }
        }

        /// A promotion away from a leader down since an earlier pass is written only if
        /// the leader's record is as the pass read it: one that registered again in
        /// between (its lease renewed, its view still naming it leader) would lead beside
        /// its successor.
        #[tokio::test]
        async fn a_promotion_is_not_written_over_a_registration_that_landed_meanwhile() {
            let f = fixture();
            let now = T0 + 60_000;
            f.node("a", T0).await;
            f.node("b", T0).await;
            f.stream("s", &["a", "b"], false, 4).await;
            // a goes down with nobody to take over.
            let r = f.pass(now).await;
            assert_eq!(r.nodes_down.len(), 2, "{r:?}");
            assert_eq!(f.get("s").await.leader, "a");
            // b is back: a pass promotes it, while a registers again.
            f.node("b", now).await;
            let racing = Registers {
                inner: &f.store,
                node: "a",
            };
            let written = pass_at(&racing, &f.config, &f.reports, (now, 0)).await;
            assert!(written.is_err(), "{written:?}");
            assert_eq!(f.get("s").await.leader, "a", "not promoted over it");
        }

        /// A control plane just started counts a broker's silence from no earlier than
        /// its own start: the stamps were written by an earlier process, whose clock
        /// may have run behind (a suspended host), and read older than they are. A
        /// broker that heartbeated until the restart was declared down at once, its
        /// lease still running, and its shard given to a second leader.
        #[tokio::test]
        async fn silence_is_counted_from_no_earlier_than_this_process_start() {
            let f = fixture();
            let now = T0 + 60_000;
            f.node("a", T0).await;
            f.node("b", now).await;
            f.stream("s", &["a", "b"], true, 4).await;
            // Started a second ago: a has not been silent for the down timeout here.
            let started = now - 1_000;
            let r = pass_at(&f.store, &f.config, &f.reports, (now, started))
                .await
                .unwrap();
            assert!(r.nodes_down.is_empty(), "{r:?}");
            assert_eq!(f.get("s").await.leader, "a");
            // Still silent past the down timeout on this process's own clock: down.
            let later = started + 1_300;
            let r = pass_at(&f.store, &f.config, &f.reports, (later, started))
                .await
                .unwrap();
            assert_eq!(r.nodes_down, ["a"], "{r:?}");
            assert_eq!(f.get("s").await.leader, "b");
        }

        /// A member rebuilding a lost copy gets a new generation under the same leader
        /// (it can be whole again only at one elected without it), once.
        #[tokio::test]
        async fn a_member_rebuilding_its_copy_gets_a_new_generation_under_the_same_leader() {
            let f = fixture();
            let now = T0 + 10_000;
            for n in ["a", "b", "c"] {
                f.node(n, now).await;
            }
            f.stream("s", &["a", "b", "c"], true, 4).await;
            f.rebuilding.set(Some("b"));
            let v = f
                .report("a", "s", 4, 100, &[("b", 0, false), ("c", 100, false)], now)
                .await;
            assert_eq!(v, Verdict::Accepted);
            let r = f.pass(now).await;
            assert_eq!((r.renewed, r.moved, r.restored), (1, 0, 0), "{r:?}");
            let a = f.get("s").await;
            assert_eq!((a.leader.as_str(), a.generation), ("a", 5));
            assert_eq!(a.replicas, ["a", "b", "c"]);
            // Not again until the leader reports at the new generation; then only if a
            // member still rebuilds.
            assert_eq!(f.pass(now + 1).await, PassReport::default());
            f.rebuilding.set(None);
            f.report(
                "a",
                "s",
                5,
                100,
                &[("b", 100, false), ("c", 100, false)],
                now + 2,
            )
            .await;
            assert_eq!(f.pass(now + 2).await, PassReport::default());
        }

        /// A renewal for a rebuilding member needs a majority of ready, whole members
        /// (its election counts no rebuilding one): with two members, or three with one
        /// down, the leader never served the new generation and the copy was never
        /// whole again; the current one serves on instead until enough are back.
        #[tokio::test]
        async fn a_rebuilding_member_is_renewed_for_only_with_a_whole_majority_up() {
            let f = fixture();
            let now = T0 + 60_000;
            for n in ["a", "b"] {
                f.node(n, now).await;
            }
            f.node("c", T0).await;
            f.rebuilding.set(Some("b"));
            f.stream("two", &["a", "b"], true, 4).await;
            f.report("a", "two", 4, 100, &[("b", 0, false)], now).await;
            f.stream("three", &["a", "b", "c"], true, 4).await;
            f.report(
                "a",
                "three",
                4,
                100,
                &[("b", 0, false), ("c", 100, false)],
                now,
            )
            .await;
            let r = f.pass(now).await;
            assert_eq!(r.renewed, 0, "{r:?}");
            assert_eq!(f.get("two").await.generation, 4);
            assert_eq!(f.get("three").await.generation, 4);
            // c is back: a and c are a whole majority of three.
            f.node("c", now).await;
            let r = f.pass(now).await;
            assert_eq!(r.renewed, 1, "{r:?}");
            assert_eq!(f.get("three").await.generation, 5);
            assert_eq!(f.get("two").await.generation, 4);
        }

        /// A member rebuilding a lost copy counts as behind every reported one when a
        /// successor is chosen (its reported position is what it held before).
        #[tokio::test]
        async fn a_member_rebuilding_its_copy_is_promoted_only_after_the_others() {
            let f = fixture();
            let now = T0 + 10_000;
            let k = key("s");
            let ranked = rank(&k, ["b", "c"]);
            let (better, worse) = (ranked[0], ranked[1]);
            for n in ["b", "c"] {
                f.node(n, now).await;
            }
            f.node("a", T0).await;
            f.stream("s", &["a", "b", "c"], true, 4).await;
            // The better-ranked member is furthest ahead by its report, but rebuilding.
            f.rebuilding.set(Some(better));
            f.report(
                "a",
                "s",
                4,
                100,
                &[(better, 100, false), (worse, 60, false)],
                now,
            )
            .await;
            f.pass(now).await;
            assert_eq!(f.get("s").await.leader, worse);
        }

        #[tokio::test]
        async fn a_halted_member_is_never_promoted() {
            let f = fixture();
            let now = T0 + 10_000;
            let k = key("s");
            let ranked = rank(&k, ["b", "c"]);
            // The halted member is both best-ranked and furthest ahead.
            let (halted, healthy) = (ranked[0], ranked[1]);
            f.node("a", T0).await;
            f.node("b", now).await;
            f.node("c", now).await;
            f.stream("s", &["a", "b", "c"], true, 2).await;
            f.report(
                "a",
                "s",
                2,
                100,
                &[(halted, 99, true), (healthy, 10, false)],
                now,
            )
            .await;
            f.pass(now).await;
            let a = f.get("s").await;
            assert_eq!((a.leader.as_str(), a.generation), (healthy, 3));

            // With every other member halted the shard stays where it is.
            let f = fixture();
            f.node("a", T0).await;
            f.node("b", now).await;
            f.node("c", now).await;
            f.stream("s", &["a", "b", "c"], true, 2).await;
            f.report("a", "s", 2, 100, &[("b", 99, true), ("c", 10, true)], now)
                .await;
            let r = f.pass(now).await;
            assert_eq!(r.unplaced, 1, "{r:?}");
            assert_eq!(f.get("s").await.leader, "a");
        }

        #[tokio::test]
        async fn without_a_report_the_best_ranked_ready_member_leads() {
            let f = fixture();
            let now = T0 + 10_000;
            let k = key("s");
            // A non-member that outranks both members is never the successor: it
            // holds none of the shard's log.
            let outsider = outranking(&k, &["b", "c"]);
            f.node("a", T0).await;
            for n in ["b", "c", outsider.as_str()] {
                f.node(n, now).await;
            }
            f.stream("s", &["a", "b", "c"], true, 1).await;
            f.pass(now).await;
            let a = f.get("s").await;
            assert_eq!(a.leader, rank(&k, ["b", "c"])[0]);
            assert_eq!(a.replicas, ["a", "b", "c"]);
            assert_eq!(a.generation, 2);

            // No member ready: the shard stays as it is (unplaced).
            let f = fixture();
            f.node("a", T0).await;
            f.node("b", T0).await;
            f.node(&outsider, now).await;
            f.stream("s", &["a", "b"], true, 1).await;
            let r = f.pass(now).await;
            assert_eq!(r.unplaced, 1, "{r:?}");
            assert_eq!(f.get("s").await.leader, "a");
        }

        #[tokio::test]
        async fn a_leader_is_not_replaced_before_expiry_plus_margin() {
            let f = fixture();
            f.node("a", T0).await;
            f.stream("s", &["a", "b"], true, 1).await;
            for (now, down) in [(T0 + 1000, false), (T0 + 1249, false), (T0 + 1250, true)] {
                f.node("b", now).await;
                let r = f.pass(now).await;
                assert_eq!(
                    r.nodes_down.contains(&"a".to_owned()),
                    down,
                    "at +{}: {r:?}",
                    now - T0
                );
                let a = f.get("s").await;
                assert_eq!(a.leader == "b", down, "at +{}: {a:?}", now - T0);
            }
            // Past the expiry but inside the margin, a may no longer take new roles.
            let f = fixture();
            f.node("a", T0).await;
            f.node("b", T0 + 1100).await;
            let s = standing(
                &decode(&f.store.get(Kind::Node, "a").await.unwrap().unwrap()).unwrap(),
                &f.config,
                T0 + 1100,
                0,
            );
            assert_eq!((s.ready, s.holds), (false, true));
        }

        #[tokio::test]
        async fn a_member_down_past_restore_after_is_replaced_in_place() {
            let f = fixture();
            let k = key("s");
            f.node("c", T0).await;
            f.stream("s", &["a", "b", "c"], true, 2).await;
            let spare = rank(&k, ["d", "e"])[0];
            // c has been silent for expiry + restore_after, less a millisecond.
            let early = T0 + 5999;
            for n in ["a", "b", "d", "e"] {
                f.node(n, early).await;
            }
            f.report("a", "s", 2, 10, &[("b", 10, false), ("c", 5, false)], early)
                .await;
            assert_eq!(f.pass(early).await.restored, 0);
            assert_eq!(f.get("s").await.replicas, ["a", "b", "c"]);

            let now = T0 + 6000;
            for n in ["a", "b", "d", "e"] {
                f.node(n, now).await;
            }
            // Not swapped in one write: a copy is staged on the spare first.
            let r = f.pass(now).await;
            assert_eq!((r.restored, r.moved), (1, 0), "{r:?}");
            let a = f.get("s").await;
            assert_eq!(
                (a.leader.as_str(), a.generation),
                ("a", 2),
                "staged at the same generation"
            );
            assert_eq!(a.replicas, ["a", "b", "c"]);
            assert_eq!(
                (a.staging.as_deref(), a.replaces.as_deref()),
                (Some(spare), Some("c"))
            );
            // The copy is near the end (not at it), and generation 2 has not
            // committed yet: no change of members before the last one committed.
            f.report("a", "s", 2, 10, &[("b", 10, false), (spare, 9, false)], now)
                .await;
            f.pass(now).await;
            assert_eq!(f.get("s").await.generation, 2, "not before it committed");
            // Committed: the copy joins, c stays until the leader's generation commits
            // over the enlarged set.
            f.committed.set(true);
            f.report(
                "a",
                "s",
                2,
                10,
                &[("b", 10, false), (spare, 10, false)],
                now,
            )
            .await;
            f.pass(now).await;
            let a = f.get("s").await;
            assert_eq!((a.leader.as_str(), a.generation), ("a", 3));
            assert_eq!(a.replicas, ["a", "b", "c", spare]);
            assert_eq!((a.staging, a.retiring.as_deref()), (None, Some("c")));
            f.committed.set(true);
            f.report(
                "a",
                "s",
                3,
                11,
                &[("b", 11, false), (spare, 11, false)],
                now,
            )
            .await;
            f.pass(now).await;
            let a = f.get("s").await;
            assert_eq!(a.generation, 4);
            assert_eq!(a.replicas, ["a", "b", spare], "c replaced, others kept");
            assert_eq!(a.retiring, None);
        }

        #[tokio::test]
        async fn sets_change_only_under_a_leader_serving_its_generation() {
            let f = fixture();
            let now = T0 + 60_000;
            f.node("c", T0).await;
            for n in ["a", "b", "d"] {
                f.node(n, now).await;
            }
            f.stream("s", &["a", "b", "c"], true, 1).await;
            // No report: the leader may still be fencing over this set.
            assert_eq!(f.pass(now).await.restored, 0);
            // A report from an older generation does not count either (here the
            // assignment was rewritten after the report was stored).
            assert_eq!(f.report("a", "s", 1, 10, &[], now).await, Verdict::Accepted);
            let mut a = f.get("s").await;
            a.generation = 2;
            f.put(Kind::Assignment, key("s"), encode(&a)).await;
            assert_eq!(f.pass(now).await.restored, 0);
            assert_eq!(f.report("a", "s", 2, 10, &[], now).await, Verdict::Accepted);
            assert_eq!(f.pass(now).await.restored, 1);
            let a = f.get("s").await;
            assert_eq!(a.replicas, ["a", "b", "c"]);
            assert_eq!(
                (a.staging.as_deref(), a.replaces.as_deref()),
                (Some("d"), Some("c"))
            );
        }

        #[tokio::test]
        async fn a_staged_move_cuts_over_once_the_copy_holds_the_log_and_then_retires_the_old_leader()
         {
            let f = fixture();
            let now = T0 + 60_000;
            for n in ["a", "b", "c"] {
                f.node(n, now).await;
            }
            f.stream("s", &["a", "b"], true, 4).await;
            let mut a = f.get("s").await;
            a.staging = Some("c".into());
            a.replaces = Some("a".into());
            f.put(Kind::Assignment, key("s"), encode(&a)).await;
            // The copy is far behind: nothing changes.
            let far = 30_000 - STAGED_MAX_LAG - 1;
            assert_eq!(
                f.report(
                    "a",
                    "s",
                    4,
                    30_000,
                    &[("b", 30_000, false), ("c", far, false)],
                    now
                )
                .await,
                Verdict::Accepted
            );
            f.pass(now).await;
            assert_eq!(
                f.get("s").await.generation,
                4,
                "no cut-over while far behind"
            );
            // Within the bound (and generation 4 committed): c leads, and a is still a
            // member while c fences.
            f.committed.set(true);
            f.report(
                "a",
                "s",
                4,
                30_000,
                &[("b", 30_000, false), ("c", 29_500, false)],
                now,
            )
            .await;
            f.pass(now).await;
            f.committed.set(false);
            let a = f.get("s").await;
            assert_eq!((a.leader.as_str(), a.generation), ("c", 5));
            assert_eq!(a.replicas, ["a", "b", "c"]);
            assert_eq!((a.staging, a.retiring.as_deref()), (None, Some("a")));
            let from_a = Handoff {
                from: "a".into(),
                generation: 5,
            };
            assert_eq!(a.handoff, Some(from_a), "a planned handoff");
            // Not before c reports generation 5 committed (serving is not enough).
            f.pass(now).await;
            assert_eq!(f.get("s").await.replicas, ["a", "b", "c"]);
            f.report(
                "c",
                "s",
                5,
                30_001,
                &[("a", 30_000, false), ("b", 30_001, false)],
                now,
            )
            .await;
            f.pass(now).await;
            assert_eq!(f.get("s").await.replicas, ["a", "b", "c"]);
            f.committed.set(true);
            f.report(
                "c",
                "s",
                5,
                30_002,
                &[("a", 30_002, false), ("b", 30_002, false)],
                now,
            )
            .await;
            f.pass(now).await;
            let a = f.get("s").await;
            assert_eq!((a.leader.as_str(), a.generation), ("c", 6));
            assert_eq!(
                (a.replicas, a.retiring),
                (vec!["b".into(), "c".into()], None)
            );
        }

        #[tokio::test]
        async fn a_staged_move_is_dropped_when_its_destination_goes_and_by_a_failover() {
            let f = fixture();
            let now = T0 + 60_000;
            f.node("c", T0).await;
            for n in ["a", "b"] {
                f.node(n, now).await;
            }
            f.stream("s", &["a", "b"], true, 4).await;
            let mut a = f.get("s").await;
            a.staging = Some("c".into());
            f.put(Kind::Assignment, key("s"), encode(&a)).await;
            f.report("a", "s", 4, 10, &[("b", 10, false), ("c", 10, false)], now)
                .await;
            f.pass(now).await;
            let a = f.get("s").await;
            // Dropped at the same generation: no member changed.
            assert_eq!((a.leader.as_str(), a.staging, a.generation), ("a", None, 4));
            // A failover (a silent past the expiry) abandons a staged move too.
            let mut a = f.get("s").await;
            a.staging = Some("c".into());
            f.put(Kind::Assignment, key("s"), encode(&a)).await;
            f.node("a", T0).await;
            f.node("b", now + 60_000).await;
            f.node("c", now + 60_000).await;
            f.pass(now + 60_000).await;
            let a = f.get("s").await;
            assert_eq!((a.leader.as_str(), a.staging), ("b", None));
            assert_eq!(a.replicas, ["a", "b"], "a staged copy never leads");
        }

        #[tokio::test]
        async fn a_staged_copy_joins_only_with_a_majority_of_the_enlarged_set_up_and_a_halted_one_is_dropped()
         {
            let f = fixture();
            f.committed.set(true);
            let now = T0 + 60_000;
            f.node("b", T0).await;
            f.node("c", T0).await;
            for n in ["a", "d"] {
                f.node(n, now).await;
            }
            f.stream("s", &["a", "b", "c"], true, 4).await;
            let mut a = f.get("s").await;
            a.staging = Some("d".into());
            a.replaces = Some("b".into());
            f.put(Kind::Assignment, key("s"), encode(&a)).await;
            f.report("a", "s", 4, 10, &[("d", 10, false)], now).await;
            f.pass(now).await;
            let a = f.get("s").await;
            assert_eq!(
                (a.generation, a.staging.as_deref()),
                (4, Some("d")),
                "2 of 4 up: its leader could not fence, so it waits"
            );
            f.node("c", now).await;
            f.pass(now).await;
            let a = f.get("s").await;
            assert_eq!(a.generation, 5, "3 of 4 up");
            assert_eq!(a.replicas, ["a", "b", "c", "d"]);
            assert_eq!((a.leader.as_str(), a.retiring.as_deref()), ("a", Some("b")));

            // A copy its leader reports halted is dropped (it would never catch up).
            f.stream("h", &["a", "c"], true, 7).await;
            let mut a = f.get("h").await;
            a.staging = Some("d".into());
            a.replaces = Some("a".into());
            f.put(Kind::Assignment, key("h"), encode(&a)).await;
            f.report("a", "h", 7, 10, &[("c", 10, false), ("d", 0, true)], now)
                .await;
            f.pass(now).await;
            let a = f.get("h").await;
            assert_eq!((a.generation, a.staging, a.replaces), (7, None, None));
        }

        /// A two-member set whose generation cannot commit (its second member died
        /// part way through copying) takes a staged copy that holds the leader's whole
        /// log, and only such a one: gating every cut-over on the commit left it
        /// unrestorable for good.
        #[tokio::test]
        async fn an_uncommitted_set_takes_a_staged_copy_holding_the_whole_log() {
            let f = fixture();
            let now = T0 + 60_000;
            f.node("b", T0).await;
            for n in ["a", "d"] {
                f.node(n, now).await;
            }
            f.stream("s", &["a", "b"], true, 4).await;
            let mut a = f.get("s").await;
            a.staging = Some("d".into());
            a.replaces = Some("b".into());
            f.put(Kind::Assignment, key("s"), encode(&a)).await;
            // Near the end but short of it, generation 4 uncommitted: it waits.
            f.report(
                "a",
                "s",
                4,
                500,
                &[("b", 100, false), ("d", 450, false)],
                now,
            )
            .await;
            f.pass(now).await;
            assert_eq!(f.get("s").await.generation, 4);
            // The whole log: it joins.
            f.report(
                "a",
                "s",
                4,
                500,
                &[("b", 100, false), ("d", 500, false)],
                now,
            )
            .await;
            f.pass(now).await;
            let a = f.get("s").await;
            assert_eq!(
                (a.generation, a.replicas.as_slice()),
                (5, ["a", "b", "d"].map(String::from).as_slice())
            );
        }

        #[tokio::test]
        async fn a_set_is_never_shrunk_and_a_short_one_is_filled() {
            let f = fixture();
            let now = T0 + 60_000;
            // c is long down but nobody can replace it: it stays a member.
            f.node("c", T0).await;
            f.node("a", now).await;
            f.node("b", now).await;
            f.stream("s", &["a", "b", "c"], true, 2).await;
            f.report("a", "s", 2, 10, &[], now).await;
            let r = f.pass(now).await;
            assert_eq!((r.restored, r.moved), (0, 0), "{r:?}");
            assert_eq!(f.get("s").await.replicas, ["a", "b", "c"]);

            // A set created short (one node was ready) grows to the replication factor.
            let f = fixture();
            f.node("a", now).await;
            f.node("b", now).await;
            f.stream("s", &["a", "b"], true, 1).await;
            let mut a = f.get("s").await;
            a.replicas.truncate(1);
            f.put(Kind::Assignment, key("s"), encode(&a)).await;
            f.report("a", "s", 1, 10, &[], now).await;
            assert_eq!(
                f.pass(now).await.restored,
                0,
                "not before its generation committed on the set it has"
            );
            f.committed.set(true);
            f.report("a", "s", 1, 10, &[], now).await;
            assert_eq!(f.pass(now).await.restored, 1);
            let a = f.get("s").await;
            assert_eq!(
                (a.replicas.as_slice(), a.generation),
                (["a".to_owned(), "b".to_owned()].as_slice(), 2)
            );
        }
    }
}
