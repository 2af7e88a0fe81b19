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
use felix_core_runtime::clock::BootTime;
use felix_core_runtime::placement::{ShardKey, ShardKind};
use felix_wire::routing::ShardRouting;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::auth::TenantKeys;
use crate::catalog::{Catalog, Consistency, Retention, StreamSpec};
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
    /// Every replica, leader included.
    pub replicas: Arc<[Arc<str>]>,
    /// A copy being staged for a move: shipped to, not a member (see
    /// `replication::machine::Assignment::learners`).
    pub learners: Arc<[Arc<str>]>,
    /// A planned handoff's old leader, at this generation (see
    /// `replication::machine::Assignment::handoff_from`).
    pub handoff_from: Option<Arc<str>>,
    /// The generation an operator's abandon wrote: copies that accepted an older one
    /// are kept for manual recovery (`core/left.rs`).
    pub abandoned: Option<u64>,
}

/// The routing snapshot: replaced whole, never patched.
#[derive(Debug, Default)]
pub struct ClusterView {
    /// Shard routes.
    pub routes: HashMap<ShardKey, Route>,
    /// Live brokers with a client address: `(node_id, addr)`.
    pub brokers: Vec<(String, String)>,
    /// Where each live broker takes broker-to-broker connections.
    pub peers: HashMap<String, SocketAddr>,
    /// Bumped by every sync, so cores notice a new snapshot with one load.
    pub version: u64,
}

/// What a leader reports about one shard (to the control plane, `/metrics` and
/// `/replication/halted`), refreshed by the core that leads it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ShardReport {
    /// `stream` or `cache`.
    pub kind: &'static str,
    /// Tenant.
    pub tenant_id: String,
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Shard.
    pub shard: u32,
    /// Generation led.
    pub generation: u64,
    /// One past the leader's last durable record.
    pub log_end: u64,
    /// Commit mark.
    pub commit: u64,
    /// The commit mark is past this generation's start record (every earlier record is
    /// on a majority of the current set).
    pub generation_committed: bool,
    /// Followers: what each durably holds, and whether it is halted.
    pub followers: Vec<FollowerReport>,
    /// Named leader, this broker lost its copy (found damaged, being rebuilt from the
    /// others) and will not lead this generation: the control plane promotes another.
    /// Left out when false (a control plane that predates it refuses unknown fields).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub cannot_lead: bool,
}

/// One follower in a [`ShardReport`].
#[derive(Debug, Clone, serde::Serialize)]
pub struct FollowerReport {
    /// Node.
    pub node_id: String,
    /// What it holds at this generation.
    pub durable_end: u64,
    /// Refused to cut committed records: it needs an operator.
    pub halted: bool,
    /// A copy staged for a move, not a member of the set.
    pub staged: bool,
    /// It lost its copy and rebuilds it (counted in no election): the control plane
    /// starts a new generation, which it can be whole again at. Left out when false.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub rebuilding: bool,
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
    /// The lease: writes are taken only before this moment ([`BootTime`] nanoseconds,
    /// which count a suspended host's time), anchored at when the last accepted
    /// heartbeat was sent.
    lease_until: AtomicU64,
    /// A renewal made after the lease ran out, waiting for a sync.
    pending_lease: AtomicU64,
    /// When the latest such renewal's heartbeat was sent ([`BootTime`] nanoseconds).
    resync_after: AtomicU64,
    /// Replicated shards this broker leads, by the core that leads each.
    pub reports: std::sync::Mutex<HashMap<ShardKey, ShardReport>>,
    /// Deliberate bugs (checker mutant runs only).
    pub mutants: crate::config::Mutants,
    /// The control plane, once joined (for a drain).
    control_plane: std::sync::Mutex<Option<ControlPlaneClient>>,
    /// Set when a drain starts: new client connections are turned away (clients
    /// reconnect elsewhere) while the ones open keep being served.
    pub draining: AtomicBool,
    /// What the last sync could not verify (reported on `/readyz` and `/metrics`).
    pub sync_status: std::sync::Mutex<SyncStatus>,
    /// Syncs that failed (the last snapshot kept).
    pub sync_failures: AtomicU64,
    /// When the last good sync completed ([`BootTime`] nanoseconds; 0: none yet).
    good_sync_ns: AtomicU64,
    /// Syncs asked of the resync thread (see `resync_loop`).
    resync: (std::sync::Mutex<Resync>, std::sync::Condvar),
}

/// Why the resync thread was asked for a sync.
#[derive(Debug, Default, Clone, Copy)]
struct Resync {
    /// The heartbeat renewed a lapsed lease (skipped if a sync made it valid already).
    lapsed: bool,
    /// A replica learned of a newer generation than the assignments it holds.
    asked: bool,
}

/// What the broker could not take from the control plane at its last sync.
#[derive(Debug, Default, Clone)]
pub struct SyncStatus {
    /// Why the last sync failed (unreachable, or a certificate that does not verify);
    /// `None` after a good one.
    pub last_error: Option<String>,
    /// Tenants whose key set was refused, and why; they keep their last good keys.
    pub unverified_tenants: Vec<(String, String)>,
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
            lease_until: AtomicU64::new(0),
            pending_lease: AtomicU64::new(0),
            resync_after: AtomicU64::new(0),
            reports: std::sync::Mutex::default(),
            mutants: crate::config::Mutants::default(),
            control_plane: std::sync::Mutex::default(),
            draining: AtomicBool::new(false),
            sync_status: std::sync::Mutex::default(),
            sync_failures: AtomicU64::new(0),
            good_sync_ns: AtomicU64::new(0),
            resync: Default::default(),
        }
    }

    /// Asks for the assignments to be read from the control plane now, not when the
    /// feed next brings them (a replica was shown a newer generation than it holds);
    /// never waits. Asks made while a sync is pending are one.
    pub fn ask_sync(&self) {
        self.want_sync(|r| r.asked = true);
    }

    fn want_sync(&self, why: impl FnOnce(&mut Resync)) {
        why(&mut self.resync.0.lock().unwrap_or_else(|e| e.into_inner()));
        self.resync.1.notify_one();
    }

    /// Hands the shards this broker leads to their replicas before it stops: asks the
    /// control plane to drain this node, then waits (up to `patience`) until the
    /// assignments it follows show it leading only what could not move. Serving goes on
    /// meanwhile; clients follow the new leaders.
    pub fn drain(&self, patience: Duration) {
        let Some(cp) = self.control_plane.lock().ok().and_then(|c| c.clone()) else {
            return;
        };
        self.draining.store(true, Ordering::SeqCst);
        let answer = match cp.post(&format!("/v1/nodes/{}/drain", self.node_id), &json!({})) {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "draining: the control plane did not take the drain");
                return;
            }
        };
        let count = |k: &str| answer[k].as_array().map_or(0, Vec::len);
        let (moved, kept) = (count("moved"), count("kept"));
        tracing::info!(moved, kept, "draining: leadership handed to replicas");
        let deadline = Instant::now() + patience;
        while self.shards_led() > kept && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let left = self.shards_led();
        if left > kept {
            tracing::warn!(left, kept, "draining: gave up waiting for every move");
            return;
        }
        // Then until each successor serves, which it does only once it took the log it
        // chose: this broker's, when it held records no follower had yet (a `Leader`
        // stream's acknowledged tail: a planned handoff's new leader waits for this
        // broker's fence for that). Stopped at once, this broker answered the fence, or
        // a fetch, too late or never: the tail was lost, or the successor waited for
        // a source that had gone.
        let moved: Vec<(String, String, u64)> = answer["moved"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|m| {
                Some((
                    m["shard"].as_str()?.to_owned(),
                    m["leader"].as_str()?.to_owned(),
                    m["generation"].as_u64()?,
                ))
            })
            .collect();
        let mut waiting = moved.len();
        while waiting > 0 && Instant::now() < deadline {
            if let Ok(view) = cp.get("/v1/placement/replication") {
                waiting = moved
                    .iter()
                    .filter(|m| !successor_serves(&view, m, &self.node_id))
                    .count();
            }
            if waiting > 0 {
                // (Each look lists every assignment: a few a second.)
                std::thread::sleep(Duration::from_millis(250));
            }
        }
        if waiting > 0 {
            tracing::warn!(
                waiting,
                "draining: gave up waiting for every successor to serve"
            );
        } else {
            tracing::info!(kept, "draining: every movable shard moved and served");
        }
    }

    /// Whether this broker holds its lease at `now` (its own boot-time clock: the
    /// monotonic one stands still while the host is suspended, the control plane's
    /// does not).
    pub fn lease_valid(&self, now: BootTime) -> bool {
        if self.mutants.ack_after_lease {
            return true;
        }
        now.nanos() < self.lease_until.load(Ordering::Acquire)
    }

    /// A heartbeat sent at `sent` was accepted with an expiry timeout of `expiry`: the
    /// lease runs to `sent + expiry - expiry/4`. The control plane declares the broker
    /// down only after `expiry + margin` (margin >= expiry/4) since it *received* the
    /// heartbeat, so this broker has stopped writing by then, with room for clock
    /// drift. Never moves backwards.
    ///
    /// A heartbeat sent after the lease ran out renews nothing yet: while this broker
    /// was cut off (or paused) the control plane may have moved its shards, and until
    /// it has read the assignments again it would take writes for shards it no longer
    /// leads. The renewal waits for a sync that started after it ([`Cluster::synced_at`]);
    /// `true` says so, and the caller starts one at once rather than leaving writes
    /// refused until the assignment feed's next poll ends.
    pub fn renew_lease(&self, sent: BootTime, expiry: Duration) -> bool {
        let sent_ns = sent.nanos();
        let until = sent.after(expiry - expiry / 4).nanos();
        if sent_ns >= self.lease_until.load(Ordering::Acquire) {
            // `resync_after` first: a sync that sees this pending lease (read first in
            // `synced_at`) then sees this renewal's time too, so one that started before
            // the renewal never makes it valid.
            self.resync_after.fetch_max(sent_ns, Ordering::AcqRel);
            self.pending_lease.fetch_max(until, Ordering::AcqRel);
            return true;
        }
        self.lease_until.fetch_max(until, Ordering::AcqRel);
        false
    }

    /// A sync from the control plane that started at `started` completed: a lease
    /// renewed while lapsed counts from now on if the sync began after that renewal.
    pub fn synced_at(&self, started: BootTime, now: BootTime) {
        self.good_sync_ns
            .store(now.nanos().max(1), Ordering::Release);
        let started_ns = started.nanos();
        // The pending lease before the time it waits for (see `renew_lease`).
        let pending = self.pending_lease.load(Ordering::Acquire);
        let after = self.resync_after.load(Ordering::Acquire);
        if started_ns > after {
            self.lease_until.fetch_max(pending, Ordering::AcqRel);
        }
    }

    /// Whether the assignments were read from the control plane within `within`.
    pub fn view_fresh(&self, within: Duration) -> bool {
        let at = self.good_sync_ns.load(Ordering::Acquire);
        at != 0 && BootTime::now().nanos().saturating_sub(at) <= within.as_nanos() as u64
    }

    /// Whether the latest assignments this broker has read name it leader of `key` at
    /// `generation`: a replica's own belief can trail them by a sync.
    pub fn leads(&self, key: &ShardKey, generation: u64) -> bool {
        if self.mutants.ack_after_lease {
            return true;
        }
        self.view
            .load()
            .routes
            .get(key)
            .is_some_and(|r| *r.leader == *self.node_id && r.generation == generation)
    }

    /// Whether the assignments read name this broker leader of `key` at a generation
    /// newer than `generation` (one atomic load, no reference count taken: every write
    /// to a replicated shard asks).
    pub fn leads_newer(&self, key: &ShardKey, generation: u64) -> bool {
        self.view
            .load()
            .routes
            .get(key)
            .is_some_and(|r| *r.leader == *self.node_id && r.generation > generation)
    }

    /// Whether the latest assignments name this broker leader of `key` with more than
    /// one copy (one atomic load, no reference count taken).
    pub fn leads_copies_of(&self, key: &ShardKey) -> bool {
        self.view
            .load()
            .routes
            .get(key)
            .is_some_and(|r| *r.leader == *self.node_id && r.replicas.len() > 1)
    }

    /// The current snapshot.
    pub fn view(&self) -> Arc<ClusterView> {
        self.view.load_full()
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

/// Whether the control plane's replication view (`GET /v1/placement/replication`) says
/// shard `key` (`kind/tenant/namespace/name/shard`), moved to `leader` at `generation`,
/// is served by its successor: a report from its leader (not `me`) at the current
/// generation, at least `generation`. A shard no longer listed (deleted) counts as
/// served; so does one whose leader was replaced since (it could not lead, or died):
/// its new leader's report is the one waited for. A report that its leader cannot
/// lead (its copy lost, being rebuilt) is not serving: the drain counted it so, and
/// left while the control plane had yet to name another leader.
fn successor_serves(
    view: &Value,
    (key, leader, generation): &(String, String, u64),
    me: &str,
) -> bool {
    let item = view["items"].as_array().into_iter().flatten().find(|it| {
        let named = format!(
            "{}/{}/{}/{}/{}",
            it["kind"].as_str().unwrap_or_default(),
            it["tenant_id"].as_str().unwrap_or_default(),
            it["namespace"].as_str().unwrap_or_default(),
            it["name"].as_str().unwrap_or_default(),
            it["shard"].as_u64().unwrap_or(u64::MAX),
        );
        named == *key
    });
    let Some(it) = item else {
        return true;
    };
    let current = it["generation"].as_u64().unwrap_or(*generation);
    let now_leader = it["leader"].as_str().unwrap_or(leader);
    now_leader != me
        && it["report"]["from"].as_str() == Some(now_leader)
        && it["report"]["cannot_lead"].as_bool() != Some(true)
        && it["report"]["generation"]
            .as_u64()
            .is_some_and(|g| g >= current.max(*generation))
}

#[derive(Deserialize)]
struct NodeDoc {
    node_id: String,
    client_addr: Option<String>,
    #[serde(default)]
    advertise_addr: Option<String>,
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
    #[serde(default)]
    replicas: Vec<String>,
    /// The destination of a move while its copy is staged.
    #[serde(default)]
    staging: Option<String>,
    /// The generation an operator's abandon wrote.
    #[serde(default)]
    abandoned: Option<u64>,
    /// A planned handoff: the old leader, and the generation it hands over at.
    #[serde(default)]
    handoff: Option<felix_controlplane::model::Handoff>,
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
    #[serde(default = "one")]
    replication_factor: u32,
    #[serde(default)]
    consistency: Consistency,
    #[serde(default)]
    incarnation: String,
}

fn one() -> u32 {
    1
}

#[derive(Deserialize)]
struct CacheDoc {
    tenant_id: String,
    namespace: String,
    cache: String,
    shards: u32,
    #[serde(default = "one")]
    replication_factor: u32,
    #[serde(default)]
    consistency: Consistency,
    #[serde(default)]
    incarnation: String,
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
    /// Held through a whole sync: the feed and the resync thread (after a lapsed lease
    /// was renewed, or when a replica asks) both sync, and a snapshot read earlier must
    /// not be installed later.
    syncing: std::sync::Mutex<()>,
}

impl Targets {
    /// Asks the resync thread for a sync after a lapsed lease was renewed; never waits
    /// (heartbeats must keep going whatever a sync costs).
    fn want_sync(&self) {
        self.cluster.want_sync(|r| r.lapsed = true);
    }
}

/// Reads everything from the control plane and installs it ([`sync`]), one sync at a
/// time; a lease renewed while lapsed counts once this has read the assignments.
fn sync_now(cp: &ControlPlaneClient, t: &Targets) -> anyhow::Result<u64> {
    let _one = t.syncing.lock().unwrap_or_else(|e| e.into_inner());
    let started = BootTime::now();
    match sync(cp, t) {
        Ok(next) => {
            t.cluster.synced_at(started, BootTime::now());
            if let Ok(mut status) = t.cluster.sync_status.lock() {
                status.last_error = None;
            }
            Ok(next)
        }
        Err(e) => {
            t.cluster.sync_failures.fetch_add(1, Ordering::Relaxed);
            if let Ok(mut status) = t.cluster.sync_status.lock() {
                status.last_error = Some(e.to_string());
            }
            Err(e)
        }
    }
}

/// The most keys one tenant's JWKS may list: more is refused as malformed.
pub const JWKS_MAX_KEYS: usize = 64;

/// Reads a JWKS answer strictly: every key an Ed25519 OKP key (`kty` `OKP`, `crv`
/// `Ed25519`, `alg` `EdDSA` when given, `use` `sig` when given) with a 32-byte `x`, each
/// `kid` once, at most [`JWKS_MAX_KEYS`]. Anything else refuses the whole set: a key
/// set that is partly wrong is not one to trust in part.
pub fn parse_jwks(v: &Value) -> Result<Vec<(String, Vec<u8>)>, String> {
    let keys = v["keys"].as_array().ok_or("no `keys` array")?;
    if keys.len() > JWKS_MAX_KEYS {
        return Err(format!("{} keys, at most {JWKS_MAX_KEYS}", keys.len()));
    }
    let mut out: Vec<(String, Vec<u8>)> = Vec::with_capacity(keys.len());
    for k in keys {
        let field = |f: &str| k[f].as_str();
        let kid = field("kid")
            .filter(|k| !k.is_empty() && k.len() <= 128)
            .ok_or("a key without a usable `kid`")?;
        if field("kty") != Some("OKP") {
            return Err(format!("key {kid}: kty {:?}, expected OKP", k["kty"]));
        }
        if field("crv") != Some("Ed25519") {
            return Err(format!("key {kid}: crv {:?}, expected Ed25519", k["crv"]));
        }
        if !matches!(field("alg"), None | Some("EdDSA")) {
            return Err(format!("key {kid}: alg {:?}, expected EdDSA", k["alg"]));
        }
        if !matches!(field("use"), None | Some("sig")) {
            return Err(format!("key {kid}: use {:?}, expected sig", k["use"]));
        }
        let x = field("x").ok_or_else(|| format!("key {kid}: no `x`"))?;
        let pk = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(x.trim_end_matches('='))
            .map_err(|e| format!("key {kid}: x is not base64url: {e}"))?;
        if pk.len() != 32 {
            return Err(format!("key {kid}: x is {} bytes, expected 32", pk.len()));
        }
        if out.iter().any(|(k, _)| k == kid) {
            return Err(format!("key id {kid} appears twice"));
        }
        out.push((kid.to_owned(), pk));
    }
    Ok(out)
}

/// `base` plus every tenant's verification keys from the control plane's JWKS, and the
/// revoked token ids. A tenant whose key set is refused ([`parse_jwks`]) or cannot be
/// fetched keeps its keys from `last`; those tenants are returned with the reason.
pub fn fetch_keys(
    cp: &ControlPlaneClient,
    base: &TenantKeys,
    last: &TenantKeys,
) -> anyhow::Result<(TenantKeys, Vec<(String, String)>)> {
    let mut keys = base.clone();
    let mut unverified = Vec::new();
    let tenants = cp.get("/v1/tenants/snapshot")?;
    for tenant in tenants["items"].as_array().into_iter().flatten() {
        let Some(id) = tenant["tenant_id"].as_str() else {
            continue;
        };
        let answer = cp
            .get(&format!("/v1/tenants/{id}/.well-known/jwks.json"))
            .map_err(|e| e.to_string())
            .and_then(|v| parse_jwks(&v));
        match answer {
            Ok(list) => {
                for (kid, pk) in list {
                    keys.add(id, &kid, pk);
                }
            }
            Err(why) => {
                tracing::error!(tenant = id, reason = %why, "refusing the tenant's key set; keeping its last good keys");
                keys.set_keys(id, last.keys_of(id).to_vec());
                unverified.push((id.to_owned(), why));
            }
        }
    }
    let denials = cp.get("/v1/token-denials")?;
    for d in denials["items"].as_array().into_iter().flatten() {
        if let (Some(t), Some(jti)) = (d["tenant_id"].as_str(), d["jti"].as_str()) {
            keys.deny(t, jti);
        }
    }
    Ok((keys, unverified))
}

/// Follows the control plane's incarnation of a stream (`stream`) or cache: one this
/// broker holds under another incarnation was deleted and created again while it was
/// away, so the old one is deleted here; the new one, and one listed again while its
/// deletion is under way, is created once the cores removed the old data (waited for
/// until `until`, one deadline for a whole sync, so names whose deletion does not finish
/// never hold up the sync's keys and routes for long; otherwise a later sync creates
/// it). Returns whether the caller may create it now.
fn follow_incarnation(
    catalog: &Catalog,
    stream: bool,
    (t, ns, n): (&str, &str, &str),
    incarnation: &str,
    until: Instant,
) -> bool {
    if !catalog.follow_incarnation(stream, t, ns, n, incarnation) {
        tracing::info!(name = %format!("{t}/{ns}/{n}"), stream, "deleted and created again while this broker was away; removing the old one's data");
    } else if !catalog.is_deleting(stream, t, ns, n) {
        return true;
    }
    // A deletion of the name is under way (started just now, or by an earlier sync that
    // found it gone): the new one is created as soon as the cores finished it, not a
    // sync later (up to 2 s of `not_found` for a stream just created again).
    while catalog.is_deleting(stream, t, ns, n) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    !catalog.is_deleting(stream, t, ns, n)
        && catalog.follow_incarnation(stream, t, ns, n, incarnation)
}

/// One full sync: stream shapes, then keys, then nodes and routes (in that order).
fn sync(cp: &ControlPlaneClient, t: &Targets) -> anyhow::Result<u64> {
    let shapes = cp.get("/v1/streams/snapshot")?;
    let mut listed = (HashSet::new(), HashSet::new());
    let wait_until = Instant::now() + Duration::from_secs(2);
    for s in items::<StreamDoc>(&shapes, "items")? {
        let spec = StreamSpec {
            shards: s.shards,
            routing: s.routing,
            retention: s.retention,
            replication_factor: s.replication_factor.max(1),
            consistency: s.consistency,
        };
        listed
            .0
            .insert(format!("{}/{}/{}", s.tenant_id, s.namespace, s.stream));
        if !follow_incarnation(
            &t.catalog,
            true,
            (&s.tenant_id, &s.namespace, &s.stream),
            &s.incarnation,
            wait_until,
        ) {
            continue;
        }
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
        if !follow_incarnation(
            &t.catalog,
            false,
            (&c.tenant_id, &c.namespace, &c.cache),
            &c.incarnation,
            wait_until,
        ) {
            continue;
        }
        let spec = StreamSpec {
            replication_factor: c.replication_factor.max(1),
            consistency: c.consistency,
            ..StreamSpec::new(c.shards)
        };
        if let Err(e) = t
            .catalog
            .create_cache(&c.tenant_id, &c.namespace, &c.cache, spec)
        {
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

    let (keys, unverified) = fetch_keys(cp, &t.base_keys, &t.keys.load())?;
    // Swapped only on a change: cores re-check live connections against each new set.
    if **t.keys.load() != keys {
        t.keys.store(Arc::new(keys));
    }
    if let Ok(mut status) = t.cluster.sync_status.lock() {
        status.unverified_tenants = unverified;
    }

    let nodes: Vec<NodeDoc> = items(&cp.get("/v1/nodes")?, "items")?;
    let addr_of: HashMap<&str, SocketAddr> = nodes
        .iter()
        .filter(|n| n.lifecycle == "live")
        .filter_map(|n| Some((n.node_id.as_str(), n.client_addr.as_deref()?.parse().ok()?)))
        .collect();
    // A draining broker is still a peer: its successors fence it (a planned handoff's
    // new leader waits for its answer, its log holding what only it may have) and fetch
    // its tail before it stops. Left out, its fence answer never came, and a `Leader`
    // stream lost what it had acknowledged last.
    let peers: HashMap<String, SocketAddr> = nodes
        .iter()
        .filter(|n| matches!(n.lifecycle.as_str(), "live" | "draining"))
        .filter_map(|n| {
            Some((
                n.node_id.clone(),
                n.advertise_addr.as_deref()?.parse().ok()?,
            ))
        })
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
                replicas: if a.replicas.is_empty() {
                    vec![Arc::from(a.leader.as_str())].into()
                } else {
                    a.replicas.iter().map(|r| Arc::from(r.as_str())).collect()
                },
                learners: a.staging.iter().map(|n| Arc::from(n.as_str())).collect(),
                // Only at the generation it was written for: a later write that kept
                // the field (a failover) must not wait for a leader that is gone.
                handoff_from: a
                    .handoff
                    .filter(|h| h.generation == a.generation)
                    .map(|h| Arc::from(h.from.as_str())),
                abandoned: a.abandoned,
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
    let version = t.cluster.view.load().version + 1;
    t.cluster.view.store(Arc::new(ClusterView {
        routes,
        brokers,
        peers,
        version,
    }));
    t.cluster.syncs.fetch_add(1, Ordering::Relaxed);
    Ok(next_seq)
}

/// What a registration answered: incarnation, heartbeat interval, when it was sent,
/// and the lease length.
type Registered = (u64, Duration, BootTime, Option<Duration>);

fn register(
    cp: &ControlPlaneClient,
    node_id: &str,
    instance: &str,
    addrs: Addrs,
) -> Result<Registered, ClientError> {
    let mut body = json!({"node_id": node_id, "client_addr": addrs.client.to_string(),
                          "instance_id": instance});
    if let Some(peer) = addrs.peer {
        body["advertise_addr"] = json!(peer.to_string());
    }
    let sent = BootTime::now();
    let answer = cp.post("/v1/nodes", &body)?;
    let incarnation = answer["incarnation"].as_u64().unwrap_or(1);
    let interval = Duration::from_millis(
        answer["heartbeat_interval_ms"]
            .as_u64()
            .unwrap_or(1000)
            .max(50),
    );
    Ok((incarnation, interval, sent, expiry_of(&answer)))
}

/// The lease length a control-plane answer grants (`expiry_timeout_ms`).
fn expiry_of(answer: &Value) -> Option<Duration> {
    answer["expiry_timeout_ms"]
        .as_u64()
        .map(Duration::from_millis)
}

/// Where this broker is reached: by clients, and by peers (broker-to-broker).
#[derive(Debug, Clone, Copy)]
pub struct Addrs {
    /// Client QUIC address.
    pub client: SocketAddr,
    /// Broker-to-broker address, when replication is on.
    pub peer: Option<SocketAddr>,
}

/// Registers with the control plane, does the first full sync, and starts the
/// heartbeat and feed threads. A 4xx from the control plane is fatal (wrong token,
/// bad address); an unreachable one is retried for `patience`.
pub fn join(
    settings: &ClusterSettings,
    cluster: Arc<Cluster>,
    catalog: Arc<Catalog>,
    keys: Arc<ArcSwap<TenantKeys>>,
    instance: &str,
    patience: Duration,
) -> anyhow::Result<()> {
    let node_id = cluster.node_id.clone();
    let node_id = node_id.as_str();
    let cp = settings.client(Some(settings.token.clone()))?;
    let deadline = Instant::now() + patience;
    let addrs = Addrs {
        client: settings.client_addr,
        peer: settings.peer_advertise_addr,
    };
    let (incarnation, interval) = loop {
        match register(&cp, node_id, instance, addrs) {
            Ok((incarnation, interval, sent, expiry)) => {
                // A first lease always waits for the first sync, just below.
                if let Some(expiry) = expiry {
                    let _ = cluster.renew_lease(sent, expiry);
                }
                break (incarnation, interval);
            }
            Err(e @ ClientError::Api { .. }) => {
                anyhow::bail!("control plane refused registration: {e}")
            }
            // A certificate that does not verify is a configuration fault (or someone in
            // the middle), not an outage: waiting will not fix it.
            Err(e @ ClientError::Tls(_)) => {
                anyhow::bail!("cannot verify the control plane: {e}")
            }
            Err(e) if Instant::now() < deadline => {
                tracing::warn!(error = %e, "control plane unreachable; retrying");
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => anyhow::bail!("control plane unreachable: {e}"),
        }
    };
    if let Ok(mut slot) = cluster.control_plane.lock() {
        *slot = Some(cp.clone());
    }
    let base_keys = (**keys.load()).clone();
    let targets = Arc::new(Targets {
        cluster: cluster.clone(),
        catalog,
        keys,
        base_keys,
        syncing: std::sync::Mutex::default(),
    });
    let mut seq = sync_now(&cp, &targets)?;
    cluster.synced.store(true, Ordering::SeqCst);
    tracing::info!(node_id, incarnation, url = %settings.url, "joined the cluster");

    {
        let (cp, targets) = (cp.clone(), targets.clone());
        let who = (node_id.to_owned(), instance.to_owned());
        std::thread::Builder::new()
            .name("felix-heartbeat".into())
            .spawn(move || heartbeat_loop(&cp, &targets, &who, addrs, incarnation, interval))?;
    }
    {
        let (cp, targets) = (cp.clone(), targets.clone());
        std::thread::Builder::new()
            .name("felix-resync".into())
            .spawn(move || resync_loop(&cp, &targets))?;
    }
    std::thread::Builder::new().name("felix-follow".into()).spawn(move || {
        let mut cp = cp;
        cp.request_timeout = Duration::from_secs(5);
        let mut synced = std::time::Instant::now();
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
                // A feed failing every poll (answering late, say) while the rest of
                // the control plane answers still syncs every few seconds: skipped
                // each time, the routes went stale for as long as heartbeats held the
                // lease.
                if synced.elapsed() < Duration::from_secs(3) {
                    continue;
                }
            }
            synced = std::time::Instant::now();
            match sync_now(&cp, &targets) {
                Ok(next) => seq = next,
                Err(e) => {
                    tracing::warn!(error = %e, "syncing from the control plane; keeping the last snapshot");
                }
            }
        }
    })?;
    Ok(())
}

/// Syncs whenever the heartbeat asks ([`Targets::want_sync`]): a lease renewed after it
/// lapsed (cut off from the control plane, or paused) holds only once the assignments
/// are read again, and the feed reads them only when its long poll ends (up to 2 s
/// later, 2.5 s after a failed poll). A sync here makes writes resume about a
/// heartbeat after the control plane answers again. Skipped when a sync of the feed
/// already made the lease valid. Also syncs at once when a replica asks
/// ([`Cluster::ask_sync`]).
fn resync_loop(cp: &ControlPlaneClient, t: &Targets) {
    let (flag, wake) = &t.cluster.resync;
    while !t.cluster.stop.load(Ordering::SeqCst) {
        let why = {
            let mut wanted = flag.lock().unwrap_or_else(|e| e.into_inner());
            if !wanted.lapsed && !wanted.asked {
                wanted = wake
                    .wait_timeout(wanted, Duration::from_secs(1))
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
            std::mem::take(&mut *wanted)
        };
        if !why.asked && (!why.lapsed || t.cluster.lease_valid(BootTime::now())) {
            continue;
        }
        if let Err(e) = sync_now(cp, t) {
            tracing::warn!(error = %e, asked = why.asked, "syncing out of the feed's turn");
        }
    }
}

/// Heartbeats every `interval`, renewing the lease from each accepted one (anchored at
/// when it was sent), and reports the replicated shards this broker leads. A renewal
/// after a lapse asks the resync thread for a sync (see [`resync_loop`]); this thread
/// never waits for one.
fn heartbeat_loop(
    cp: &ControlPlaneClient,
    targets: &Targets,
    (node_id, instance): &(String, String),
    addrs: Addrs,
    mut incarnation: u64,
    interval: Duration,
) {
    let cluster = &targets.cluster;
    let path = format!("/v1/nodes/{node_id}/heartbeat");
    let report_path = format!("/v1/nodes/{node_id}/replica-status");
    while !cluster.stop.load(Ordering::SeqCst) {
        std::thread::sleep(interval);
        let sent = BootTime::now();
        match cp.post(&path, &json!({"incarnation": incarnation})) {
            Ok(answer) => {
                cluster.heartbeats.fetch_add(1, Ordering::Relaxed);
                if let Some(expiry) = expiry_of(&answer)
                    && cluster.renew_lease(sent, expiry)
                {
                    targets.want_sync();
                }
                let shards: Vec<ShardReport> = cluster
                    .reports
                    .lock()
                    .map(|r| r.values().cloned().collect())
                    .unwrap_or_default();
                if !shards.is_empty()
                    && let Err(e) = cp.post(&report_path, &json!({ "shards": shards }))
                {
                    tracing::debug!(error = %e, "replica report");
                }
            }
            // Declared down (or replaced): register again, as a new incarnation. While
            // another broker holds this node id the control plane refuses that, no
            // heartbeat renews the lease, and this broker stops writing as it runs out.
            Err(ClientError::Api {
                status: 409 | 404, ..
            }) => match register(cp, node_id, instance, addrs) {
                Ok((i, _, sent, expiry)) => {
                    if let Some(expiry) = expiry
                        && cluster.renew_lease(sent, expiry)
                    {
                        targets.want_sync();
                    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// What a drain waits for: the moved shard's current leader reporting at the
    /// current generation, and able to lead.
    #[test]
    fn a_successor_serves_once_its_leader_reports_able_to_lead() {
        let moved = ("stream/t/ns/s/0".to_string(), "b".to_string(), 4);
        let view = |leader: &str, generation: u64, report: Value| {
            json!({"items": [{"kind": "stream", "tenant_id": "t", "namespace": "ns",
                "name": "s", "shard": 0, "leader": leader, "generation": generation,
                "report": report}]})
        };
        let report = |from: &str, generation: u64, cannot_lead: bool| json!({"from": from, "generation": generation, "cannot_lead": cannot_lead});
        assert!(successor_serves(
            &view("b", 4, report("b", 4, false)),
            &moved,
            "a"
        ));
        assert!(!successor_serves(&view("b", 4, Value::Null), &moved, "a"));
        assert!(!successor_serves(
            &view("b", 4, report("b", 3, false)),
            &moved,
            "a"
        ));
        assert!(!successor_serves(
            &view("a", 5, report("a", 5, false)),
            &moved,
            "a"
        ));
        assert!(
            !successor_serves(&view("b", 4, report("b", 4, true)), &moved, "a"),
            "a leader that cannot lead does not serve"
        );
        // Replaced since: the new leader's report is the one that counts.
        assert!(successor_serves(
            &view("c", 5, report("c", 5, false)),
            &moved,
            "a"
        ));
        assert!(
            successor_serves(&json!({"items": []}), &moved, "a"),
            "deleted"
        );
    }

    fn jwk(kid: &str, x: &[u8]) -> Value {
        json!({"kty": "OKP", "crv": "Ed25519", "alg": "EdDSA", "use": "sig", "kid": kid,
               "x": base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(x)})
    }

    /// The lease on virtual boot time: it runs 3/4 of the expiry from when the renewing
    /// heartbeat was sent, and one renewed after it lapsed (a pause, a cut-off, a host
    /// suspended: boot time runs on through a suspend where the monotonic clock stood
    /// still and hid the lapse) counts only once a sync begun after it has read the
    /// assignments again.
    #[test]
    fn a_lease_renewed_after_a_lapse_counts_once_a_later_sync_read_the_assignments() {
        let c = Cluster::new("n".into());
        let expiry = Duration::from_secs(4);
        let t = |ms: u64| BootTime::from_nanos(ms * 1_000_000);
        // The first lease waits for the first sync.
        assert!(c.renew_lease(t(100_000), expiry));
        assert!(!c.lease_valid(t(100_100)));
        c.synced_at(t(100_050), t(100_200));
        assert!(c.lease_valid(t(100_300)));
        assert!(c.lease_valid(t(102_999)));
        assert!(
            !c.lease_valid(t(103_000)),
            "3/4 of the expiry after sending"
        );
        // Renewed within the lease: extended at once.
        assert!(!c.renew_lease(t(102_000), expiry));
        assert!(c.lease_valid(t(104_999)));
        // The host sleeps a minute; the first heartbeat after waking renews nothing
        // until a sync that began after it completes.
        assert!(!c.lease_valid(t(165_000)));
        assert!(c.renew_lease(t(165_000), expiry));
        assert!(!c.lease_valid(t(165_100)));
        c.synced_at(t(164_900), t(165_200));
        assert!(
            !c.lease_valid(t(165_300)),
            "a sync begun before the renewal"
        );
        c.synced_at(t(165_100), t(165_400));
        assert!(c.lease_valid(t(165_500)));
    }

    #[test]
    fn forged_or_malformed_key_sets_are_refused_whole() {
        let good = json!({"keys": [jwk("a", &[1; 32]), jwk("b", &[2; 32])]});
        assert_eq!(parse_jwks(&good).unwrap().len(), 2);
        let with = |k: Value| json!({"keys": [jwk("a", &[1; 32]), k]});
        let refusals = [
            (json!({}), "keys"),
            (
                with(json!({"kty": "RSA", "kid": "r", "n": "x", "e": "AQAB"})),
                "kty",
            ),
            (
                with(json!({"kty": "OKP", "crv": "X25519", "kid": "c", "x": "AAAA"})),
                "crv",
            ),
            (
                with(
                    json!({"kty": "OKP", "crv": "Ed25519", "alg": "none", "kid": "n", "x": "AAAA"}),
                ),
                "alg",
            ),
            (with(jwk("a", &[3; 32])), "twice"),
            (with(jwk("short", &[3; 16])), "16 bytes"),
            (
                with(json!({"kty": "OKP", "crv": "Ed25519", "kid": "bad", "x": "!!"})),
                "base64url",
            ),
            (
                with(json!({"kty": "OKP", "crv": "Ed25519", "x": "AAAA"})),
                "kid",
            ),
        ];
        for (set, why) in refusals {
            let e = parse_jwks(&set).unwrap_err();
            assert!(e.contains(why), "{set}: {e}");
        }
        let many: Vec<Value> = (0..=JWKS_MAX_KEYS)
            .map(|i| jwk(&format!("k{i}"), &[1; 32]))
            .collect();
        assert!(
            parse_jwks(&json!({ "keys": many }))
                .unwrap_err()
                .contains("at most")
        );
    }

    /// A replica that learned of a newer generation asks for the assignments, and they
    /// are read at once, the lease valid or not; without an ask, a valid lease makes
    /// the resync thread sync nothing.
    #[test]
    fn a_replicas_ask_syncs_at_once_while_a_lapsed_lease_alone_does_not_when_valid() {
        // Every path answers an empty document: a sync of nothing succeeds.
        let cp = ControlPlaneClient::new(&canned(Vec::new()), None).unwrap();
        let cluster = Arc::new(Cluster::new("a".into()));
        assert!(cluster.renew_lease(BootTime::now(), Duration::from_secs(600)));
        cluster.synced_at(BootTime::now(), BootTime::now());
        assert!(cluster.lease_valid(BootTime::now()));
        let targets = Arc::new(Targets {
            cluster: cluster.clone(),
            catalog: Arc::new(Catalog::open(None, None).unwrap()),
            keys: Arc::new(ArcSwap::from_pointee(TenantKeys::default())),
            base_keys: TenantKeys::default(),
            syncing: std::sync::Mutex::default(),
        });
        let thread = {
            let t = targets.clone();
            std::thread::spawn(move || resync_loop(&cp, &t))
        };
        let syncs_within = |d: Duration| {
            let until = std::time::Instant::now() + d;
            while std::time::Instant::now() < until {
                if cluster.syncs.load(Ordering::SeqCst) > 0 {
                    return true;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            false
        };
        targets.want_sync();
        assert!(
            !syncs_within(Duration::from_millis(1500)),
            "a valid lease needs no sync"
        );
        cluster.ask_sync();
        assert!(syncs_within(Duration::from_secs(10)), "the ask was synced");
        cluster.stop.store(true, Ordering::SeqCst);
        thread.join().unwrap();
    }

    /// A one-shot HTTP server answering each path with a canned JSON body.
    fn canned(answers: Vec<(&'static str, Value)>) -> String {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { return };
                let mut buf = [0u8; 4096];
                let n = conn.read(&mut buf).unwrap_or(0);
                let head = String::from_utf8_lossy(&buf[..n]).into_owned();
                let path = head.split(' ').nth(1).unwrap_or("").to_owned();
                let body = answers
                    .iter()
                    .find(|(p, _)| *p == path)
                    .map_or_else(|| json!({"code": "not_found"}), |(_, v)| v.clone())
                    .to_string();
                let _ = write!(
                    conn,
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        format!("http://{addr}")
    }

    #[test]
    fn a_refused_key_set_keeps_the_tenants_last_good_keys_and_says_why() {
        let url = canned(vec![
            (
                "/v1/tenants/snapshot",
                json!({"items": [{"tenant_id": "acme"}, {"tenant_id": "globex"}]}),
            ),
            // Someone rewrote acme's set: a key that is not Ed25519 sits in it.
            (
                "/v1/tenants/acme/.well-known/jwks.json",
                json!({"keys": [jwk("evil", &[9; 32]), {"kty": "EC", "kid": "p256"}]}),
            ),
            (
                "/v1/tenants/globex/.well-known/jwks.json",
                json!({"keys": [jwk("g1", &[7; 32])]}),
            ),
            (
                "/v1/token-denials",
                json!({"items": [{"tenant_id": "globex", "jti": "leaked"}]}),
            ),
        ]);
        let cp = ControlPlaneClient::new(&url, None).unwrap();
        let mut last = TenantKeys::default();
        last.add("acme", "a1", vec![1; 32]);
        let (keys, unverified) = fetch_keys(&cp, &TenantKeys::default(), &last).unwrap();
        assert_eq!(
            keys.keys_of("acme"),
            last.keys_of("acme"),
            "acme keeps a1, gains nothing"
        );
        assert_eq!(keys.keys_of("globex").len(), 1);
        assert_eq!(unverified.len(), 1);
        assert_eq!(unverified[0].0, "acme");
        assert!(unverified[0].1.contains("kty"), "{unverified:?}");
        // The denial arrived with the keys.
        let mut expected = TenantKeys::default();
        expected.set_keys("acme", last.keys_of("acme").to_vec());
        expected.add("globex", "g1", vec![7; 32]);
        expected.deny("globex", "leaked");
        assert_eq!(keys, expected);
    }
}
