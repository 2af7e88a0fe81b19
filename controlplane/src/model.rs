//! Resource shapes, as stored and as served.

use felix_wire::routing::ShardRouting;
use serde::{Deserialize, Serialize};

/// The tenant whose tokens may carry cluster-scope permissions.
pub const OPERATOR_TENANT: &str = "operator";

/// A tenant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tenant {
    /// Id.
    pub tenant_id: String,
    /// Display name.
    #[serde(default)]
    pub display_name: String,
}

/// A namespace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Namespace {
    /// Tenant.
    #[serde(default)]
    pub tenant_id: String,
    /// Name.
    pub namespace: String,
    /// Display name.
    #[serde(default)]
    pub display_name: String,
}

/// A tenant, as created: a field it does not know is refused by name, not dropped
/// (the stored [`Tenant`] stays lenient, for records a later version writes).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantCreate {
    /// Id.
    pub tenant_id: String,
    /// Display name.
    #[serde(default)]
    pub display_name: String,
}

impl From<TenantCreate> for Tenant {
    fn from(t: TenantCreate) -> Tenant {
        Tenant {
            tenant_id: t.tenant_id,
            display_name: t.display_name,
        }
    }
}

/// A namespace, as created: unknown fields refused, as [`TenantCreate`]'s. The tenant
/// is the path's (one given here is ignored).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamespaceCreate {
    /// Tenant (ignored: the path names it).
    #[serde(default)]
    pub tenant_id: String,
    /// Name.
    pub namespace: String,
    /// Display name.
    #[serde(default)]
    pub display_name: String,
}

impl From<NamespaceCreate> for Namespace {
    fn from(n: NamespaceCreate) -> Namespace {
        Namespace {
            tenant_id: n.tenant_id,
            namespace: n.namespace,
            display_name: n.display_name,
        }
    }
}

/// Consistency of acknowledgements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Consistency {
    /// Acknowledged once the leader has it durably.
    Leader,
    /// Acknowledged once a majority of the replica set has it.
    Quorum,
}

/// Retention bounds (unset = broker default); zero is refused.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Retention {
    /// Maximum age.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_age_seconds: Option<u64>,
    /// Maximum size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_size_bytes: Option<u64>,
}

/// A stream, as created.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamCreate {
    /// Name.
    pub stream: String,
    /// `Stream`, `Queue` or `Cache` (stored, not enforced).
    pub kind: String,
    /// Shard count (fixed).
    pub shards: u32,
    /// Replicas, leader included.
    #[serde(default = "one")]
    pub replication_factor: u32,
    /// Retention (default: the broker's).
    #[serde(default)]
    pub retention: Retention,
    /// Consistency (default `Leader`).
    #[serde(default = "leader")]
    pub consistency: Consistency,
    /// `AtMostOnce` / `AtLeastOnce` (stored, not enforced; default `AtLeastOnce`).
    #[serde(default = "at_least_once")]
    pub delivery: String,
    /// Durable log (default true).
    #[serde(default = "yes")]
    pub durable: bool,
    /// Key-to-shard mapping (fixed).
    #[serde(default)]
    pub routing: ShardRouting,
}

fn one() -> u32 {
    1
}

fn yes() -> bool {
    true
}

fn at_least_once() -> String {
    "AtLeastOnce".into()
}

/// A stream, as served.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stream {
    /// Tenant.
    pub tenant_id: String,
    /// Namespace.
    pub namespace: String,
    /// The creation fields.
    #[serde(flatten)]
    pub spec: StreamCreate,
    /// Store version (for `PATCH` preconditions).
    #[serde(default)]
    pub version: u64,
    /// A random id given at creation: the same name deleted and created again is
    /// another incarnation, and a broker that was away meanwhile drops the old one's
    /// data instead of serving it as the new one's. Empty in documents written before.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub incarnation: String,
}

/// A stream update: only these may change.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamPatch {
    /// New retention.
    #[serde(default)]
    pub retention: Option<Retention>,
    /// New consistency.
    #[serde(default)]
    pub consistency: Option<Consistency>,
    /// New delivery declaration.
    #[serde(default)]
    pub delivery: Option<String>,
    /// Durability: only its current value is taken (it is set at creation).
    #[serde(default)]
    pub durable: Option<bool>,
    /// The version the caller read (409 when it moved on).
    #[serde(default)]
    pub version: Option<u64>,
}

/// A cache, as created.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheCreate {
    /// Name.
    pub cache: String,
    /// Display name.
    #[serde(default)]
    pub display_name: String,
    /// Shard count.
    #[serde(default = "one")]
    pub shards: u32,
    /// Replicas.
    #[serde(default = "one")]
    pub replication_factor: u32,
    /// Consistency.
    #[serde(default = "leader")]
    pub consistency: Consistency,
}

fn leader() -> Consistency {
    Consistency::Leader
}

/// A cache, as served.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cache {
    /// Tenant.
    pub tenant_id: String,
    /// Namespace.
    pub namespace: String,
    /// The creation fields.
    #[serde(flatten)]
    pub spec: CacheCreate,
    /// Store version.
    #[serde(default)]
    pub version: u64,
    /// A random id given at creation (see [`Stream::incarnation`]).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub incarnation: String,
}

/// A node's lifecycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Lifecycle {
    /// Heartbeating.
    Live,
    /// Handing off.
    Draining,
    /// Missed heartbeats past the expiry.
    Down,
    /// Deregistered.
    Left,
}

/// Node capacity.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capacity {
    /// Most shards it may lead (absent = unlimited).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_shards: Option<u32>,
}

/// A node's registration body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeRegistration {
    /// Id.
    pub node_id: String,
    /// Where clients reach it; a node without one is never assigned shards.
    #[serde(default)]
    pub client_addr: Option<String>,
    /// Where peers reach it.
    #[serde(default)]
    pub advertise_addr: Option<String>,
    /// Region.
    #[serde(default = "default_region")]
    pub region: String,
    /// Capacity.
    #[serde(default)]
    pub capacity: Capacity,
    /// Which broker process holds this id: an identity kept in its data directory, the
    /// same across its restarts. A second broker started with the same node id is
    /// refused while the first still heartbeats.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_id: Option<String>,
}

fn default_region() -> String {
    "default".into()
}

/// A node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Node {
    /// Registration.
    #[serde(flatten)]
    pub registration: NodeRegistration,
    /// Lifecycle.
    pub lifecycle: Lifecycle,
    /// Bumped on every registration.
    pub incarnation: u64,
    /// Last heartbeat (ms since epoch).
    pub last_heartbeat_ms: u64,
}

/// Which shard an assignment is for.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct AssignmentKey {
    /// Tenant.
    pub tenant_id: String,
    /// Namespace.
    pub namespace: String,
    /// `stream` or `cache`.
    pub kind: String,
    /// Stream or cache name.
    pub name: String,
    /// Shard.
    pub shard: u32,
}

impl AssignmentKey {
    /// The store key.
    pub fn store_key(&self) -> String {
        format!(
            "{}/{}/{}/{}/{}",
            self.kind, self.tenant_id, self.namespace, self.name, self.shard
        )
    }
}

/// Who leads a shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment {
    /// Which shard.
    #[serde(flatten)]
    pub key: AssignmentKey,
    /// The leading node.
    pub leader: String,
    /// Replica nodes, leader included.
    pub replicas: Vec<String>,
    /// +1 per change of leader.
    pub generation: u64,
    /// `active`.
    pub state: String,
    /// Present for jump_hash streams.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing: Option<ShardRouting>,
    /// A copy being staged on a node outside `replicas`: the leader ships to it, no
    /// majority counts it. Placement makes it a member once it holds the log.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staging: Option<String>,
    /// The member the staged copy replaces: the leader (a move: the copy then leads)
    /// or a follower down too long (a restore).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replaces: Option<String>,
    /// After a staged copy joined: the member it replaces (the old leader, for a
    /// move), still a member so the next election's fence covers it, removed once the
    /// leader reports its generation committed over the enlarged set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retiring: Option<String>,
    /// The generation an operator's abandon wrote (`POST /v1/placement/abandon`):
    /// copies from before it are what a manual recovery would start from, so brokers
    /// never remove them on their own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub abandoned: Option<u64>,
    /// A planned handoff (a move or a drain, not a failover) wrote this generation:
    /// the new leader waits a while for the old one's fence, since the old leader's log
    /// holds records it acknowledged without waiting for followers (`Leader` mode).
    /// Brokers read it only at the generation it names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handoff: Option<Handoff>,
}

/// The old leader of a planned handoff, and the generation that handed over.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Handoff {
    /// The old leader.
    pub from: String,
    /// The generation written by the handoff.
    pub generation: u64,
}

/// Validates a resource name: 1-128 of `[A-Za-z0-9-_.]`, starting alphanumeric.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}
