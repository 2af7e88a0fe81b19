//! Placement: a timed pass that marks silent nodes down and gives every shard a leader
//! and replicas among the ready nodes.
//!
//! Ranking is rendezvous (highest-random-weight) hashing: each node gets a score per
//! shard and the highest leads, the next best replicate. The shard key and the node id
//! are hashed separately and then mixed; hashing their concatenation skews badly.
//! A pass only moves what it must: a shard keeps its leader while that leader is ready,
//! so adding a node does not reshuffle a settled cluster. Every write is conditional on
//! the version the pass read, so a pass racing an operator's move loses and replans.

use std::collections::{BTreeMap, HashSet};

use felix_wire::routing::ShardRouting;

use crate::api::{ApiConfig, now_ms};
use crate::model::{Assignment, AssignmentKey, Cache, Lifecycle, Node, Stream};
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
    /// Assignments whose leader or replicas changed.
    pub moved: usize,
    /// Assignments removed (stream or cache gone, or shard count shrank).
    pub removed: usize,
    /// Shards no ready node could take.
    pub unplaced: usize,
}

struct Target {
    key: AssignmentKey,
    replication: u32,
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

/// The leader and replicas a shard should have. A ready current leader stays; otherwise
/// the best-ranked node that `may_lead` (falling back to any that `may_lead_at_all`).
fn plan(
    store_key: &str,
    replication: u32,
    ready: &[&str],
    current_leader: Option<&str>,
    may_lead: impl Fn(&str) -> bool,
    may_lead_at_all: impl Fn(&str) -> bool,
) -> Option<(String, Vec<String>)> {
    let ranked = rank(store_key, ready.iter().copied());
    let leader = match current_leader {
        Some(l) if ready.contains(&l) => l,
        _ => ranked
            .iter()
            .copied()
            .find(|n| may_lead(n))
            .or_else(|| ranked.iter().copied().find(|n| may_lead_at_all(n)))?,
    };
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

/// Runs one placement pass at wall-clock `now_ms`.
pub async fn pass_at(
    store: &dyn Store,
    config: &ApiConfig,
    now_ms: u64,
) -> Result<PassReport, StoreError> {
    let expiry = config.expiry_timeout.as_millis() as u64;
    let mut report = PassReport::default();
    let mut ops = Vec::new();

    // 1. Nodes silent past the expiry go down; a heartbeat never revives them.
    let mut ready: Vec<String> = Vec::new();
    let mut leading: BTreeMap<String, u32> = BTreeMap::new();
    let mut caps: BTreeMap<String, Option<u32>> = BTreeMap::new();
    for d in store.list(Kind::Node, "").await? {
        let mut n: Node = decode(&d)?;
        let silent = now_ms.saturating_sub(n.last_heartbeat_ms) >= expiry;
        if n.lifecycle == Lifecycle::Live && silent {
            n.lifecycle = Lifecycle::Down;
            report.nodes_down.push(n.registration.node_id.clone());
            ops.push(Op::Put {
                kind: Kind::Node,
                key: d.key.clone(),
                value: encode(&n),
                expect: Expect::Version(d.version),
            });
        } else if n.lifecycle == Lifecycle::Live && n.registration.client_addr.is_some() {
            caps.insert(
                n.registration.node_id.clone(),
                n.registration.capacity.max_shards,
            );
            ready.push(n.registration.node_id.clone());
        }
    }

    // 2. What should be placed.
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
        if ready.contains(&a.leader) {
            *leading.entry(a.leader.clone()).or_default() += 1;
        }
        current.insert(d.key.clone(), (d, a));
    }

    // A node may not lead past its `max_shards` (hard) and, when a shard needs a new
    // leader, should not pass its fair share (soft): hashing alone can put all of a
    // small stream on one node.
    let share = (wanted.len() as u32)
        .div_ceil(ready.len().max(1) as u32)
        .max(1);
    let ready_ids: Vec<&str> = ready.iter().map(String::as_str).collect();
    for (key, target) in std::mem::take(&mut wanted) {
        let led = |n: &str| leading.get(n).copied().unwrap_or(0);
        let under_cap = |n: &str| {
            caps.get(n)
                .copied()
                .flatten()
                .is_none_or(|cap| led(n) < cap)
        };
        let under_share = |n: &str| under_cap(n) && led(n) < share;
        let existing = current.remove(&key);
        let current_leader = existing.as_ref().map(|(_, a)| a.leader.as_str());
        let Some((leader, replicas)) = plan(
            &key,
            target.replication,
            &ready_ids,
            current_leader,
            under_share,
            under_cap,
        ) else {
            report.unplaced += 1;
            continue;
        };
        match existing {
            Some((doc, mut a)) => {
                if leader == a.leader && replicas == a.replicas {
                    continue;
                }
                if leader != a.leader {
                    *leading.entry(leader.clone()).or_default() += 1;
                    a.generation += 1;
                }
                a.leader = leader;
                a.replicas = replicas;
                report.moved += 1;
                ops.push(Op::Put {
                    kind: Kind::Assignment,
                    key,
                    value: encode(&a),
                    expect: Expect::Version(doc.version),
                });
            }
            None => {
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
                    }),
                    expect: Expect::Absent,
                });
            }
        }
    }
    if !ops.is_empty() {
        store.batch(ops).await?;
    }
    Ok(report)
}

/// Runs one placement pass now.
pub async fn pass(store: &dyn Store, config: &ApiConfig) -> Result<PassReport, StoreError> {
    pass_at(store, config, now_ms()).await
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
    fn plan_keeps_a_ready_leader_and_fills_replicas() {
        let any = |_: &str| true;
        let (l, r) = plan("k", 2, &["a", "b", "c"], Some("b"), any, any).unwrap();
        assert_eq!(l, "b");
        assert_eq!(r.len(), 2);
        assert_eq!(r[0], "b");
        assert!(distinct(&r));
        assert!(plan("k", 1, &[], None, any, any).is_none());
        let (l, _) = plan("k", 1, &["a"], Some("gone"), any, any).unwrap();
        assert_eq!(l, "a");
        // Nobody under their share: fall back to anyone under their cap.
        let (l, _) = plan("k", 1, &["a", "b"], None, |_| false, |n| n == "b").unwrap();
        assert_eq!(l, "b");
        assert!(plan("k", 1, &["a", "b"], None, |_| false, |_| false).is_none());
    }
}
