//! Replica reports: what each shard's leader says it and its followers durably hold.
//!
//! A leader posts `POST /v1/nodes/{id}/replica-status` on every replication pass. The
//! control plane keeps the latest accepted report per shard **in memory only**: the
//! reports are hints for choosing a successor (who is furthest ahead, who is halted),
//! not a source of truth, and a leader re-sends them within a pass. A control-plane
//! restart therefore forgets them until the next reports arrive; until then a failover
//! falls back to the best-ranked ready member, which is still safe for Quorum streams
//! because the promoted broker fences a majority of the set before it serves.
//!
//! Reports only move forward (a later generation, or the same generation with a log
//! end at least as far), so a delayed or duplicated request can never roll positions
//! back, and they expire after `2 × expiry_timeout + heartbeat_interval`: a report
//! older than that describes a leader whose lease has certainly lapsed.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::model::{Assignment, AssignmentKey};

/// One follower as its leader sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FollowerReport {
    /// The follower.
    pub node_id: String,
    /// The end of what the follower has durably stored (confirmed to the leader).
    pub durable_end: u64,
    /// The follower stopped replicating (diverged, needs a bootstrap): it may not lead.
    #[serde(default)]
    pub halted: bool,
    /// A copy staged for a move (not a member of the set yet).
    #[serde(default)]
    pub staged: bool,
    /// The follower lost its copy (found damaged) and rebuilds it from the others: it
    /// counts in no election until it verified a generation elected without it, which
    /// placement starts.
    #[serde(default)]
    pub rebuilding: bool,
}

/// One shard in a leader's report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardReport {
    /// `stream` or `cache`.
    pub kind: String,
    /// Tenant.
    pub tenant_id: String,
    /// Namespace.
    pub namespace: String,
    /// Stream or cache name.
    pub name: String,
    /// Shard.
    pub shard: u32,
    /// The assignment generation the leader serves.
    pub generation: u64,
    /// The end of the leader's own log.
    pub log_end: u64,
    /// The committed (majority-held) mark.
    pub commit: u64,
    /// The commit mark is past the leader's generation-start record: every record
    /// before it is on a majority of the current set, which a member's removal needs.
    #[serde(default)]
    pub generation_committed: bool,
    /// Its followers.
    #[serde(default)]
    pub followers: Vec<FollowerReport>,
    /// The named leader lost its copy (found damaged, being rebuilt from the others)
    /// and may not lead this generation: placement promotes another member.
    #[serde(default)]
    pub cannot_lead: bool,
}

impl ShardReport {
    /// Which shard.
    pub fn key(&self) -> AssignmentKey {
        AssignmentKey {
            tenant_id: self.tenant_id.clone(),
            namespace: self.namespace.clone(),
            kind: self.kind.clone(),
            name: self.name.clone(),
            shard: self.shard,
        }
    }

    /// Whether this report may replace `older`: a later generation, or the same one
    /// with a log end at least as far (a leader's log only grows while it leads).
    pub fn supersedes(&self, older: &ShardReport) -> bool {
        self.generation > older.generation
            || (self.generation == older.generation
                && (self.log_end >= older.log_end || self.cannot_lead))
    }
}

/// The body of `POST /v1/nodes/{id}/replica-status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaStatus {
    /// One entry per shard the node leads.
    pub shards: Vec<ShardReport>,
}

/// What became of one shard's report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Stored.
    Accepted,
    /// Older than what is stored, or about a generation that is over.
    Stale,
    /// The reporting node does not lead the shard at that generation.
    NotLeader,
    /// No assignment for the shard.
    Unassigned,
    /// The generation is newer than the assignment's (the report raced a write the
    /// control plane has not made, or the node is confused).
    FutureGeneration,
}

/// An accepted report, as kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredReport {
    /// The reporting leader.
    pub from: String,
    /// When it arrived (control-plane wall clock, ms).
    pub received_ms: u64,
    /// What it said.
    pub report: ShardReport,
}

impl StoredReport {
    /// Reported positions: the leader's log end and each follower's durable end.
    pub fn positions(&self) -> BTreeMap<String, u64> {
        let mut out: BTreeMap<String, u64> = self
            .report
            .followers
            .iter()
            .filter(|f| f.node_id != self.from)
            .map(|f| (f.node_id.clone(), f.durable_end))
            .collect();
        out.insert(self.from.clone(), self.report.log_end);
        out
    }

    /// Whether the report names `node` as a halted follower.
    pub fn halted(&self, node: &str) -> bool {
        self.report
            .followers
            .iter()
            .any(|f| f.halted && f.node_id == node)
    }

    /// Whether a member (not a staged copy) is rebuilding a lost copy.
    pub fn any_rebuilding(&self) -> bool {
        self.report
            .followers
            .iter()
            .any(|f| f.rebuilding && !f.staged)
    }

    /// Whether the report names `node` as a follower rebuilding its copy.
    pub fn rebuilding(&self, node: &str) -> bool {
        self.report
            .followers
            .iter()
            .any(|f| f.rebuilding && f.node_id == node)
    }

    /// Whether any follower is halted.
    pub fn any_halted(&self) -> bool {
        self.report.followers.iter().any(|f| f.halted)
    }
}

/// Judges one report against the shard's assignment and the stored report.
pub fn judge(
    node: &str,
    report: &ShardReport,
    assignment: Option<&Assignment>,
    stored: Option<&StoredReport>,
) -> Verdict {
    let Some(a) = assignment else {
        return Verdict::Unassigned;
    };
    if report.generation > a.generation {
        return Verdict::FutureGeneration;
    }
    // Only the current generation's leader is known; an older generation is over.
    if report.generation < a.generation {
        return Verdict::Stale;
    }
    if a.leader != node {
        return Verdict::NotLeader;
    }
    if stored.is_some_and(|s| !report.supersedes(&s.report)) {
        return Verdict::Stale;
    }
    Verdict::Accepted
}

/// The latest accepted report per shard (keyed by assignment store key), shared by the
/// API and the placement pass.
#[derive(Debug, Clone, Default)]
pub struct ReplicaReports {
    inner: Arc<Mutex<HashMap<String, StoredReport>>>,
}

impl ReplicaReports {
    /// No reports.
    pub fn new() -> ReplicaReports {
        ReplicaReports::default()
    }

    fn live(
        &self,
        now_ms: u64,
        ttl_ms: u64,
    ) -> std::sync::MutexGuard<'_, HashMap<String, StoredReport>> {
        let mut m = self.inner.lock().expect("replica reports lock");
        m.retain(|_, r| now_ms.saturating_sub(r.received_ms) < ttl_ms);
        m
    }

    /// Judges `report` from `node` and stores it when accepted.
    pub fn offer(
        &self,
        node: &str,
        report: ShardReport,
        assignment: Option<&Assignment>,
        now_ms: u64,
        ttl_ms: u64,
    ) -> Verdict {
        let key = report.key().store_key();
        let mut m = self.live(now_ms, ttl_ms);
        let verdict = judge(node, &report, assignment, m.get(&key));
        let mut report = report;
        if let Some(stored) = m.get(&key)
            && report.cannot_lead
            && report.followers.is_empty()
            && stored.report.generation == report.generation
        {
            // A leader that lost its copy knows nothing of its followers: keep what it
            // said of them before (the choice of its successor goes by them).
            report.followers = stored.report.followers.clone();
        }
        if verdict == Verdict::Accepted {
            m.insert(
                key,
                StoredReport {
                    from: node.to_owned(),
                    received_ms: now_ms,
                    report,
                },
            );
        }
        verdict
    }

    /// Every unexpired report at `now_ms`.
    pub fn snapshot(&self, now_ms: u64, ttl_ms: u64) -> HashMap<String, StoredReport> {
        self.live(now_ms, ttl_ms).clone()
    }

    /// Forgets a shard's report (its assignment was rewritten from scratch).
    pub fn forget(&self, store_key: &str) {
        self.inner
            .lock()
            .expect("replica reports lock")
            .remove(store_key);
    }
}

/// Whether a shard lacks redundancy: fewer ready members than members, or the latest
/// report names a halted follower or one rebuilding its copy.
pub fn under_replicated(
    a: &Assignment,
    ready: impl Fn(&str) -> bool,
    report: Option<&StoredReport>,
) -> bool {
    let ready_members = a.replicas.iter().filter(|n| ready(n)).count();
    ready_members < a.replicas.len() || report.is_some_and(|r| r.any_halted() || r.any_rebuilding())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assignment(leader: &str, generation: u64) -> Assignment {
        Assignment {
            key: report(0, 0).key(),
            leader: leader.into(),
            replicas: vec!["a".into(), "b".into(), "c".into()],
            generation,
            state: "active".into(),
            routing: None,
            staging: None,
            replaces: None,
            retiring: None,
            abandoned: None,
            handoff: None,
        }
    }

    fn report(generation: u64, log_end: u64) -> ShardReport {
        ShardReport {
            kind: "stream".into(),
            tenant_id: "t".into(),
            namespace: "ns".into(),
            name: "s".into(),
            shard: 0,
            generation,
            log_end,
            commit: log_end,
            generation_committed: true,
            followers: vec![FollowerReport {
                node_id: "b".into(),
                durable_end: log_end / 2,
                halted: false,
                staged: false,
                rebuilding: false,
            }],
            cannot_lead: false,
        }
    }

    #[test]
    fn reports_only_move_forward_and_only_from_the_leader() {
        let r = ReplicaReports::new();
        let a = assignment("a", 3);
        let ttl = 10_000;
        assert_eq!(
            r.offer("a", report(3, 10), None, 0, ttl),
            Verdict::Unassigned
        );
        assert_eq!(
            r.offer("a", report(4, 10), Some(&a), 0, ttl),
            Verdict::FutureGeneration
        );
        assert_eq!(
            r.offer("b", report(3, 10), Some(&a), 0, ttl),
            Verdict::NotLeader
        );
        assert_eq!(
            r.offer("a", report(2, 99), Some(&a), 0, ttl),
            Verdict::Stale
        );
        assert_eq!(
            r.offer("a", report(3, 10), Some(&a), 0, ttl),
            Verdict::Accepted
        );
        assert_eq!(
            r.offer("a", report(3, 10), Some(&a), 1, ttl),
            Verdict::Accepted
        );
        assert_eq!(r.offer("a", report(3, 9), Some(&a), 2, ttl), Verdict::Stale);
        let stored = &r.snapshot(2, ttl)[&a.key.store_key()];
        assert_eq!(stored.report.log_end, 10);
        assert_eq!(
            stored.positions(),
            BTreeMap::from([("a".into(), 10), ("b".into(), 5)])
        );
        // Expired, the old report no longer holds a newer one back.
        assert_eq!(
            r.offer("a", report(3, 9), Some(&a), ttl + 1, ttl),
            Verdict::Accepted
        );
        assert!(r.snapshot(3 * ttl, ttl).is_empty());
    }
}
