//! The `felix` command line: publish, subscribe, read by position and time, use caches,
//! counters and state, and inspect a broker.
//!
//! Connection settings come from flags, then `FELIX_*` environment, then a context file
//! (`--context`, `FELIX_CONTEXT`, or `~/.config/felix/context.yaml`), then the dev
//! defaults (`127.0.0.1:5000`, tenant `dev`, `./felix-data/dev/{token,ca.pem}`), so
//! after `felix-broker dev` in the same directory `felix pub orders hello` just works.
//!
//! Exit codes: 0 ok, 2 usage or configuration, 3 broker unreachable or connection lost,
//! 4 refused credentials (unauthenticated / forbidden), 5 not found, 6 other broker
//! error, 7 timed out, 8 output could not be written, 9 a condition did not hold (a
//! conditional put or delete, a commit's `--expect-offset`, a publish's `--if-tail`:
//! nothing was written). A write refused after a resend whose first try may have
//! applied exits 3: its outcome is unknown. `felix pin` and `felix top` (the broker's
//! operator endpoint) use the same scale: 2 a rule refused, 3 the endpoint unreachable
//! or the broker stopping.

use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::{
    AckMode, CacheWatchFilter, CacheWatchStart, ClientConfig, ClientError, ClusterClient,
    ErrorCode, StartPosition,
};
use bytes::Bytes;
use clap::{Parser, Subcommand, ValueEnum};
use felix_wire::message::{CacheCondition, StateChange};
use serde::Deserialize;

#[derive(Parser)]
#[command(name = "felix", about = "The Felix command line", version)]
struct Cli {
    /// Broker address (host:port); repeatable for several seeds.
    #[arg(long, global = true)]
    broker: Vec<String>,
    /// Tenant to authenticate as.
    #[arg(long, global = true)]
    tenant: Option<String>,
    /// Token (prefer --token-file).
    #[arg(long, global = true)]
    token: Option<String>,
    /// File holding the token.
    #[arg(long, global = true)]
    token_file: Option<PathBuf>,
    /// CA certificate (PEM) to verify brokers with.
    #[arg(long, global = true)]
    ca: Option<PathBuf>,
    /// TLS server name.
    #[arg(long, global = true)]
    server_name: Option<String>,
    /// Namespace.
    #[arg(long, global = true, default_value = "default")]
    namespace: String,
    /// Output JSON lines.
    #[arg(long, global = true)]
    json: bool,
    /// Context file (YAML: broker, tenant, token_file, ca, server_name, controlplane,
    /// controlplane_token_file).
    #[arg(long, global = true)]
    context: Option<PathBuf>,
    /// Control-plane URL for `stream` commands (`https://host:port`, or `http://` on
    /// loopback).
    #[arg(long, global = true)]
    controlplane: Option<String>,
    /// File holding a control-plane token (audience felix-controlplane).
    #[arg(long, global = true)]
    controlplane_token_file: Option<PathBuf>,
    /// CA bundle (PEM) the control plane's certificate must chain to (`https` URLs;
    /// also FELIX_CONTROLPLANE_CA).
    #[arg(long, global = true)]
    controlplane_ca: Option<PathBuf>,
    /// Speak plain HTTP to a control plane that is not on loopback.
    #[arg(long, global = true)]
    controlplane_insecure: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum Ack {
    None,
    PerMessage,
}

#[derive(Subcommand)]
enum Command {
    /// Publish messages: the arguments, or each line of stdin.
    Pub {
        /// Stream.
        stream: String,
        /// Messages (default: read lines from stdin).
        messages: Vec<String>,
        /// Routing key.
        #[arg(long)]
        key: Option<String>,
        /// Acknowledgement.
        #[arg(long, value_enum, default_value = "per-message")]
        ack: Ack,
        /// Write the messages as one batch, only if the shard's next offset is this
        /// (refused with the shard's tail otherwise, nothing written).
        #[arg(long, conflicts_with = "key")]
        if_tail: Option<u64>,
        /// The shard a conditional publish (`--if-tail`) writes.
        #[arg(long, requires = "if_tail")]
        shard: Option<u32>,
    },
    /// Print messages from a stream shard.
    Sub {
        /// Stream.
        stream: String,
        /// Where to start: earliest, latest, or an offset.
        #[arg(long, default_value = "latest")]
        from: String,
        /// Stop after this many messages.
        #[arg(long)]
        count: Option<u64>,
        /// Shard.
        #[arg(long, default_value_t = 0)]
        shard: u32,
    },
    /// Read a bounded range of a stream shard (`stream_read`): its records from
    /// `--from`, up to `--end` or `--max`, then (with --json) the offset the next read
    /// starts at.
    Read {
        /// Stream.
        stream: String,
        /// First offset.
        #[arg(long, default_value_t = 0)]
        from: u64,
        /// Stop before this offset (default: as far as the log goes, following it
        /// while it grows).
        #[arg(long)]
        end: Option<u64>,
        /// At most this many records.
        #[arg(long)]
        max: Option<u32>,
        /// Shard.
        #[arg(long, default_value_t = 0)]
        shard: u32,
    },
    /// The first offset of a stream shard appended at or after a time
    /// (`offset_for_time`).
    OffsetAt {
        /// Stream.
        stream: String,
        /// Microseconds since the Unix epoch.
        micros: u64,
        /// Shard.
        #[arg(long, default_value_t = 0)]
        shard: u32,
    },
    /// Cache operations.
    Cache {
        #[command(subcommand)]
        op: CacheCmd,
    },
    /// An entity's state on a stream: atomic commits and reads.
    State {
        #[command(subcommand)]
        op: StateCmd,
    },
    /// Consumer groups (queues) on a stream shard.
    Group {
        #[command(subcommand)]
        op: GroupCmd,
    },
    /// Brokers a client may use.
    Topology,
    /// Shard count of a stream.
    Shards {
        /// Stream.
        stream: String,
    },
    /// Create and list streams through the control plane.
    Stream {
        #[command(subcommand)]
        op: StreamCmd,
    },
    /// Shard leadership, through the control plane.
    Shard {
        #[command(subcommand)]
        op: ShardCmd,
    },
    /// Brokers, through the control plane.
    Broker {
        #[command(subcommand)]
        op: BrokerCmd,
    },
    /// Pin shards to a core on a running broker (`tenant/ns/stream[/shard]=core`):
    /// they move live and the pin is kept across restarts. Talks to the broker's
    /// operator endpoint (`--http`).
    Pin {
        /// The rule, e.g. `acme/default/orders/2=1`.
        rule: String,
        /// The broker's operator HTTP address (`felix-broker --http`; also
        /// FELIX_BROKER_HTTP).
        #[arg(long)]
        http: Option<String>,
    },
    /// A live view of a broker's cores: busy %, msgs/s, shards, connections,
    /// subscriber queues, fsync p99, cross-core traffic, the hottest shards and
    /// suggested pins.
    Top {
        /// The broker's operator HTTP address (`felix-broker --http`; also
        /// FELIX_BROKER_HTTP).
        #[arg(long)]
        http: Option<String>,
        /// Seconds between frames.
        #[arg(long, default_value_t = 1.0, value_parser = seconds)]
        interval: f64,
        /// Stop after this many frames.
        #[arg(long)]
        iterations: Option<u64>,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum Routing {
    Modulo,
    JumpHash,
}

#[derive(Subcommand)]
enum StreamCmd {
    /// Create a stream (shard count and routing are fixed from then on).
    Create {
        /// Stream.
        stream: String,
        /// Shard count.
        #[arg(long, default_value_t = 1)]
        shards: u32,
        /// Key-to-shard mapping.
        #[arg(long, value_enum, default_value = "modulo")]
        routing: Routing,
        /// Replicas, leader included.
        #[arg(long, default_value_t = 1)]
        replication_factor: u32,
    },
    /// List the namespace's streams.
    List,
}

/// Which group: `STREAM GROUP [--shard N]`.
#[derive(clap::Args)]
struct GroupArgs {
    /// Stream.
    stream: String,
    /// Group.
    group: String,
    /// Shard.
    #[arg(long, default_value_t = 0)]
    shard: u32,
}

#[derive(Subcommand)]
enum GroupCmd {
    /// Claim records and print them (offset, attempt and the offsets without a record
    /// just before it, `skipped_before`, with --json).
    Poll {
        #[command(flatten)]
        at: GroupArgs,
        /// Records at most.
        #[arg(long, default_value_t = 32)]
        max: u32,
        /// Seconds the broker may wait for records.
        #[arg(long, default_value_t = 5.0, value_parser = seconds)]
        wait: f64,
        /// Acknowledge each record once printed.
        #[arg(long)]
        ack: bool,
        /// Poll as this named member: its claims are its own.
        #[arg(long)]
        consumer: Option<String>,
        /// With --consumer: first hand back the records this member still holds.
        #[arg(long, requires = "consumer")]
        reclaim: bool,
    },
    /// Finish records.
    Ack {
        #[command(flatten)]
        at: GroupArgs,
        /// Offsets.
        #[arg(required = true)]
        offsets: Vec<u64>,
    },
    /// List the offsets the group gave up on.
    DeadLetters {
        #[command(flatten)]
        at: GroupArgs,
    },
    /// Put dead letters back in the queue, their attempts reset.
    Redrive {
        #[command(flatten)]
        at: GroupArgs,
        /// Offsets.
        #[arg(required = true)]
        offsets: Vec<u64>,
    },
    /// Print the group's cursor, lag and counts.
    Describe {
        #[command(flatten)]
        at: GroupArgs,
    },
}

#[derive(Subcommand)]
enum ShardCmd {
    /// Move a shard's leadership to another of its replicas (a new generation).
    Move {
        /// Stream.
        stream: String,
        /// Shard.
        shard: u32,
        /// The replica to lead it (node id).
        destination: String,
    },
}

#[derive(Subcommand)]
enum BrokerCmd {
    /// Drain a broker: it takes no new roles, and the shards it leads move to replicas.
    Drain {
        /// Node id.
        node: String,
    },
}

#[derive(Subcommand)]
enum CacheCmd {
    /// Read a key.
    Get {
        /// Cache.
        cache: String,
        /// Key.
        key: String,
    },
    /// Set a key (with --if-absent or --if-version, only if that holds: prints the
    /// new version, or fails with the current one).
    Put {
        /// Cache.
        cache: String,
        /// Key.
        key: String,
        /// Value.
        value: String,
        /// Time to live, seconds (more than 0).
        #[arg(long, value_parser = positive_seconds)]
        ttl: Option<f64>,
        /// Only if the key has no live value.
        #[arg(long, conflicts_with = "if_version")]
        if_absent: bool,
        /// Only if the key's version (the offset of the put that wrote it) is this.
        #[arg(long)]
        if_version: Option<u64>,
    },
    /// Remove a key and print the value it had; with --if-version, only at that version
    /// (and nothing printed but, with --json, whether it applied).
    Delete {
        /// Cache.
        cache: String,
        /// Key.
        key: String,
        /// Only if the key's version is this.
        #[arg(long)]
        if_version: Option<u64>,
    },
    /// Print the changes of a key, or of the keys of a prefix, as they are applied: each
    /// put as `key=value`, each delete (an expiry is one) as `key deleted`; with --json,
    /// objects with the offset. Follows the cache shard when it moves.
    Watch {
        /// Cache.
        cache: String,
        /// The key to follow.
        #[arg(long, conflicts_with = "prefix", required_unless_present = "prefix")]
        key: Option<String>,
        /// Follow every key starting with this (`""`: all) on one cache shard.
        #[arg(long)]
        prefix: Option<String>,
        /// The cache shard a prefix watch follows (a cache of several shards needs
        /// it).
        #[arg(long, requires = "prefix")]
        shard: Option<u32>,
        /// Replay from this offset (default: from now).
        #[arg(long)]
        from: Option<u64>,
        /// Start with the current values.
        #[arg(long, conflicts_with = "from")]
        retained: bool,
        /// Stop after this many changes.
        #[arg(long)]
        count: Option<u64>,
    },
    /// Add a signed delta to a counter beside the cache; prints the sum. Resent after
    /// a lost connection, so at least once: an add whose answer was lost may count
    /// twice.
    Add {
        /// Cache.
        cache: String,
        /// Counter.
        key: String,
        /// Delta.
        #[arg(allow_negative_numbers = true)]
        delta: i64,
    },
    /// Print a counter's sum (fails as not found when never written).
    Counter {
        /// Cache.
        cache: String,
        /// Counter.
        key: String,
    },
}

#[derive(Subcommand)]
enum StateCmd {
    /// Append an event and apply state changes to an entity, all or nothing; prints the
    /// offset (every key's new version).
    Commit {
        /// Stream.
        stream: String,
        /// Entity key (routes to the shard).
        entity: String,
        /// The event appended.
        #[arg(long, default_value = "")]
        event: String,
        /// Set a key: `KEY=VALUE` (repeatable).
        #[arg(long = "put", value_name = "KEY=VALUE")]
        puts: Vec<String>,
        /// Remove a key (repeatable).
        #[arg(long = "delete", value_name = "KEY")]
        deletes: Vec<String>,
        /// Only if the shard's next offset is this (optimistic concurrency).
        #[arg(long)]
        expect_offset: Option<u64>,
    },
    /// Print one key of an entity's state (fails as not found when it has none).
    Get {
        /// Stream.
        stream: String,
        /// Entity key.
        entity: String,
        /// Key.
        key: String,
    },
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Context {
    broker: Option<Vec<String>>,
    tenant: Option<String>,
    token_file: Option<PathBuf>,
    ca: Option<PathBuf>,
    server_name: Option<String>,
    controlplane: Option<String>,
    controlplane_token_file: Option<PathBuf>,
    #[serde(default)]
    controlplane_ca: Option<PathBuf>,
}

enum Failure {
    Usage(String),
    Client(ClientError),
    /// A conditional write's condition did not hold (exit code 9).
    NotApplied(String),
    /// What was read could not be written out (a closed pipe, a full disk).
    Output(std::io::Error),
}

/// Writes one record out, flushed: an error ends the command (a consumer acking what
/// it showed must not ack what it could not show).
fn shown(
    json: bool,
    out: &mut impl Write,
    payload: &[u8],
    extra: serde_json::Value,
) -> Result<(), Failure> {
    show(json, out, payload, extra)
        .and_then(|()| out.flush())
        .map_err(Failure::Output)
}

impl From<ClientError> for Failure {
    fn from(e: ClientError) -> Self {
        Failure::Client(e)
    }
}

fn exit_code(e: &ClientError) -> i32 {
    match e {
        ClientError::Connection { .. }
        | ClientError::SubscriptionLost(_)
        | ClientError::SubscriptionLagged { .. } => 3,
        // A write refused after a resend, whose first try may have applied: its
        // outcome is unknown, not "nothing was written" (9).
        ClientError::GaveUp {
            in_doubt: true,
            last,
            ..
        } if last.refusal().is_some() => 3,
        ClientError::GaveUp { last, .. } => exit_code(last),
        e if e.is_credential_failure() => 4,
        ClientError::Broker(b) if b.code == Some(ErrorCode::NotFound) => 5,
        ClientError::Config(_) => 2,
        ClientError::Timeout(_) => 7,
        ClientError::Refused {
            reason: felix_wire::message::PublishRefusalReason::OffsetMismatch { .. },
            ..
        } => 9,
        _ => 6,
    }
}

fn load_context(cli: &Cli) -> Result<Context, Failure> {
    let path = cli
        .context
        .clone()
        .or_else(|| std::env::var("FELIX_CONTEXT").ok().map(PathBuf::from))
        .or_else(|| {
            let home = std::env::var("HOME").ok()?;
            let p = PathBuf::from(home).join(".config/felix/context.yaml");
            p.exists().then_some(p)
        });
    match path {
        None => Ok(Context::default()),
        Some(p) => {
            let text = std::fs::read_to_string(&p)
                .map_err(|e| Failure::Usage(format!("context {}: {e}", p.display())))?;
            serde_yaml::from_str(&text)
                .map_err(|e| Failure::Usage(format!("context {}: {e}", p.display())))
        }
    }
}

async fn connect(cli: &Cli) -> Result<(ClusterClient, String), Failure> {
    let ctx = load_context(cli)?;
    let brokers: Vec<String> = if !cli.broker.is_empty() {
        cli.broker.clone()
    } else if let Ok(b) = std::env::var("FELIX_BROKER") {
        b.split(',').map(str::to_owned).collect()
    } else {
        ctx.broker
            .clone()
            .unwrap_or_else(|| vec!["127.0.0.1:5000".into()])
    };
    let seeds: Vec<SocketAddr> = brokers
        .iter()
        .map(|b| {
            b.parse()
                .or_else(|_| {
                    use std::net::ToSocketAddrs;
                    b.to_socket_addrs()
                        .ok()
                        .and_then(|mut a| a.next())
                        .ok_or(())
                })
                .map_err(|_| Failure::Usage(format!("broker {b:?} is not host:port")))
        })
        .collect::<Result<_, _>>()?;
    let tenant = cli
        .tenant
        .clone()
        .or_else(|| std::env::var("FELIX_TENANT").ok())
        .or(ctx.tenant.clone())
        .unwrap_or_else(|| "dev".into());
    let token = match (&cli.token, &cli.token_file) {
        (Some(t), _) => t.clone(),
        (None, Some(f)) => read_token(f)?,
        (None, None) => match std::env::var("FELIX_TOKEN") {
            Ok(t) => t,
            Err(_) => {
                let f = std::env::var("FELIX_TOKEN_FILE")
                    .map(PathBuf::from)
                    .ok()
                    .or(ctx.token_file.clone())
                    .unwrap_or_else(|| PathBuf::from("felix-data/dev/token"));
                read_token(&f)?
            }
        },
    };
    let ca = cli
        .ca
        .clone()
        .or_else(|| std::env::var("FELIX_CA").ok().map(PathBuf::from))
        .or(ctx.ca.clone())
        .unwrap_or_else(|| PathBuf::from("felix-data/dev/ca.pem"));
    let server_name = cli
        .server_name
        .clone()
        .or(ctx.server_name.clone())
        .unwrap_or_else(|| "localhost".into());
    let quinn = crate::quic_client_config_from_file(&ca, false)
        .map_err(|e| Failure::Usage(format!("--ca: {e:#}")))?;
    let mut config = ClientConfig::from_env_or_yaml(quinn, None)
        .map_err(|e| Failure::Usage(format!("{e:#}")))?;
    config.auth_tenant_id = Some(tenant.clone());
    config.auth_token = Some(token);
    let policy = crate::ReconnectPolicy {
        attempts: 3,
        deadline: Some(Duration::from_secs(10)),
        ..Default::default()
    };
    Ok((
        ClusterClient::connect_with_policy(&seeds, &server_name, config, policy).await?,
        tenant,
    ))
}

fn read_token(f: &std::path::Path) -> Result<String, Failure> {
    std::fs::read_to_string(f)
        .map(|t| t.trim().to_owned())
        .map_err(|e| {
            Failure::Usage(format!(
                "token file {}: {e} (pass --token-file or set FELIX_TOKEN)",
                f.display()
            ))
        })
}

/// Sets `v`'s `payload` to the payload's text, and, when it is not UTF-8, its bytes in
/// base64 as `payload_base64` (its text then has U+FFFD in place of what was not: the
/// bytes were lost to a `--json` reader until 2026-12-08).
fn put_payload(v: &mut serde_json::Value, payload: &[u8]) {
    use base64::Engine as _;
    match std::str::from_utf8(payload) {
        Ok(text) => v["payload"] = text.into(),
        Err(_) => {
            v["payload"] = String::from_utf8_lossy(payload).into_owned().into();
            v["payload_base64"] = base64::engine::general_purpose::STANDARD
                .encode(payload)
                .into();
        }
    }
}

/// Standard input's lines as bytes, without their `\n` (or `\r\n`).
fn stdin_lines() -> impl Iterator<Item = std::io::Result<Vec<u8>>> {
    std::io::stdin().lock().split(b'\n').map(|line| {
        line.map(|mut l| {
            if l.last() == Some(&b'\r') {
                l.pop();
            }
            l
        })
    })
}

/// A number of seconds, 0 or more: `nan` (which `f64` parses) panicked the command, and
/// a negative one was taken as 0 or 1 ms (until 2026-12-08).
fn seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!("{s:?}: a number of seconds, 0 or more")),
    }
}

/// A number of seconds more than 0 (a time to live: `--ttl -5` put a value that expired
/// at once, and said it was put).
fn positive_seconds(s: &str) -> Result<f64, String> {
    match seconds(s) {
        Ok(v) if v > 0.0 => Ok(v),
        _ => Err(format!("{s:?}: a number of seconds more than 0")),
    }
}

/// Records asked of one read by `felix read`.
const READ_PAGE_RECORDS: u32 = 1000;

fn show(
    json: bool,
    out: &mut impl Write,
    payload: &[u8],
    extra: serde_json::Value,
) -> std::io::Result<()> {
    if json {
        let mut v = extra;
        put_payload(&mut v, payload);
        writeln!(out, "{v}")
    } else {
        out.write_all(payload)?;
        out.write_all(b"\n")
    }
}

/// How many times in a row `felix cache watch` watches again after a move or a lag with
/// no change between before it gives up.
const WATCH_FOLLOWS_MAX: u32 = 20;

/// Counts one more watch in a row with no change between: how long to wait before it,
/// or the end of the command past [`WATCH_FOLLOWS_MAX`].
fn watch_again(follows: &mut u32) -> Result<Duration, Failure> {
    *follows += 1;
    if *follows > WATCH_FOLLOWS_MAX {
        return Err(Failure::Client(ClientError::SubscriptionLost(format!(
            "the watch ended {} times in a row with nothing between",
            *follows - 1
        ))));
    }
    Ok(Duration::from_millis(50) * *follows)
}

/// A cache watch's change: `key=value` for a put, `key deleted` for a delete; with
/// `json`, an object with its offset and expiry (`payload` null for a delete).
fn show_change(json: bool, out: &mut impl Write, c: &crate::CacheChange) -> std::io::Result<()> {
    if json {
        let mut v = serde_json::json!({
            "key": c.key,
            "payload": null,
            "offset": c.offset,
            "expires_at_millis": c.expires_at_millis,
        });
        if let Some(value) = &c.value {
            put_payload(&mut v, value);
        }
        writeln!(out, "{v}")?;
    } else {
        match &c.value {
            Some(v) => {
                write!(out, "{}=", c.key)?;
                out.write_all(v)?;
                out.write_all(b"\n")?;
            }
            None => writeln!(out, "{} deleted", c.key)?,
        }
    }
    out.flush()
}

/// Prints a number a read found (with `json`, `fields` whatever it found) and fails
/// with `missing` when it found none.
fn found<T: std::fmt::Display>(
    (json, out): (bool, &mut impl Write),
    fields: serde_json::Value,
    value: Option<T>,
    missing: impl FnOnce() -> Failure,
) -> Result<(), Failure> {
    if json {
        let _ = writeln!(out, "{fields}");
    } else if let Some(v) = &value {
        let _ = writeln!(out, "{v}");
    }
    value.map(|_| ()).ok_or_else(missing)
}

/// A read that found nothing, failing as the broker's `not_found` does (exit code 5).
fn not_found(context: &'static str, message: String) -> Failure {
    Failure::Client(ClientError::Broker(crate::BrokerError {
        code: Some(ErrorCode::NotFound),
        retry: None,
        detail: None,
        message,
        context,
    }))
}

/// Exit code for a control-plane failure, on the same scale as broker failures.
fn controlplane_exit_code(e: &felix_controlplane::client::ClientError) -> i32 {
    use felix_controlplane::client::ClientError as Cp;
    if matches!(e, Cp::BadUrl(_) | Cp::Tls(_)) {
        // Settings that cannot work: configuration, not an unreachable service.
        return 2;
    }
    match e.status() {
        None => 3,
        Some(401 | 403) => 4,
        Some(404) => 5,
        Some(400 | 413) => 2,
        Some(_) => 6,
    }
}

/// `felix stream ...`: talks to the control plane, not to a broker.
fn run_controlplane(cli: &Cli) -> Result<(), i32> {
    let mut out = Out::new(std::io::stdout().lock());
    let ran = run_controlplane_to(cli, &mut out);
    let written = out.finish().map_err(|e| {
        eprintln!("felix: writing out: {e}");
        8
    });
    ran.and(written)
}

fn run_controlplane_to(cli: &Cli, out: &mut Out<std::io::StdoutLock<'_>>) -> Result<(), i32> {
    use felix_controlplane::client::ControlPlaneClient;
    let usage = |f: Failure| {
        let m = match f {
            Failure::Usage(m) | Failure::NotApplied(m) => m,
            Failure::Client(e) => e.to_string(),
            Failure::Output(e) => e.to_string(),
        };
        eprintln!("felix: {m}");
        2
    };
    let ctx = load_context(cli).map_err(usage)?;
    let url = cli
        .controlplane
        .clone()
        .or_else(|| std::env::var("FELIX_CONTROLPLANE_URL").ok())
        .or(ctx.controlplane.clone())
        // `felix-broker dev` embeds one here.
        .unwrap_or_else(|| "http://127.0.0.1:7070".into());
    let token = match std::env::var("FELIX_CONTROLPLANE_TOKEN") {
        Ok(t) if cli.controlplane_token_file.is_none() => t,
        _ => {
            let f = cli
                .controlplane_token_file
                .clone()
                .or_else(|| {
                    std::env::var("FELIX_CONTROLPLANE_TOKEN_FILE")
                        .ok()
                        .map(PathBuf::from)
                })
                .or(ctx.controlplane_token_file.clone())
                .unwrap_or_else(|| PathBuf::from("felix-data/dev/controlplane.token"));
            read_token(&f).map_err(usage)?
        }
    };
    let tenant = cli
        .tenant
        .clone()
        .or_else(|| std::env::var("FELIX_TENANT").ok())
        .or(ctx.tenant.clone())
        .unwrap_or_else(|| "dev".into());
    let ca = cli
        .controlplane_ca
        .clone()
        .or_else(|| {
            std::env::var("FELIX_CONTROLPLANE_CA")
                .ok()
                .map(PathBuf::from)
        })
        .or(ctx.controlplane_ca.clone());
    let tls = ca
        .as_deref()
        .map(felix_controlplane::client::ClientTls::from_ca_file)
        .transpose()
        .map_err(|e| usage(Failure::Usage(e.to_string())))?;
    let cp = if cli.controlplane_insecure {
        eprintln!("felix: warning: plain HTTP to the control plane (--controlplane-insecure)");
        ControlPlaneClient::new_insecure(&url, Some(token), tls)
    } else {
        ControlPlaneClient::with_tls(&url, Some(token), tls)
    }
    .map_err(|e| usage(Failure::Usage(e.to_string())))?;
    let path = format!("/v1/tenants/{tenant}/namespaces/{}/streams", cli.namespace);
    let fail = |e: felix_controlplane::client::ClientError| {
        eprintln!("felix: {e}");
        controlplane_exit_code(&e)
    };
    let op = match &cli.command {
        Command::Stream { op } => op,
        Command::Shard {
            op:
                ShardCmd::Move {
                    stream,
                    shard,
                    destination,
                },
        } => {
            let moved = cp
                .post(
                    "/v1/shard-moves",
                    &serde_json::json!({
                        "tenant_id": tenant, "namespace": cli.namespace, "stream": stream,
                        "shard": shard, "destination": destination,
                    }),
                )
                .map_err(fail)?;
            if cli.json {
                let _ = writeln!(out, "{moved}");
            } else if moved["staged"].as_bool() == Some(true) {
                let _ = writeln!(
                    out,
                    "{stream}/{shard}: staging a copy on {destination} (generation {}); it \
                     leads once the copy holds the log",
                    moved["assignment"]["generation"]
                );
            } else {
                let _ = writeln!(
                    out,
                    "{stream}/{shard}: {} leads at generation {}",
                    moved["assignment"]["leader"].as_str().unwrap_or("?"),
                    moved["assignment"]["generation"]
                );
            }
            return Ok(());
        }
        Command::Broker {
            op: BrokerCmd::Drain { node },
        } => {
            let drained = cp
                .post(&format!("/v1/nodes/{node}/drain"), &serde_json::json!({}))
                .map_err(fail)?;
            if cli.json {
                let _ = writeln!(out, "{drained}");
            } else {
                for m in drained["moved"].as_array().into_iter().flatten() {
                    let _ = writeln!(
                        out,
                        "moved {} to {}",
                        m["shard"].as_str().unwrap_or("?"),
                        m["leader"].as_str().unwrap_or("?")
                    );
                }
                for k in drained["kept"].as_array().into_iter().flatten() {
                    let _ = writeln!(
                        out,
                        "kept {} (no other ready replica)",
                        k.as_str().unwrap_or("?")
                    );
                }
            }
            return Ok(());
        }
        _ => unreachable!("only control-plane commands come here"),
    };
    match op {
        StreamCmd::Create {
            stream,
            shards,
            routing,
            replication_factor,
        } => {
            let routing = match routing {
                Routing::Modulo => "modulo",
                Routing::JumpHash => "jump_hash",
            };
            let created = cp
                .post(
                    &path,
                    &serde_json::json!({
                        "stream": stream, "kind": "Stream", "shards": shards,
                        "routing": routing, "replication_factor": replication_factor,
                    }),
                )
                .map_err(fail)?;
            if cli.json {
                let _ = writeln!(out, "{created}");
            } else {
                let _ = writeln!(
                    out,
                    "created {tenant}/{}/{stream} with {shards} shards",
                    cli.namespace
                );
            }
        }
        StreamCmd::List => {
            let listed = cp.get(&path).map_err(fail)?;
            for s in listed["items"].as_array().into_iter().flatten() {
                if cli.json {
                    let _ = writeln!(out, "{s}");
                } else {
                    let _ = writeln!(
                        out,
                        "{} shards={} routing={}",
                        s["stream"].as_str().unwrap_or(""),
                        s["shards"],
                        s["routing"].as_str().unwrap_or("modulo")
                    );
                }
            }
        }
    }
    Ok(())
}

async fn run(cli: Cli) -> Result<(), Failure> {
    let mut out = Out::new(std::io::stdout().lock());
    let ran = run_to(&cli, &mut out).await;
    let written = out.finish().map_err(Failure::Output);
    ran.and(written)
}

/// Standard output that keeps its first write error for the command's exit code (8):
/// a result printed to a closed or full output was dropped in silence, and the command
/// exited 0 after it (until 2026-12-08). Later writes fail at once.
struct Out<W: Write> {
    inner: W,
    failed: Option<std::io::Error>,
}

impl<W: Write> Out<W> {
    fn new(inner: W) -> Self {
        Self {
            inner,
            failed: None,
        }
    }

    fn keep<T>(&mut self, r: std::io::Result<T>) -> std::io::Result<T> {
        // An interrupted write is tried again (by `write_all`): kept, it failed every
        // try after it, for good.
        if let Err(e) = &r
            && self.failed.is_none()
            && e.kind() != std::io::ErrorKind::Interrupted
        {
            self.failed = Some(std::io::Error::new(e.kind(), e.to_string()));
        }
        r
    }

    fn check(&self) -> std::io::Result<()> {
        match &self.failed {
            Some(e) => Err(std::io::Error::new(e.kind(), e.to_string())),
            None => Ok(()),
        }
    }

    /// Flushes; the first write error, if any.
    fn finish(mut self) -> std::io::Result<()> {
        self.check()?;
        let flushed = self.inner.flush();
        self.keep(flushed)
    }
}

impl<W: Write> Write for Out<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.check()?;
        let r = self.inner.write(buf);
        self.keep(r)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.check()?;
        let r = self.inner.flush();
        self.keep(r)
    }
}

async fn run_to(cli: &Cli, out: &mut Out<std::io::StdoutLock<'_>>) -> Result<(), Failure> {
    let (client, tenant) = connect(cli).await?;
    let ns = cli.namespace.as_str();
    let mut out = out;
    match &cli.command {
        Command::Pub {
            stream,
            messages,
            key,
            ack,
            if_tail,
            shard,
        } => {
            if let Some(expected) = if_tail.as_ref() {
                let payloads: Vec<Bytes> = if messages.is_empty() {
                    let mut lines = Vec::new();
                    for line in stdin_lines() {
                        lines.push(Bytes::from(
                            line.map_err(|e| Failure::Usage(format!("stdin: {e}")))?,
                        ));
                    }
                    lines
                } else {
                    messages.iter().map(|m| Bytes::from(m.clone())).collect()
                };
                // Any broker takes it: a non-leader forwards a publish to the leader.
                let o = client
                    .client()
                    .publish_if(&tenant, ns, stream, *shard, payloads, *expected)
                    .await?;
                if cli.json {
                    let _ = writeln!(out, "{}", serde_json::json!({"offset": o}));
                }
                return Ok(());
            }
            let ack = match ack {
                Ack::None => AckMode::None,
                Ack::PerMessage => AckMode::PerMessage,
            };
            let send = |m: Vec<u8>| {
                let (client, tenant, stream, key) = (&client, &tenant, stream.clone(), key.clone());
                async move {
                    match key {
                        Some(k) => {
                            client
                                .publish_keyed(tenant, ns, &stream, m, Bytes::from(k), ack)
                                .await
                        }
                        None => client.publish(tenant, ns, &stream, m, ack).await,
                    }
                }
            };
            let emit = |o: Option<u64>, out: &mut dyn Write| {
                if cli.json {
                    let _ = writeln!(out, "{}", serde_json::json!({"offset": o}));
                }
            };
            let sent = async {
                if messages.is_empty() {
                    // Lines as bytes: a payload need not be text (one that was not ended
                    // the command part-way, its lines before it sent, as a usage error).
                    for line in stdin_lines() {
                        let o =
                            send(line.map_err(|e| Failure::Usage(format!("stdin: {e}")))?).await?;
                        emit(o, &mut out);
                    }
                } else {
                    for m in messages {
                        let o = send(m.clone().into_bytes()).await?;
                        emit(o, &mut out);
                    }
                }
                Ok::<_, Failure>(())
            }
            .await;
            if ack == AckMode::None {
                // Unacknowledged publishes return once written to the send buffer:
                // exiting then lost them (and said 0). Those sent before a failure too.
                let flushed = client.flush_publishes().await;
                sent?;
                flushed?;
            } else {
                sent?;
            }
        }
        Command::Sub {
            stream,
            from,
            count,
            shard,
        } => {
            let start = match from.as_str() {
                "latest" => Some(StartPosition::Latest),
                "earliest" => Some(StartPosition::Earliest),
                n => Some(StartPosition::Offset(felix_wire::Offset(
                    n.parse().map_err(|_| {
                        Failure::Usage(format!("--from {n:?}: earliest, latest or an offset"))
                    })?,
                ))),
            };
            let mut sub = client
                .subscribe_shard(&tenant, ns, stream, *shard, start)
                .await?;
            let (mut seen, mut last) = (0u64, None);
            while count.is_none_or(|c| seen < c) {
                match sub.next_event().await? {
                    Some(e) => {
                        shown(
                            cli.json,
                            &mut out,
                            &e.payload,
                            serde_json::json!({"offset": e.offset, "shard": shard}),
                        )?;
                        seen += 1;
                        last = e.offset.or(last);
                    }
                    None => match sub.end() {
                        // Follow a planned move: resume after the last record shown.
                        Some(crate::SubscriptionEnd::Moved {
                            node_id,
                            resume_from,
                            ..
                        }) => {
                            eprintln!(
                                "shard {shard} moved to {}; following",
                                node_id.as_deref().unwrap_or("another broker")
                            );
                            let resume = last.map(|o| o + 1).or(resume_from);
                            let start = resume
                                .map(|o| StartPosition::Offset(felix_wire::Offset(o)))
                                .or(start);
                            sub = client
                                .subscribe_shard(&tenant, ns, stream, *shard, start)
                                .await?;
                        }
                        // Ended short of `--count`: not a success (it exited 0).
                        Some(crate::SubscriptionEnd::StreamDeleted) => {
                            return Err(not_found(
                                "sub",
                                format!("stream {stream} was deleted after {seen} records"),
                            ));
                        }
                        None if count.is_some() => {
                            return Err(Failure::Client(ClientError::SubscriptionLost(format!(
                                "the broker ended the subscription after {seen} records"
                            ))));
                        }
                        None => break,
                    },
                }
            }
        }
        Command::Cache { op } => match op {
            CacheCmd::Get { cache, key } => {
                match client.cache_get(&tenant, ns, cache, key).await? {
                    Some(v) => {
                        shown(cli.json, &mut out, &v, serde_json::json!({"key": key}))?;
                    }
                    None => {
                        if cli.json {
                            let _ = writeln!(
                                out,
                                "{}",
                                serde_json::json!({"key": key, "payload": null})
                            );
                        }
                        return Err(not_found("cache get", format!("key {key:?} not found")));
                    }
                }
            }
            CacheCmd::Put {
                cache,
                key,
                value,
                ttl,
                if_absent,
                if_version,
            } => {
                let ttl_ms = ttl.map(|s| (s * 1000.0).round().max(1.0) as u64);
                let value = Bytes::from(value.clone().into_bytes());
                let condition = match (if_absent, if_version) {
                    (true, _) => Some(CacheCondition::Absent),
                    (false, Some(v)) => Some(CacheCondition::Version(*v)),
                    (false, None) => None,
                };
                let Some(condition) = condition else {
                    client
                        .cache_put(&tenant, ns, cache, key, value, ttl_ms)
                        .await?;
                    return Ok(());
                };
                let tenant = tenant.as_str();
                let (_, (applied, version)) = client
                    .on_owner(|c| {
                        let value = value.clone();
                        async move {
                            c.cache_put_if(tenant, ns, cache, key, value, ttl_ms, condition)
                                .await
                        }
                    })
                    .await?;
                if cli.json {
                    let _ = writeln!(
                        out,
                        "{}",
                        serde_json::json!({"key": key, "applied": applied, "version": version})
                    );
                } else if applied {
                    let _ = writeln!(out, "{}", version.unwrap_or_default());
                }
                if !applied {
                    return Err(Failure::NotApplied(match version {
                        Some(v) => format!("cache put {key:?}: not applied, its version is {v}"),
                        None => format!("cache put {key:?}: not applied, it has no value"),
                    }));
                }
            }
            CacheCmd::Delete {
                cache,
                key,
                if_version: Some(version),
            } => {
                let tenant = tenant.as_str();
                let (_, applied) = client
                    .on_owner(|c| async move {
                        c.cache_delete_if(tenant, ns, cache, key, *version).await
                    })
                    .await?;
                if cli.json {
                    let _ = writeln!(
                        out,
                        "{}",
                        serde_json::json!({"key": key, "applied": applied})
                    );
                }
                if !applied {
                    return Err(Failure::NotApplied(format!(
                        "cache delete {key:?}: not applied, its version is not {version}"
                    )));
                }
            }
            CacheCmd::Delete {
                cache,
                key,
                if_version: None,
            } => {
                if let Some(v) = client.cache_delete(&tenant, ns, cache, key).await? {
                    shown(cli.json, &mut out, &v, serde_json::json!({"key": key}))?;
                }
            }
            CacheCmd::Watch {
                cache,
                key,
                prefix,
                shard,
                from,
                retained,
                count,
            } => {
                let filter = match (key, prefix) {
                    (Some(k), _) => CacheWatchFilter::Key(k.clone()),
                    (None, Some(p)) => CacheWatchFilter::Prefix {
                        prefix: p.clone(),
                        shard: *shard,
                    },
                    (None, None) => unreachable!("clap requires --key or --prefix"),
                };
                let (tenant, filter) = (tenant.as_str(), &filter);
                let mut start = match (from, retained) {
                    (Some(o), _) => CacheWatchStart::Offset(*o),
                    (None, true) => CacheWatchStart::Retained,
                    (None, false) => CacheWatchStart::Now,
                };
                let (mut seen, mut follows) = (0u64, 0u32);
                // Watched again where the last watch ended: at the shard's new owner
                // after a move, from where the broker says after a lag.
                'watch: while count.is_none_or(|c| seen < c) {
                    let started = client
                        .on_owner(|c| async move {
                            c.watch_cache(tenant, ns, cache, filter, start).await
                        })
                        .await;
                    let mut watch = match started {
                        Ok((_, w)) => w,
                        // Watching again while the new owner takes the shard over, or
                        // through a route not yet updated: tried again, within bounds.
                        Err(e)
                            if follows > 0
                                && !e.is_credential_failure()
                                && !matches!(e, ClientError::Config(_)) =>
                        {
                            eprintln!("felix: watching again: {e}");
                            tokio::time::sleep(watch_again(&mut follows)?).await;
                            continue 'watch;
                        }
                        Err(e) => return Err(e.into()),
                    };
                    if follows > 0 && watch.resnapshotted() {
                        eprintln!(
                            "felix: the watch starts over from the current values ({})",
                            watch.retained_count().unwrap_or(0)
                        );
                    }
                    // Where a watch would go on from: past the current values, then
                    // past each live change shown.
                    let (mut next, mut current) =
                        (watch.live_offset(), watch.retained_count().unwrap_or(0));
                    while count.is_none_or(|c| seen < c) {
                        let resume = match watch.next_change().await {
                            Ok(Some(change)) => {
                                show_change(cli.json, &mut out, &change)
                                    .map_err(Failure::Output)?;
                                seen += 1;
                                follows = 0;
                                match current.checked_sub(1) {
                                    Some(left) => current = left,
                                    None => next = change.offset + 1,
                                }
                                continue;
                            }
                            Ok(None) => match watch.end() {
                                Some(crate::SubscriptionEnd::Moved {
                                    resume_from,
                                    node_id,
                                    ..
                                }) => {
                                    eprintln!(
                                        "felix: cache shard moved to {}; watching there",
                                        node_id.as_deref().unwrap_or("another broker")
                                    );
                                    resume_from.unwrap_or(next)
                                }
                                _ => {
                                    return Err(Failure::Client(ClientError::SubscriptionLost(
                                        format!("the broker ended the watch after {seen} changes"),
                                    )));
                                }
                            },
                            Err(ClientError::SubscriptionLagged { resume_from }) => {
                                eprintln!("felix: the watch lagged; watching from {resume_from}");
                                resume_from
                            }
                            Err(e) => return Err(e.into()),
                        };
                        tokio::time::sleep(watch_again(&mut follows)?).await;
                        // The current values came once.
                        start = CacheWatchStart::Offset(resume);
                        continue 'watch;
                    }
                }
            }
            CacheCmd::Add { cache, key, delta } => {
                let sum = client.counter_add(&tenant, ns, cache, key, *delta).await?;
                if cli.json {
                    let _ = writeln!(out, "{}", serde_json::json!({"key": key, "value": sum}));
                } else {
                    let _ = writeln!(out, "{sum}");
                }
            }
            CacheCmd::Counter { cache, key } => {
                let sum = client.counter_get(&tenant, ns, cache, key).await?;
                found(
                    (cli.json, &mut out),
                    serde_json::json!({"key": key, "value": sum}),
                    sum,
                    || not_found("cache counter", format!("counter {key:?} never written")),
                )?;
            }
        },
        Command::State { op } => match op {
            StateCmd::Commit {
                stream,
                entity,
                event,
                puts,
                deletes,
                expect_offset,
            } => {
                let mut changes = Vec::new();
                for p in puts {
                    let (key, value) = p
                        .split_once('=')
                        .filter(|(k, _)| !k.is_empty())
                        .ok_or_else(|| Failure::Usage(format!("--put {p:?}: KEY=VALUE")))?;
                    changes.push(StateChange::Put {
                        key: key.to_owned(),
                        value: Bytes::from(value.to_owned()),
                    });
                }
                changes.extend(
                    deletes
                        .iter()
                        .map(|k| StateChange::Delete { key: k.clone() }),
                );
                let offset = client
                    .commit(
                        &tenant,
                        ns,
                        stream,
                        entity,
                        Bytes::from(event.clone()),
                        changes,
                        *expect_offset,
                    )
                    .await?;
                if cli.json {
                    let _ = writeln!(out, "{}", serde_json::json!({"offset": offset}));
                } else {
                    let _ = writeln!(out, "{offset}");
                }
            }
            StateCmd::Get {
                stream,
                entity,
                key,
            } => {
                let (value, as_of) = client.state_get(&tenant, ns, stream, entity, key).await?;
                match value {
                    Some((v, version)) => shown(
                        cli.json,
                        &mut out,
                        &v,
                        serde_json::json!({"key": key, "version": version, "as_of": as_of}),
                    )?,
                    None => {
                        if cli.json {
                            let _ = writeln!(
                                out,
                                "{}",
                                serde_json::json!({"key": key, "payload": null, "as_of": as_of})
                            );
                        }
                        return Err(not_found("state get", format!("key {key:?} not found")));
                    }
                }
            }
        },
        Command::Read {
            stream,
            from,
            end,
            max,
            shard,
        } => {
            let tenant = tenant.as_str();
            // Page by page: a broker answers at most 10,000 records and about 4 MiB a
            // read (1,000 when no maximum is asked), and one read printed only its first
            // page and exited 0 (until 2026-12-08).
            let (mut at, mut left) = (*from, *max);
            loop {
                let want = left
                    .map(|l| l.min(READ_PAGE_RECORDS))
                    .or(Some(READ_PAGE_RECORDS));
                let (_, (records, next)) = client
                    .on_owner(|c| async move {
                        c.stream_read(tenant, ns, stream, *shard, at, *end, want)
                            .await
                    })
                    .await?;
                let taken = records.len() as u32;
                for r in records {
                    shown(
                        cli.json,
                        &mut out,
                        &r.payload,
                        serde_json::json!({"offset": r.offset.0, "shard": shard,
                            "timestamp_micros": r.timestamp_micros}),
                    )?;
                }
                left = left.map(|l| l.saturating_sub(taken));
                let done =
                    taken == 0 || next <= at || left == Some(0) || end.is_some_and(|e| next >= e);
                at = next;
                if done {
                    break;
                }
            }
            if cli.json {
                let _ = writeln!(out, "{}", serde_json::json!({"next_offset": at}));
            }
        }
        Command::OffsetAt {
            stream,
            micros,
            shard,
        } => {
            let tenant = tenant.as_str();
            let (_, offset) = client
                .on_owner(|c| async move {
                    c.offset_for_time(tenant, ns, stream, *shard, *micros).await
                })
                .await?;
            found(
                (cli.json, &mut out),
                serde_json::json!({"offset": offset}),
                offset,
                || {
                    not_found(
                        "offset at",
                        format!("nothing appended to shard {shard} at or after {micros}"),
                    )
                },
            )?;
        }
        Command::Group { op } => {
            // Only the shard's owner serves its groups: each request goes to the broker
            // a `not_leader` answer names (it failed "owned by ..." on any other).
            let at =
                |a: &GroupArgs| crate::GroupRef::new(&tenant, ns, &a.stream, a.shard, &a.group);
            match op {
                GroupCmd::Poll {
                    at: a,
                    max,
                    wait,
                    ack,
                    consumer,
                    reclaim,
                } => {
                    let g = at(a);
                    let options = crate::PollOptions {
                        max_records: *max,
                        wait: std::time::Duration::from_secs_f64(wait.clamp(0.0, 30.0)),
                        visibility: None,
                    };
                    let (c, records) = client
                        .on_owner(|c| {
                            let (g, consumer) = (g.clone(), consumer.clone());
                            async move {
                                match consumer {
                                    Some(name) => {
                                        c.group_poll_as(&g, options, &name, *reclaim).await
                                    }
                                    None => c.group_poll(&g, options).await,
                                }
                            }
                        })
                        .await?;
                    for r in records {
                        // Acked only once shown: a record that could not be written
                        // out stays claimed, and is delivered again once its claim
                        // lapses.
                        shown(
                            cli.json,
                            &mut out,
                            &r.payload,
                            serde_json::json!({
                                "offset": r.offset.0,
                                "attempts": r.attempts,
                                "skipped_before": r.skipped_before,
                            }),
                        )?;
                        if *ack {
                            c.group_ack(&g, r.offset.0).await?;
                        }
                    }
                }
                GroupCmd::Ack { at: a, offsets } => {
                    let g = &at(a);
                    for o in offsets {
                        client
                            .on_owner(|c| async move { c.group_ack(g, *o).await })
                            .await?;
                    }
                }
                GroupCmd::DeadLetters { at: a } => {
                    let g = &at(a);
                    let (_, dead) = client
                        .on_owner(|c| async move { c.group_dead_letters(g).await })
                        .await?;
                    for o in dead {
                        let _ = writeln!(out, "{o}");
                    }
                }
                GroupCmd::Redrive { at: a, offsets } => {
                    let g = &at(a);
                    for o in offsets {
                        client
                            .on_owner(|c| async move { c.group_redrive(g, *o).await })
                            .await?;
                    }
                }
                GroupCmd::Describe { at: a } => {
                    let g = &at(a);
                    let (_, i) = client
                        .on_owner(|c| async move { c.group_describe(g).await })
                        .await?;
                    let committed = i.committed.map_or("none".to_string(), |c| c.to_string());
                    if cli.json {
                        let _ = writeln!(
                            out,
                            "{}",
                            serde_json::json!({"committed": i.committed, "tail": i.tail,
                                "lag": i.lag(), "in_flight": i.in_flight, "owed": i.owed,
                                "dead_letters": i.dead_letters})
                        );
                    } else {
                        let _ = writeln!(
                            out,
                            "committed {committed}\ntail {}\nlag {}\nin_flight {}\nowed {}\ndead_letters {}",
                            i.tail,
                            i.lag(),
                            i.in_flight,
                            i.owed,
                            i.dead_letters
                        );
                    }
                }
            }
        }
        Command::Topology => {
            let brokers = client.client().topology().await?;
            for b in brokers {
                if cli.json {
                    let _ = writeln!(
                        out,
                        "{}",
                        serde_json::json!({"node_id": b.node_id, "addr": b.addr})
                    );
                } else {
                    let _ = writeln!(out, "{} {}", b.node_id, b.addr);
                }
            }
        }
        Command::Stream { .. }
        | Command::Shard { .. }
        | Command::Broker { .. }
        | Command::Pin { .. }
        | Command::Top { .. } => {
            unreachable!("handled before connecting")
        }
        Command::Shards { stream } => {
            let n = client.stream_shards(&tenant, ns, stream).await?;
            if cli.json {
                let _ = writeln!(
                    out,
                    "{}",
                    serde_json::json!({"stream": stream, "shards": n})
                );
            } else {
                let _ = writeln!(out, "{n}");
            }
        }
    }
    Ok(())
}

/// Parses the process arguments, runs the command and exits with its code.
pub fn main() {
    let cli = Cli::parse();
    let ops_http = |flag: &Option<String>| {
        flag.clone()
            .or_else(|| std::env::var("FELIX_BROKER_HTTP").ok())
            .unwrap_or_else(|| "127.0.0.1:9090".to_owned())
    };
    match &cli.command {
        Command::Pin { rule, http } => {
            std::process::exit(match crate::ops::pin(&ops_http(http), rule, cli.json) {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("felix: {e}");
                    e.code
                }
            })
        }
        Command::Top {
            http,
            interval,
            iterations,
        } => {
            let every = Duration::from_secs_f64(interval.clamp(0.1, 3600.0));
            std::process::exit(match crate::ops::top(&ops_http(http), every, *iterations) {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("felix: {e}");
                    e.code
                }
            })
        }
        _ => {}
    }
    if matches!(
        &cli.command,
        Command::Stream { .. } | Command::Shard { .. } | Command::Broker { .. }
    ) {
        std::process::exit(match run_controlplane(&cli) {
            Ok(()) => 0,
            Err(code) => code,
        });
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime starts");
    let code = match rt.block_on(run(cli)) {
        Ok(()) => 0,
        Err(Failure::Usage(m)) => {
            eprintln!("felix: {m}");
            2
        }
        Err(Failure::Client(e)) => {
            eprintln!("felix: {e}");
            exit_code(&e)
        }
        Err(Failure::Output(e)) => {
            eprintln!("felix: writing out: {e}");
            8
        }
        Err(Failure::NotApplied(m)) => {
            eprintln!("felix: {m}");
            9
        }
    };
    std::process::exit(code);
}
