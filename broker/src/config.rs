//! Broker configuration: defaults < YAML file < `FELIX_*` environment < flags.
//!
//! Every value is validated at start, and an error names the key it came from.

use felix_core_runtime::quic::{
    CROWDED_WINDOW_BYTES, UNTRUSTED_WINDOW_BYTES, reserved_per_connection,
};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;

use felix_core_runtime::CoreSet;
use felix_core_runtime::placement::PinRule;
use felix_storage_uring::FsyncMode;
use serde::Deserialize;

/// A tenant's token verification key.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TenantKey {
    /// Key id (the token header's `kid`).
    pub kid: String,
    /// Raw Ed25519 public key, base64url.
    pub public_key: String,
}

/// A tenant and its keys.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// Tenant id.
    pub id: String,
    /// Verification keys.
    pub keys: Vec<TenantKey>,
}

/// A stream declared up front.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct StreamConfig {
    /// Tenant.
    pub tenant: String,
    /// Namespace.
    pub namespace: String,
    /// Stream name.
    pub name: String,
    /// Shard count.
    pub shards: u32,
}

/// Connections a core's replication listener accepts (from peers, and anyone reaching
/// its port before a `Hello`).
pub const PEER_CONNECTIONS_PER_CORE: usize = 1024;

/// The YAML file (every key optional).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// QUIC address.
    pub listen: Option<String>,
    /// HTTP address (`/metrics`, `/livez`, `/readyz`).
    pub http: Option<String>,
    /// Data directory.
    pub data_dir: Option<PathBuf>,
    /// Cores (`0-3`, `0,2`, `all`).
    pub cores: Option<String>,
    /// `on-commit`, `periodic:<ms>` or `none`.
    pub fsync: Option<String>,
    /// Shard count of auto-created streams and caches.
    pub default_shards: Option<u32>,
    /// Create unknown streams and caches on first use.
    pub auto_create: Option<bool>,
    /// This node's id.
    pub node_id: Option<String>,
    /// TLS certificate chain (PEM).
    pub tls_cert: Option<PathBuf>,
    /// TLS key (PKCS#8 PEM).
    pub tls_key: Option<PathBuf>,
    /// Tenants and their keys.
    #[serde(default)]
    pub tenants: Vec<TenantConfig>,
    /// Streams to declare.
    #[serde(default)]
    pub streams: Vec<StreamConfig>,
    /// Operator pinning rules (`tenant/ns/name/shard=core`).
    #[serde(default)]
    pub pins: Vec<String>,
    /// Acked publishes a client stream may have unanswered.
    pub publish_window: Option<u32>,
    /// Consumer groups: how long a claim holds before the record is owed again.
    pub group_visibility_ms: Option<u64>,
    /// Caches: writes since the last compaction before the next one (and at least four
    /// times the live keys).
    pub cache_compact_after: Option<u64>,
    /// Consumer groups: deliveries before a record is dead-lettered.
    pub group_max_attempts: Option<u32>,
    /// Consumer groups: claims outstanding per group; polls at the cap answer empty.
    pub group_max_in_flight: Option<usize>,
    /// Log bytes between a shard's group snapshots.
    pub group_snapshot_bytes: Option<u64>,
    /// Log bytes between saves of a shard's idempotent-producer table.
    pub producer_snapshot_bytes: Option<u64>,
    /// Connections per core beyond which handshakes are refused.
    pub max_connections: Option<usize>,
    /// Bytes of QUIC flow-control windows a core's connections may be granted together
    /// (send and receive; once for clients' connections, once for peers').
    pub max_quic_window_bytes_per_core: Option<u64>,
    /// Per-subscriber queue, in batches.
    pub subscriber_queue: Option<usize>,
    /// Segment size.
    pub segment_bytes: Option<u64>,
    /// Microseconds an idle core busy-polls before sleeping (0: never spin).
    pub spin_us: Option<u64>,
    /// Without fsync on commit: microseconds a log lets appends gather before writing.
    pub write_linger_us: Option<u64>,
    /// Bytes of zeros a log keeps written past its newest segment's data (0: none).
    pub zero_ahead_bytes: Option<u64>,
    /// Under fsync on commit: write rounds durably (O_DSYNC) instead of write + fdatasync.
    pub dsync_writes: Option<bool>,
    /// Move an unpinned shard to the core its requests arrive on (default true).
    pub follow_load: Option<bool>,
    /// A connection with no authenticated stream is closed after this (0: never).
    pub auth_timeout_ms: Option<u64>,
    /// A connection silent this long is closed, and its subscriptions end.
    pub idle_timeout_ms: Option<u64>,
    /// Subscriptions one connection may hold.
    pub max_subscriptions_per_connection: Option<usize>,
    /// Group polls one connection may have waiting for records; more answer at once.
    pub max_waiting_polls_per_connection: Option<usize>,
    /// Bytes of unfinished frames one connection may hold before it is closed.
    pub max_unfinished_frame_bytes_per_connection: Option<usize>,
    /// Bytes of unfinished frames a core's connections may hold together.
    pub max_unfinished_frame_bytes_per_core: Option<usize>,
    /// Bytes of answers one connection may leave unread before it is closed.
    pub max_unwritten_answer_bytes_per_connection: Option<usize>,
    /// Bytes of answers a core's connections may leave unread together.
    pub max_unwritten_answer_bytes_per_core: Option<usize>,
    /// Request bytes in flight per connection (publish records, other requests by frame)
    /// before reading pauses.
    pub max_inflight_publish_bytes: Option<usize>,
    /// Request bytes in flight on one core, all its connections together.
    pub max_inflight_request_bytes_per_core: Option<usize>,
    /// Bytes of current values that starting cache watches hold together.
    pub max_watch_snapshot_bytes: Option<usize>,
    /// Concurrent streams a client may open per connection, per direction.
    pub max_streams_per_connection: Option<u32>,
    /// How often each core enforces retention and finishes deletions (ms).
    pub housekeeping_ms: Option<u64>,
    /// Damaged replica copies kept under `damaged-copies/` (the newest; older ones
    /// are deleted as new ones are set aside).
    pub damaged_copies_kept: Option<usize>,
    /// Serve `POST /debug/storage-faults` (tests and chaos runs only).
    pub fault_injection: Option<bool>,
    /// A deliberately broken behaviour, for showing the chaos checker catches it
    /// (debug builds with `fault_injection` only; see [`Mutants`]).
    pub mutant: Option<String>,
    /// Control-plane URL (`https://host:port`, or `http://` on loopback): follow it for
    /// placement and keys.
    pub controlplane_url: Option<String>,
    /// CA bundle (PEM) the control plane's certificate must chain to.
    pub controlplane_ca: Option<PathBuf>,
    /// Follow a plain-HTTP control plane on a host that is not loopback (keys and
    /// assignments then travel unprotected; warned about at start).
    pub controlplane_insecure: Option<bool>,
    /// This node's control-plane token.
    pub node_token: Option<String>,
    /// A file holding the node token.
    pub node_token_file: Option<PathBuf>,
    /// Where clients reach this broker (default: `listen`, unless unspecified).
    pub client_advertise_addr: Option<String>,
    /// CA (PEM) that signed the other brokers' certificates, for forwarding.
    pub peer_ca: Option<PathBuf>,
    /// Name the other brokers' certificates carry (default `localhost`).
    pub peer_server_name: Option<String>,
    /// Where this broker takes broker-to-broker connections (replication).
    pub internal_listen: Option<String>,
    /// Where peers reach that listener (default: `internal_listen`).
    pub internal_advertise_addr: Option<String>,
    /// Accept peers that do not present a node token (tests on one host only).
    pub internal_allow_unauthenticated: Option<bool>,
}

/// Following a control plane.
#[derive(Debug, Clone)]
pub struct ClusterSettings {
    /// Control-plane URL.
    pub url: String,
    /// Node token (control-plane audience).
    pub token: String,
    /// Where clients reach this broker.
    pub client_addr: SocketAddr,
    /// CA for peer brokers.
    pub peer_ca: Option<PathBuf>,
    /// Peer certificate name.
    pub peer_server_name: String,
    /// Broker-to-broker listener.
    pub internal_listen: Option<SocketAddr>,
    /// Where peers reach it.
    pub peer_advertise_addr: Option<SocketAddr>,
    /// Accept peers without a node token.
    pub internal_allow_unauthenticated: bool,
    /// CA bundle the control plane's certificate must chain to (`https` URLs).
    pub ca: Option<PathBuf>,
    /// Plain HTTP to a control plane that is not on loopback was asked for.
    pub insecure: bool,
}

impl ClusterSettings {
    /// A client for the control plane with `token`, verifying it as configured.
    pub fn client(
        &self,
        token: Option<String>,
    ) -> Result<
        felix_controlplane::client::ControlPlaneClient,
        felix_controlplane::client::ClientError,
    > {
        use felix_controlplane::client::{ClientTls, ControlPlaneClient};
        let tls = self
            .ca
            .as_deref()
            .map(ClientTls::from_ca_file)
            .transpose()?;
        if self.insecure {
            ControlPlaneClient::new_insecure(&self.url, token, tls)
        } else {
            ControlPlaneClient::with_tls(&self.url, token, tls)
        }
    }
}

/// Default [`BrokerConfig::write_linger`], in µs (`docs/configuration.md`).
pub const DEFAULT_WRITE_LINGER_US: u64 = 2000;
/// Default [`BrokerConfig::zero_ahead_bytes`] (`docs/configuration.md`).
pub const DEFAULT_ZERO_AHEAD_BYTES: u64 = 1 << 20;

/// Fully resolved configuration.
#[derive(Debug, Clone)]
pub struct BrokerConfig {
    /// QUIC address.
    pub listen: SocketAddr,
    /// HTTP address.
    pub http: Option<SocketAddr>,
    /// Data directory.
    pub data_dir: PathBuf,
    /// Cores.
    pub cores: CoreSet,
    /// Durability of acks.
    pub fsync: FsyncMode,
    /// Auto-create shard count (`None`: unknown names are refused).
    pub auto_create_shards: Option<u32>,
    /// Node id.
    pub node_id: String,
    /// TLS files; `None` in dev mode (generated).
    pub tls: Option<(PathBuf, PathBuf)>,
    /// Tenants.
    pub tenants: Vec<TenantConfig>,
    /// Declared streams.
    pub streams: Vec<StreamConfig>,
    /// Pin rules.
    pub pins: Vec<PinRule>,
    /// Publish window.
    pub publish_window: u32,
    /// Consumer-group bounds.
    pub group_limits: crate::groups::tracker::Limits,
    /// Cache compaction threshold (writes).
    pub cache_compact_after: u64,
    /// Log bytes between saves of a shard's idempotent-producer table.
    pub producer_snapshot_bytes: u64,
    /// Connection limit per core.
    pub max_connections: usize,
    /// See [`FileConfig::max_quic_window_bytes_per_core`].
    pub quic_window_bytes_per_core: u64,
    /// Subscriber queue capacity.
    pub subscriber_queue: usize,
    /// Segment size.
    pub segment_bytes: u64,
    /// Busy-poll before an idle core sleeps.
    pub spin: Option<std::time::Duration>,
    /// Without fsync on commit: how long a log lets appends gather before writing.
    pub write_linger: std::time::Duration,
    /// Zeros a log keeps written past its newest segment's data, so appends overwrite
    /// blocks instead of growing the file (`LogConfig::zero_ahead_bytes`).
    pub zero_ahead_bytes: u64,
    /// Under fsync on commit, each round's data is one durable (O_DSYNC) write instead
    /// of a write and an fdatasync (`LogConfig::dsync_writes`).
    pub dsync_writes: bool,
    /// Move an unpinned shard to the core its requests arrive on (`core/follow.rs`).
    pub follow_load: bool,
    /// Control-plane following, when configured.
    pub cluster: Option<ClusterSettings>,
    /// Per-connection bounds.
    pub limits: crate::session::Limits,
    /// QUIC idle timeout.
    pub idle_timeout: std::time::Duration,
    /// Concurrent client streams per connection, per direction.
    pub max_streams: u32,
    /// Retention and deletion cadence.
    pub housekeeping_interval: std::time::Duration,
    /// Damaged replica copies kept for an operator (`core/damaged.rs`).
    pub damaged_copies_kept: usize,
    /// Storage fault injection over HTTP (tests only).
    pub fault_injection: bool,
    /// Deliberate bugs (checker mutant runs only).
    pub mutants: Mutants,
}

/// Deliberate bugs the chaos checker must catch (`mutant:` in the config, a
/// comma-separated list). Honoured only by debug builds with `fault_injection` on; a
/// release build refuses to start with one.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Mutants {
    /// `ack-after-lease`: write and acknowledge with the lease lapsed, on shards this
    /// broker no longer leads (the replica's own view of its deposition included).
    pub ack_after_lease: bool,
    /// `skip-fence`: lead without fencing a majority; take deposed leaders' records.
    pub skip_fence: bool,
    /// `reuse-offsets`: at open, hand out the last record's offset again.
    pub reuse_offsets: bool,
    /// `forget-rebuilding`: a damaged replica copy starts over empty without the mark
    /// that keeps it out of elections.
    pub forget_rebuilding: bool,
    /// `unwritten-group-acks`: a consumer group's ack is answered without its event
    /// being written (the ack lives in memory only).
    pub unwritten_group_acks: bool,
}

impl Mutants {
    fn parse(list: &str) -> Result<Mutants, String> {
        let mut m = Mutants::default();
        for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            match name {
                "ack-after-lease" => m.ack_after_lease = true,
                "skip-fence" => m.skip_fence = true,
                "reuse-offsets" => m.reuse_offsets = true,
                "forget-rebuilding" => m.forget_rebuilding = true,
                "unwritten-group-acks" => m.unwritten_group_acks = true,
                other => {
                    return Err(format!(
                        "unknown mutant {other:?} (ack-after-lease, skip-fence, reuse-offsets, forget-rebuilding, unwritten-group-acks)"
                    ));
                }
            }
        }
        Ok(m)
    }
}

/// A configuration error naming the key.
#[derive(Debug, thiserror::Error)]
#[error("configuration key `{key}` (from {source_name}): {message}")]
pub struct ConfigError {
    /// The key.
    pub key: &'static str,
    /// Where the value came from.
    pub source_name: &'static str,
    /// What is wrong.
    pub message: String,
}

/// Values from flags (highest precedence).
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    /// `--listen`.
    pub listen: Option<String>,
    /// `--http`.
    pub http: Option<String>,
    /// `--data-dir`.
    pub data_dir: Option<PathBuf>,
    /// `--cores`.
    pub cores: Option<String>,
    /// `--fsync`.
    pub fsync: Option<String>,
    /// `--shards`.
    pub default_shards: Option<u32>,
    /// `--controlplane`.
    pub controlplane_url: Option<String>,
    /// `--node-id`.
    pub node_id: Option<String>,
    /// `--spin-us`.
    pub spin_us: Option<u64>,
    /// `--auth-timeout-ms`.
    pub auth_timeout_ms: Option<u64>,
    /// `--idle-timeout-ms`.
    pub idle_timeout_ms: Option<u64>,
}

fn parse<T: FromStr>(key: &'static str, src: &'static str, v: &str) -> Result<T, ConfigError>
where
    T::Err: std::fmt::Display,
{
    v.parse().map_err(|e: T::Err| ConfigError {
        key,
        source_name: src,
        message: format!("{v:?}: {e}"),
    })
}

/// Whether unknown streams and caches are made on first use: by default in dev only.
/// Never beside a control plane, the catalog's authority: a stream made on one broker
/// is not listed there, and the next sync deleted it, acknowledged records and all.
fn auto_create(set: Option<bool>, dev: bool, cluster: bool) -> Result<bool, ConfigError> {
    match set {
        Some(true) if cluster => Err(ConfigError {
            key: "auto_create",
            source_name: "config file",
            message: "streams and caches are created through the control plane when \
                      controlplane_url is set (one made here would be deleted at the next \
                      sync, its records with it)"
                .into(),
        }),
        Some(on) => Ok(on),
        None => Ok(dev && !cluster),
    }
}

/// A yes/no setting from the environment or the file (it has no flag), `default` when
/// neither names it.
fn bool_setting(
    key: &'static str,
    env: &str,
    file: Option<bool>,
    default: bool,
) -> Result<bool, ConfigError> {
    let l = layer(key, env, file.map(|b| b.to_string()), None);
    let Some(v) = l.value else {
        return Ok(default);
    };
    // One spelling for every switch: `FELIX_FAULT_INJECTION=yes` meant off, and
    // `FELIX_DSYNC_WRITES=1` failed the start.
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(ConfigError {
            key,
            source_name: l.source,
            message: format!("{v:?} is not a switch: true or false (1 or 0)"),
        }),
    }
}

/// A value with where it came from.
struct Layered {
    value: Option<String>,
    source: &'static str,
}

fn layer(key: &'static str, env: &str, file: Option<String>, flag: Option<String>) -> Layered {
    let _ = key;
    if let Some(v) = flag {
        return Layered {
            value: Some(v),
            source: "flag",
        };
    }
    // Set but empty (an unset compose variable) is unset: `FELIX_HTTP=""` turned off
    // `/metrics` and `/readyz` in silence.
    if let Ok(v) = std::env::var(env)
        && !v.is_empty()
    {
        return Layered {
            value: Some(v),
            source: "environment",
        };
    }
    Layered {
        value: file,
        source: "config file",
    }
}

impl BrokerConfig {
    /// Resolves `file` < env < `flags` over the defaults.
    pub fn resolve(
        file: FileConfig,
        flags: Overrides,
        dev: bool,
    ) -> Result<BrokerConfig, ConfigError> {
        let l = layer(
            "listen",
            "FELIX_LISTEN",
            file.listen.clone(),
            flags.listen.clone(),
        );
        let listen: SocketAddr = match l.value {
            Some(v) => parse("listen", l.source, &v)?,
            None => "127.0.0.1:5000".parse().expect("valid default"),
        };
        let l = layer("http", "FELIX_HTTP", file.http.clone(), flags.http.clone());
        let http = match l.value.as_deref() {
            Some("off") | Some("") => None,
            Some(v) => Some(parse("http", l.source, v)?),
            None => Some("127.0.0.1:9090".parse().expect("valid default")),
        };
        let l = layer(
            "data_dir",
            "FELIX_DATA_DIR",
            file.data_dir.map(|p| p.display().to_string()),
            flags.data_dir.map(|p| p.display().to_string()),
        );
        let data_dir = PathBuf::from(l.value.unwrap_or_else(|| "./felix-data".into()));
        let l = layer(
            "cores",
            "FELIX_CORES",
            file.cores.clone(),
            flags.cores.clone(),
        );
        let cores = match l.value {
            Some(v) => parse::<CoreSet>("cores", l.source, &v)?,
            None => CoreSet::all(),
        };
        let l = layer(
            "fsync",
            "FELIX_FSYNC",
            file.fsync.clone(),
            flags.fsync.clone(),
        );
        let fsync = match l.value {
            Some(v) => parse::<FsyncMode>("fsync", l.source, &v)?,
            None => FsyncMode::OnCommit,
        };
        let l = layer(
            "default_shards",
            "FELIX_DEFAULT_SHARDS",
            file.default_shards.map(|n| n.to_string()),
            flags.default_shards.map(|n| n.to_string()),
        );
        let shards: u32 = match l.value {
            Some(v) => parse("default_shards", l.source, &v)?,
            None => 1,
        };
        if shards == 0 || shards > 4096 {
            return Err(ConfigError {
                key: "default_shards",
                source_name: l.source,
                message: format!("{shards} is out of range 1..=4096"),
            });
        }
        let mut pins = Vec::new();
        for p in &file.pins {
            pins.push(parse::<PinRule>("pins", "config file", p)?);
        }
        let tls = match (file.tls_cert, file.tls_key) {
            (Some(c), Some(k)) => Some((c, k)),
            (None, None) => None,
            _ => {
                return Err(ConfigError {
                    key: "tls_cert",
                    source_name: "config file",
                    message: "tls_cert and tls_key go together".into(),
                });
            }
        };
        if !dev && tls.is_none() {
            return Err(ConfigError {
                key: "tls_cert",
                source_name: "config file",
                message: "a non-dev broker needs tls_cert and tls_key".into(),
            });
        }
        let l = layer(
            "controlplane_url",
            "FELIX_CONTROLPLANE_URL",
            file.controlplane_url.clone(),
            flags.controlplane_url.clone(),
        );
        let cluster = match l.value {
            None => {
                // Without a control plane the broker runs standalone: a cluster setting
                // there is most likely a forgotten `controlplane_url`, and the broker
                // would take writes that no other broker ever copies.
                let env = |name: &str| std::env::var(name).is_ok_and(|v| !v.is_empty());
                // (A switch set off asks for nothing a standalone broker lacks; layered
                // as everywhere.)
                let set = [
                    (
                        "controlplane_ca",
                        file.controlplane_ca.is_some() || env("FELIX_CONTROLPLANE_CA"),
                    ),
                    (
                        "controlplane_insecure",
                        bool_setting(
                            "controlplane_insecure",
                            "FELIX_CONTROLPLANE_INSECURE",
                            file.controlplane_insecure,
                            false,
                        )?,
                    ),
                    (
                        "node_token",
                        file.node_token.is_some() || env("FELIX_NODE_TOKEN"),
                    ),
                    (
                        "node_token_file",
                        file.node_token_file.is_some() || env("FELIX_NODE_TOKEN_FILE"),
                    ),
                    (
                        "client_advertise_addr",
                        file.client_advertise_addr.is_some() || env("FELIX_CLIENT_ADVERTISE_ADDR"),
                    ),
                    ("peer_ca", file.peer_ca.is_some()),
                    ("peer_server_name", file.peer_server_name.is_some()),
                    (
                        "internal_listen",
                        file.internal_listen.is_some() || env("FELIX_INTERNAL_LISTEN"),
                    ),
                    (
                        "internal_advertise_addr",
                        file.internal_advertise_addr.is_some()
                            || env("FELIX_INTERNAL_ADVERTISE_ADDR"),
                    ),
                    (
                        "internal_allow_unauthenticated",
                        file.internal_allow_unauthenticated == Some(true),
                    ),
                ];
                if let Some((key, _)) = set.iter().find(|(_, on)| *on) {
                    return Err(ConfigError {
                        key,
                        source_name: l.source,
                        message: "a cluster setting, and no controlplane_url is set: set it \
                                  (FELIX_CONTROLPLANE_URL) to join the cluster, or remove this \
                                  one to run standalone"
                            .into(),
                    });
                }
                None
            }
            Some(url) => {
                let src = l.source;
                let ca = layer(
                    "controlplane_ca",
                    "FELIX_CONTROLPLANE_CA",
                    file.controlplane_ca
                        .as_ref()
                        .map(|p| p.display().to_string()),
                    None,
                );
                // Layered like every setting: ORed, `FELIX_CONTROLPLANE_INSECURE=false`
                // could not turn off the file's `true`.
                let insecure = bool_setting(
                    "controlplane_insecure",
                    "FELIX_CONTROLPLANE_INSECURE",
                    file.controlplane_insecure,
                    false,
                )?;
                let probe = ClusterSettings {
                    url: url.clone(),
                    token: String::new(),
                    client_addr: listen,
                    peer_ca: None,
                    peer_server_name: String::new(),
                    internal_listen: None,
                    peer_advertise_addr: None,
                    internal_allow_unauthenticated: false,
                    ca: ca.value.as_ref().map(PathBuf::from),
                    insecure,
                };
                // The URL, the CA and plain HTTP off loopback are checked here, so a
                // broker refuses a control plane it could not verify before it starts.
                if let Err(e) = probe.client(None) {
                    let key = match e {
                        felix_controlplane::client::ClientError::Tls(_) if ca.value.is_some() => {
                            "controlplane_ca"
                        }
                        _ => "controlplane_url",
                    };
                    return Err(ConfigError {
                        key,
                        source_name: src,
                        message: e.to_string(),
                    });
                }
                if insecure && url.starts_with("http://") {
                    tracing::warn!(%url, "following a plain-HTTP control plane (controlplane_insecure): keys and assignments travel unprotected");
                }
                let t = layer(
                    "node_token",
                    "FELIX_NODE_TOKEN",
                    file.node_token.clone(),
                    None,
                );
                let tf = layer(
                    "node_token_file",
                    "FELIX_NODE_TOKEN_FILE",
                    file.node_token_file
                        .as_ref()
                        .map(|p| p.display().to_string()),
                    None,
                );
                // The two are one setting: whichever comes from the higher layer wins
                // (a file named in the environment beat a token in the config file
                // nowhere: any token won, and a secret rotated through the environment
                // was ignored).
                let rank = |source: &str| match source {
                    "flag" => 2,
                    "environment" => 1,
                    _ => 0,
                };
                let (t_value, tf_value) = match (&t.value, &tf.value) {
                    (Some(_), Some(_)) if rank(tf.source) > rank(t.source) => (None, tf.value),
                    _ => (t.value, tf.value),
                };
                let token = match (t_value, tf_value) {
                    (Some(t), _) => t,
                    (None, Some(path)) => std::fs::read_to_string(&path)
                        .map_err(|e| ConfigError {
                            key: "node_token_file",
                            source_name: tf.source,
                            message: format!("{path}: {e}"),
                        })?
                        .trim()
                        .to_owned(),
                    (None, None) => {
                        return Err(ConfigError {
                            key: "node_token",
                            source_name: src,
                            message:
                                "following a control plane needs node_token or node_token_file"
                                    .into(),
                        });
                    }
                };
                let a = layer(
                    "client_advertise_addr",
                    "FELIX_CLIENT_ADVERTISE_ADDR",
                    file.client_advertise_addr.clone(),
                    None,
                );
                let client_addr: SocketAddr = match a.value {
                    Some(v) => parse("client_advertise_addr", a.source, &v)?,
                    None if !listen.ip().is_unspecified() && listen.port() != 0 => listen,
                    None => {
                        return Err(ConfigError {
                            key: "client_advertise_addr",
                            source_name: "default",
                            message: format!(
                                "listen {listen} is not an address clients can reach; set client_advertise_addr"
                            ),
                        });
                    }
                };
                let i = layer(
                    "internal_listen",
                    "FELIX_INTERNAL_LISTEN",
                    file.internal_listen.clone(),
                    None,
                );
                let internal_listen: Option<SocketAddr> = match i.value {
                    Some(v) => Some(parse("internal_listen", i.source, &v)?),
                    None => None,
                };
                let a = layer(
                    "internal_advertise_addr",
                    "FELIX_INTERNAL_ADVERTISE_ADDR",
                    file.internal_advertise_addr.clone(),
                    None,
                );
                let peer_advertise_addr: Option<SocketAddr> = match (a.value, internal_listen) {
                    (Some(v), _) => Some(parse("internal_advertise_addr", a.source, &v)?),
                    (None, Some(l)) if !l.ip().is_unspecified() && l.port() != 0 => Some(l),
                    (None, Some(l)) => {
                        return Err(ConfigError {
                            key: "internal_advertise_addr",
                            source_name: "default",
                            message: format!(
                                "internal_listen {l} is not an address peers can reach; set internal_advertise_addr"
                            ),
                        });
                    }
                    (None, None) => None,
                };
                Some(ClusterSettings {
                    internal_listen,
                    peer_advertise_addr,
                    internal_allow_unauthenticated: file
                        .internal_allow_unauthenticated
                        .unwrap_or(false),
                    url,
                    token,
                    client_addr,
                    peer_ca: file.peer_ca.clone(),
                    peer_server_name: file
                        .peer_server_name
                        .clone()
                        .unwrap_or_else(|| "localhost".into()),
                    ca: probe.ca,
                    insecure,
                })
            }
        };
        if !dev && file.tenants.is_empty() && cluster.is_none() {
            return Err(ConfigError {
                key: "tenants",
                source_name: "config file",
                message:
                    "a non-dev broker needs tenants with keys, or a control plane to get them from"
                        .into(),
            });
        }
        let publish_window = file.publish_window.unwrap_or(256);
        if publish_window == 0 {
            return Err(ConfigError {
                key: "publish_window",
                source_name: "config file",
                message: "must be at least 1".into(),
            });
        }
        let l = layer(
            "auth_timeout_ms",
            "FELIX_AUTH_TIMEOUT_MS",
            file.auth_timeout_ms.map(|n| n.to_string()),
            flags.auth_timeout_ms.map(|n| n.to_string()),
        );
        let auth_timeout = match l.value {
            Some(v) => Some(parse::<u64>("auth_timeout_ms", l.source, &v)?)
                .filter(|ms| *ms > 0)
                .map(std::time::Duration::from_millis),
            None => Some(std::time::Duration::from_secs(10)),
        };
        let l = layer(
            "idle_timeout_ms",
            "FELIX_IDLE_TIMEOUT_MS",
            file.idle_timeout_ms.map(|n| n.to_string()),
            flags.idle_timeout_ms.map(|n| n.to_string()),
        );
        let idle_timeout_ms: u64 = match l.value {
            Some(v) => parse("idle_timeout_ms", l.source, &v)?,
            None => 30_000,
        };
        if !(100..=600_000).contains(&idle_timeout_ms) {
            return Err(ConfigError {
                key: "idle_timeout_ms",
                source_name: l.source,
                message: format!("{idle_timeout_ms} is out of range 100..=600000"),
            });
        }
        let positive = |key: &'static str, v: Option<usize>, default: usize| match v {
            Some(0) => Err(ConfigError {
                key,
                source_name: "config file",
                message: "must be at least 1".into(),
            }),
            Some(n) => Ok(n),
            None => Ok(default),
        };
        let defaults = crate::session::Limits::default();
        let limits = crate::session::Limits {
            auth_timeout,
            subscriptions_per_connection: positive(
                "max_subscriptions_per_connection",
                file.max_subscriptions_per_connection,
                defaults.subscriptions_per_connection,
            )?,
            waiting_polls_per_connection: positive(
                "max_waiting_polls_per_connection",
                file.max_waiting_polls_per_connection,
                defaults.waiting_polls_per_connection,
            )?,
            unfinished_frame_bytes_per_connection: positive(
                "max_unfinished_frame_bytes_per_connection",
                file.max_unfinished_frame_bytes_per_connection,
                defaults.unfinished_frame_bytes_per_connection,
            )?,
            unfinished_frame_bytes_per_core: positive(
                "max_unfinished_frame_bytes_per_core",
                file.max_unfinished_frame_bytes_per_core,
                defaults.unfinished_frame_bytes_per_core,
            )?,
            unwritten_answer_bytes_per_connection: positive(
                "max_unwritten_answer_bytes_per_connection",
                file.max_unwritten_answer_bytes_per_connection,
                defaults.unwritten_answer_bytes_per_connection,
            )?,
            unwritten_answer_bytes_per_core: positive(
                "max_unwritten_answer_bytes_per_core",
                file.max_unwritten_answer_bytes_per_core,
                defaults.unwritten_answer_bytes_per_core,
            )?,
            inflight_publish_bytes: positive(
                "max_inflight_publish_bytes",
                file.max_inflight_publish_bytes,
                defaults.inflight_publish_bytes,
            )?,
            inflight_request_bytes_per_core: positive(
                "max_inflight_request_bytes_per_core",
                file.max_inflight_request_bytes_per_core,
                defaults.inflight_request_bytes_per_core,
            )?,
            watch_snapshot_bytes: positive(
                "max_watch_snapshot_bytes",
                file.max_watch_snapshot_bytes,
                defaults.watch_snapshot_bytes,
            )?,
        };
        if limits.inflight_publish_bytes < crate::session::dispatch::REQUEST_MIN_CHARGE {
            // Every request is charged at least that: below it, each connection would run
            // one request at a time, silently.
            return Err(ConfigError {
                key: "max_inflight_publish_bytes",
                source_name: "config file",
                message: format!(
                    "must be at least {} (what a request is charged at least)",
                    crate::session::dispatch::REQUEST_MIN_CHARGE
                ),
            });
        }
        if limits.inflight_request_bytes_per_core < limits.inflight_publish_bytes {
            return Err(ConfigError {
                key: "max_inflight_request_bytes_per_core",
                source_name: "config file",
                message: "must be at least max_inflight_publish_bytes".into(),
            });
        }
        // One whole frame of the largest size must fit, or a client sending (or asking for)
        // one could never be served; a core holds at least what one connection may.
        let one_frame =
            felix_wire::frame::DEFAULT_MAX_PAYLOAD_BYTES as usize + felix_wire::frame::HEADER_LEN;
        byte_bounds(
            (
                "max_unfinished_frame_bytes_per_connection",
                limits.unfinished_frame_bytes_per_connection,
            ),
            (
                "max_unfinished_frame_bytes_per_core",
                limits.unfinished_frame_bytes_per_core,
            ),
            one_frame,
        )?;
        byte_bounds(
            (
                "max_unwritten_answer_bytes_per_connection",
                limits.unwritten_answer_bytes_per_connection,
            ),
            (
                "max_unwritten_answer_bytes_per_core",
                limits.unwritten_answer_bytes_per_core,
            ),
            one_frame,
        )?;
        let max_streams = positive(
            "max_streams_per_connection",
            file.max_streams_per_connection.map(|n| n as usize),
            1024,
        )?
        .min(u32::MAX as usize) as u32;
        let housekeeping_ms = positive(
            "housekeeping_ms",
            file.housekeeping_ms.map(|n| n as usize),
            1000,
        )? as u64;
        let damaged_copies_kept = positive("damaged_copies_kept", file.damaged_copies_kept, 4)?;
        // Values that parse but would misbehave later were taken as they came (or
        // clamped in silence): a segment of 100 bytes failed every shard's open while
        // `/readyz` said ready, `max_connections: 0` refused every client, a zero
        // visibility made every claim lapse at once.
        let at_least = |key: &'static str, v: Option<u64>, min: u64, max: u64| match v {
            Some(n) if n < min || n > max => Err(ConfigError {
                key,
                source_name: "config file",
                message: format!("{n} is out of range {min}..={max}"),
            }),
            _ => Ok(()),
        };
        // (A segment must hold its header and one batch's: the log refuses less, and
        // every durable shard's open failed while the broker ran on.)
        let segment_min = (felix_storage_uring::format::SEGMENT_HEADER_BYTES
            + felix_storage_uring::format::BATCH_HEADER_BYTES) as u64;
        at_least("segment_bytes", file.segment_bytes, segment_min, 64 << 30)?;
        at_least(
            "max_connections",
            file.max_connections.map(|n| n as u64),
            1,
            u64::MAX,
        )?;
        let max_connections = file.max_connections.unwrap_or(10_000);
        // Every connection a core may have is sure of its floor: a send window and the
        // receive credit it may begin with (the crowded window on the clients' port; the
        // full untrusted one on the peers', which has no other).
        let per_connection = reserved_per_connection(u64::from(CROWDED_WINDOW_BYTES));
        let per_peer = reserved_per_connection(u64::from(UNTRUSTED_WINDOW_BYTES));
        let window_floors = (max_connections as u64)
            .saturating_mul(per_connection)
            .max(PEER_CONNECTIONS_PER_CORE as u64 * per_peer);
        let quic_window_bytes_per_core = file.max_quic_window_bytes_per_core.unwrap_or(4 << 30);
        if quic_window_bytes_per_core < window_floors {
            return Err(ConfigError {
                key: "max_quic_window_bytes_per_core",
                source_name: "config file",
                message: format!(
                    "{quic_window_bytes_per_core} is below {window_floors}, the larger of max_connections ({max_connections}) x {per_connection} and {PEER_CONNECTIONS_PER_CORE} x {per_peer} (the replication port's connections)"
                ),
            });
        }
        at_least(
            "group_visibility_ms",
            file.group_visibility_ms,
            100,
            u64::MAX,
        )?;
        at_least(
            "group_max_attempts",
            file.group_max_attempts.map(u64::from),
            1,
            u64::MAX,
        )?;
        at_least(
            "group_max_in_flight",
            file.group_max_in_flight.map(|n| n as u64),
            1,
            u64::MAX,
        )?;
        at_least(
            "group_snapshot_bytes",
            file.group_snapshot_bytes,
            4096,
            u64::MAX,
        )?;
        at_least(
            "producer_snapshot_bytes",
            file.producer_snapshot_bytes,
            4096,
            u64::MAX,
        )?;
        at_least("cache_compact_after", file.cache_compact_after, 1, u64::MAX)?;
        at_least(
            "subscriber_queue",
            file.subscriber_queue.map(|n| n as u64),
            1,
            u64::MAX,
        )?;
        let fault_injection = bool_setting(
            "fault_injection",
            "FELIX_FAULT_INJECTION",
            file.fault_injection,
            false,
        )?;
        let mutants = match file.mutant.as_deref() {
            None => Mutants::default(),
            Some(list) => {
                let refuse = |message: String| ConfigError {
                    key: "mutant",
                    source_name: "config file",
                    message,
                };
                if !cfg!(debug_assertions) || !fault_injection {
                    return Err(refuse(
                        "mutants are deliberate bugs: only debug builds with fault_injection take one"
                            .into(),
                    ));
                }
                Mutants::parse(list).map_err(refuse)?
            }
        };
        Ok(BrokerConfig {
            fault_injection,
            mutants,
            limits,
            idle_timeout: std::time::Duration::from_millis(idle_timeout_ms),
            max_streams,
            housekeeping_interval: std::time::Duration::from_millis(housekeeping_ms),
            damaged_copies_kept,
            listen,
            http,
            data_dir,
            cores,
            fsync,
            auto_create_shards: auto_create(file.auto_create, dev, cluster.is_some())?
                .then_some(shards),
            node_id: layer("node_id", "FELIX_NODE_ID", file.node_id, flags.node_id)
                .value
                .unwrap_or_else(|| "node-1".into()),
            tls,
            tenants: file.tenants,
            streams: file.streams,
            pins,
            publish_window,
            cache_compact_after: file.cache_compact_after.unwrap_or(10_000),
            producer_snapshot_bytes: file
                .producer_snapshot_bytes
                .unwrap_or(crate::producers::SNAPSHOT_EVERY_BYTES)
                .max(4096),
            group_limits: {
                let d = crate::groups::tracker::Limits::default();
                crate::groups::tracker::Limits {
                    visibility_ms: file.group_visibility_ms.unwrap_or(d.visibility_ms).max(1),
                    max_attempts: file.group_max_attempts.unwrap_or(d.max_attempts).max(1),
                    max_in_flight: file.group_max_in_flight.unwrap_or(d.max_in_flight).max(1),
                    snapshot_every_bytes: file
                        .group_snapshot_bytes
                        .unwrap_or(d.snapshot_every_bytes)
                        .max(4096),
                    max_in_flight_per_shard: d.max_in_flight_per_shard,
                    max_claim: d.max_claim,
                    unwritten_acks: mutants.unwritten_group_acks,
                }
            },
            max_connections,
            quic_window_bytes_per_core,
            subscriber_queue: file.subscriber_queue.unwrap_or(512),
            segment_bytes: file.segment_bytes.unwrap_or(256 << 20),
            spin: {
                let l = layer(
                    "spin_us",
                    "FELIX_SPIN_US",
                    file.spin_us.map(|n| n.to_string()),
                    flags.spin_us.map(|n| n.to_string()),
                );
                match l.value {
                    Some(v) => Some(parse::<u64>("spin_us", l.source, &v)?)
                        .filter(|us| *us > 0)
                        .map(std::time::Duration::from_micros),
                    None => None,
                }
            },
            write_linger: {
                let l = layer(
                    "write_linger_us",
                    "FELIX_WRITE_LINGER_US",
                    file.write_linger_us.map(|n| n.to_string()),
                    None,
                );
                let us = match l.value {
                    Some(v) => parse::<u64>("write_linger_us", l.source, &v)?,
                    None => DEFAULT_WRITE_LINGER_US,
                };
                if us > 100_000 {
                    return Err(ConfigError {
                        key: "write_linger_us",
                        source_name: l.source,
                        message: format!(
                            "{us} µs: at most 100000 (it widens the crash loss window)"
                        ),
                    });
                }
                std::time::Duration::from_micros(us)
            },
            zero_ahead_bytes: {
                let l = layer(
                    "zero_ahead_bytes",
                    "FELIX_ZERO_AHEAD_BYTES",
                    file.zero_ahead_bytes.map(|n| n.to_string()),
                    None,
                );
                let bytes = match l.value {
                    Some(v) => parse::<u64>("zero_ahead_bytes", l.source, &v)?,
                    None => DEFAULT_ZERO_AHEAD_BYTES,
                };
                if bytes > 64 << 20 {
                    return Err(ConfigError {
                        key: "zero_ahead_bytes",
                        source_name: l.source,
                        message: format!("{bytes}: at most 67108864 (64 MiB)"),
                    });
                }
                bytes
            },
            dsync_writes: bool_setting(
                "dsync_writes",
                "FELIX_DSYNC_WRITES",
                file.dsync_writes,
                true,
            )?,
            follow_load: bool_setting("follow_load", "FELIX_FOLLOW_LOAD", file.follow_load, true)?,
            cluster,
        })
    }

    /// Reads a YAML file.
    pub fn load_file(path: &std::path::Path) -> anyhow::Result<FileConfig> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        serde_yaml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
    }
}

/// Checks a per-connection byte bound against one whole frame and a per-core one against
/// the per-connection one.
fn byte_bounds(
    (conn_key, per_conn): (&'static str, usize),
    (core_key, per_core): (&'static str, usize),
    one_frame: usize,
) -> Result<(), ConfigError> {
    if per_conn < one_frame {
        return Err(ConfigError {
            key: conn_key,
            source_name: "config file",
            message: format!("must be at least one whole frame, {one_frame} bytes"),
        });
    }
    if per_core < per_conn {
        return Err(ConfigError {
            key: core_key,
            source_name: "config file",
            message: format!("must be at least {conn_key}"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_beat_the_file_and_errors_name_the_key() {
        let file: FileConfig =
            serde_yaml::from_str("listen: 127.0.0.1:7000\nfsync: none\ndefault_shards: 3\n")
                .unwrap();
        let flags = Overrides {
            listen: Some("127.0.0.1:7001".into()),
            ..Overrides::default()
        };
        let c = BrokerConfig::resolve(file, flags, true).unwrap();
        assert_eq!(c.listen.port(), 7001);
        assert_eq!(c.fsync, FsyncMode::None);
        assert_eq!(c.auto_create_shards, Some(3));
        let bad: FileConfig = serde_yaml::from_str("fsync: sometimes\n").unwrap();
        let e = BrokerConfig::resolve(bad, Overrides::default(), true).unwrap_err();
        assert_eq!(e.key, "fsync");
        assert!(
            serde_yaml::from_str::<FileConfig>("lisen: x\n").is_err(),
            "unknown keys are refused"
        );
        let e =
            BrokerConfig::resolve(FileConfig::default(), Overrides::default(), false).unwrap_err();
        assert_eq!(e.key, "tls_cert");
    }

    #[test]
    fn byte_bounds_hold_one_whole_frame_and_a_core_holds_what_a_connection_may() {
        let refused = |yaml: &str| {
            let file: FileConfig = serde_yaml::from_str(yaml).unwrap();
            BrokerConfig::resolve(file, Overrides::default(), true)
                .unwrap_err()
                .key
        };
        assert_eq!(
            refused("max_unfinished_frame_bytes_per_connection: 16777216\n"),
            "max_unfinished_frame_bytes_per_connection",
            "a 16 MiB frame and its header would not fit"
        );
        assert_eq!(
            refused("max_unwritten_answer_bytes_per_core: 1048576\n"),
            "max_unwritten_answer_bytes_per_core"
        );
        let file: FileConfig =
            serde_yaml::from_str("max_unfinished_frame_bytes_per_connection: 16777228\n").unwrap();
        BrokerConfig::resolve(file, Overrides::default(), true).unwrap();
    }

    /// Values that parse but would misbehave later are refused at start, naming the
    /// key: a 100-byte segment failed every shard's open while `/readyz` said ready,
    /// `max_connections: 0` refused every client, and a zero group visibility (clamped
    /// to 1 ms in silence) made every claim lapse at once.
    #[test]
    fn values_that_would_misbehave_later_are_refused_at_start() {
        let resolved = |yaml: &str| {
            let file: FileConfig = serde_yaml::from_str(yaml).unwrap();
            BrokerConfig::resolve(file, Overrides::default(), true).map_err(|e| e.key)
        };
        for (yaml, key) in [
            ("segment_bytes: 100\n", "segment_bytes"),
            ("segment_bytes: 4096\n", "segment_bytes"),
            ("segment_bytes: 100000000000000\n", "segment_bytes"),
            ("max_connections: 0\n", "max_connections"),
            (
                "max_quic_window_bytes_per_core: 1638399999\n",
                "max_quic_window_bytes_per_core",
            ),
            (
                "max_connections: 100\nmax_quic_window_bytes_per_core: 1107296255\n",
                "max_quic_window_bytes_per_core",
            ),
            ("group_visibility_ms: 0\n", "group_visibility_ms"),
            ("group_max_attempts: 0\n", "group_max_attempts"),
            ("group_max_in_flight: 0\n", "group_max_in_flight"),
            ("group_snapshot_bytes: 100\n", "group_snapshot_bytes"),
            ("producer_snapshot_bytes: 100\n", "producer_snapshot_bytes"),
            ("cache_compact_after: 0\n", "cache_compact_after"),
            ("subscriber_queue: 0\n", "subscriber_queue"),
            (
                "max_inflight_publish_bytes: 4095\n",
                "max_inflight_publish_bytes",
            ),
        ] {
            assert_eq!(resolved(yaml).err(), Some(key), "{yaml}");
        }
        assert!(resolved("segment_bytes: 16384\ngroup_visibility_ms: 100\n").is_ok());
        assert!(
            resolved("max_connections: 100\nmax_quic_window_bytes_per_core: 1107296256\n").is_ok()
        );
    }

    /// Beside a control plane no stream is made on first use: the next sync deleted a
    /// stream the control plane does not list, with the records acknowledged in it.
    #[test]
    fn auto_create_is_off_beside_a_control_plane_and_cluster_keys_need_one() {
        let resolved = |yaml: &str| {
            let file: FileConfig = serde_yaml::from_str(yaml).unwrap();
            BrokerConfig::resolve(file, Overrides::default(), true)
        };
        let cp = "controlplane_url: http://127.0.0.1:7070\nnode_token: t\n";
        let refused = resolved(&format!("{cp}auto_create: true\n")).map(|_| ());
        assert_eq!(refused.err().map(|e| e.key), Some("auto_create"));
        let c = resolved(cp).unwrap();
        assert_eq!(
            c.auto_create_shards, None,
            "off by default there, dev or not"
        );
        // A cluster setting without the control plane: a forgotten URL, refused.
        let standalone = resolved("node_token: t\n").map(|_| ());
        assert_eq!(standalone.err().map(|e| e.key), Some("node_token"));
        let standalone = resolved("internal_listen: 127.0.0.1:5001\n").map(|_| ());
        assert_eq!(standalone.err().map(|e| e.key), Some("internal_listen"));
        // A switch set off asks for nothing: fine standalone.
        assert!(resolved("controlplane_insecure: false\n").is_ok());
        assert!(resolved("internal_allow_unauthenticated: false\n").is_ok());
        assert!(
            resolved("auto_create: true\n")
                .unwrap()
                .auto_create_shards
                .is_some()
        );
    }

    /// A switch from the environment overrides the file either way, in one spelling
    /// for every switch, and an empty variable is unset: ORed, `false` could not turn
    /// off the file's `true`; `yes` meant off for one switch and failed another.
    #[test]
    fn switches_layer_like_every_setting() {
        // A variable of this test's own (the environment is the process's).
        const VAR: &str = "FELIX_TEST_SWITCHES_LAYER";
        let with = |v: &str, file: Option<bool>| {
            // SAFETY: no other thread reads this test's own variable.
            unsafe { std::env::set_var(VAR, v) };
            bool_setting("switch", VAR, file, false)
        };
        assert_eq!(with("false", Some(true)).ok(), Some(false));
        assert_eq!(with("0", Some(true)).ok(), Some(false));
        assert_eq!(with("yes", Some(false)).ok(), Some(true));
        assert_eq!(with("1", None).ok(), Some(true));
        assert_eq!(with("", Some(true)).ok(), Some(true), "empty is unset");
        assert_eq!(with("maybe", None).err().map(|e| e.key), Some("switch"));
        // SAFETY: as above.
        unsafe { std::env::remove_var(VAR) };
    }
}
