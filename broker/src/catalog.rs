//! What streams and caches exist, and their shard counts.
//!
//! Single-node metadata: held in memory, persisted to `<data-dir>/catalog.json` so a
//! restart routes keys exactly as before (a stream's shard count and routing are fixed
//! at creation). In dev mode a stream or cache used for the first time is created with
//! the defaults. Writes are rare and take a lock; every core keeps its own read cache
//! ([`CoreCatalog`]) so the publish path never touches the lock after first use.

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use felix_wire::routing::ShardRouting;
use serde::{Deserialize, Serialize};

use crate::error::BrokerError;

/// A stream's fixed shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamSpec {
    /// Shard count.
    pub shards: u32,
    /// Key-to-shard mapping.
    #[serde(default)]
    pub routing: ShardRouting,
}

/// A name triple: tenant, namespace, stream or cache.
pub type Name = (String, String, String);

#[derive(Debug, Default, Serialize, Deserialize)]
struct State {
    streams: HashMap<String, StreamSpec>,
    caches: HashMap<String, StreamSpec>,
}

fn flat(t: &str, ns: &str, n: &str) -> String {
    format!("{t}/{ns}/{n}")
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
            "invalid {what} name {name:?}: 1-128 of [A-Za-z0-9-_.], starting alphanumeric"
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
        })
    }

    fn persist(&self, state: &State) -> Result<(), BrokerError> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let tmp = path.with_extension("json.tmp");
        let write = || -> std::io::Result<()> {
            let f = std::fs::File::create(&tmp)?;
            serde_json::to_writer_pretty(&f, state)?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)?;
            if let Some(dir) = path.parent() {
                std::fs::File::open(dir)?.sync_all()?;
            }
            Ok(())
        };
        write().map_err(|e| BrokerError::Internal(format!("persisting the catalog: {e}")))
    }

    /// Declares a stream (idempotent when the spec matches).
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
        validate_name(if stream { "stream" } else { "cache" }, n)?;
        if spec.shards == 0 || spec.shards > 4096 {
            return Err(BrokerError::InvalidRequest(format!(
                "shard count {} out of range 1..=4096",
                spec.shards
            )));
        }
        let mut st = self.state.write().expect("catalog lock");
        let map = if stream {
            &mut st.streams
        } else {
            &mut st.caches
        };
        if let Some(existing) = map.get(&flat(t, ns, n)) {
            return Ok(*existing);
        }
        map.insert(flat(t, ns, n), spec);
        self.persist(&st)?;
        Ok(spec)
    }

    /// A stream's (`stream`) or cache's spec, if declared.
    pub fn spec(&self, stream: bool, t: &str, ns: &str, n: &str) -> Option<StreamSpec> {
        let st = self.state.read().expect("catalog lock");
        let map = if stream { &st.streams } else { &st.caches };
        map.get(&flat(t, ns, n)).copied()
    }

    fn lookup(
        &self,
        stream: bool,
        t: &str,
        ns: &str,
        n: &str,
        create: bool,
    ) -> Result<StreamSpec, BrokerError> {
        {
            let st = self.state.read().expect("catalog lock");
            let map = if stream { &st.streams } else { &st.caches };
            if let Some(spec) = map.get(&flat(t, ns, n)) {
                return Ok(*spec);
            }
        }
        match self.auto_create_shards {
            Some(shards) if create => self.create(
                stream,
                t,
                ns,
                n,
                StreamSpec {
                    shards,
                    routing: ShardRouting::Modulo,
                },
            ),
            _ => Err(BrokerError::NotFound(format!(
                "{} {t}/{ns}/{n} not found",
                if stream { "stream" } else { "cache" }
            ))),
        }
    }

    /// Every stream, for the admin view.
    pub fn streams(&self) -> Vec<(String, StreamSpec)> {
        let st = self.state.read().expect("catalog lock");
        let mut v: Vec<_> = st.streams.iter().map(|(k, v)| (k.clone(), *v)).collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }
}

/// One core's read-through cache of the catalog.
#[derive(Debug)]
pub struct CoreCatalog {
    shared: Arc<Catalog>,
    streams: RefCell<HashMap<Name, StreamSpec>>,
    caches: RefCell<HashMap<Name, StreamSpec>>,
}

impl CoreCatalog {
    /// A cache over `shared`.
    pub fn new(shared: Arc<Catalog>) -> Self {
        Self {
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
    ) -> Result<StreamSpec, BrokerError> {
        let cache = if stream { &self.streams } else { &self.caches };
        // Borrowed-key lookup without allocating: scan is avoided by a tuple key built
        // only on a miss.
        let key = (t.to_owned(), ns.to_owned(), n.to_owned());
        if let Some(spec) = cache.borrow().get(&key) {
            return Ok(*spec);
        }
        let spec = self.shared.lookup(stream, t, ns, n, create)?;
        cache.borrow_mut().insert(key, spec);
        Ok(spec)
    }

    /// A stream's spec; created with defaults in dev mode when `create`.
    pub fn stream(
        &self,
        t: &str,
        ns: &str,
        s: &str,
        create: bool,
    ) -> Result<StreamSpec, BrokerError> {
        self.get(true, t, ns, s, create)
    }

    /// A cache's spec; created with defaults in dev mode when `create`.
    pub fn cache(
        &self,
        t: &str,
        ns: &str,
        c: &str,
        create: bool,
    ) -> Result<StreamSpec, BrokerError> {
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
}
