//! Metadata storage: versioned JSON documents with atomic batches and a change log.
//!
//! Every resource (tenant, namespace, stream, cache, node, assignment, signing key) is
//! a document `(kind, key) -> (version, value)`. Writes state what they expect
//! (absent, a version, or anything) and apply all-or-nothing in a batch; each write
//! appends a change with a global sequence number, which is what the assignment feed
//! serves. This is the shape a replicated state machine applies, so an embedded Raft
//! group can implement the same trait by replicating `batch` calls.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Resource kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// Tenants.
    Tenant,
    /// Namespaces.
    Namespace,
    /// Streams.
    Stream,
    /// Caches.
    Cache,
    /// Broker nodes.
    Node,
    /// Shard assignments.
    Assignment,
    /// Tenant signing keys.
    SigningKey,
    /// Control-plane state (bootstrap).
    Meta,
    /// Revoked tokens, by tenant and token id.
    Denial,
    /// The audit log of control-plane writes.
    Audit,
}

impl Kind {
    /// Whether writes of this kind are kept in the change log ([`Store::changes`]):
    /// assignments only, the feed brokers follow. Every kind was logged once, and the
    /// log kept for good what nobody read: a node's heartbeat every second, the audit
    /// log, and tenants' signing keys (in clear for keys stored before sealing, under
    /// retired key-encryption keys after a rotation).
    pub fn followed(self) -> bool {
        matches!(self, Kind::Assignment)
    }

    /// The stored name.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Tenant => "tenant",
            Kind::Namespace => "namespace",
            Kind::Stream => "stream",
            Kind::Cache => "cache",
            Kind::Node => "node",
            Kind::Assignment => "assignment",
            Kind::SigningKey => "signing_key",
            Kind::Meta => "meta",
            Kind::Denial => "token_denial",
            Kind::Audit => "audit",
        }
    }
}

/// A stored document.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Doc {
    /// Its key.
    pub key: String,
    /// Bumped on every write (1 after create).
    pub version: u64,
    /// The resource.
    pub value: Value,
}

/// What a write expects to find.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// Nothing (a create).
    Absent,
    /// This version (an update with a version check).
    Version(u64),
    /// Something, any version.
    Present,
    /// Don't care.
    Any,
}

/// One write in a batch.
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// Create or replace.
    Put {
        /// Kind.
        kind: Kind,
        /// Key.
        key: String,
        /// Value.
        value: Value,
        /// Precondition.
        expect: Expect,
    },
    /// Remove.
    Delete {
        /// Kind.
        kind: Kind,
        /// Key.
        key: String,
        /// Precondition.
        expect: Expect,
    },
}

/// One entry of the change log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Change {
    /// Global sequence.
    pub seq: u64,
    /// Key.
    pub key: String,
    /// `put` or `delete`.
    pub op: String,
    /// The new value (put).
    pub value: Option<Value>,
}

/// Why a store call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// A precondition did not hold.
    #[error("conflict on {kind} {key:?}: {reason}")]
    Conflict {
        /// Kind.
        kind: &'static str,
        /// Key.
        key: String,
        /// What was found.
        reason: String,
    },
    /// A document that must exist does not.
    #[error("{kind} {key:?} not found")]
    NotFound {
        /// Kind.
        kind: &'static str,
        /// Key.
        key: String,
    },
    /// The backend failed.
    #[error("store unavailable: {0}")]
    Unavailable(String),
}

/// A boxed future (the trait is used as `dyn Store`).
pub type BoxFut<'a, T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

/// A metadata store.
pub trait Store: Send + Sync + std::fmt::Debug {
    /// One document.
    fn get<'a>(&'a self, kind: Kind, key: &'a str) -> BoxFut<'a, Option<Doc>>;
    /// Every document of a kind whose key starts with `prefix`, in key order.
    fn list<'a>(&'a self, kind: Kind, prefix: &'a str) -> BoxFut<'a, Vec<Doc>>;
    /// Applies every op or none; returns the written documents (puts), in op order.
    fn batch(&self, ops: Vec<Op>) -> BoxFut<'_, Vec<Doc>>;
    /// Changes of `kind` after `since`, up to `limit`, and the next sequence to ask
    /// from; waits up to `wait` for one when there is none yet.
    fn changes(
        &self,
        kind: Kind,
        since: u64,
        limit: usize,
        wait: Duration,
    ) -> BoxFut<'_, (Vec<Change>, u64)>;
    /// The current end of the change log.
    fn head(&self) -> BoxFut<'_, u64>;
    /// Up to where the change log may have been cut ([`CHANGES_KEPT`]; 0: nothing
    /// cut): a reader asking for changes after a sequence below this may have missed
    /// some, and reads the snapshot again. Asked after a [`Store::changes`], it covers
    /// every cut that read could have missed (the Postgres store answers from its reads,
    /// not with a query of its own).
    fn trimmed(&self) -> BoxFut<'_, u64>;
    /// Whether the backend answers.
    fn ping(&self) -> BoxFut<'_, ()>;
}

/// Changes the log keeps, the newest: older ones are cut as new ones are logged (every
/// placement change was kept for good, in memory or in the database). Readers follow
/// the head; one that falls this far behind is told to read the snapshot again.
pub const CHANGES_KEPT: usize = 10_000;

#[derive(Debug, Default)]
struct MemState {
    docs: HashMap<Kind, BTreeMap<String, Doc>>,
    changes: Vec<(Kind, Change)>,
    seq: u64,
    /// The highest sequence cut from `changes`.
    trimmed: u64,
}

/// The in-memory store (dev and tests).
#[derive(Debug)]
pub struct MemoryStore {
    state: Mutex<MemState>,
    notify: tokio::sync::watch::Sender<u64>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self {
            state: Mutex::default(),
            notify: tokio::sync::watch::channel(0).0,
        }
    }
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }
}

fn check(kind: Kind, key: &str, found: Option<u64>, expect: Expect) -> Result<(), StoreError> {
    let conflict = |reason: String| StoreError::Conflict {
        kind: kind.name(),
        key: key.to_owned(),
        reason,
    };
    match (expect, found) {
        (Expect::Any, _) => Ok(()),
        (Expect::Absent, None) => Ok(()),
        (Expect::Absent, Some(_)) => Err(conflict("already exists".into())),
        (Expect::Present, Some(_)) => Ok(()),
        (Expect::Present | Expect::Version(_), None) => Err(StoreError::NotFound {
            kind: kind.name(),
            key: key.to_owned(),
        }),
        (Expect::Version(v), Some(f)) if v == f => Ok(()),
        (Expect::Version(v), Some(f)) => Err(conflict(format!("version is {f}, expected {v}"))),
    }
}

impl Store for MemoryStore {
    fn get<'a>(&'a self, kind: Kind, key: &'a str) -> BoxFut<'a, Option<Doc>> {
        let st = self.state.lock().expect("store lock");
        let r = st.docs.get(&kind).and_then(|m| m.get(key)).cloned();
        Box::pin(async move { Ok(r) })
    }

    fn list<'a>(&'a self, kind: Kind, prefix: &'a str) -> BoxFut<'a, Vec<Doc>> {
        let st = self.state.lock().expect("store lock");
        let r = st
            .docs
            .get(&kind)
            .map(|m| {
                m.range(prefix.to_owned()..)
                    .take_while(|(k, _)| k.starts_with(prefix))
                    .map(|(_, d)| d.clone())
                    .collect()
            })
            .unwrap_or_default();
        Box::pin(async move { Ok(r) })
    }

    fn batch(&self, ops: Vec<Op>) -> BoxFut<'_, Vec<Doc>> {
        let result = (|| {
            let mut st = self.state.lock().expect("store lock");
            // Check every precondition against the state as each op would see it,
            // on a scratch copy of the touched documents, before changing anything.
            let mut scratch: HashMap<(Kind, String), Option<u64>> = HashMap::new();
            for (i, op) in ops.iter().enumerate() {
                let (kind, key, expect) = match op {
                    Op::Put {
                        kind, key, expect, ..
                    }
                    | Op::Delete { kind, key, expect } => (*kind, key, *expect),
                };
                let found = *scratch.entry((kind, key.clone())).or_insert_with(|| {
                    st.docs
                        .get(&kind)
                        .and_then(|m| m.get(key))
                        .map(|d| d.version)
                });
                check(kind, key, found, expect)?;
                let next = match op {
                    // The version it will be written at: its sequence number.
                    Op::Put { .. } => Some(st.seq + i as u64 + 1),
                    Op::Delete { .. } => None,
                };
                scratch.insert((kind, key.clone()), next);
            }
            let mut written = Vec::new();
            for op in ops {
                st.seq += 1;
                let seq = st.seq;
                match op {
                    Op::Put {
                        kind, key, value, ..
                    } => {
                        let m = st.docs.entry(kind).or_default();
                        // The write's sequence number: never repeated for a key, a
                        // delete and a create again included (per-key counters began
                        // at 1 again, and a write conditional on a version read before
                        // the delete landed on the new document).
                        let version = seq;
                        let doc = Doc {
                            key: key.clone(),
                            version,
                            value: value.clone(),
                        };
                        m.insert(key.clone(), doc.clone());
                        written.push(doc);
                        if !kind.followed() {
                            continue;
                        }
                        st.changes.push((
                            kind,
                            Change {
                                seq,
                                key,
                                op: "put".into(),
                                value: Some(value),
                            },
                        ));
                    }
                    Op::Delete { kind, key, .. } => {
                        if let Some(m) = st.docs.get_mut(&kind) {
                            m.remove(&key);
                        }
                        if !kind.followed() {
                            continue;
                        }
                        st.changes.push((
                            kind,
                            Change {
                                seq,
                                key,
                                op: "delete".into(),
                                value: None,
                            },
                        ));
                    }
                }
            }
            // A quarter over before cutting: one cut per 2,500 changes, not one each.
            if st.changes.len() > CHANGES_KEPT + CHANGES_KEPT / 4 {
                let cut = st.changes.len() - CHANGES_KEPT;
                st.trimmed = st.changes[cut - 1].1.seq;
                st.changes.drain(..cut);
            }
            let _ = self.notify.send(st.seq);
            Ok(written)
        })();
        Box::pin(async move { result })
    }

    fn changes(
        &self,
        kind: Kind,
        since: u64,
        limit: usize,
        wait: Duration,
    ) -> BoxFut<'_, (Vec<Change>, u64)> {
        Box::pin(async move {
            let mut rx = self.notify.subscribe();
            let deadline = tokio::time::Instant::now() + wait;
            loop {
                let (page, head) = {
                    let st = self.state.lock().expect("store lock");
                    let start = st.changes.partition_point(|(_, c)| c.seq <= since);
                    let page: Vec<Change> = st.changes[start..]
                        .iter()
                        .filter(|(k, _)| *k == kind)
                        .take(limit)
                        .map(|(_, c)| c.clone())
                        .collect();
                    (page, st.seq)
                };
                if !page.is_empty() {
                    let next = page.last().map_or(head, |c| c.seq);
                    return Ok((page, next));
                }
                if tokio::time::timeout_at(deadline, rx.changed())
                    .await
                    .is_err()
                {
                    return Ok((Vec::new(), head.max(since)));
                }
            }
        })
    }

    fn head(&self) -> BoxFut<'_, u64> {
        let seq = self.state.lock().expect("store lock").seq;
        Box::pin(async move { Ok(seq) })
    }

    fn trimmed(&self) -> BoxFut<'_, u64> {
        let trimmed = self.state.lock().expect("store lock").trimmed;
        Box::pin(async move { Ok(trimmed) })
    }

    fn ping(&self) -> BoxFut<'_, ()> {
        Box::pin(async { Ok(()) })
    }
}
