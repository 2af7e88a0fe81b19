//! What streams and caches exist: their shard counts, routing and retention.
//!
//! Single-node metadata, held in memory and persisted to `<data-dir>/catalog.json` so a
//! restart routes keys exactly as before (shard count and routing are fixed at creation).
//! In dev mode a stream or cache used for the first time is created with the defaults,
//! by a client whose token may write it.
//!
//! What must stay true:
//! - No file I/O on a core thread. Changes land in memory under a short lock (no I/O
//!   under it); [`Catalog::persist`] writes them, called by the thread that made the
//!   change when it may block (the control-plane follower, the embedded control plane),
//!   or by a core through its blocking pool before it acknowledges the first write to a
//!   new stream ([`Catalog::needs_persist`]).
//! - A deleted stream's data never comes back. A deletion is recorded (and persisted)
//!   until every core has closed its shards and removed their directories
//!   ([`Catalog::pending_deletions`], [`Catalog::deletion_done`]); the name cannot be
//!   created again until then, and a restart finishes a deletion a crash interrupted.
//! - Cores read through a per-core cache ([`CoreCatalog`]) that is dropped whenever the
//!   catalog's epoch moves (a deletion or a retention change), so the publish path takes
//!   the lock only on a miss and never allocates on a hit.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use felix_core_runtime::placement::{ShardKey, ShardKind};
use felix_wire::routing::{ShardRouting, fnv1a64, fnv1a64_update};
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use crate::error::BrokerError;

/// How long a stream keeps its records; unset bounds do not apply.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Retention {
    /// Records older than this go (whole sealed segments at a time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_age_seconds: Option<u64>,
    /// The log is trimmed from its head while larger than this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_size_bytes: Option<u64>,
}

impl Retention {
    /// Whether any bound is set.
    pub fn is_set(&self) -> bool {
        self.max_age_seconds.is_some() || self.max_size_bytes.is_some()
    }
}

/// When a write is acknowledged.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Consistency {
    /// Once the leader holds it durably (what is not yet shipped may be lost in a
    /// failover: `felix_broker_replication_lag_records`).
    #[default]
    Leader,
    /// Once a majority of the replica set, leader included, holds it durably.
    Quorum,
}

/// A stream's or cache's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamSpec {
    /// Shard count (fixed).
    pub shards: u32,
    /// Key-to-shard mapping (fixed).
    #[serde(default)]
    pub routing: ShardRouting,
    /// Retention (may change).
    #[serde(default)]
    pub retention: Retention,
    /// Copies of each shard, leader included (fixed).
    #[serde(default = "one")]
    pub replication_factor: u32,
    /// When writes are acknowledged (may change).
    #[serde(default)]
    pub consistency: Consistency,
}

fn one() -> u32 {
    1
}

impl StreamSpec {
    /// A spec with default routing, no retention, one copy.
    pub fn new(shards: u32) -> StreamSpec {
        StreamSpec {
            shards,
            routing: ShardRouting::Modulo,
            retention: Retention::default(),
            replication_factor: 1,
            consistency: Consistency::Leader,
        }
    }

    /// Whether its shards are replicated.
    pub fn replicated(&self) -> bool {
        self.replication_factor > 1
    }
}

/// A stream or cache being deleted: its data is removed by the cores that own its
/// shards before the name may be used again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deletion {
    /// Stream or cache.
    pub stream: bool,
    /// Tenant.
    pub tenant: String,
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Its shard count.
    pub shards: u32,
    /// Cores 0-63 that finished (bit per core index).
    #[serde(default)]
    pub done_by: u64,
    /// Cores from 64 up that finished: a bit of `done_by` each, shifted past 63, was
    /// core 0's bit again (a release build: a deletion finished while those cores still
    /// held the stream's shards, and the name was free again) or a panic (debug).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub done_by_high: Vec<usize>,
}

impl Deletion {
    /// Its shard `shard`.
    pub fn shard_key(&self, shard: u32) -> ShardKey {
        ShardKey {
            kind: if self.stream {
                ShardKind::Stream
            } else {
                ShardKind::Cache
            },
            tenant: self.tenant.clone(),
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            shard,
        }
    }

    /// Whether core `core` finished its part.
    fn done(&self, core: usize) -> bool {
        match core {
            0..64 => self.done_by & (1 << core) != 0,
            _ => self.done_by_high.contains(&core),
        }
    }

    /// Core `core`'s part is to do again; whether it was done.
    fn unmark_done(&mut self, core: usize) -> bool {
        let was = self.done(core);
        match core {
            0..64 => self.done_by &= !(1 << core),
            _ => self.done_by_high.retain(|c| *c != core),
        }
        was
    }

    /// Core `core` finished its part.
    fn mark_done(&mut self, core: usize) {
        match core {
            0..64 => self.done_by |= 1 << core,
            _ if !self.done(core) => self.done_by_high.push(core),
            _ => {}
        }
    }
}

#[derive(Debug, Default, Clone, Serialize, Deserialize)]
struct State {
    streams: HashMap<String, StreamSpec>,
    caches: HashMap<String, StreamSpec>,
    #[serde(default)]
    deleting: Vec<Deletion>,
    /// The control plane's incarnation of each name (`s:` or `c:` and the flat name):
    /// a name it lists under another incarnation was deleted and created again while
    /// this broker was away.
    #[serde(default)]
    incarnations: HashMap<String, String>,
}

impl State {
    fn map(&self, stream: bool) -> &HashMap<String, StreamSpec> {
        if stream { &self.streams } else { &self.caches }
    }

    fn map_mut(&mut self, stream: bool) -> &mut HashMap<String, StreamSpec> {
        if stream {
            &mut self.streams
        } else {
            &mut self.caches
        }
    }

    fn deleting(&self, stream: bool, t: &str, ns: &str, n: &str) -> bool {
        self.deleting
            .iter()
            .any(|d| d.stream == stream && d.tenant == t && d.namespace == ns && d.name == n)
    }
}

fn flat(t: &str, ns: &str, n: &str) -> String {
    format!("{t}/{ns}/{n}")
}

fn incarnation_key(stream: bool, t: &str, ns: &str, n: &str) -> String {
    format!("{}:{}", if stream { "s" } else { "c" }, flat(t, ns, n))
}

fn what(stream: bool) -> &'static str {
    if stream { "stream" } else { "cache" }
}

/// Validates a tenant, namespace, stream or cache name: 1-128 of `[A-Za-z0-9-_.]`,
/// starting alphanumeric (so it is also a safe path component).
pub fn validate_name(what: &'static str, name: &str) -> Result<(), BrokerError> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    if ok {
        Ok(())
    } else {
        Err(BrokerError::InvalidRequest(format!(
            "invalid {what} name {:?}: 1-128 of [A-Za-z0-9-_.], starting alphanumeric",
            crate::error::cut(name)
        )))
    }
}

/// The shared catalog.
#[derive(Debug)]
pub struct Catalog {
    state: RwLock<State>,
    path: Option<PathBuf>,
    /// Shard count for streams and caches created on first use; `None` = refuse unknown.
    auto_create_shards: Option<u32>,
    /// Bumped by every change; `durable` is the version last written to disk.
    version: AtomicU64,
    durable: AtomicU64,
    /// Bumped by changes that invalidate what cores cached (deletions, retention).
    epoch: AtomicU64,
    /// Held while writing the file (never on a core thread).
    persisting: Mutex<()>,
    /// Names created since the last write, with the version that created them: a
    /// publish to one of them waits for the catalog on disk, others do not.
    unwritten: Mutex<HashMap<(bool, String), u64>>,
}

impl Catalog {
    /// Loads `path` if it exists.
    pub fn open(path: Option<PathBuf>, auto_create_shards: Option<u32>) -> anyhow::Result<Catalog> {
        let state = match &path {
            Some(p) if p.exists() => serde_json::from_slice(&std::fs::read(p)?)
                .map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?,
            _ => State::default(),
        };
        Ok(Catalog {
            state: RwLock::new(state),
            path,
            auto_create_shards,
            version: AtomicU64::new(0),
            durable: AtomicU64::new(0),
            epoch: AtomicU64::new(0),
            persisting: Mutex::new(()),
            unwritten: Mutex::default(),
        })
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(|p| p.into_inner())
    }

    fn changed(&self, invalidates: bool) {
        self.version.fetch_add(1, Ordering::SeqCst);
        if invalidates {
            self.epoch.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Whether changes are waiting to be written. Cheap: two atomic loads.
    pub fn needs_persist(&self) -> bool {
        self.durable.load(Ordering::Acquire) < self.version.load(Ordering::Acquire)
    }

    /// Whether the stream (`stream`) or cache was created since the catalog was last
    /// written. Cheap when nothing is waiting (two atomic loads); a lock otherwise.
    pub fn unwritten(&self, stream: bool, t: &str, ns: &str, n: &str) -> bool {
        self.needs_persist()
            && self
                .unwritten
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains_key(&(stream, flat(t, ns, n)))
    }

    /// The cache-invalidation epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Writes the catalog durably (temporary file, fsync, rename, directory fsync) if it
    /// changed since the last write. Blocks: never call it on a core thread.
    pub fn persist(&self) -> Result<(), BrokerError> {
        let Some(path) = &self.path else {
            self.durable
                .store(self.version.load(Ordering::SeqCst), Ordering::Release);
            self.unwritten
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clear();
            return Ok(());
        };
        let _writing = self.persisting.lock().unwrap_or_else(|p| p.into_inner());
        let (version, body) = {
            let st = self.read();
            let version = self.version.load(Ordering::SeqCst);
            (version, serde_json::to_vec_pretty(&*st))
        };
        if version <= self.durable.load(Ordering::Acquire) {
            return Ok(());
        }
        let body = body.map_err(|e| BrokerError::Internal(format!("encoding the catalog: {e}")))?;
        write_durably(path, &body).map_err(|e| {
            // Nothing was written: out of room is worth retrying, and says so.
            let reason = match e.raw_os_error() {
                Some(libc::ENOSPC | libc::EDQUOT) => Some("disk_full"),
                _ => crate::core::out_of_resources(&e),
            };
            match reason {
                Some(r) => {
                    tracing::warn!(error = %e, "persisting the catalog");
                    BrokerError::Overloaded(r.into())
                }
                None => BrokerError::Storage(format!("persisting the catalog: {e}")),
            }
        })?;
        self.durable.fetch_max(version, Ordering::AcqRel);
        self.unwritten
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|_, v| *v > version);
        Ok(())
    }

    /// Declares a stream (idempotent when the spec matches; a new retention replaces the
    /// old one).
    pub fn create_stream(
        &self,
        t: &str,
        ns: &str,
        s: &str,
        spec: StreamSpec,
    ) -> Result<StreamSpec, BrokerError> {
        self.create(true, t, ns, s, spec)
    }

    /// Declares a cache (idempotent when the spec matches).
    pub fn create_cache(
        &self,
        t: &str,
        ns: &str,
        c: &str,
        spec: StreamSpec,
    ) -> Result<StreamSpec, BrokerError> {
        self.create(false, t, ns, c, spec)
    }

    fn create(
        &self,
        stream: bool,
        t: &str,
        ns: &str,
        n: &str,
        spec: StreamSpec,
    ) -> Result<StreamSpec, BrokerError> {
        validate_name("tenant", t)?;
        validate_name("namespace", ns)?;
        validate_name(what(stream), n)?;
        if spec.shards == 0 || spec.shards > 4096 {
            return Err(BrokerError::InvalidRequest(format!(
                "shard count {} out of range 1..=4096",
                spec.shards
            )));
        }
        let mut st = self.write();
        if st.deleting(stream, t, ns, n) {
            return Err(BrokerError::ShardUnavailable("deleting".into()));
        }
        let map = st.map_mut(stream);
        if let Some(existing) = map.get_mut(&flat(t, ns, n)) {
            if existing.shards == spec.shards
                && existing.routing == spec.routing
                && (existing.retention != spec.retention
                    || existing.consistency != spec.consistency
                    || existing.replication_factor != spec.replication_factor)
            {
                existing.retention = spec.retention;
                existing.consistency = spec.consistency;
                existing.replication_factor = spec.replication_factor;
                let updated = *existing;
                drop(st);
                self.changed(true);
                return Ok(updated);
            }
            return Ok(*existing);
        }
        map.insert(flat(t, ns, n), spec);
        // Marked unwritten before anyone can see the name (the lock is still held): a
        // request on another core that finds it also finds that it must wait.
        self.changed(false);
        let version = self.version.load(Ordering::SeqCst);
        self.unwritten
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((stream, flat(t, ns, n)), version);
        drop(st);
        Ok(spec)
    }

    /// Follows the control plane's `incarnation` of a stream (`stream`) or cache it lists.
    /// Returns `false` when this catalog holds the name under another incarnation: it
    /// was deleted and created again while this broker was away, so the old one is
    /// deleted here (its data removed by the cores) and the caller creates the new one
    /// once that is done. A name held with no incarnation yet (a catalog written before
    /// incarnations, or created here first) takes this one.
    pub fn follow_incarnation(
        &self,
        stream: bool,
        t: &str,
        ns: &str,
        n: &str,
        incarnation: &str,
    ) -> bool {
        if incarnation.is_empty() {
            return true;
        }
        let key = incarnation_key(stream, t, ns, n);
        let held = self.read().incarnations.get(&key).cloned();
        match held {
            Some(h) if h == incarnation => true,
            Some(_) if self.read().map(stream).contains_key(&flat(t, ns, n)) => {
                self.delete(stream, t, ns, n);
                false
            }
            _ => {
                self.write()
                    .incarnations
                    .insert(key, incarnation.to_owned());
                self.changed(false);
                true
            }
        }
    }

    /// Deletes a stream (`stream`) or cache: it is gone for new requests at once, and
    /// its data is removed by the cores (see the module docs). Returns whether it
    /// existed.
    pub fn delete(&self, stream: bool, t: &str, ns: &str, n: &str) -> bool {
        let mut st = self.write();
        let Some(spec) = st.map_mut(stream).remove(&flat(t, ns, n)) else {
            return false;
        };
        st.incarnations.remove(&incarnation_key(stream, t, ns, n));
        st.deleting.push(Deletion {
            stream,
            tenant: t.to_owned(),
            namespace: ns.to_owned(),
            name: n.to_owned(),
            shards: spec.shards,
            done_by: 0,
            done_by_high: Vec::new(),
        });
        drop(st);
        self.changed(true);
        true
    }

    /// Deletions some core has not finished yet (`core` is the asking core's index).
    pub fn pending_deletions(&self, core: usize) -> Vec<Deletion> {
        self.read()
            .deleting
            .iter()
            .filter(|d| !d.done(core))
            .cloned()
            .collect()
    }

    /// Every deletion under way, whichever cores finished their parts.
    pub fn deletions_under_way(&self) -> Vec<Deletion> {
        self.read().deleting.clone()
    }

    /// `core`'s part of `deletion` is to do again (a shard of it moves to `core`: see
    /// `CoreBroker::reopen_deletions_moving_here`). Returns whether it was done.
    pub fn deletion_reopened_for(&self, deletion: &Deletion, core: usize) -> bool {
        let mut st = self.write();
        let reopened = st.deleting.iter_mut().any(|d| {
            let named = d.stream == deletion.stream
                && d.tenant == deletion.tenant
                && d.namespace == deletion.namespace
                && d.name == deletion.name;
            named && d.unmark_done(core)
        });
        drop(st);
        if reopened {
            self.changed(false);
        }
        reopened
    }

    /// `core` removed its part of `deletion`. Once all `cores` have, the deletion is
    /// forgotten and the name may be created again. Returns whether it was the last.
    pub fn deletion_done(&self, deletion: &Deletion, core: usize, cores: usize) -> bool {
        let mut st = self.write();
        let mut finished = false;
        st.deleting.retain_mut(|d| {
            if d.stream == deletion.stream
                && d.tenant == deletion.tenant
                && d.namespace == deletion.namespace
                && d.name == deletion.name
            {
                d.mark_done(core);
                finished = (0..cores).all(|c| d.done(c));
                !finished
            } else {
                true
            }
        });
        drop(st);
        self.changed(false);
        finished
    }

    /// A stream's (`stream`) or cache's spec with the control plane's incarnation of it
    /// (empty when not known), read together: a deletion between two reads would pair
    /// the old spec with no incarnation.
    pub fn spec_and_incarnation(
        &self,
        stream: bool,
        t: &str,
        ns: &str,
        n: &str,
    ) -> Option<(StreamSpec, String)> {
        let st = self.read();
        let spec = *st.map(stream).get(&flat(t, ns, n))?;
        let incarnation = st
            .incarnations
            .get(&incarnation_key(stream, t, ns, n))
            .cloned()
            .unwrap_or_default();
        Some((spec, incarnation))
    }

    /// Whether a deletion of this name is still in progress.
    pub fn is_deleting(&self, stream: bool, t: &str, ns: &str, n: &str) -> bool {
        self.read().deleting(stream, t, ns, n)
    }

    /// A stream's (`stream`) or cache's spec, if declared.
    pub fn spec(&self, stream: bool, t: &str, ns: &str, n: &str) -> Option<StreamSpec> {
        self.read().map(stream).get(&flat(t, ns, n)).copied()
    }

    /// Looks a name up; creates it with the defaults when `create` and auto-create is
    /// on. In memory only: the caller persists.
    pub fn lookup(
        &self,
        stream: bool,
        t: &str,
        ns: &str,
        n: &str,
        create: bool,
    ) -> Result<StreamSpec, BrokerError> {
        if let Some(spec) = self.spec(stream, t, ns, n) {
            return Ok(spec);
        }
        match self.auto_create_shards {
            Some(shards) if create => self.create(stream, t, ns, n, StreamSpec::new(shards)),
            _ => Err(BrokerError::NotFound(format!(
                "{} {t}/{ns}/{n} not found",
                what(stream)
            ))),
        }
    }

    /// Every stream (`stream`) or cache, by `tenant/ns/name`.
    pub fn list(&self, stream: bool) -> Vec<(String, StreamSpec)> {
        let st = self.read();
        let mut v: Vec<_> = st
            .map(stream)
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// Every stream, for the admin view.
    pub fn streams(&self) -> Vec<(String, StreamSpec)> {
        self.list(true)
    }
}

fn write_durably(path: &Path, body: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    let tmp = path.with_extension("json.tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(body)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// A stream or cache as one core sees it: its spec and the key of each shard, built
/// once so requests share them instead of allocating names.
#[derive(Debug)]
pub struct Entry {
    /// The spec.
    pub spec: StreamSpec,
    keys: Vec<Arc<ShardKey>>,
}

impl Entry {
    fn new(kind: ShardKind, t: &str, ns: &str, n: &str, spec: StreamSpec) -> Entry {
        Entry {
            spec,
            keys: (0..spec.shards)
                .map(|shard| {
                    Arc::new(ShardKey {
                        kind,
                        tenant: t.to_owned(),
                        namespace: ns.to_owned(),
                        name: n.to_owned(),
                        shard,
                    })
                })
                .collect(),
        }
    }

    /// The key of `shard` (None past the shard count).
    pub fn key(&self, shard: u32) -> Option<&Arc<ShardKey>> {
        self.keys.get(shard as usize)
    }

    fn is(&self, t: &str, ns: &str, n: &str) -> bool {
        let k = &self.keys[0];
        k.tenant == t && k.namespace == ns && k.name == n
    }
}

fn name_hash(t: &str, ns: &str, n: &str) -> u64 {
    [t, ns, n].iter().fold(fnv1a64(&[]), |h, p| {
        fnv1a64_update(
            fnv1a64_update(h, &(p.len() as u32).to_be_bytes()),
            p.as_bytes(),
        )
    })
}

type EntryMap = FxHashMap<u64, Vec<Rc<Entry>>>;

/// One core's read-through cache of the catalog.
#[derive(Debug)]
pub struct CoreCatalog {
    shared: Arc<Catalog>,
    epoch: Cell<u64>,
    streams: RefCell<EntryMap>,
    caches: RefCell<EntryMap>,
}

impl CoreCatalog {
    /// A cache over `shared`.
    pub fn new(shared: Arc<Catalog>) -> Self {
        Self {
            epoch: Cell::new(shared.epoch()),
            shared,
            streams: RefCell::default(),
            caches: RefCell::default(),
        }
    }

    fn get(
        &self,
        stream: bool,
        t: &str,
        ns: &str,
        n: &str,
        create: bool,
    ) -> Result<Rc<Entry>, BrokerError> {
        let epoch = self.shared.epoch();
        if epoch != self.epoch.get() {
            self.epoch.set(epoch);
            self.streams.borrow_mut().clear();
            self.caches.borrow_mut().clear();
        }
        let cache = if stream { &self.streams } else { &self.caches };
        let h = name_hash(t, ns, n);
        if let Some(e) = cache
            .borrow()
            .get(&h)
            .and_then(|v| v.iter().find(|e| e.is(t, ns, n)))
        {
            return Ok(e.clone());
        }
        let spec = self.shared.lookup(stream, t, ns, n, create)?;
        let kind = if stream {
            ShardKind::Stream
        } else {
            ShardKind::Cache
        };
        let e = Rc::new(Entry::new(kind, t, ns, n, spec));
        cache.borrow_mut().entry(h).or_default().push(e.clone());
        Ok(e)
    }

    /// A stream; created with defaults in dev mode when `create`.
    pub fn stream(
        &self,
        t: &str,
        ns: &str,
        s: &str,
        create: bool,
    ) -> Result<Rc<Entry>, BrokerError> {
        self.get(true, t, ns, s, create)
    }

    /// A cache; created with defaults in dev mode when `create`.
    pub fn cache(
        &self,
        t: &str,
        ns: &str,
        c: &str,
        create: bool,
    ) -> Result<Rc<Entry>, BrokerError> {
        self.get(false, t, ns, c, create)
    }

    /// The shared catalog.
    pub fn shared(&self) -> &Arc<Catalog> {
        &self.shared
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_and_specs_survive_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("catalog.json");
        let c = Catalog::open(Some(path.clone()), Some(4)).unwrap();
        assert!(c.lookup(true, "dev", "default", "../x", true).is_err());
        assert!(c.lookup(true, "dev", "default", "", true).is_err());
        assert_eq!(
            c.lookup(true, "dev", "default", "orders", true)
                .unwrap()
                .shards,
            4
        );
        assert!(
            c.lookup(false, "dev", "default", "orders", false).is_err(),
            "caches are separate"
        );
        assert!(c.needs_persist(), "the creation is in memory only");
        c.persist().unwrap();
        assert!(!c.needs_persist());
        let c = Catalog::open(Some(path), Some(8)).unwrap();
        assert_eq!(
            c.lookup(true, "dev", "default", "orders", true)
                .unwrap()
                .shards,
            4,
            "a stream keeps its shard count across restarts"
        );
        let strict = Catalog::open(None, None).unwrap();
        assert!(matches!(
            strict.lookup(true, "dev", "default", "nope", true),
            Err(BrokerError::NotFound(_))
        ));
    }

    #[test]
    fn a_deleted_name_stays_gone_until_every_core_removed_its_data() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("catalog.json");
        let c = Catalog::open(Some(path.clone()), Some(2)).unwrap();
        c.lookup(true, "t", "ns", "s", true).unwrap();
        assert!(c.delete(true, "t", "ns", "s"));
        assert!(!c.delete(true, "t", "ns", "s"), "only once");
        assert!(matches!(
            c.lookup(true, "t", "ns", "s", true),
            Err(BrokerError::ShardUnavailable(_))
        ));
        c.persist().unwrap();
        // A restart in the middle still knows the deletion is owed.
        let c = Catalog::open(Some(path), Some(2)).unwrap();
        let owed = c.pending_deletions(0);
        assert_eq!(owed.len(), 1);
        assert!(!c.deletion_done(&owed[0], 0, 2));
        assert!(c.pending_deletions(0).is_empty());
        assert_eq!(c.pending_deletions(1).len(), 1);
        assert!(c.deletion_done(&owed[0], 1, 2));
        assert!(!c.is_deleting(true, "t", "ns", "s"));
        // Past 64 cores each still counts apart: core 64 was core 0's bit again.
        c.lookup(true, "t", "ns", "wide", true).unwrap();
        assert!(c.delete(true, "t", "ns", "wide"));
        let owed = c.pending_deletions(0);
        for core in 0..65 {
            assert_eq!(c.pending_deletions(core).len(), 1, "core {core}");
        }
        for core in (1..66).rev() {
            assert!(!c.deletion_done(&owed[0], core, 66), "core {core}");
        }
        assert!(c.pending_deletions(64).is_empty());
        assert_eq!(c.pending_deletions(0).len(), 1, "core 0 has not finished");
        assert!(c.deletion_done(&owed[0], 0, 66));
        assert!(
            c.lookup(true, "t", "ns", "s", true).is_ok(),
            "the name is free again"
        );
    }

    #[test]
    fn core_caches_hit_without_the_lock_and_drop_on_a_new_epoch() {
        let shared = Arc::new(Catalog::open(None, Some(3)).unwrap());
        let core = CoreCatalog::new(shared.clone());
        let a = core.stream("t", "ns", "s", true).unwrap();
        assert_eq!(a.spec.shards, 3);
        assert_eq!(a.key(2).unwrap().shard, 2);
        assert!(a.key(3).is_none());
        let b = core.stream("t", "ns", "s", false).unwrap();
        assert!(Rc::ptr_eq(&a, &b), "a hit shares the entry");
        assert!(core.stream("t", "ns", "other", false).is_err());
        shared.delete(true, "t", "ns", "s");
        assert!(
            core.stream("t", "ns", "s", false).is_err(),
            "a deletion is seen by the next lookup"
        );
    }
}
