//! Following the control plane: register, heartbeat, and mirror the assignment feed
//! into an immutable routing snapshot the cores read with one atomic load.
//!
//! Two plain threads, outside the pinned cores, do the talking (the control-plane
//! client is blocking): one heartbeats, one follows the feed. The follower writes the
//! catalog (stream shapes) and token keys before it publishes routes, so a shard that
//! becomes ours is known to the cores before any request is routed to it. A request
//! for a shard with no route is refused, never served locally.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use base64::Engine as _;
use felix_controlplane::client::{ClientError, ControlPlaneClient};
use felix_core_runtime::placement::{ShardKey, ShardKind};
use felix_wire::routing::ShardRouting;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::auth::TenantKeys;
use crate::catalog::{Catalog, Retention, StreamSpec};
use crate::config::ClusterSettings;

/// Who leads one shard.
#[derive(Debug, Clone)]
pub struct Route {
    /// The leader's node id.
    pub leader: Arc<str>,
    /// Where clients reach it (None: it did not say, or it is not live).
    pub addr: Option<SocketAddr>,
    /// Assignment generation.
    pub generation: u64,
}

/// The routing snapshot: replaced whole, never patched.
#[derive(Debug, Default)]
pub struct ClusterView {
    /// Shard routes.
    pub routes: HashMap<ShardKey, Route>,
    /// Live brokers with a client address: `(node_id, addr)`.
    pub brokers: Vec<(String, String)>,
}

/// Where a request for a shard goes.
#[derive(Debug, Clone)]
pub enum Resolved {
    /// This broker leads it.
    Local,
    /// Another broker does.
    Remote(Route),
    /// Nobody can take it now (why).
    Unavailable(&'static str),
}

/// This broker's membership.
#[derive(Debug)]
pub struct Cluster {
    /// This node.
    pub node_id: String,
    view: ArcSwap<ClusterView>,
    /// Set after the first full sync.
    pub synced: AtomicBool,
    /// Full syncs done.
    pub syncs: AtomicU64,
    /// Heartbeats the control plane accepted.
    pub heartbeats: AtomicU64,
    stop: AtomicBool,
}

impl Cluster {
    /// An empty membership: everything is unavailable until [`join`] syncs it.
    pub fn new(node_id: String) -> Cluster {
        Cluster {
            node_id,
            view: ArcSwap::from_pointee(ClusterView::default()),
            synced: AtomicBool::new(false),
            syncs: AtomicU64::new(0),
            heartbeats: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        }
    }

    /// Resolves a shard's owner: one atomic load and a map lookup.
    pub fn resolve(&self, key: &ShardKey) -> Resolved {
        if !self.synced.load(Ordering::Relaxed) {
            return Resolved::Unavailable("not_ready");
        }
        let view = self.view.load();
        match view.routes.get(key) {
            None => Resolved::Unavailable("not_assigned"),
            Some(r) if *r.leader == *self.node_id => Resolved::Local,
            Some(r) if r.addr.is_none() => Resolved::Unavailable("owner_unavailable"),
            Some(r) => Resolved::Remote(r.clone()),
        }
    }

    /// Every shard route of one stream or cache, by shard.
    pub fn routes_of(&self, kind: ShardKind, t: &str, ns: &str, name: &str) -> Vec<(u32, Route)> {
        let view = self.view.load();
        let mut out: Vec<(u32, Route)> = view
            .routes
            .iter()
            .filter(|(k, _)| k.kind == kind && k.tenant == t && k.namespace == ns && k.name == name)
            .map(|(k, r)| (k.shard, r.clone()))
            .collect();
        out.sort_by_key(|(s, _)| *s);
        out
    }

    /// Shards this broker leads now.
    pub fn shards_led(&self) -> usize {
        let view = self.view.load();
        view.routes
            .values()
            .filter(|r| *r.leader == *self.node_id)
            .count()
    }

    /// Live brokers clients can reach.
    pub fn brokers(&self) -> Vec<(String, String)> {
        self.view.load().brokers.clone()
    }

    /// Asks the follower threads to stop (at their next wake).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

#[derive(Deserialize)]
struct NodeDoc {
    node_id: String,
    client_addr: Option<String>,
    lifecycle: String,
}

#[derive(Deserialize)]
struct AssignmentDoc {
    tenant_id: String,
    namespace: String,
    kind: String,
    name: String,
    shard: u32,
    leader: String,
    generation: u64,
}

#[derive(Deserialize)]
struct StreamDoc {
    tenant_id: String,
    namespace: String,
    stream: String,
    shards: u32,
    #[serde(default)]
    routing: ShardRouting,
    #[serde(default)]
    retention: Retention,
}

#[derive(Deserialize)]
struct CacheDoc {
    tenant_id: String,
    namespace: String,
    cache: String,
    shards: u32,
}

fn items<T: serde::de::DeserializeOwned>(v: &Value, field: &str) -> anyhow::Result<Vec<T>> {
    serde_json::from_value(v.get(field).cloned().unwrap_or(Value::Array(Vec::new())))
        .map_err(|e| anyhow::anyhow!("control plane answer `{field}`: {e}"))
}

/// What the follower needs to update.
struct Targets {
    cluster: Arc<Cluster>,
    catalog: Arc<Catalog>,
    keys: Arc<ArcSwap<TenantKeys>>,
    base_keys: TenantKeys,
}

/// `base` plus every tenant's verification keys from the control plane's JWKS.
pub fn fetch_keys(cp: &ControlPlaneClient, base: &TenantKeys) -> anyhow::Result<TenantKeys> {
    let mut keys = base.clone();
    let tenants = cp.get("/v1/tenants/snapshot")?;
    for tenant in tenants["items"].as_array().into_iter().flatten() {
        let Some(id) = tenant["tenant_id"].as_str() else {
            continue;
        };
        let jwks = cp.get(&format!("/v1/tenants/{id}/.well-known/jwks.json"))?;
        for k in jwks["keys"].as_array().into_iter().flatten() {
            let (Some(kid), Some(x)) = (k["kid"].as_str(), k["x"].as_str()) else {
                continue;
            };
            match base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(x.trim_end_matches('=')) {
                Ok(pk) => keys.add(id, kid, pk),
                Err(e) => tracing::warn!(tenant = id, kid, error = %e, "unreadable JWK"),
            }
        }
    }
    Ok(keys)
}

/// One full sync: stream shapes, then keys, then nodes and routes (in that order).
fn sync(cp: &ControlPlaneClient, t: &Targets) -> anyhow::Result<u64> {
    let shapes = cp.get("/v1/streams/snapshot")?;
    let mut listed = (HashSet::new(), HashSet::new());
    for s in items::<StreamDoc>(&shapes, "items")? {
        let spec = StreamSpec {
            shards: s.shards,
            routing: s.routing,
            retention: s.retention,
        };
        listed
            .0
            .insert(format!("{}/{}/{}", s.tenant_id, s.namespace, s.stream));
        if let Err(e) = t
            .catalog
            .create_stream(&s.tenant_id, &s.namespace, &s.stream, spec)
        {
            tracing::warn!(error = %e, "stream {}/{}/{} differs from the local catalog", s.tenant_id, s.namespace, s.stream);
        }
    }
    for c in items::<CacheDoc>(&shapes, "caches")? {
        listed
            .1
            .insert(format!("{}/{}/{}", c.tenant_id, c.namespace, c.cache));
        if let Err(e) = t.catalog.create_cache(
            &c.tenant_id,
            &c.namespace,
            &c.cache,
            StreamSpec::new(c.shards),
        ) {
            tracing::warn!(error = %e, "cache {}/{}/{} differs from the local catalog", c.tenant_id, c.namespace, c.cache);
        }
    }
    // The control plane is the catalog's authority: a name it no longer lists was
    // deleted, and its data goes with it (the cores remove it).
    for (stream, names) in [(true, &listed.0), (false, &listed.1)] {
        for (name, _) in t.catalog.list(stream) {
            if names.contains(&name) {
                continue;
            }
            let mut parts = name.splitn(3, '/');
            if let (Some(tn), Some(ns), Some(n)) = (parts.next(), parts.next(), parts.next()) {
                tracing::info!(name = %name, "deleted in the control plane; removing its data");
                t.catalog.delete(stream, tn, ns, n);
            }
        }
    }
    if let Err(e) = t.catalog.persist() {
        tracing::error!(error = %e, "persisting the catalog");
    }

    let keys = fetch_keys(cp, &t.base_keys)?;
    t.keys.store(Arc::new(keys));

    let nodes: Vec<NodeDoc> = items(&cp.get("/v1/nodes")?, "items")?;
    let addr_of: HashMap<&str, SocketAddr> = nodes
        .iter()
        .filter(|n| n.lifecycle == "live")
        .filter_map(|n| Some((n.node_id.as_str(), n.client_addr.as_deref()?.parse().ok()?)))
        .collect();
    let snapshot = cp.get("/v1/shard-assignments/snapshot")?;
    let next_seq = snapshot["next_seq"].as_u64().unwrap_or(0);
    let mut routes = HashMap::new();
    for a in items::<AssignmentDoc>(&snapshot, "items")? {
        let kind = match a.kind.as_str() {
            "stream" => ShardKind::Stream,
            "cache" => ShardKind::Cache,
            _ => continue,
        };
        let addr = addr_of.get(a.leader.as_str()).copied();
        routes.insert(
            ShardKey {
                kind,
                tenant: a.tenant_id,
                namespace: a.namespace,
                name: a.name,
                shard: a.shard,
            },
            Route {
                leader: a.leader.into(),
                addr,
                generation: a.generation,
            },
        );
    }
    let mut brokers: Vec<(String, String)> = addr_of
        .iter()
        .map(|(n, a)| ((*n).to_owned(), a.to_string()))
        .collect();
    brokers.sort();
    t.cluster
        .view
        .store(Arc::new(ClusterView { routes, brokers }));
    t.cluster.syncs.fetch_add(1, Ordering::Relaxed);
    Ok(next_seq)
}

fn register(
    cp: &ControlPlaneClient,
    node_id: &str,
    client_addr: SocketAddr,
) -> Result<(u64, Duration), ClientError> {
    let answer = cp.post(
        "/v1/nodes",
        &json!({"node_id": node_id, "client_addr": client_addr.to_string()}),
    )?;
    let incarnation = answer["incarnation"].as_u64().unwrap_or(1);
    let interval = Duration::from_millis(
        answer["heartbeat_interval_ms"]
            .as_u64()
            .unwrap_or(1000)
            .max(50),
    );
    Ok((incarnation, interval))
}

/// Registers with the control plane, does the first full sync, and starts the
/// heartbeat and feed threads. A 4xx from the control plane is fatal (wrong token,
/// bad address); an unreachable one is retried for `patience`.
pub fn join(
    settings: &ClusterSettings,
    cluster: Arc<Cluster>,
    catalog: Arc<Catalog>,
    keys: Arc<ArcSwap<TenantKeys>>,
    patience: Duration,
) -> anyhow::Result<()> {
    let node_id = cluster.node_id.clone();
    let node_id = node_id.as_str();
    let cp = ControlPlaneClient::new(&settings.url, Some(settings.token.clone()))?;
    let deadline = Instant::now() + patience;
    let (incarnation, interval) = loop {
        match register(&cp, node_id, settings.client_addr) {
            Ok(r) => break r,
            Err(e @ ClientError::Api { .. }) => {
                anyhow::bail!("control plane refused registration: {e}")
            }
            Err(e) if Instant::now() < deadline => {
                tracing::warn!(error = %e, "control plane unreachable; retrying");
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => anyhow::bail!("control plane unreachable: {e}"),
        }
    };
    let base_keys = (**keys.load()).clone();
    let targets = Targets {
        cluster: cluster.clone(),
        catalog,
        keys,
        base_keys,
    };
    let mut seq = sync(&cp, &targets)?;
    cluster.synced.store(true, Ordering::SeqCst);
    tracing::info!(node_id, incarnation, url = %settings.url, "joined the cluster");

    {
        let (cp, cluster, node_id, client_addr) = (
            cp.clone(),
            cluster.clone(),
            node_id.to_owned(),
            settings.client_addr,
        );
        std::thread::Builder::new()
            .name("felix-heartbeat".into())
            .spawn(move || {
                heartbeat_loop(&cp, &cluster, &node_id, client_addr, incarnation, interval)
            })?;
    }
    std::thread::Builder::new().name("felix-follow".into()).spawn(move || {
        let mut cp = cp;
        cp.request_timeout = Duration::from_secs(5);
        while !targets.cluster.stop.load(Ordering::SeqCst) {
            // Long-poll for assignment changes; any change, or the poll ending, brings a
            // full resync (streams, keys and nodes change without an assignment event).
            let polled = cp.get_long(
                &format!("/v1/shard-assignments/changes?since={seq}&wait_ms=2000"),
                Duration::from_secs(3),
            );
            if let Err(e) = &polled {
                tracing::warn!(error = %e, "following the assignment feed");
                std::thread::sleep(Duration::from_millis(500));
                continue;
            }
            match sync(&cp, &targets) {
                Ok(next) => seq = next,
                Err(e) => tracing::warn!(error = %e, "syncing from the control plane; keeping the last snapshot"),
            }
        }
    })?;
    Ok(())
}

fn heartbeat_loop(
    cp: &ControlPlaneClient,
    cluster: &Cluster,
    node_id: &str,
    client_addr: SocketAddr,
    mut incarnation: u64,
    interval: Duration,
) {
    let path = format!("/v1/nodes/{node_id}/heartbeat");
    while !cluster.stop.load(Ordering::SeqCst) {
        std::thread::sleep(interval);
        match cp.post(&path, &json!({"incarnation": incarnation})) {
            Ok(_) => {
                cluster.heartbeats.fetch_add(1, Ordering::Relaxed);
            }
            // Declared down (or replaced): register again, as a new incarnation.
            Err(ClientError::Api {
                status: 409 | 404, ..
            }) => match register(cp, node_id, client_addr) {
                Ok((i, _)) => {
                    tracing::warn!(
                        incarnation = i,
                        "the control plane had marked this node down; registered again"
                    );
                    incarnation = i;
                }
                Err(e) => tracing::warn!(error = %e, "registering again"),
            },
            Err(e) => tracing::warn!(error = %e, "heartbeat"),
        }
    }
}
