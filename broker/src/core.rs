//! One core's broker: the shards it owns, its subscribers, and the cross-core messages
//! it sends and answers.
//!
//! A shard's state is touched only by its owning core. A session on another core asks
//! the owner through the mesh ([`CoreMsg`]), and the owner re-checks ownership when the
//! message arrives. Deliveries go the other way: after a commit, the owner encodes
//! nothing yet; it sends one shared [`Envelope`] to each core with subscribers, where it
//! is queued to each local subscriber and encoded once per wire format.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::future::poll_fn;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Poll, Waker};

use bytes::Bytes;
use felix_core_runtime::CoreId;
use felix_core_runtime::mesh::{Mesh, SendError};
use felix_core_runtime::placement::{Placement, ShardKey, ShardKind};
use felix_core_runtime::task;
use felix_storage_uring::{Appended, DmaBackend, LogConfig, ReadBatch, SegmentLog};
use felix_wire::message::{CursorErrorReason, StartPosition};
use futures_channel::oneshot;
use std::time::{Duration, Instant};

use crate::auth::TenantKeys;
use crate::catalog::{Catalog, CoreCatalog, Entry};
use crate::cluster::{Cluster, Resolved, Route};
use crate::error::BrokerError;
use crate::forward::Forwarder;
use crate::session::Limits;
use crate::session::dispatch::Directory;
use crate::shard::{CacheShard, Envelope, StreamShard};
use arc_swap::ArcSwap;
use felix_core_runtime::clock;

/// How long a group request waits for the log to be committed past a group write whose
/// outcome was unknown before the groups are built again; past it, `not_ready`
/// (retryable).
const GROUPS_SETTLE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Deliveries queued for one peer core beyond the mesh channel; more are dropped (the
/// subscribers on that core see an offset gap).
const OUTBOUND_MAX: usize = 4096;
/// Requests one core may have outstanding at another; more are refused `overloaded`
/// before anything is sent, so nothing is appended and the client may retry. Answers
/// are bounded by the requests that asked for them.
pub const CROSS_CORE_REQUESTS_MAX: usize = 8192;

/// A stream shard's retention bounds, the floor no removal passes, and its replica
/// (see `CoreBroker::retention_due`).
type RetentionDue = (
    crate::catalog::Retention,
    u64,
    Option<Rc<crate::replication::replica::ReplicaShard>>,
);

/// Stream shards of a core whose retention runs at once (each in a task of its own, so
/// one waiting for a majority holds up no other; bounded, since each may copy state).
const RETENTION_SHARDS_AT_ONCE: usize = 16;

/// Group polls one core may have waiting for records at another, within
/// `CROSS_CORE_REQUESTS_MAX`: a quarter, so long polls (of any number of clients) always
/// leave the other requests most of the slots. Past it a poll answers at once.
pub const CROSS_CORE_POLLS_WAITING_MAX: usize = CROSS_CORE_REQUESTS_MAX / 4;
/// Expired values one cache shard deletes per housekeeping round (the reference's
/// bound: 1,024 a shard a pass).
const EXPIRE_BATCH: usize = 1024;

/// A cache operation.
#[derive(Debug)]
pub enum CacheOp {
    /// Read a key.
    Get(String),
    /// Write a key with an optional TTL (ms).
    Put(String, Bytes, Option<u64>),
    /// Remove a key.
    Delete(String),
    /// Write a key only if the condition holds.
    PutIf(
        String,
        Bytes,
        Option<u64>,
        felix_wire::message::CacheCondition,
    ),
    /// Remove a key only if its version is this.
    DeleteIf(String, u64),
    /// Add a signed delta to a counter.
    CounterAdd(String, i64),
    /// Read a counter.
    CounterGet(String),
    /// Write a delete of a key whose value at this version expired (the leader's
    /// housekeeping; nothing is written when the key was written again since).
    Expire(String, u64),
}

/// A cache answer.
#[derive(Debug)]
pub enum CacheAnswer {
    /// A value (or none) and its version.
    Value(Option<Bytes>, Option<u64>),
    /// A put's version.
    Written(u64),
    /// A counter's sum (`None`: never written).
    Counter(Option<i64>),
    /// A conditional write: applied or not, and the version (the new one when applied,
    /// the current one when not).
    Condition(bool, Option<u64>),
}

/// An atomic commit on its way to the log: the encoded record and the tail it expects
/// (if any). The shard's state reads it back from the log once it is visible.
#[derive(Debug)]
pub struct CommitWrite {
    /// The commit record ([`crate::state::encode`]).
    pub record: Bytes,
    /// Write only if the shard's next offset is this.
    pub expected: Option<u64>,
}

/// A cache watch's request to the core that owns the cache shard.
#[derive(Debug)]
pub enum WatchReq {
    /// Where a new watch starts: `from` (an offset), or now; with `retained`, the
    /// current values first.
    Start {
        /// Keys followed.
        filter: crate::shard::WatchFilter,
        /// Resume offset.
        from: Option<u64>,
        /// Current values first.
        retained: bool,
    },
    /// Changes from `from`, waiting up to `wait` for one.
    Next {
        /// Keys followed.
        filter: crate::shard::WatchFilter,
        /// Resume offset.
        from: u64,
        /// Longest wait.
        wait: std::time::Duration,
    },
}

/// The owner's answer to a [`WatchReq`].
#[derive(Debug)]
pub enum WatchAnswer {
    /// Current values to deliver first (retained, or a resnapshot), and where changes
    /// continue.
    Started {
        /// Values.
        values: Vec<crate::shard::WatchChange>,
        /// What the values are charged against the process's bound on copies held
        /// (`shard::snapshots`), given back as the watcher takes them.
        charge: crate::shard::snapshots::SnapshotCharge,
        /// Where the watch continues.
        resume: u64,
        /// The offset asked for is gone: the values restate the state.
        resnapshot: bool,
        /// The life of the cache log it was read from (`CacheShard::life`).
        life: u64,
    },
    /// Changes, where the next read starts, and the life of the log they were read
    /// from.
    Changes(Vec<crate::shard::WatchChange>, u64, u64),
}

/// The condition a publish is written under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteIf {
    /// An idempotent producer's batch `(producer_id, sequence)`: written once.
    Idempotent(u64, u64),
    /// Only if the shard's next offset is this (`publish_if`); else refused
    /// `offset_mismatch` with the tail, nothing written.
    Tail(u64),
}

/// A write that is not a plain publish.
#[derive(Debug)]
pub enum Special {
    /// An atomic commit.
    Commit(CommitWrite),
    /// Consumer-group events (a `Group` batch: replicated with the shard, never fanned
    /// out to readers).
    Group,
    /// Copies of state entries carried past retention (a `State` batch: replicated with
    /// the shard, never fanned out to readers).
    State,
    /// A publish written only if the shard's next offset is this (a plain data batch).
    Tail(u64),
}

/// A state request, for the core that owns the stream shard.
#[derive(Debug)]
pub enum StateOp {
    /// Commit an event and changes.
    Commit {
        /// The event readers see.
        event: Bytes,
        /// The write.
        write: CommitWrite,
    },
    /// Read one key.
    Get(String),
}

/// A state answer.
#[derive(Debug)]
pub enum StateAnswer {
    /// The commit's offset.
    Committed(u64),
    /// A value and its version, as of an offset.
    Value(Option<(Bytes, u64)>, u64),
}

/// Messages between cores. Each says what dropping it (the owner core gone) means.
#[derive(Debug)]
pub enum CoreMsg {
    /// Append to a stream shard the receiver owns. Dropped: the publisher's wait fails
    /// and it is answered `unacknowledged` (outcome unknown).
    Append {
        /// Shard.
        key: Arc<ShardKey>,
        /// Records (shared buffers from the client's frame).
        records: Vec<Bytes>,
        /// What it is written under, if anything.
        condition: Option<WriteIf>,
        /// When the connection's core sent it (the mesh-hop stage).
        sent: std::time::Instant,
        /// Where to answer.
        reply: ReplyTo,
    },
    /// Register a subscriber living on `core`. Dropped: the subscribe fails.
    Subscribe {
        /// Shard.
        key: Arc<ShardKey>,
        /// Requested start.
        start: Option<StartPosition>,
        /// The subscriber's core.
        core: CoreId,
        /// Where to answer with `(start, live)`.
        reply: ReplyTo,
    },
    /// One subscriber on `core` went away. Dropped: the owner keeps sending that core
    /// deliveries nobody reads (harmless, bounded by the outbound queue).
    Unsubscribe {
        /// Shard.
        key: Arc<ShardKey>,
        /// The subscriber's core.
        core: CoreId,
    },
    /// Read history. Dropped: the read fails and the subscription ends.
    Read {
        /// Shard.
        key: Arc<ShardKey>,
        /// First offset.
        from: u64,
        /// Byte budget.
        max_bytes: usize,
        /// Where to answer.
        reply: ReplyTo,
    },
    /// A committed batch for the receiver's subscribers. Dropped: they see a gap.
    Deliver {
        /// Shard.
        key: Arc<ShardKey>,
        /// The shared batch.
        envelope: Arc<Envelope>,
    },
    /// A cache operation on a cache shard the receiver owns. Dropped: the client gets
    /// `unacknowledged`.
    /// A consumer-group request for a stream shard this core owns.
    Group {
        /// The stream shard.
        key: Arc<ShardKey>,
        /// The request.
        op: crate::groups::GroupOp,
        /// Where the answer goes.
        reply: ReplyTo,
    },
    /// The request `asked` (a waiting group poll of `key`) was dropped by its asker (its
    /// client left): the poll ends and hands back what it claimed, its attempts not
    /// counted. It travels the request's way, in order behind it (held with it during a
    /// re-pin, passed on with it to a new owner). Dropped: the poll waits out its wait,
    /// and its claims their visibility, as before.
    GroupCancel {
        /// The stream shard.
        key: Arc<ShardKey>,
        /// The request.
        asked: ReplyTo,
    },
    /// A state request for a stream shard this core owns.
    State {
        /// The stream shard.
        key: Arc<ShardKey>,
        /// The request.
        op: StateOp,
        /// Where the answer goes.
        reply: ReplyTo,
    },
    /// A cache watch's request for a cache shard this core owns.
    Watch {
        /// The cache shard.
        key: Arc<ShardKey>,
        /// The request.
        req: WatchReq,
        /// Where the answer goes.
        reply: ReplyTo,
    },
    Cache {
        /// Shard.
        key: Arc<ShardKey>,
        /// What to do.
        op: CacheOp,
        /// Where to answer.
        reply: ReplyTo,
    },
    /// A replication frame from a peer broker, for a shard this core owns (or answering
    /// a request it sent). Dropped: the sender resends after its timeout.
    Peer {
        /// The peer.
        from: crate::replication::machine::NodeId,
        /// The frame.
        msg: felix_wire::internal::InternalMessage,
    },
    /// A step of a live re-pin (see `core/moves.rs`). Dropped: the re-pin fails.
    Move {
        /// The step.
        step: moves::MoveStep,
        /// Where to answer.
        reply: ReplyTo,
    },
    /// The shard `key` was closed until a restart at its owner with this core's
    /// subscribers registered (a re-pin's open there failed for good): they end with
    /// an error. Never dropped.
    SubscribersEnd {
        /// Shard.
        key: Arc<ShardKey>,
    },
    /// The answer to a request this core sent. Dropped: the request's wait fails.
    Reply {
        /// The request.
        id: u64,
        /// The answer.
        body: ReplyBody,
    },
}

/// Where a cross-core request is answered: the asking core and its request id.
/// Answers travel back over the mesh, like requests.
#[derive(Debug, Clone, Copy)]
pub struct ReplyTo {
    /// The asking core.
    pub core: CoreId,
    /// Its request id.
    pub id: u64,
}

/// Bytes a core's connections make it hold, with the handle that closes one.
pub(crate) type HeldByConnections = crate::session::held::HeldBytes<
    felix_core_runtime::quic::ConnId,
    felix_core_runtime::quic::Connection,
>;

/// How long a poll whose wait was cut (`CROSS_CORE_POLLS_WAITING_MAX`, a connection's
/// `waiting_polls_per_connection`) and found nothing pauses before it answers, holding
/// no request slot: its consumer polls again a few times a second, not in a busy loop.
pub const CUT_POLL_PAUSE: Duration = Duration::from_millis(250);

/// Pauses an empty answer to a poll that asked to wait `asked_ms` and was cut to 0.
pub async fn pause_cut_poll(
    asked_ms: u64,
    answer: &Result<crate::groups::GroupAnswer, BrokerError>,
) {
    if let Ok(crate::groups::GroupAnswer::Records(r)) = answer
        && r.is_empty()
    {
        task::sleep(Duration::from_millis(asked_ms).min(CUT_POLL_PAUSE)).await;
    }
}

/// Whether `op` is a group poll that may wait (one its asker may cancel).
fn waiting_poll(op: &crate::groups::GroupOp) -> bool {
    matches!(op, crate::groups::GroupOp::Poll { wait_ms, .. } if *wait_ms > 0)
}

/// A waiting group poll this core asked another for, cancelled there when dropped
/// before its answer came (its client left): otherwise the owner went on waiting, claimed
/// what came, counted an attempt and answered nobody, and the records waited out their
/// visibility (after the attempt limit, dead letters never delivered).
struct CancelPoll {
    core: Rc<CoreBroker>,
    owner: CoreId,
    key: Arc<ShardKey>,
    /// The request, while its answer has not come.
    asked: Option<ReplyTo>,
}

impl Drop for CancelPoll {
    fn drop(&mut self) {
        if let Some(asked) = self.asked.take() {
            let key = self.key.clone();
            self.core
                .send_ordered(self.owner, CoreMsg::GroupCancel { key, asked }, false);
        }
    }
}

/// A request this core sent and awaits the answer to.
struct Pending {
    owner: CoreId,
    /// A long poll counted among `owner`'s waiting polls: its shard (for the tenant).
    waits: Option<Arc<ShardKey>>,
    answer: oneshot::Sender<ReplyBody>,
}

/// A cross-core answer.
#[derive(Debug)]
pub enum ReplyBody {
    /// To `Append`.
    Append(Result<Appended, BrokerError>),
    /// To `Subscribe`: `(start, live)`.
    Subscribe(Result<(u64, u64), BrokerError>),
    /// To `Read`.
    Read(Result<Vec<ReadBatch>, BrokerError>),
    /// To `Cache`.
    Cache(Result<CacheAnswer, BrokerError>),
    /// To `Group`.
    Group(Result<crate::groups::GroupAnswer, BrokerError>),
    /// To `State`.
    State(Result<StateAnswer, BrokerError>),
    /// To `Watch`.
    Watch(Result<WatchAnswer, BrokerError>),
    /// To `Move`.
    Move(Result<moves::MoveAnswer, BrokerError>),
}

/// Per-core counters for `/metrics`.
#[derive(Debug, Default)]
pub struct CoreMetrics {
    /// From a publish read off its stream to its acknowledgement being ready
    /// (appended, replicated as the stream asks, lease checked; forwarding excluded).
    pub publish_ack: crate::histogram::Histogram,
    /// From a batch's offsets being claimed on the shard's core to its commit (the
    /// device write and fdatasync under `fsync: on-commit`).
    pub append_commit: crate::histogram::Histogram,
    /// From a publish leaving the connection's core to the shard's core taking it up
    /// (only publishes that cross cores).
    pub mesh_hop: crate::histogram::Histogram,
    /// One flush round's device writes, this core's logs.
    pub log_write: crate::histogram::Histogram,
    /// One fdatasync, this core's logs (a group commit covers a round).
    pub log_fsync: crate::histogram::Histogram,
    /// From an answer (or a delivery) written to a client connection's stream to the
    /// first datagram of that connection handed to the kernel after it.
    pub answer_send: crate::histogram::Histogram,
    /// Publish batches appended.
    pub publish_batches: AtomicU64,
    /// Records appended.
    pub publish_records: AtomicU64,
    /// Payload bytes appended.
    pub publish_bytes: AtomicU64,
    /// Publishes refused or failed.
    pub publish_errors: AtomicU64,
    /// Batches handed to subscriber queues.
    pub events_queued: AtomicU64,
    /// Batches dropped because a subscriber queue was full.
    pub events_dropped: AtomicU64,
    /// Live subscriptions on this core.
    pub subscriptions: AtomicU64,
    /// Open client connections on this core.
    pub connections: AtomicU64,
    /// Connections closed because a token they authenticated with was revoked.
    pub revoked_connections: AtomicU64,
    /// Cache operations.
    pub cache_ops: AtomicU64,
    /// Consumer-group requests.
    pub group_ops: AtomicU64,
    /// Group snapshots written.
    pub group_snapshots: AtomicU64,
    /// Builds of a shard's groups from its log.
    pub group_folds: AtomicU64,
    /// Of them, builds that started from a snapshot.
    pub group_folds_from_snapshot: AtomicU64,
    /// Record bytes those builds read.
    pub group_fold_bytes: AtomicU64,
    /// Cache compactions done.
    pub cache_compactions: AtomicU64,
    /// Subscriptions ended with `subscription_lagged` (retention removed what they had
    /// not read).
    pub subscriptions_lagged: AtomicU64,
    /// Expired cache values deleted by housekeeping.
    pub cache_expired: AtomicU64,
    /// Subscriptions ended because their shard moved to another broker.
    pub subscriptions_moved: AtomicU64,
    /// Idempotent re-sends answered from the log instead of appended again.
    pub idempotent_duplicates: AtomicU64,
    /// Producer tables saved as snapshots beside their shard's log.
    pub producer_snapshots_saved: AtomicU64,
    /// Producer tables built from a snapshot (then the log after it) rather than from
    /// the log's base.
    pub producer_tables_from_snapshot: AtomicU64,
    /// Cache watch reads answered from the log rather than the cache's recent changes
    /// (a watcher catching up from behind them).
    pub cache_watch_log_reads: AtomicU64,
    /// Record bytes read from logs to build producer tables: a leader's before its first
    /// idempotent publish, a follower's to save its table.
    pub producer_table_read_bytes: AtomicU64,
    /// Cross-core messages sent.
    pub mesh_sent: AtomicU64,
    /// Shards open on this core.
    pub shards_open: AtomicU64,
    /// Requests forwarded to the broker that leads their shard.
    pub forwarded: AtomicU64,
    /// Times a subscriber's overflowed queue was made up by reading the log.
    pub subscriber_catchups: AtomicU64,
    /// Deliveries to this core that another core dropped (its outbound queue was full);
    /// this core's subscribers then check the log for what they missed.
    pub deliveries_lost_inbound: AtomicU64,
    /// fdatasync calls by this core's open stream logs (sampled every 250 ms).
    pub log_syncs: AtomicU64,
    /// Batches those syncs made durable: `/ log_syncs` is appends per flush.
    pub log_synced_batches: AtomicU64,
    /// Zeros those logs wrote ahead of their data (`zero_ahead_bytes`).
    pub log_zero_ahead_bytes: AtomicU64,
    /// Of `log_syncs`, the durable (O_DSYNC) writes of data (`dsync_writes`).
    pub log_dsync_writes: AtomicU64,
    /// Live batches a subscriber refused because they belonged to another shard (a bug
    /// caught, never a record sent to the wrong subscriber).
    pub foreign_batches: AtomicU64,
    /// Cross-core requests refused because the destination core had too many
    /// outstanding from this one.
    pub cross_core_refused: AtomicU64,
    /// Cross-core requests outstanding from this core (all destinations).
    pub cross_core_outstanding: AtomicU64,
    /// Connections closed for holding too many bytes of unfinished frames.
    pub unfinished_closed: AtomicU64,
    /// Connections closed for leaving too many bytes of answers unread.
    pub unwritten_closed: AtomicU64,
    /// Group polls answered at once instead of waiting, past their connection's
    /// allowance or the waiting polls one core may hold at another.
    pub poll_waits_cut: AtomicU64,
    /// Request bytes in flight on this core, all connections together.
    pub request_bytes_in_flight: AtomicU64,
    /// Open logs poisoned by a failed write or fsync (sampled).
    pub poisoned_logs: AtomicU64,
    /// When an append on this core last failed for lack of disk space (`mono_ms` + 1),
    /// 0 once one succeeded since: see [`CoreMetrics::disk_full_now`].
    pub disk_full: AtomicU64,
    /// Appends refused for lack of disk space.
    pub disk_full_refusals: AtomicU64,
    /// 1 while this core serves; 0 before it starts and after it stops.
    pub alive: AtomicU64,
    /// Records removed by retention.
    pub retention_segments_removed: AtomicU64,
    /// State entries copied to the tail ahead of retention.
    pub state_copies: AtomicU64,
    /// Records shipped to followers.
    pub replication_shipped: AtomicU64,
    /// Records stored as a follower.
    pub replicated: AtomicU64,
    /// Records led shards (Leader consistency) hold that their slowest follower does
    /// not: what a failover now could lose.
    pub replication_lag_records: AtomicU64,
    /// Followers halted (they would have to cut committed records).
    pub replication_halted: AtomicU64,
    /// Copies of replicated shards removed after this broker left their set.
    pub replicas_left: AtomicU64,
    /// Copies this core's replicas are rebuilding (found damaged, started over).
    pub replicas_rebuilding: AtomicU64,
    /// Bytes this core's subscriber queues hold together (sampled each housekeeping
    /// round; bounded by [`SUB_QUEUES_BYTES_PER_CORE`]).
    pub subscriber_queue_bytes: AtomicU64,
    /// Quorum publishes answered outcome-unknown (no majority in time, or leadership
    /// changed first).
    pub quorum_unknown: AtomicU64,
    /// Writes refused because this broker's lease had run out.
    pub lease_refusals: AtomicU64,
    /// Requests held while their shard moved to this core (a live re-pin).
    pub requests_held: AtomicU64,
    /// Requests refused rather than held: this core held `HELD_MAX` already.
    pub requests_held_refused: AtomicU64,
    /// Publishes held while this broker took their replicated shard over.
    pub takeover_held: AtomicU64,
    /// Requests sent here under an older placement, passed on to the owning core.
    pub requests_passed_on: AtomicU64,
    /// Shards moved to this core by live re-pins.
    pub shards_moved_in: AtomicU64,
    /// Automatic re-pins this core applied (load following; the coordinator's only).
    pub follow_moves: AtomicU64,
    /// CPU time this core's thread has used, nanoseconds (sampled every 250 ms).
    pub cpu_ns: AtomicU64,
    /// Batches waiting in this core's subscriber queues (sampled).
    pub subscriber_queued: AtomicU64,
    /// This core's open shards and where their logs end (sampled, for `/cores`).
    pub shards: std::sync::Mutex<Vec<ShardSample>>,
}

/// How long a refusal for lack of disk space keeps a core "disk full" with no append
/// succeeding after it: the flag was cleared only by a later append on that core, so a
/// core whose full shard was deleted or moved away, or that nobody wrote to again once
/// `/readyz` said 503 and a balancer took the broker out, stayed unready until a
/// restart (until 2026-12-08). A core whose disk is still full is refused again at
/// the next append, and says so again.
pub const DISK_FULL_FRESH_MS: u64 = 5_000;

impl CoreMetrics {
    /// Whether an append on this core failed for lack of disk space in the last
    /// [`DISK_FULL_FRESH_MS`], with none succeeding since.
    pub fn disk_full_now(&self) -> bool {
        let at = self.disk_full.load(Ordering::Relaxed);
        at > 0 && (crate::groups::mono_ms() + 1).saturating_sub(at) < DISK_FULL_FRESH_MS
    }
}

/// Counters summed over a core's stream logs (see [`CoreMetrics::log_syncs`]).
#[derive(Debug, Clone, Copy, Default)]
struct LogTotals {
    syncs: u64,
    synced_batches: u64,
    zero_ahead_bytes: u64,
    dsync_writes: u64,
}

impl LogTotals {
    /// These totals and what a log counted since `before`.
    fn plus(
        self,
        now: &felix_storage_uring::LogStats,
        before: &felix_storage_uring::LogStats,
    ) -> Self {
        Self {
            syncs: self.syncs + now.syncs.saturating_sub(before.syncs),
            synced_batches: self.synced_batches
                + now.synced_batches.saturating_sub(before.synced_batches),
            zero_ahead_bytes: self.zero_ahead_bytes
                + now.zero_ahead_bytes.saturating_sub(before.zero_ahead_bytes),
            dsync_writes: self.dsync_writes + now.dsync_writes.saturating_sub(before.dsync_writes),
        }
    }
}

/// One open shard as last sampled by its core.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ShardSample {
    /// `stream:tenant/namespace/name/shard` or `cache:…`.
    pub shard: String,
    /// Where its log ends (records and markers written so far).
    pub end: u64,
    /// Cores with subscribers to it.
    pub subscriber_cores: usize,
}

/// What every core shares (read-mostly).
#[derive(Debug)]
pub struct Shared {
    /// Where shard logs live.
    pub data_dir: PathBuf,
    /// Log settings for new shards.
    pub log_config: LogConfig,
    /// Streams and caches.
    pub catalog: Arc<Catalog>,
    /// Shard-to-core placement.
    pub placement: Arc<Placement>,
    /// Token verification keys (swapped whole when the control plane's JWKS change).
    pub keys: Arc<ArcSwap<TenantKeys>>,
    /// Control-plane membership and routes; `None` for a standalone broker.
    pub cluster: Option<Arc<Cluster>>,
    /// This broker's node id.
    pub node_id: String,
    /// The client address a standalone broker answers `topology` with (`None` when it
    /// listens on an unspecified address).
    pub client_addr: Option<std::net::SocketAddr>,
    /// Acked publishes a stream may have unanswered.
    pub publish_window: u32,
    /// The receive window a client connection gets once it authenticated (until then
    /// `felix_core_runtime::quic::UNTRUSTED_WINDOW_BYTES`).
    pub connection_window_bytes: u32,
    /// The streams a client connection may open each way once it authenticated (until
    /// then `felix_core_runtime::quic::UNTRUSTED_STREAMS`).
    pub max_streams: u32,
    /// Consumer-group bounds.
    pub group_limits: crate::groups::tracker::Limits,
    /// Cache compaction threshold (writes).
    pub cache_compact_after: u64,
    /// Log bytes between saves of a shard's idempotent-producer table.
    pub producer_snapshot_bytes: u64,
    /// Subscriber queue capacity (batches).
    pub subscriber_queue: usize,
    /// Max frame payload after auth.
    pub max_frame_bytes: u32,
    /// Deliberate bugs (checker mutant runs only).
    pub mutants: crate::config::Mutants,
    /// Per-connection bounds.
    pub limits: Limits,
    /// How often each core enforces retention and finishes deletions.
    pub housekeeping_interval: Duration,
    /// Damaged replica copies kept under `damaged-copies/` (`core/damaged.rs`).
    pub damaged_copies_kept: usize,
    /// Entries of `damaged-copies/` some core is building or exchanging right now:
    /// pruning never deletes them.
    pub damaged_in_flight: std::sync::Mutex<std::collections::HashSet<String>>,
    /// Per-core metrics, in core order.
    pub metrics: Vec<Arc<CoreMetrics>>,
    /// Set once every core is serving.
    pub ready: std::sync::atomic::AtomicBool,
    /// Set when the broker begins to stop (its cores take no new work): `/readyz` says
    /// so, as it does while a cluster broker drains.
    pub stopping: std::sync::atomic::AtomicBool,
    /// Storage faults armed over HTTP, when fault injection is on.
    pub faults: Option<Arc<felix_storage_uring::StorageFaults>>,
    /// With fault injection on: the core (index) whose next housekeeping tick panics,
    /// or -1. Tests that a dead core takes the process down.
    pub panic_core: std::sync::atomic::AtomicI64,
    /// With fault injection on: cores do not look at the assignments for their replicas
    /// (none is opened, stopped or handed a new generation) while set. Tests the window
    /// in which a broker is named leader before its core has attached the replica.
    pub replica_sync_paused: std::sync::atomic::AtomicBool,
    /// With fault injection on: a shard's log, once opened, is not handed to the
    /// requests waiting for it while set. Tests a re-pin that starts while a shard's
    /// first open is under way.
    pub opens_held: std::sync::atomic::AtomicBool,
    /// Operators' re-pins, from the HTTP thread to the core that applies them.
    pub repins: futures_channel::mpsc::UnboundedSender<moves::RepinJob>,
    /// The receiving end, taken by the first core to start.
    pub repin_jobs:
        std::sync::Mutex<Option<futures_channel::mpsc::UnboundedReceiver<moves::RepinJob>>>,
    /// Move unpinned shards to the core their requests arrive on (`core/follow.rs`).
    pub follow_load: bool,
    /// Each core's request counts per shard since its last report, for load following.
    pub load_reports: std::sync::Mutex<Vec<follow::LoadReport>>,
    /// The rules load following added (the others are operators'), newest first.
    pub auto_pins: std::sync::Mutex<Vec<felix_core_runtime::placement::PinRule>>,
    /// The current values starting cache watches hold, bounded for the process.
    pub watch_snapshots: Arc<crate::shard::snapshots::SnapshotBudget>,
}

#[path = "core/carry.rs"]
mod carry;
#[path = "core/damaged.rs"]
mod damaged;
pub use damaged::{DAMAGED_DIR, count as count_damaged_copies, prune as prune_damaged_copies};
#[path = "core/follow.rs"]
pub mod follow;
#[path = "core/idempotent.rs"]
mod idempotent;
#[path = "core/left.rs"]
mod left;
mod polls;
pub use left::empty_trash as empty_left_copies_trash;
#[path = "core/moves.rs"]
pub mod moves;
#[path = "core/takeover.rs"]
mod takeover;

enum Slot<T> {
    Opening(Vec<Waker>),
    Ready(T),
    Failed(BrokerError),
}

/// Why a subscription's queue was closed: what its pump tells the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// The client unsubscribed: the stream is finished.
    Unsubscribed,
    /// The broker is shutting down: the stream is reset (`draining`), not finished, so
    /// the client takes it for a lost subscription and resumes elsewhere. Finished, it
    /// read as the broker ending the subscription for good.
    Draining,
    /// The stream was deleted: `stream_deleted`, then finished.
    Deleted,
    /// The shard was closed until a restart where it moved (its open failed for good):
    /// the stream is reset `shard_unavailable`, and a new subscription is refused with
    /// the open's error.
    Failed,
}

/// Bytes of records a subscriber's queue holds (past it, as past its count of batches,
/// new batches are dropped and read back from the log): the batches are shared with the
/// publishes they came from, and one subscriber that stopped reading held up to
/// `subscriber_queue` of them (512 batches of up to 16 MiB, 8 GiB) in memory.
pub const SUB_QUEUE_BYTES: usize = 32 << 20;

/// Bytes of records the subscriber queues of one core hold together (past it, new
/// batches are dropped from every queue of the core holding any, and read back from the
/// log). Each queue's own bound let one connection's 1,024 subscriptions that stopped
/// reading, each holding other batches, hold 32 GiB; the bound on unread answers counts
/// only the batch a pump is writing. A batch queued for several subscribers counts once
/// for each (so lagging subscribers of one busy stream read from the log sooner than
/// its memory needs); an empty queue always takes one.
pub const SUB_QUEUES_BYTES_PER_CORE: usize = 1 << 30;

/// A local subscriber's bounded queue of committed batches (overflow policy DropNew;
/// the pump reads dropped batches back from the log).
#[derive(Debug)]
pub struct SubQueue {
    queue: RefCell<VecDeque<Arc<Envelope>>>,
    capacity: usize,
    /// Bytes of records queued, bounded by [`SUB_QUEUE_BYTES`].
    bytes: Cell<usize>,
    /// Bytes the core's queues hold together, bounded by `SUB_QUEUES_BYTES_PER_CORE`
    /// (or less, for tests).
    core_bytes: Rc<QueuedBytes>,
    waker: RefCell<Option<Waker>>,
    /// Batches dropped because the queue was full.
    pub dropped: Cell<u64>,
    closed: Cell<Option<Ending>>,
}

/// What a core's subscriber queues hold together.
#[derive(Debug)]
pub struct QueuedBytes {
    held: Cell<usize>,
    max: usize,
}

impl QueuedBytes {
    /// A bound of `max` bytes.
    pub fn new(max: usize) -> Rc<QueuedBytes> {
        Rc::new(QueuedBytes {
            held: Cell::new(0),
            max,
        })
    }

    /// Bytes held now.
    pub fn held(&self) -> usize {
        self.held.get()
    }
}

impl SubQueue {
    fn new(capacity: usize, core_bytes: Rc<QueuedBytes>) -> SubQueue {
        SubQueue {
            queue: RefCell::default(),
            capacity,
            bytes: Cell::new(0),
            core_bytes,
            waker: RefCell::default(),
            dropped: Cell::new(0),
            closed: Cell::new(None),
        }
    }

    fn push(&self, env: Arc<Envelope>) -> bool {
        let accepted = {
            let mut q = self.queue.borrow_mut();
            let bytes = self.bytes.get() + env.bytes();
            let core_bytes = self.core_bytes.held.get() + env.bytes();
            // An empty queue takes a batch past either bound: a subscriber that keeps
            // up reads from memory however many others lag, and its pump, woken by
            // the batch, sees drops at once (an empty queue that dropped left it
            // waiting up to `GAP_CHECK` to read the batch back).
            if q.len() >= self.capacity
                || (bytes > SUB_QUEUE_BYTES || core_bytes > self.core_bytes.max) && !q.is_empty()
            {
                self.dropped.set(self.dropped.get() + 1);
                false
            } else {
                self.bytes.set(bytes);
                self.core_bytes.held.set(core_bytes);
                q.push_back(env);
                true
            }
        };
        if let Some(w) = self.waker.borrow_mut().take() {
            w.wake();
        }
        accepted
    }

    /// The next batch; `None` once closed.
    pub async fn next(&self) -> Option<Arc<Envelope>> {
        poll_fn(|cx| {
            if let Some(e) = self.queue.borrow_mut().pop_front() {
                self.taken(e.bytes());
                return Poll::Ready(Some(e));
            }
            if self.closed.get().is_some() {
                return Poll::Ready(None);
            }
            *self.waker.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        })
        .await
    }

    /// Batches queued.
    pub fn len(&self) -> usize {
        self.queue.borrow().len()
    }

    /// Whether none is queued.
    pub fn is_empty(&self) -> bool {
        self.queue.borrow().is_empty()
    }

    /// Every batch queued now, without waiting (up to `max`).
    pub fn take_ready(&self, max: usize, out: &mut Vec<Arc<Envelope>>) {
        let mut q = self.queue.borrow_mut();
        let n = q.len().min(max);
        for e in q.drain(..n) {
            self.taken(e.bytes());
            out.push(e);
        }
    }

    fn taken(&self, bytes: usize) {
        self.bytes.set(self.bytes.get() - bytes);
        self.core_bytes.held.set(self.core_bytes.held.get() - bytes);
    }

    /// Ends the subscription, for `why`. The first reason given stands.
    pub fn close(&self, why: Ending) {
        if self.closed.get().is_none() {
            self.closed.set(Some(why));
        }
        if let Some(w) = self.waker.borrow_mut().take() {
            w.wake();
        }
    }

    /// Why it was closed, once it was.
    pub fn ending(&self) -> Option<Ending> {
        self.closed.get()
    }
}

impl Drop for SubQueue {
    fn drop(&mut self) {
        // A subscription ending with batches queued gives their share back.
        let core = &self.core_bytes.held;
        core.set(core.get() - self.bytes.get());
    }
}

/// Deliveries waiting for room in the mesh channel to one peer core.
#[derive(Default)]
struct Outbound {
    queue: VecDeque<CoreMsg>,
    /// A drainer task owns the channel: new deliveries queue behind it.
    draining: bool,
}

/// The overload reason for an error worth retrying once the machine has room again
/// (out of file descriptors or memory), or `None`. A shard that failed to open for one
/// of these is not remembered as failed: the next request opens it again.
pub fn out_of_resources(e: &std::io::Error) -> Option<&'static str> {
    if felix_storage_uring::is_out_of_descriptors(e) {
        return Some("out_of_file_descriptors");
    }
    (e.raw_os_error() == Some(libc::ENOMEM)).then_some("out_of_memory")
}

/// One core's broker.
pub struct CoreBroker {
    /// This core's broker, for work begun where only a reference is at hand.
    me: std::rc::Weak<CoreBroker>,
    /// This core.
    pub core: CoreId,
    /// Shared state.
    pub shared: Arc<Shared>,
    /// Catalog cache.
    pub catalog: CoreCatalog,
    /// This core's metrics.
    pub metrics: Arc<CoreMetrics>,
    mesh: Mesh<CoreMsg>,
    streams: RefCell<HashMap<Arc<ShardKey>, Slot<Rc<StreamShard>>>>,
    caches: RefCell<HashMap<Arc<ShardKey>, Slot<Rc<CacheShard>>>>,
    subscribers: RefCell<HashMap<Arc<ShardKey>, Vec<Rc<SubQueue>>>>,
    outbound: Vec<RefCell<Outbound>>,
    pending: RefCell<HashMap<u64, Pending>>,
    /// Waiting group polls other cores asked this one for, by who asked (core, request
    /// id): a [`CoreMsg::GroupCancel`] of one ends it early.
    polls_asked: RefCell<HashMap<(CoreId, u64), oneshot::Sender<()>>>,
    /// Requests outstanding at each core, by core index.
    outstanding: Vec<Cell<usize>>,
    /// Of those, group polls waiting for records, by core index, shared by tenant.
    waiting_polls: Vec<RefCell<polls::PollShares>>,
    /// What this core's connections hold in begun, unfinished frames.
    pub(crate) unfinished: RefCell<HeldByConnections>,
    /// What this core's connections hold in answers QUIC has not taken yet.
    pub(crate) unwritten: RefCell<HeldByConnections>,
    /// Request bytes in flight on this core, every connection's together (each takes
    /// its connection's budget first), and the requests waiting for room.
    pub(crate) request_bytes: RefCell<crate::session::outbox::FifoBytes>,
    /// Bytes this core's subscriber queues hold together.
    pub(crate) sub_queued: Rc<QueuedBytes>,
    next_request: Cell<u64>,
    draining: Cell<bool>,
    /// Sends requests on to other brokers (cluster mode).
    pub forwarder: Option<Forwarder>,
    /// Replicas of the replicated shards this core owns (cluster mode with a
    /// broker-to-broker listener).
    pub replicas: Option<Rc<crate::replication::replica::Replicas>>,
    /// Woken when the verification keys change (a key retired, a token revoked):
    /// connections on this core check their grants again.
    pub keys_changed: crate::groups::Wakers,
    /// A live re-pin in progress: what moves to and from this core, requests held.
    moving: RefCell<Option<moves::MoveState>>,
    /// Re-pins begun on this core (see `finish_deletions`).
    moves_begun: Cell<u64>,
    /// Writes held while this broker takes their replicated shard over, per shard in
    /// arrival order (`core/takeover.rs`).
    takeover_held: RefCell<HashMap<Arc<ShardKey>, Vec<takeover::Held>>>,
    /// Counters of the stream logs closed on this core (a shard moved away): the
    /// sampled counters stay monotonic.
    closed_log_stats: Cell<LogTotals>,
    /// Shards just handed over by another core, to open without re-checking every batch.
    handed_over: RefCell<std::collections::HashSet<Arc<ShardKey>>>,
    /// Stream shards a live re-pin handed to this core whose logs would not open here
    /// for want of resources (out of descriptors or memory): what the old core handed
    /// over (subscriber cores, groups) waits here for the next open, or is handed on by
    /// the next re-pin (`core/moves.rs`).
    pending_takes: RefCell<HashMap<Arc<ShardKey>, moves::Handover>>,
    /// Requests accepted here for a shard this core has not handed them yet (waiting for
    /// its log to open, or about to ask for it), per shard: a re-pin's release waits for
    /// them as it waits for work holding the shard (`core/moves.rs`).
    awaiting_shard: Rc<RefCell<HashMap<Arc<ShardKey>, usize>>>,
    /// Idempotent publishes that arrived while their shard was not open here, in
    /// arrival order: one task per shard hands them to the shard's queue once it
    /// opens, and later publishes queue behind them (`core/idempotent.rs`).
    idempotent_opening: RefCell<HashMap<Arc<ShardKey>, crate::producers::Waiting>>,
    /// The bound on abandoned publishes in this core's idempotent queues, opening and
    /// open shards' together (`core/idempotent.rs`).
    idempotent_abandoned: crate::producers::AbandonedBound,
    /// Per shard since the last load report: small requests this core received for it
    /// and, for shards it owns, small deliveries it sent to each core (index = core).
    load: RefCell<HashMap<Arc<ShardKey>, Vec<u32>>>,
    /// Copies on disk of sets this broker was left out of while it was down, and since
    /// when (`core/left.rs`).
    left_copies: RefCell<left::LeftCopies>,
}

impl std::fmt::Debug for CoreBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CoreBroker")
            .field("core", &self.core)
            .finish()
    }
}

/// A log opened, or found damaged (why).
enum Opened {
    Log(SegmentLog<DmaBackend>),
    Damaged(BrokerError),
}

pub(crate) fn shard_dir(root: &std::path::Path, key: &ShardKey) -> PathBuf {
    let kind = match key.kind {
        ShardKind::Stream => "streams",
        ShardKind::Cache => "caches",
    };
    root.join(kind)
        .join(&key.tenant)
        .join(&key.namespace)
        .join(&key.name)
        .join(key.shard.to_string())
}

impl Directory for CoreBroker {
    fn stream(&self, t: &str, ns: &str, s: &str, create: bool) -> Result<Rc<Entry>, BrokerError> {
        self.catalog.stream(t, ns, s, create)
    }

    fn cache(&self, t: &str, ns: &str, c: &str, create: bool) -> Result<Rc<Entry>, BrokerError> {
        self.catalog.cache(t, ns, c, create)
    }

    fn resolve(&self, key: &ShardKey) -> Resolved {
        CoreBroker::resolve(self, key)
    }

    fn topology(&self) -> Vec<(String, String)> {
        match &self.shared.cluster {
            Some(c) => c.brokers(),
            // A standalone broker is the whole cluster: it answers with itself (when it
            // listens on an address a client can dial).
            None => self
                .shared
                .client_addr
                .map(|a| vec![(self.shared.node_id.clone(), a.to_string())])
                .unwrap_or_default(),
        }
    }

    fn owners(&self, kind: ShardKind, t: &str, ns: &str, name: &str) -> Vec<(u32, Route)> {
        match &self.shared.cluster {
            Some(c) => c.routes_of(kind, t, ns, name),
            None => Vec::new(),
        }
    }
}

/// Clears a shard's `Opening` slot, waking its waiters (one of them opens it again),
/// unless disarmed once the open's answer is in the slot.
struct OpenCleared<'a, T> {
    slots: &'a RefCell<HashMap<Arc<ShardKey>, Slot<Rc<T>>>>,
    key: &'a Arc<ShardKey>,
    armed: bool,
}

impl<T> Drop for OpenCleared<'_, T> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut slots = self.slots.borrow_mut();
        if matches!(slots.get(self.key), Some(Slot::Opening(_)))
            && let Some(Slot::Opening(waiters)) = slots.remove(self.key)
        {
            drop(slots);
            waiters.into_iter().for_each(Waker::wake);
        }
    }
}

/// Lets the next group build of a shard go ahead, unless disarmed: a build dropped
/// part way (its poll's client gone) left every later group request of the shard
/// waiting for good.
struct BuildingGroups<'a>(&'a StreamShard);

impl Drop for BuildingGroups<'_> {
    fn drop(&mut self) {
        self.0.building_groups.set(false);
    }
}

/// The shards of `slots` that are open (those opening or failed left out).
fn ready<T>(slots: &RefCell<HashMap<Arc<ShardKey>, Slot<Rc<T>>>>) -> Vec<Rc<T>> {
    slots
        .borrow()
        .values()
        .filter_map(|s| match s {
            Slot::Ready(s) => Some(s.clone()),
            _ => None,
        })
        .collect()
}
impl CoreBroker {
    /// Notes the core's request bytes in flight on its gauge.
    pub(crate) fn note_request_bytes(&self) {
        let used = self.request_bytes.borrow().used();
        self.metrics
            .request_bytes_in_flight
            .store(used as u64, Ordering::Relaxed);
    }

    /// Gives back `n` request bytes taken from the core's budget.
    pub(crate) fn release_request_bytes(&self, n: usize) {
        if n == 0 {
            return;
        }
        self.request_bytes.borrow_mut().release(n);
        self.note_request_bytes();
    }

    /// A core's broker over its connected mesh.
    pub fn new(
        core: CoreId,
        shared: Arc<Shared>,
        mesh: Mesh<CoreMsg>,
        forwarder: Option<Forwarder>,
        replicas: Option<Rc<crate::replication::replica::Replicas>>,
    ) -> Rc<CoreBroker> {
        let cores = mesh.cores();
        let unfinished = crate::session::held::HeldBytes::new(
            shared.limits.unfinished_frame_bytes_per_connection,
            shared.limits.unfinished_frame_bytes_per_core,
        );
        let unwritten = crate::session::held::HeldBytes::new(
            shared.limits.unwritten_answer_bytes_per_connection,
            shared.limits.unwritten_answer_bytes_per_core,
        );
        let request_bytes =
            crate::session::outbox::FifoBytes::new(shared.limits.inflight_request_bytes_per_core);
        Rc::new_cyclic(|me| CoreBroker {
            me: me.clone(),
            core,
            catalog: CoreCatalog::new(shared.catalog.clone()),
            metrics: shared.metrics[core.index()].clone(),
            shared,
            mesh,
            streams: RefCell::default(),
            caches: RefCell::default(),
            subscribers: RefCell::default(),
            outbound: (0..cores).map(|_| RefCell::default()).collect(),
            pending: RefCell::default(),
            polls_asked: RefCell::default(),
            outstanding: (0..cores).map(|_| Cell::new(0)).collect(),
            waiting_polls: (0..cores).map(|_| RefCell::default()).collect(),
            unfinished: RefCell::new(unfinished),
            unwritten: RefCell::new(unwritten),
            request_bytes: RefCell::new(request_bytes),
            sub_queued: QueuedBytes::new(SUB_QUEUES_BYTES_PER_CORE),
            next_request: Cell::new(1),
            draining: Cell::new(false),
            forwarder,
            replicas,
            keys_changed: crate::groups::Wakers::default(),
            moving: RefCell::default(),
            moves_begun: Cell::new(0),
            closed_log_stats: Cell::new(LogTotals::default()),
            takeover_held: RefCell::default(),
            left_copies: RefCell::default(),
            handed_over: RefCell::default(),
            pending_takes: RefCell::default(),
            awaiting_shard: Rc::default(),
            idempotent_opening: RefCell::default(),
            idempotent_abandoned: Default::default(),
            load: RefCell::default(),
        })
    }

    /// The core that owns `key`.
    pub fn owner(&self, key: &ShardKey) -> CoreId {
        self.shared.placement.core_for(key)
    }

    /// Where a request for `key` goes: here, another broker, or nowhere right now.
    /// A standalone broker serves everything itself.
    pub fn resolve(&self, key: &ShardKey) -> Resolved {
        match &self.shared.cluster {
            None => Resolved::Local,
            Some(c) => c.resolve(key),
        }
    }

    /// Whether this core serves `key`: it owns it, or it is moving away and not yet
    /// released.
    fn serves(&self, key: &ShardKey) -> bool {
        self.owner(key) == self.core || self.leaving(key)
    }

    /// Whether the broker is shutting down.
    pub fn draining(&self) -> bool {
        self.draining.get()
    }

    /// Whether new client connections are turned away: shutting down, or draining
    /// (the shards move to replicas; clients reconnect to another broker while the
    /// connections already open keep being served).
    pub fn refusing_connections(&self) -> bool {
        self.draining.get()
            || self
                .shared
                .cluster
                .as_ref()
                .is_some_and(|c| c.draining.load(Ordering::Relaxed))
    }

    /// Before a write to `key`'s stream or cache: if the name was created since the
    /// catalog was last written (by this request, on first use), writes the catalog, so
    /// the name is on disk before anything under it is. Names already written cost two
    /// atomic loads; nothing is written when this fails (out of room is `overloaded`).
    pub async fn catalog_written_for(&self, key: &ShardKey) -> Result<(), BrokerError> {
        let stream = key.kind == ShardKind::Stream;
        if self
            .catalog
            .shared()
            .unwritten(stream, &key.tenant, &key.namespace, &key.name)
        {
            self.persist_catalog().await?;
        }
        Ok(())
    }

    /// Writes the catalog from the core's blocking pool (never on the core thread).
    pub async fn persist_catalog(&self) -> Result<(), BrokerError> {
        let catalog = self.shared.catalog.clone();
        task::spawn_blocking(move || catalog.persist())
            .await
            .inspect_err(|e| tracing::error!(error = %e, "persisting the catalog"))
    }

    /// Sends a request on to the shard's leader (see [`crate::forward`]), authenticated
    /// with the client's own token.
    pub fn forward(
        self: &Rc<Self>,
        session: &crate::session::Session,
        route: &Route,
        request: Bytes,
        answered: bool,
    ) -> std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Option<felix_wire::Frame>, BrokerError>>>,
    > {
        let core = self.clone();
        let (grant, token) = (session.grant().clone(), session.token.clone());
        // The leader's answer is relayed as it comes: it must carry what this client
        // negotiated (a get's version).
        let features = session
            .features
            .intersection(crate::forward::RELAYED_FEATURES);
        let addr = route.addr;
        // Forwarded here already: sent on as such, and not again from there.
        let again = session.forwarded >= 1;
        self.metrics.forwarded.fetch_add(1, Ordering::Relaxed);
        Box::pin(async move {
            let (Some(f), Some(addr)) = (core.forwarder.as_ref(), addr) else {
                return Err(BrokerError::ShardUnavailable("owner_unavailable".into()));
            };
            f.call(addr, &grant, &token, features, request, answered, again)
                .await
        })
    }

    async fn open_log(&self, key: &ShardKey) -> Result<SegmentLog<DmaBackend>, BrokerError> {
        // A shard opens only while its stream exists: a request that raced a deletion
        // must not bring the deleted directory back.
        let stream = key.kind == ShardKind::Stream;
        let Some(spec) = self
            .shared
            .catalog
            .spec(stream, &key.tenant, &key.namespace, &key.name)
        else {
            return Err(BrokerError::NotFound(format!("{key} does not exist")));
        };
        let dir = shard_dir(&self.shared.data_dir, key);
        let rebuildable = spec.replicated() && self.replicas.is_some();
        match self.open_log_in(key, &dir, spec.replicated()).await? {
            Opened::Log(log) => Ok(log),
            Opened::Damaged(_) if rebuildable => {
                // Other copies hold what this one held: set it aside and rebuild it
                // from them (`damaged.rs`); open the empty copy in its place.
                self.set_damaged_copy_aside(key, &dir).await?;
                match self.open_log_in(key, &dir, true).await? {
                    Opened::Log(log) => Ok(log),
                    Opened::Damaged(e) => Err(e),
                }
            }
            Opened::Damaged(e) => {
                // Remembered by the shard's slot (`Slot::Failed`) until the broker
                // restarts or the stream is deleted: said once, here.
                tracing::error!(shard = %key, error = %e, "the shard's log is damaged and stays closed until a restart (felix-log repair --dry-run says what a repair would do)");
                Err(e)
            }
        }
    }

    async fn open_log_in(
        &self,
        key: &ShardKey,
        dir: &std::path::Path,
        replicated: bool,
    ) -> Result<Opened, BrokerError> {
        let backend = DmaBackend::open_dir_with_faults(dir, self.shared.faults.clone())
            .await
            .map_err(|e| match out_of_resources(&e) {
                Some(reason) => {
                    tracing::warn!(shard = %key, error = %e, "cannot open a shard now");
                    BrokerError::Overloaded(reason.into())
                }
                None => BrokerError::Storage(format!("{}: {e}", dir.display())),
            })?;
        let mut config = self.shared.log_config.clone();
        if self.handed_over.borrow_mut().remove(key) {
            // Closed and sealed by another core of this broker a moment ago (a live
            // re-pin): its sealed segments' indexes and tails are checked, not every
            // batch again (which a start after a crash does).
            config.verify_on_open = felix_storage_uring::VerifyOnOpen::Tail;
        }
        if replicated {
            // A leader ships what it reads back from its log, so a linger would delay
            // every follower (and a Quorum ack) by that much: write at once.
            config.write_linger = std::time::Duration::ZERO;
        }
        let (log, report) = match SegmentLog::open(backend, config).await {
            Ok(opened) => opened,
            Err(felix_storage_uring::StorageError::Io { source, op, file })
                if out_of_resources(&source).is_some() =>
            {
                tracing::warn!(shard = %key, %op, %file, error = %source, "cannot open a shard now");
                let reason = out_of_resources(&source).unwrap_or("out_of_resources");
                return Err(BrokerError::Overloaded(reason.into()));
            }
            Err(e @ felix_storage_uring::StorageError::Corrupt(_)) => {
                let e = BrokerError::Storage(format!("{}: {e}", dir.display()));
                return Ok(Opened::Damaged(e));
            }
            Err(e) => return Err(e.into()),
        };
        if report.truncated_bytes > 0 || report.discarded_segments > 0 {
            tracing::warn!(shard = %key, ?report, "recovered a torn tail");
        }
        if self.shared.mutants.reuse_offsets
            && let Some((last, _)) = log.last_batch()
        {
            // Deliberately broken (checker mutant runs only): the last batch's offsets
            // are handed out again.
            log.truncate_from(last).await?;
        }
        while self.shared.opens_held.load(Ordering::Relaxed) {
            task::sleep(Duration::from_millis(1)).await;
        }
        self.metrics.shards_open.fetch_add(1, Ordering::Relaxed);
        Ok(Opened::Log(log))
    }

    /// The stream shard `key`, opening (and recovering) it on first use. Only on the
    /// owning core.
    pub async fn stream_shard(&self, key: &Arc<ShardKey>) -> Result<Rc<StreamShard>, BrokerError> {
        self.shard_slot(
            &self.streams,
            key,
            || async {
                let log = match self.open_log(key).await {
                    Ok(log) => log,
                    Err(e) => {
                        if !matches!(e, BrokerError::Overloaded(_)) {
                            // Closed here until a restart (`Slot::Failed`), or deleted
                            // (`NotFound`, not kept in the slot): a handover passed on
                            // would let the next core serve it.
                            let h = self.pending_takes.borrow_mut().remove(key);
                            if let Some(h) = h.filter(|_| !matches!(e, BrokerError::NotFound(_))) {
                                self.end_subscribers(key, &h.interested);
                            }
                        }
                        return Err(e);
                    }
                };
                let s = Rc::new(StreamShard::new(key.clone(), log));
                // A re-pin's take that could not open the log left its handover here:
                // nothing has served the shard since, so it is still what the old core
                // left, and nothing serves the shard before it is applied.
                if let Some(h) = self.pending_takes.borrow_mut().remove(key) {
                    moves::adopt(&s, h);
                }
                Ok(s)
            },
            |s| async move {
                let _ = s.log.close().await;
            },
        )
        .await
    }

    /// The cache shard `key`, opening it (and replaying its log) on first use.
    pub async fn cache_shard(&self, key: &Arc<ShardKey>) -> Result<Rc<CacheShard>, BrokerError> {
        self.shard_slot(
            &self.caches,
            key,
            || async {
                let log = self.open_log(key).await?;
                CacheShard::open(key.clone(), log).await.map(Rc::new)
            },
            |c| async move {
                let _ = c.close().await;
            },
        )
        .await
    }

    /// The shard `key` of `slots`, opened by `open` on first use: one open at a time,
    /// later requests wait for it and share its answer. `close` undoes an open that
    /// finished after the shard moved to another core. A request that waited on an open
    /// that failed without leaving an answer behind (out of file descriptors, a re-pin)
    /// tries the open itself: it gets its own answer, not a bare "closed".
    async fn shard_slot<T, Open, Opened, Close, Closed>(
        &self,
        slots: &RefCell<HashMap<Arc<ShardKey>, Slot<Rc<T>>>>,
        key: &Arc<ShardKey>,
        open: Open,
        close: Close,
    ) -> Result<Rc<T>, BrokerError>
    where
        Open: Fn() -> Opened,
        Opened: std::future::Future<Output = Result<Rc<T>, BrokerError>>,
        Close: Fn(Rc<T>) -> Closed,
        Closed: std::future::Future<Output = ()>,
    {
        // Waiting for an open counts as work on the shard until it has its answer (taken
        // only then: an open shard is answered without touching the count).
        let mut awaiting = None;
        let moved = || BrokerError::ShardUnavailable(format!("{key} moved to another core"));
        let wake = |slot: Option<Slot<Rc<T>>>| {
            if let Some(Slot::Opening(waiters)) = slot {
                waiters.into_iter().for_each(Waker::wake);
            }
        };
        loop {
            if !self.serves(key) {
                return Err(moved());
            }
            let first = {
                let mut map = slots.borrow_mut();
                match map.get(key) {
                    Some(Slot::Ready(s)) => return Ok(s.clone()),
                    Some(Slot::Failed(e)) => return Err(e.clone()),
                    Some(Slot::Opening(_)) => false,
                    None => {
                        map.insert(key.clone(), Slot::Opening(Vec::new()));
                        true
                    }
                }
            };
            awaiting.get_or_insert_with(|| self.awaiting(key));
            if first {
                // Should this request be dropped before the open ends (its client gone),
                // the slot is cleared and its waiters try again: left opening, every
                // later request of the shard on this core waited for good.
                let mut cleared = OpenCleared {
                    slots,
                    key,
                    armed: true,
                };
                let opened = open().await;
                if !self.serves(key) {
                    // The table changed while it opened (a live re-pin): another core
                    // owns it now and may open it too. Close this copy, never serve it.
                    if let Ok(s) = opened {
                        close(s).await;
                        self.metrics.shards_open.fetch_sub(1, Ordering::Relaxed);
                    }
                    cleared.armed = false;
                    wake(slots.borrow_mut().remove(key));
                    return Err(moved());
                }
                cleared.armed = false;
                let mut map = slots.borrow_mut();
                match &opened {
                    Ok(s) => wake(map.insert(key.clone(), Slot::Ready(s.clone()))),
                    // Out of file descriptors or memory: the next request tries again.
                    // No such stream or cache (a request that raced its deletion): kept,
                    // it refused the one made again under the name until a restart.
                    Err(BrokerError::Overloaded(_) | BrokerError::NotFound(_)) => {
                        wake(map.remove(key))
                    }
                    Err(e) => wake(map.insert(key.clone(), Slot::Failed(e.clone()))),
                }
                return opened;
            }
            let shared = poll_fn(|cx| match slots.borrow_mut().get_mut(key) {
                Some(Slot::Ready(s)) => Poll::Ready(Some(Ok(s.clone()))),
                Some(Slot::Failed(e)) => Poll::Ready(Some(Err(e.clone()))),
                Some(Slot::Opening(w)) => {
                    w.push(cx.waker().clone());
                    Poll::Pending
                }
                None => Poll::Ready(None),
            })
            .await;
            if let Some(answer) = shared {
                return answer;
            }
        }
    }

    /// Sends a request to `owner` now (in call order, behind anything queued for that
    /// core) and returns the wait for its answer, which comes back over the mesh. Sending
    /// eagerly matters: a session queues many requests before it awaits the first.
    fn ask(
        self: &Rc<Self>,
        owner: CoreId,
        make: impl FnOnce(ReplyTo) -> CoreMsg,
    ) -> impl std::future::Future<Output = Result<ReplyBody, BrokerError>> + 'static {
        self.ask_bounded(owner, CROSS_CORE_REQUESTS_MAX, None, make)
    }

    /// As [`CoreBroker::ask`] for control messages (a re-pin's steps): never refused
    /// for load, so a shard can move while its core is saturated. They are few.
    fn ask_control(
        self: &Rc<Self>,
        owner: CoreId,
        make: impl FnOnce(ReplyTo) -> CoreMsg,
    ) -> impl std::future::Future<Output = Result<ReplyBody, BrokerError>> + 'static {
        self.ask_bounded(owner, usize::MAX, None, make)
    }

    /// `waits`: the request is a long poll of this shard (a group poll, a cache watch's
    /// next look) that may wait; it is counted among `owner`'s waiting polls until its
    /// answer comes back (not until its asker goes away: the owner holds it for its wait
    /// either way).
    fn ask_bounded(
        self: &Rc<Self>,
        owner: CoreId,
        bound: usize,
        waits: Option<Arc<ShardKey>>,
        make: impl FnOnce(ReplyTo) -> CoreMsg,
    ) -> impl std::future::Future<Output = Result<ReplyBody, BrokerError>> + 'static {
        let outstanding = &self.outstanding[owner.index()];
        let rx = if outstanding.get() >= bound {
            self.metrics
                .cross_core_refused
                .fetch_add(1, Ordering::Relaxed);
            None
        } else {
            outstanding.set(outstanding.get() + 1);
            self.metrics
                .cross_core_outstanding
                .fetch_add(1, Ordering::Relaxed);
            let id = self.next_request.get();
            self.next_request.set(id + 1);
            let (tx, rx) = oneshot::channel();
            if let Some(key) = &waits {
                self.waiting_polls[owner.index()]
                    .borrow_mut()
                    .started(&key.tenant);
            }
            self.pending.borrow_mut().insert(
                id,
                Pending {
                    owner,
                    waits,
                    answer: tx,
                },
            );
            self.send_ordered(
                owner,
                make(ReplyTo {
                    core: self.core,
                    id,
                }),
                false,
            );
            Some(rx)
        };
        async move {
            match rx {
                None => Err(BrokerError::Overloaded("core_queue_full".into())),
                Some(rx) => rx.await.map_err(|_| {
                    BrokerError::ShardUnavailable("the owning core did not answer".into())
                }),
            }
        }
    }

    /// Completes the request `id` this core sent.
    fn complete(&self, id: u64, body: ReplyBody) {
        let Some(Pending {
            owner,
            waits,
            answer: tx,
        }) = self.pending.borrow_mut().remove(&id)
        else {
            return;
        };
        let n = &self.outstanding[owner.index()];
        n.set(n.get().saturating_sub(1));
        if let Some(key) = waits {
            self.waiting_polls[owner.index()]
                .borrow_mut()
                .ended(&key.tenant);
        }
        self.metrics
            .cross_core_outstanding
            .fetch_sub(1, Ordering::Relaxed);
        let _ = tx.send(body);
    }

    /// Answers a request from `to.core`.
    fn respond(self: &Rc<Self>, to: ReplyTo, body: ReplyBody) {
        if to.core == self.core {
            self.complete(to.id, body);
        } else {
            self.send_ordered(to.core, CoreMsg::Reply { id: to.id, body }, false);
        }
    }

    /// Appends `records` to a stream shard, wherever it lives; resolves once the batch
    /// is acknowledged (durable under on-commit fsync) and fanned out. The request is
    /// issued when this is called, not when the future is first polled, so a session's
    /// pipelined publishes are in flight together.
    pub fn append(
        self: &Rc<Self>,
        key: Arc<ShardKey>,
        records: Vec<Bytes>,
        condition: Option<WriteIf>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Appended, BrokerError>>>> {
        self.note_load(&key, self.core, records.len());
        let owner = self.owner(&key);
        if owner == self.core && self.held(&key) {
            let k = key.clone();
            return self.after_arrival(&k, move |c| c.append(key, records, condition));
        }
        if owner == self.core {
            self.append_under(key, records, condition)
        } else {
            let answer = self.ask(owner, |reply| CoreMsg::Append {
                key,
                records,
                condition,
                sent: std::time::Instant::now(),
                reply,
            });
            Box::pin(async move {
                match answer.await? {
                    ReplyBody::Append(r) => r,
                    other => Err(BrokerError::Internal(format!(
                        "mismatched answer {other:?}"
                    ))),
                }
            })
        }
    }

    /// Whether this broker may take or acknowledge a write for `rs` now: its lease
    /// holds and the assignments it last read still name it leader at the replica's
    /// generation (the replica itself learns of a successor a sync later).
    fn may_acknowledge(&self, rs: &crate::replication::replica::ReplicaShard) -> bool {
        match &self.shared.cluster {
            None => true,
            Some(c) => c.lease_valid(clock::BootTime::now()) && c.leads(&rs.key, rs.generation()),
        }
    }

    /// A read answered by a replicated shard's leader: refused (`stale`, counted) unless
    /// it may still acknowledge, as a write's answer is. A leader paused or cut off past
    /// its lease may still think it leads while a successor takes writes; the control
    /// plane names one only after the lease ran out, so a read within it is current.
    fn lease_read(
        &self,
        rs: &crate::replication::replica::ReplicaShard,
    ) -> Result<(), BrokerError> {
        if self.may_acknowledge(rs) {
            return Ok(());
        }
        self.metrics.lease_refusals.fetch_add(1, Ordering::Relaxed);
        Err(BrokerError::ShardUnavailable("stale".into()))
    }

    /// After a wait: the replica still serves and [`Self::lease_read`] holds.
    fn still_reading(
        &self,
        rs: &crate::replication::replica::ReplicaShard,
    ) -> Result<(), BrokerError> {
        if !rs.serving() {
            return Err(BrokerError::ShardUnavailable("not_ready".into()));
        }
        self.lease_read(rs)
    }

    /// Refuses (`stale`, counted) when this broker is in a cluster and cut off from the
    /// control plane past its lease: another broker may lead its shards by now.
    fn within_lease(&self) -> Result<(), BrokerError> {
        match &self.shared.cluster {
            Some(c) if !c.lease_valid(clock::BootTime::now()) => {
                self.metrics.lease_refusals.fetch_add(1, Ordering::Relaxed);
                Err(BrokerError::ShardUnavailable("stale".into()))
            }
            _ => Ok(()),
        }
    }

    /// The replica of `key` on this core. A shard the catalog says is replicated but
    /// whose replica is not attached yet (just after a restart, before the first sync
    /// with the control plane's assignments) is unavailable: served as a plain shard it
    /// would acknowledge writes no majority holds and show readers uncommitted records.
    fn replica_of(
        &self,
        key: &ShardKey,
    ) -> Result<Option<Rc<crate::replication::replica::ReplicaShard>>, BrokerError> {
        if let Some(rs) = self.replicas.as_ref().and_then(|r| r.get(key)) {
            return Ok(Some(rs));
        }
        if self.replicated(key) {
            return Err(BrokerError::ShardUnavailable("not_ready".into()));
        }
        Ok(None)
    }

    /// Whether `key` belongs to a replicated stream or cache of a broker in a cluster.
    fn replicated(&self, key: &ShardKey) -> bool {
        self.shared.cluster.is_some()
            && self
                .shared
                .catalog
                .spec(
                    key.kind == ShardKind::Stream,
                    &key.tenant,
                    &key.namespace,
                    &key.name,
                )
                .is_some_and(|s| s.replicated())
    }

    /// Appends on this (the owning) core. The offsets are claimed before this returns
    /// its future when the shard is open; the commit and fanout run in a task of their
    /// own, so a publisher going away cannot cancel them half way. (Idempotent
    /// publishes still waiting for their producer table whose clients left may be
    /// dropped past a bound: see `producers::Waiting`.)
    pub fn append_local(
        self: &Rc<Self>,
        key: Arc<ShardKey>,
        records: Vec<Bytes>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Appended, BrokerError>>>> {
        let k = key.clone();
        self.through_takeover(&k, move |c| c.write_local(key, records, None))
    }

    /// [`CoreBroker::append_local`] under `condition`.
    fn append_under(
        self: &Rc<Self>,
        key: Arc<ShardKey>,
        records: Vec<Bytes>,
        condition: Option<WriteIf>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Appended, BrokerError>>>> {
        match condition {
            None => self.append_local(key, records),
            Some(WriteIf::Idempotent(producer, sequence)) => {
                self.append_idempotent(key, records, (producer, sequence))
            }
            Some(WriteIf::Tail(expected)) => {
                let k = key.clone();
                self.through_takeover(&k, move |c| {
                    c.write_tagged(key, records, Some(Special::Tail(expected)), None)
                })
            }
        }
    }

    /// As [`CoreBroker::append_local`]; with `commit`, the batch is that atomic commit
    /// (`records` is then its event, what subscribers are sent) and its changes reach the
    /// shard's state in commit order.
    fn write_local(
        self: &Rc<Self>,
        key: Arc<ShardKey>,
        records: Vec<Bytes>,
        commit: Option<CommitWrite>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Appended, BrokerError>>>> {
        self.write_tagged(key, records, commit.map(Special::Commit), None)
    }

    /// Writes consumer-group events of stream shard `key` (on its owning core): durable,
    /// and on a replicated shard held by a majority (Quorum) under the lease, like any
    /// write; never fanned out.
    pub(crate) fn write_group(
        self: &Rc<Self>,
        key: Arc<ShardKey>,
        records: Vec<Bytes>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Appended, BrokerError>>>> {
        self.write_tagged(key, records, Some(Special::Group), None)
    }

    /// As [`CoreBroker::write_local`], the batch tagged with an idempotent producer's
    /// `(producer_id, sequence)` (and noted with its contents). Every claim made here is
    /// noted in the shard's producer table, so the table stays current without reading
    /// the log back.
    fn write_tagged(
        self: &Rc<Self>,
        key: Arc<ShardKey>,
        records: Vec<Bytes>,
        commit: Option<Special>,
        tag: Option<crate::producers::Tagged>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Appended, BrokerError>>>> {
        let shard = self.ready_stream(&key);
        let before = shard.as_ref().map(|s| s.log.next_offset());
        let fut = self.write_claimed(key, records, commit, tag.map(|(t, _)| t));
        if let (Some(shard), Some(before)) = (shard, before) {
            let after = shard.log.next_offset();
            if after > before {
                shard.note_claimed(before, after, tag);
            }
        }
        fut
    }

    /// The stream shard `key` when it is open on this core.
    fn ready_stream(&self, key: &ShardKey) -> Option<Rc<StreamShard>> {
        match self.streams.borrow().get(key) {
            Some(Slot::Ready(s)) => Some(s.clone()),
            _ => None,
        }
    }

    fn write_claimed(
        self: &Rc<Self>,
        key: Arc<ShardKey>,
        records: Vec<Bytes>,
        commit: Option<Special>,
        tag: Option<(u64, u64)>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Appended, BrokerError>>>> {
        if let Err(e) = self.within_lease() {
            return Box::pin(std::future::ready(Err(e)));
        }
        match self.replica_of(&key) {
            Ok(Some(rs)) => return Box::pin(self.append_replicated(rs, records, commit, tag)),
            Ok(None) => {}
            Err(e) => return Box::pin(std::future::ready(Err(e))),
        }
        Box::pin(self.append_unreplicated(key, records, commit, tag))
    }

    /// Appends to a replicated shard this broker leads: offsets claimed now, acked after
    /// local durability (Leader) or once a majority holds it (Quorum), and only while
    /// the lease holds.
    fn append_replicated(
        self: &Rc<Self>,
        rs: Rc<crate::replication::replica::ReplicaShard>,
        records: Vec<Bytes>,
        commit: Option<Special>,
        tag: Option<(u64, u64)>,
    ) -> impl std::future::Future<Output = Result<Appended, BrokerError>> + 'static {
        let this = self.clone();
        // Group events that change a group (a snapshot restates what the groups hold).
        let changes_groups = matches!(commit, Some(Special::Group))
            && !records.iter().all(|r| crate::groups::is_snapshot(r));
        let admitted = if self.may_acknowledge(&rs) {
            match &commit {
                None => rs.admit(&records, clock::wall_micros(), tag),
                Some(Special::Tail(e)) if *e != rs.log().next_offset() => {
                    Err(BrokerError::OffsetMismatch {
                        tail: rs.log().next_offset(),
                    })
                }
                Some(Special::Tail(_)) => rs.admit(&records, clock::wall_micros(), None),
                Some(Special::Group) => rs.admit_group(&records, clock::wall_micros()),
                Some(Special::State) => rs.admit_state(&records, clock::wall_micros()),
                Some(Special::Commit(c)) => match c.expected {
                    Some(e) if e != rs.log().next_offset() => Err(BrokerError::OffsetMismatch {
                        tail: rs.log().next_offset(),
                    }),
                    _ => rs
                        .admit_commit(&c.record, clock::wall_micros())
                        .inspect(|_| {
                            if let crate::replication::replica::Held::Stream(s) = &rs.held {
                                s.commits_claimed.set(rs.log().next_offset());
                            }
                        }),
                },
            }
        } else {
            self.metrics.lease_refusals.fetch_add(1, Ordering::Relaxed);
            Err(BrokerError::ShardUnavailable("stale".into()))
        };
        let (tx, rx) = oneshot::channel();
        task::spawn(async move {
            let result = async {
                let (pending, term) = admitted?;
                let waiting = clock::now().instant;
                let appended = rs
                    .log()
                    .commit(pending)
                    .await
                    .inspect_err(|_| rs.append_failed(term))?;
                this.metrics.append_commit.observe(waiting.elapsed());
                rs.durable(appended.end);
                if rs.consistency.get() == crate::catalog::Consistency::Quorum {
                    let waited = task::timeout(
                        crate::replication::replica::QUORUM_WAIT,
                        rs.committed(appended.end, term),
                    )
                    .await;
                    match waited {
                        Some(Ok(())) => {}
                        Some(Err(e)) => {
                            this.metrics.quorum_unknown.fetch_add(1, Ordering::Relaxed);
                            rs.fan_out_later(appended.end);
                            forget_groups_if_changed(&rs, changes_groups);
                            return Err(e);
                        }
                        None => {
                            this.metrics.quorum_unknown.fetch_add(1, Ordering::Relaxed);
                            rs.fan_out_later(appended.end);
                            forget_groups_if_changed(&rs, changes_groups);
                            return Err(BrokerError::Unacknowledged(
                                "a majority of replicas did not confirm the write in time".into(),
                            ));
                        }
                    }
                }
                // The lease and the assignments are read again at the ack: a broker
                // paused past its lease must not acknowledge what a successor may not
                // hold. Nor one whose replica stopped leading since admission: a
                // follower fenced by a successor refused it (a planned move writes the
                // successor's generation at once, with no lease to wait out, and a
                // Leader-mode write waits for no follower that would refuse it).
                // (The `ack-after-lease` mutant breaks this guard whole, so that the
                // chaos checker's test of it still sees what a broken guard lets by.)
                let deposed = !this
                    .shared
                    .cluster
                    .as_ref()
                    .is_some_and(|c| c.mutants.ack_after_lease)
                    && (rs.term() != term || !rs.serving());
                if deposed || !this.may_acknowledge(&rs) {
                    this.metrics.lease_refusals.fetch_add(1, Ordering::Relaxed);
                    rs.fan_out_later(appended.end);
                    forget_groups_if_changed(&rs, changes_groups);
                    return Err(BrokerError::Unacknowledged(
                        "the lease lapsed or the shard was reassigned before the write was acknowledged"
                            .into(),
                    ));
                }
                if let crate::replication::replica::Held::Stream(s) = &rs.held {
                    if matches!(commit, Some(Special::Group | Special::State)) {
                        s.advance_fanout(appended);
                    } else {
                        this.fanout(s, appended, records);
                    }
                }
                Ok(appended)
            }
            .await;
            match &result {
                Ok(a) => {
                    this.metrics.publish_batches.fetch_add(1, Ordering::Relaxed);
                    this.metrics
                        .publish_records
                        .fetch_add(a.end - a.first, Ordering::Relaxed);
                }
                Err(_) => {
                    this.metrics.publish_errors.fetch_add(1, Ordering::Relaxed);
                }
            }
            let _ = tx.send(result);
        })
        .detach();
        async move {
            rx.await.unwrap_or_else(|_| {
                Err(BrokerError::Internal(
                    "append task ended without an answer".into(),
                ))
            })
        }
    }

    fn append_unreplicated(
        self: &Rc<Self>,
        key: Arc<ShardKey>,
        records: Vec<Bytes>,
        commit: Option<Special>,
        tag: Option<(u64, u64)>,
    ) -> impl std::future::Future<Output = Result<Appended, BrokerError>> + 'static {
        let (tx, rx) = oneshot::channel();
        let ready = match self.streams.borrow().get(&key) {
            Some(Slot::Ready(s)) => Some(s.clone()),
            _ => None,
        };
        let this = self.clone();
        let claim = move |shard: &StreamShard,
                          records: &[Bytes],
                          commit: &Option<Special>|
              -> Result<felix_storage_uring::PendingAppend, BrokerError> {
            match commit {
                None => Ok(shard.log.begin_append(
                    records,
                    clock::wall_micros(),
                    tag.map(|(producer_id, sequence)| felix_storage_uring::ProducerTag {
                        producer_id,
                        sequence,
                    }),
                )?),
                Some(Special::Tail(e)) if *e != shard.log.next_offset() => {
                    Err(BrokerError::OffsetMismatch {
                        tail: shard.log.next_offset(),
                    })
                }
                Some(Special::Tail(_)) => {
                    Ok(shard
                        .log
                        .begin_append(records, clock::wall_micros(), None)?)
                }
                Some(Special::Group) => Ok(shard.log.begin_group(records, clock::wall_micros())?),
                Some(Special::State) => Ok(shard.log.begin_state(records, clock::wall_micros())?),
                Some(Special::Commit(c)) => match c.expected {
                    Some(e) if e != shard.log.next_offset() => Err(BrokerError::OffsetMismatch {
                        tail: shard.log.next_offset(),
                    }),
                    _ => {
                        let pending = shard.log.begin_commit(&c.record, clock::wall_micros())?;
                        // Counted where claimed (also after waiting for the shard to
                        // open): a state copy waits until the index has it.
                        shard.commits_claimed.set(shard.log.next_offset());
                        Ok(pending)
                    }
                },
            }
        };
        // Not open yet: accepted here all the same, until it has the shard.
        let awaiting = ready.is_none().then(|| self.awaiting(&key));
        // Claim offsets now when possible: request order is offset order.
        let claimed = ready.map(|shard| {
            let pending = claim(&shard, &records, &commit);
            (shard, pending)
        });
        task::spawn(async move {
            let result = async {
                let (shard, pending) = match claimed {
                    Some((shard, pending)) => (shard, pending?),
                    None => {
                        let shard = this.stream_shard(&key).await;
                        drop(awaiting);
                        let shard = shard?;
                        let pending = claim(&shard, &records, &commit)?;
                        (shard, pending)
                    }
                };
                let waiting = clock::now().instant;
                let appended = shard.log.commit(pending).await?;
                this.metrics.append_commit.observe(waiting.elapsed());
                // Fanout before any other await: offset order.
                if matches!(commit, Some(Special::Group | Special::State)) {
                    shard.advance_fanout(appended);
                } else {
                    this.fanout(&shard, appended, records);
                }
                Ok(appended)
            }
            .await;
            match &result {
                Ok(a) => {
                    this.metrics.publish_batches.fetch_add(1, Ordering::Relaxed);
                    this.metrics
                        .publish_records
                        .fetch_add(a.end - a.first, Ordering::Relaxed);
                    this.metrics.disk_full.store(0, Ordering::Relaxed);
                }
                Err(e) => {
                    this.metrics.publish_errors.fetch_add(1, Ordering::Relaxed);
                    if matches!(e, BrokerError::Overloaded(r) if r == "disk_full") {
                        this.metrics
                            .disk_full
                            .store(crate::groups::mono_ms() + 1, Ordering::Relaxed);
                        this.metrics
                            .disk_full_refusals
                            .fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            let _ = tx.send(result);
        })
        .detach();
        async move {
            rx.await.unwrap_or_else(|_| {
                Err(BrokerError::Internal(
                    "append task ended without an answer".into(),
                ))
            })
        }
    }

    fn fanout(self: &Rc<Self>, shard: &StreamShard, appended: Appended, records: Vec<Bytes>) {
        shard.advance_fanout(appended);
        if !shard.has_subscribers() {
            return;
        }
        let count = records.len();
        let env = Arc::new(Envelope::new(shard.key.clone(), appended.first, records));
        for core in shard.interested_cores() {
            self.note_load(&shard.key, core, count);
            if core == self.core {
                self.deliver_local(&shard.key, &env);
            } else {
                self.send_ordered(
                    core,
                    CoreMsg::Deliver {
                        key: shard.key.clone(),
                        envelope: env.clone(),
                    },
                    true,
                );
            }
        }
    }

    /// Ends this core's subscriptions to `key`, closed for good at its owner.
    fn end_local_subscribers(&self, key: &ShardKey) {
        if let Some(subs) = self.subscribers.borrow_mut().remove(key) {
            subs.iter().for_each(|q| q.close(Ending::Failed));
        }
    }

    /// Tells the cores in `interested` (a handover's subscriber cores) that `key` will
    /// not be served here until a restart: their subscriptions end with an error
    /// instead of waiting, as a quiet stream, for records that never come. (Not for a
    /// shard whose stream was deleted meanwhile: its deletion ends them, as deleted.)
    pub(super) fn end_subscribers(&self, key: &Arc<ShardKey>, interested: &[(CoreId, usize)]) {
        let Some(this) = self.me.upgrade() else {
            return;
        };
        for &(core, _) in interested {
            if core == self.core {
                self.end_local_subscribers(key);
            } else {
                this.send_ordered(core, CoreMsg::SubscribersEnd { key: key.clone() }, false);
            }
        }
    }

    fn deliver_local(&self, key: &ShardKey, env: &Arc<Envelope>) {
        if let Some(subs) = self.subscribers.borrow().get(key) {
            for s in subs {
                if s.push(env.clone()) {
                    self.metrics.events_queued.fetch_add(1, Ordering::Relaxed);
                } else {
                    self.metrics.events_dropped.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// Sends to another core in order: straight into the mesh channel while it has room,
    /// else behind earlier messages in an outbound queue drained by one task (so a later
    /// message can never overtake an earlier one). A `droppable` message (a delivery)
    /// is dropped when that queue is full; answers never are (they are bounded by the
    /// requests in flight).
    fn send_ordered(self: &Rc<Self>, core: CoreId, msg: CoreMsg, droppable: bool) {
        let start_drainer = {
            let mut out = self.outbound[core.index()].borrow_mut();
            if out.draining {
                if !droppable || out.queue.len() < OUTBOUND_MAX {
                    out.queue.push_back(msg);
                } else {
                    self.metrics.events_dropped.fetch_add(1, Ordering::Relaxed);
                    // Tell the destination core's subscribers to look for a gap.
                    self.shared.metrics[core.index()]
                        .deliveries_lost_inbound
                        .fetch_add(1, Ordering::Relaxed);
                }
                false
            } else {
                match self.mesh.try_send(core, msg) {
                    Ok(()) => {
                        self.metrics.mesh_sent.fetch_add(1, Ordering::Relaxed);
                        false
                    }
                    Err(SendError::Full(m)) => {
                        out.queue.push_back(m);
                        out.draining = true;
                        true
                    }
                    Err(_) => false,
                }
            }
        };
        if start_drainer {
            let this = self.clone();
            task::spawn(async move { this.drain_outbound(core).await }).detach();
        }
    }

    async fn drain_outbound(&self, core: CoreId) {
        loop {
            let next = {
                let mut out = self.outbound[core.index()].borrow_mut();
                let next = out.queue.pop_front();
                if next.is_none() {
                    out.draining = false;
                }
                next
            };
            let Some(msg) = next else { return };
            if self.mesh.send(core, msg).await.is_err() {
                let mut out = self.outbound[core.index()].borrow_mut();
                out.queue.clear();
                out.draining = false;
                return;
            }
            self.metrics.mesh_sent.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Registers a local subscriber before asking the owner where live delivery starts
    /// (register, then read history: nothing published in between is lost). Returns
    /// the queue and `(start, live)`.
    pub async fn subscribe(
        self: &Rc<Self>,
        key: Arc<ShardKey>,
        start: Option<StartPosition>,
    ) -> Result<(Rc<SubQueue>, u64, u64), BrokerError> {
        let queue = Rc::new(SubQueue::new(
            self.shared.subscriber_queue,
            self.sub_queued.clone(),
        ));
        self.subscribers
            .borrow_mut()
            .entry(key.clone())
            .or_default()
            .push(queue.clone());
        let answer = self.register(key.clone(), start).await;
        match answer {
            Ok((s, live)) => {
                self.metrics.subscriptions.fetch_add(1, Ordering::Relaxed);
                Ok((queue, s, live))
            }
            Err(e) => {
                self.forget_local(&key, &queue);
                Err(e)
            }
        }
    }

    /// Registers this core's subscriber to `key` at the shard's owner: `(start, live)`.
    fn register(
        self: &Rc<Self>,
        key: Arc<ShardKey>,
        start: Option<StartPosition>,
    ) -> moves::Answer<(u64, u64)> {
        let owner = self.owner(&key);
        if owner == self.core && self.held(&key) {
            let k = key.clone();
            return self.after_arrival(&k, move |c| c.register(key, start));
        }
        if owner == self.core {
            let this = self.clone();
            return Box::pin(async move { this.register_at_owner(&key, start, this.core).await });
        }
        let answer = self.ask(owner, |reply| CoreMsg::Subscribe {
            key,
            start,
            core: self.core,
            reply,
        });
        Box::pin(async move {
            match answer.await? {
                ReplyBody::Subscribe(r) => r,
                other => Err(BrokerError::Internal(format!(
                    "mismatched answer {other:?}"
                ))),
            }
        })
    }

    async fn register_at_owner(
        &self,
        key: &Arc<ShardKey>,
        start: Option<StartPosition>,
        core: CoreId,
    ) -> Result<(u64, u64), BrokerError> {
        // The replica first: a copy this broker no longer holds (retired, its directory
        // moved away) is not opened again, empty, for a reader that lagged behind.
        let replica = self.replica_of(key)?;
        let shard = self.stream_shard(key).await?;
        let base = shard.log.base_offset();
        if replica.as_ref().is_some_and(|rs| !rs.serving()) {
            // Still fencing or catching up (or deposed): nothing to read here yet.
            return Err(BrokerError::ShardUnavailable("not_ready".into()));
        }
        if let Some(rs) = &replica {
            // Past its lease a successor may hold records beyond this commit mark: a
            // cursor there would be refused as in the future, for good (retryable here).
            self.lease_read(rs)?;
        }
        let visible = replica.map_or(u64::MAX, |rs| rs.visible_end());
        let tail = shard.log.committed_end().min(visible);
        let start = match start {
            None | Some(StartPosition::Latest) => None,
            Some(StartPosition::Earliest) => Some(base),
            Some(StartPosition::Offset(o)) if o.0 < base => {
                return Err(BrokerError::Cursor {
                    reason: CursorErrorReason::TooOld,
                    requested: o.0,
                    available: base,
                });
            }
            Some(StartPosition::Offset(o)) if o.0 > tail => {
                return Err(BrokerError::Cursor {
                    reason: CursorErrorReason::InFuture,
                    requested: o.0,
                    available: tail,
                });
            }
            Some(StartPosition::Offset(o)) => Some(o.0),
        };
        let live = shard.register(core);
        Ok((start.unwrap_or(live), live))
    }

    fn forget_local(&self, key: &Arc<ShardKey>, queue: &Rc<SubQueue>) {
        let mut subs = self.subscribers.borrow_mut();
        if let Some(list) = subs.get_mut(key) {
            list.retain(|q| !Rc::ptr_eq(q, queue));
            if list.is_empty() {
                subs.remove(key);
            }
        }
    }

    /// Ends a subscription made with [`CoreBroker::subscribe`].
    pub fn unsubscribe(self: &Rc<Self>, key: Arc<ShardKey>, queue: &Rc<SubQueue>) {
        // Ended by the stream's deletion, its registration went with the deleted
        // shard. Dropped at the owner now, it would be taken off a stream made again
        // under the name since: the count of this core's subscribers there, which
        // another subscription of this core made (fan-out then skipped this core, and
        // that subscription waited for good).
        let deleted = matches!(queue.ending(), Some(Ending::Deleted | Ending::Failed));
        queue.close(Ending::Unsubscribed);
        self.forget_local(&key, queue);
        self.metrics.subscriptions.fetch_sub(1, Ordering::Relaxed);
        if !deleted {
            self.unregister(key);
        }
    }

    /// Drops this core's subscriber to `key` at the shard's owner (in order behind
    /// what this core sent that owner before).
    fn unregister(self: &Rc<Self>, key: Arc<ShardKey>) {
        let owner = self.owner(&key);
        if owner == self.core && self.held(&key) {
            let (this, k) = (self.clone(), key.clone());
            self.hold(&k, Box::new(move || this.unregister(key)));
        } else if owner == self.core {
            self.unregister_at_owner(&key, self.core);
        } else {
            let core = self.core;
            self.send_ordered(owner, CoreMsg::Unsubscribe { key, core }, false);
        }
    }

    /// Drops a subscriber on `core` from the shard `key` this core owns: from the open
    /// shard, or from the handover a re-pin left waiting for its open here.
    fn unregister_at_owner(&self, key: &ShardKey, core: CoreId) {
        if let Some(Slot::Ready(s)) = self.streams.borrow().get(key) {
            s.unregister(core);
        } else if let Some(h) = self.pending_takes.borrow_mut().get_mut(key) {
            h.unregister(core);
        }
    }

    /// Reads committed history from a stream shard, wherever it lives.
    pub async fn read(
        self: &Rc<Self>,
        key: Arc<ShardKey>,
        from: u64,
        max_bytes: usize,
    ) -> Result<Vec<ReadBatch>, BrokerError> {
        let owner = self.owner(&key);
        if owner == self.core && self.held(&key) {
            let k = key.clone();
            return self
                .after_arrival(&k, move |c| {
                    Box::pin(async move { c.read(key, from, max_bytes).await })
                })
                .await;
        }
        if owner == self.core {
            self.read_local(&key, from, max_bytes).await
        } else {
            match self
                .ask(owner, |reply| CoreMsg::Read {
                    key,
                    from,
                    max_bytes,
                    reply,
                })
                .await?
            {
                ReplyBody::Read(r) => r,
                other => Err(BrokerError::Internal(format!(
                    "mismatched answer {other:?}"
                ))),
            }
        }
    }

    /// Reads on the owning core: committed records only (a replicated Quorum shard's
    /// readers stop at its commit mark); on a replicated `Leader` shard, which reads to
    /// the log's end, only where this copy serves within its lease.
    async fn read_local(
        &self,
        key: &Arc<ShardKey>,
        from: u64,
        max_bytes: usize,
    ) -> Result<Vec<ReadBatch>, BrokerError> {
        // The replica first, as at a subscription's registration.
        let replica = self.replica_of(key)?;
        // A `Leader` copy still fencing holds a suffix its takeover may cut, and a
        // deposed or lapsed one may hold records at offsets its successor gave to
        // others. (A Quorum copy's reads stop at its commit mark: stale there, never
        // wrong, so a subscription catching up is not ended for a lapsed lease.)
        let checked = replica
            .as_ref()
            .filter(|rs| rs.consistency.get() == crate::catalog::Consistency::Leader);
        if let Some(rs) = checked {
            self.still_reading(rs)?;
        }
        let shard = self.stream_shard(key).await?;
        let mut batches = shard.log.read(from, max_bytes).await?;
        if let Some(rs) = checked {
            // The read may have waited for the device meanwhile.
            self.still_reading(rs)?;
        }
        if let Some(rs) = replica {
            let visible = rs.visible_end();
            batches.retain(|b| b.end_offset() <= visible);
        }
        Ok(batches)
    }

    /// Routes a replication frame from a peer to the core it is for: the shard's owner
    /// for a request, the asking core for an answer.
    pub fn route_peer(
        self: &Rc<Self>,
        from: crate::replication::machine::NodeId,
        msg: felix_wire::internal::InternalMessage,
    ) {
        use crate::replication::replica::{Target, target};
        let to = match target(&msg) {
            Some(Target::Shard(k)) => self.owner(&k),
            Some(Target::Core(c)) if c.index() < self.outbound.len() => c,
            _ => return,
        };
        if to == self.core {
            if let Some(r) = &self.replicas {
                r.deliver(from, msg);
            }
        } else {
            // Droppable like a delivery: the sender resends after its timeout.
            self.send_ordered(to, CoreMsg::Peer { from, msg }, true);
        }
    }

    /// Starts the task that keeps this core's replicas in line with the control
    /// plane's assignments: within 10 ms of a new snapshot (a new leader
    /// should start taking its shards over at once), and every 100 ms regardless.
    pub fn start_replication(self: &Rc<Self>) {
        let Some(replicas) = self.replicas.clone() else {
            return;
        };
        let this = Rc::downgrade(self);
        task::spawn(async move {
            let (mut seen, mut last) = (u64::MAX, std::time::Instant::now());
            loop {
                // Cluster mode only: 100 looks a second on an idle core, one atomic load
                // each when nothing changed.
                task::sleep(Duration::from_millis(10)).await;
                let Some(core) = this.upgrade() else { return };
                if core.draining() {
                    return;
                }
                if core.shared.replica_sync_paused.load(Ordering::Relaxed) {
                    continue;
                }
                let version = core.shared.cluster.as_ref().map_or(0, |c| c.view().version);
                if version == seen && last.elapsed() < Duration::from_millis(100) {
                    continue;
                }
                (seen, last) = (version, std::time::Instant::now());
                let catalog = core.shared.catalog.clone();
                let left = replicas
                    .sync(
                        // Not while it moves between cores: attached at the core it
                        // leaves, its replica held the release for good; at the core
                        // it goes to, it opened the log beside the old one.
                        |k| core.owner(k) == core.core && !core.leaving(k) && !core.held(k),
                        |k| {
                            let (spec, life) = catalog.spec_and_incarnation(
                                k.kind == ShardKind::Stream,
                                &k.tenant,
                                &k.namespace,
                                &k.name,
                            )?;
                            spec.replicated().then_some((spec.consistency, life))
                        },
                        |key| {
                            let core = core.clone();
                            async move {
                                use crate::replication::replica::Held;
                                match key.kind {
                                    ShardKind::Stream => {
                                        core.stream_shard(&key).await.map(Held::Stream)
                                    }
                                    ShardKind::Cache => {
                                        core.cache_shard(&key).await.map(Held::Cache)
                                    }
                                }
                            }
                        },
                    )
                    .await;
                for key in left {
                    core.leave_replica(&key).await;
                }
                // Records from before a leader's term reach subscribers as its commit
                // mark passes them: an empty batch at the new frontier makes every
                // subscriber behind it read them from the log.
                for rs in replicas.all() {
                    if let (Some(to), crate::replication::replica::Held::Stream(s)) =
                        (rs.fanout_marker(), &rs.held)
                    {
                        core.fanout(s, Appended { first: to, end: to }, Vec::new());
                    }
                }
            }
        })
        .detach();
    }

    /// A cache watch's request, wherever the cache shard lives.
    pub async fn watch(
        self: &Rc<Self>,
        key: Arc<ShardKey>,
        req: WatchReq,
    ) -> Result<WatchAnswer, BrokerError> {
        let owner = self.owner(&key);
        if owner == self.core && self.held(&key) {
            let k = key.clone();
            return self
                .after_arrival(&k, move |c| {
                    Box::pin(async move { c.watch(key, req).await })
                })
                .await;
        }
        if owner == self.core {
            self.watch_local(&key, req).await
        } else {
            // A watch's long poll holds a request slot for its wait, as a group poll
            // does, and shares the group polls' bound (and each tenant's share of it):
            // uncapped, a few connections' watches of an idle cache held every slot to
            // the cache's core, and every tenant's requests there were refused
            // `core_queue_full`.
            let mut req = req;
            let asked = match &req {
                WatchReq::Next { wait, .. } => *wait,
                WatchReq::Start { .. } => Duration::ZERO,
            };
            let waits =
                (!asked.is_zero() && self.admit_wait(owner, &key.tenant)).then(|| key.clone());
            let cut = !asked.is_zero() && waits.is_none();
            if cut && let WatchReq::Next { wait, .. } = &mut req {
                *wait = Duration::ZERO;
            }
            let answer = match self
                .ask_bounded(owner, CROSS_CORE_REQUESTS_MAX, waits, |reply| {
                    CoreMsg::Watch { key, req, reply }
                })
                .await?
            {
                ReplyBody::Watch(r) => r,
                other => Err(BrokerError::Internal(format!(
                    "mismatched answer {other:?}"
                ))),
            };
            if cut && matches!(&answer, Ok(WatchAnswer::Changes(c, ..)) if c.is_empty()) {
                // Holding no slot: the watch asks again a few times a second, not in a
                // busy loop.
                task::sleep(asked.min(CUT_POLL_PAUSE)).await;
            }
            answer
        }
    }

    async fn watch_local(
        &self,
        key: &Arc<ShardKey>,
        req: WatchReq,
    ) -> Result<WatchAnswer, BrokerError> {
        let replica = self.replica_of(key)?;
        let term = replica.as_ref().map(|rs| rs.term());
        let cache = match &replica {
            Some(rs) => {
                if !rs.serving() {
                    return Err(BrokerError::ShardUnavailable("not_ready".into()));
                }
                rs.reads_settled().await?;
                self.lease_read(rs)?;
                match &rs.held {
                    crate::replication::replica::Held::Cache(c) => c.clone(),
                    _ => {
                        return Err(BrokerError::Internal(
                            "a stream replica asked for a cache".into(),
                        ));
                    }
                }
            }
            None => {
                // A start, as a get (a watch going on sees nothing new from a copy
                // whose writes are refused).
                if matches!(req, WatchReq::Start { .. }) {
                    self.within_lease()?;
                }
                self.cache_shard(key).await?
            }
        };
        match req {
            WatchReq::Start {
                filter,
                from,
                retained,
            } => {
                cache.watch_waiting(Instant::now());
                let now = clock::now();
                match from {
                    // Below the base, compaction or retention removed what lay between;
                    // past the end, a failover cut what the watcher saw (a Leader
                    // shard's acknowledged writes may be, and new ones take their
                    // offsets): either way it starts over from the current values.
                    Some(o) if o < cache.log().base_offset() || o > cache.applied_end() => {
                        let (values, resume, charge) = self.snapshot(&cache, &filter, now)?;
                        Ok(WatchAnswer::Started {
                            values,
                            charge,
                            resume,
                            resnapshot: true,
                            life: cache.life,
                        })
                    }
                    Some(o) => Ok(WatchAnswer::Started {
                        values: Vec::new(),
                        charge: Default::default(),
                        resume: o,
                        resnapshot: false,
                        life: cache.life,
                    }),
                    None if retained => {
                        let (values, resume, charge) = self.snapshot(&cache, &filter, now)?;
                        Ok(WatchAnswer::Started {
                            values,
                            charge,
                            resume,
                            resnapshot: false,
                            life: cache.life,
                        })
                    }
                    None => Ok(WatchAnswer::Started {
                        values: Vec::new(),
                        charge: Default::default(),
                        resume: cache.applied_end(),
                        resnapshot: false,
                        life: cache.life,
                    }),
                }
            }
            WatchReq::Next { filter, from, wait } => {
                // Waits until a change the watch follows is applied, or `wait` ends: a
                // watcher of a few keys of a busy cache is not answered nothing, and
                // asked again, at every write of another key.
                cache.watch_waiting(Instant::now());
                let deadline = Instant::now() + wait;
                let mut from = from;
                loop {
                    // Looked at before every read: leadership lost and won back
                    // meanwhile (a `Leader` cache's takeover may have cut what the
                    // watcher saw), or the lease run out, is not read through.
                    if let Some(rs) = &replica {
                        if !rs.serving() || Some(rs.term()) != term {
                            return Err(BrokerError::ShardUnavailable("not_ready".into()));
                        }
                        self.lease_read(rs)?;
                    }
                    if from > cache.applied_end() {
                        // A cut (above) since the watch started here: it ends lagged
                        // and the client's next start resnapshots.
                        return Err(BrokerError::ShardUnavailable("watch_past_end".into()));
                    }
                    if cache.applied_end() > from {
                        let found = cache.changes(from, &filter, 1 << 20).await?;
                        if found.from_log {
                            self.metrics
                                .cache_watch_log_reads
                                .fetch_add(1, Ordering::Relaxed);
                        }
                        if !found.changes.is_empty()
                            || found.next == from
                            || Instant::now() >= deadline
                        {
                            return Ok(WatchAnswer::Changes(found.changes, found.next, cache.life));
                        }
                        from = found.next;
                        // More applied while it read (from the log): read on.
                        continue;
                    }
                    // At the applied end, no wait since it was looked at: woken by the
                    // next change the watch follows (not by other keys' writes), by
                    // anything that may move the applied end otherwise, or the wait's
                    // end.
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Ok(WatchAnswer::Changes(Vec::new(), from, cache.life));
                    }
                    if task::timeout(left, cache.change_followed(&filter)).await
                        == Some(crate::shard::Wake::Released)
                    {
                        // Answered now: the shard is leaving this core (a move waits for
                        // its watches to let go) or closing.
                        return Ok(WatchAnswer::Changes(Vec::new(), from, cache.life));
                    }
                }
            }
        }
    }

    /// A copy of the current values of `cache` that `filter` follows, and where changes
    /// go on after it, charged against the process's bound on such copies held
    /// (`shard::snapshots`): refused `overloaded` ([`SNAPSHOTS_FULL`]) while it would
    /// not fit with the copies held.
    ///
    /// [`SNAPSHOTS_FULL`]: crate::shard::snapshots::SNAPSHOTS_FULL
    fn snapshot(
        &self,
        cache: &CacheShard,
        filter: &crate::shard::WatchFilter,
        now: clock::Now,
    ) -> Result<
        (
            Vec<crate::shard::WatchChange>,
            u64,
            crate::shard::snapshots::SnapshotCharge,
        ),
        BrokerError,
    > {
        use crate::shard::snapshots::SNAPSHOTS_FULL;
        let full = || BrokerError::Overloaded(SNAPSHOTS_FULL.into());
        let budget = &self.shared.watch_snapshots;
        // A watcher asking again while the bound is full costs a load, not a scan of
        // the cache; with some room, a scan that copies nothing; a copy is built only
        // once charged (with no await in between, it is the one counted).
        if !budget.has_room() {
            return Err(full());
        }
        let charge = budget
            .take(cache.snapshot_bytes(filter, now))
            .ok_or_else(full)?;
        let (values, resume) = cache.snapshot(filter, now);
        Ok((values, resume, charge))
    }

    /// A commit or state read, wherever the stream shard lives.
    pub async fn state(
        self: &Rc<Self>,
        key: Arc<ShardKey>,
        op: StateOp,
    ) -> Result<StateAnswer, BrokerError> {
        let owner = self.owner(&key);
        if owner == self.core && self.held(&key) {
            let k = key.clone();
            return self
                .after_arrival(&k, move |c| Box::pin(async move { c.state(key, op).await }))
                .await;
        }
        if owner == self.core {
            self.state_local(key, op).await
        } else {
            match self
                .ask(owner, |reply| CoreMsg::State { key, op, reply })
                .await?
            {
                ReplyBody::State(r) => r,
                other => Err(BrokerError::Internal(format!(
                    "mismatched answer {other:?}"
                ))),
            }
        }
    }

    /// A commit or state read on the owning core; held while this broker's replica
    /// takes the shard over, as publishes are.
    async fn state_local(
        self: &Rc<Self>,
        key: Arc<ShardKey>,
        op: StateOp,
    ) -> Result<StateAnswer, BrokerError> {
        let k = key.clone();
        self.through_takeover(&k, move |c| {
            Box::pin(async move { c.state_now(key, op).await })
        })
        .await
    }

    async fn state_now(
        self: &Rc<Self>,
        key: Arc<ShardKey>,
        op: StateOp,
    ) -> Result<StateAnswer, BrokerError> {
        match op {
            StateOp::Commit { event, write } => {
                let appended = self.write_local(key, vec![event], Some(write)).await?;
                Ok(StateAnswer::Committed(appended.first))
            }
            StateOp::Get(k) => {
                if let Some(rs) = self.replica_of(&key)?
                    && !rs.serving()
                {
                    return Err(BrokerError::ShardUnavailable("not_ready".into()));
                }
                let shard = self.stream_shard(&key).await?;
                let to = match self.replica_of(&key)? {
                    None => {
                        self.within_lease()?;
                        shard.fanout_end()
                    }
                    Some(rs) => {
                        // A read index: everything in the log now (which holds every
                        // write a previous leader acknowledged) must be committed before
                        // the answer, or a new leader would answer from before its
                        // predecessor's last acknowledged commit.
                        let index = rs.log().committed_end();
                        if rs.consistency.get() == crate::catalog::Consistency::Quorum {
                            let term = rs.term();
                            match task::timeout(
                                crate::replication::replica::QUORUM_WAIT,
                                rs.committed(index, term),
                            )
                            .await
                            {
                                Some(Ok(())) => {}
                                Some(Err(e)) => return Err(e),
                                None => {
                                    return Err(BrokerError::ShardUnavailable("not_ready".into()));
                                }
                            }
                        }
                        self.lease_read(&rs)?;
                        rs.visible_end().min(rs.log().committed_end())
                    }
                };
                self.catch_up_state(&shard, to).await?;
                // As of what the index covers: another read may have caught it up past
                // `to` while this one waited for the log, and the value is then from
                // that later frontier (answered as of `to`, its version could exceed it).
                let (value, as_of) = {
                    let index = shard.state.borrow();
                    let index = index.as_ref();
                    (
                        index.and_then(|i| i.get(&k)),
                        index.map_or(to, |i| i.end().max(to)),
                    )
                };
                Ok(StateAnswer::Value(value, as_of))
            }
        }
    }

    /// Brings the shard's state index up to `to` (its visible frontier) by reading the
    /// commits in the log it has not applied, building it from the log's base the first
    /// time.
    async fn catch_up_state(&self, shard: &StreamShard, to: u64) -> Result<(), BrokerError> {
        if shard.state.borrow().is_none() {
            *shard.state.borrow_mut() = Some(crate::state::StateIndex::at(shard.log.base_offset()));
        }
        loop {
            let Some(from) = shard.state.borrow().as_ref().map(|i| i.end()) else {
                // Dropped meanwhile (the frontier was reset): the caller may retry.
                return Err(BrokerError::ShardUnavailable("state_rebuilding".into()));
            };
            if from >= to {
                return Ok(());
            }
            // Retention removed what lies below the log's base only once the index held
            // every commit and copy in it (`state_floor` catches up first) or when it
            // held none: either way nothing there is left to apply. (A read racing a
            // removal finds it trimmed, and looks again.)
            let base = shard.log.base_offset();
            if from < base {
                if let Some(index) = shard.state.borrow_mut().as_mut() {
                    index.skip_to(base);
                }
                continue;
            }
            let batches = match shard.log.read(from, 4 << 20).await {
                Ok(b) => b,
                Err(felix_storage_uring::StorageError::Trimmed { .. }) => continue,
                Err(e) => return Err(e.into()),
            };
            if batches.is_empty() {
                return Ok(());
            }
            if let Some(index) = shard.state.borrow_mut().as_mut() {
                if index.end() != from {
                    // Another reader moved it, or it was dropped and rebuilt from the
                    // base while this read was out: the read is not for it.
                    continue;
                }
                index.apply_batches(&batches, to)?;
                if index.end() == from {
                    // A read that does not begin at `from` would make this loop spin.
                    return Err(BrokerError::Storage(format!(
                        "state catch-up: a read from {from} began at {}",
                        batches[0].base_offset
                    )));
                }
            }
        }
    }

    /// A consumer-group request, wherever the stream shard lives.
    pub async fn group(
        self: &Rc<Self>,
        key: Arc<ShardKey>,
        op: crate::groups::GroupOp,
    ) -> Result<crate::groups::GroupAnswer, BrokerError> {
        self.metrics.group_ops.fetch_add(1, Ordering::Relaxed);
        // Consumers of one group on one core draw the shard there (load following);
        // their claims move with it.
        self.note_load(&key, self.core, 1);
        let owner = self.owner(&key);
        if owner == self.core && self.held(&key) {
            let k = key.clone();
            let waits = waiting_poll(&op);
            return self
                .after_arrival_or_not(
                    &k,
                    move |c| Box::pin(async move { c.group(key, op).await }),
                    waits,
                )
                .await;
        }
        if owner == self.core {
            self.group_local(&key, op).await
        } else {
            let mut op = op;
            let asked = match &op {
                crate::groups::GroupOp::Poll { wait_ms, .. } => *wait_ms,
                _ => 0,
            };
            let waits = self
                .admit_poll_wait(owner, &key.tenant, &mut op)
                .then(|| key.clone());
            let cut = asked > 0 && waits.is_none();
            // A poll that waits there is cancelled there if this request is dropped.
            let mut cancel = (asked > 0 && !cut).then(|| CancelPoll {
                core: self.clone(),
                owner,
                key: key.clone(),
                asked: None,
            });
            let answer = self.ask_bounded(owner, CROSS_CORE_REQUESTS_MAX, waits, |reply| {
                if let Some(c) = cancel.as_mut() {
                    c.asked = Some(reply);
                }
                CoreMsg::Group { key, op, reply }
            });
            let answer = answer.await;
            if let Some(c) = cancel.as_mut() {
                c.asked = None;
            }
            let answer = match answer? {
                ReplyBody::Group(r) => r,
                other => Err(BrokerError::Internal(format!(
                    "mismatched answer {other:?}"
                ))),
            };
            if cut {
                pause_cut_poll(asked, &answer).await;
            }
            answer
        }
    }

    /// Whether a group request for `owner` is a poll that may wait there. Waiting polls
    /// hold their request slot for up to their wait; past `CROSS_CORE_POLLS_WAITING_MAX`,
    /// or past `tenant`'s share of it (`core/polls.rs`), a poll's wait is cut to 0 (it
    /// answers with what is there now), so polls can never hold more than their share of
    /// the slots every other request needs, nor one tenant's polls all of theirs.
    fn admit_poll_wait(
        &self,
        owner: CoreId,
        tenant: &str,
        op: &mut crate::groups::GroupOp,
    ) -> bool {
        let crate::groups::GroupOp::Poll { wait_ms, .. } = op else {
            return false;
        };
        if *wait_ms == 0 {
            return false;
        }
        if !self.admit_wait(owner, tenant) {
            *wait_ms = 0;
            return false;
        }
        true
    }

    /// Whether a long poll of `tenant` (a group poll, a cache watch's) may wait at
    /// `owner`: within the pair's bound on waiting polls and `tenant`'s share of it
    /// (`core/polls.rs`). Counted as cut when not.
    fn admit_wait(&self, owner: CoreId, tenant: &str) -> bool {
        let now = std::time::Instant::now();
        let admitted = self.waiting_polls[owner.index()]
            .borrow_mut()
            .admit(tenant, now);
        if !admitted {
            self.metrics.poll_waits_cut.fetch_add(1, Ordering::Relaxed);
        }
        admitted
    }

    /// A group request on the owning core; held while this broker's replica takes the
    /// shard over, as publishes are.
    async fn group_local(
        self: &Rc<Self>,
        key: &Arc<ShardKey>,
        op: crate::groups::GroupOp,
    ) -> Result<crate::groups::GroupAnswer, BrokerError> {
        let k = key.clone();
        let waits = waiting_poll(&op);
        self.through_takeover_or_not(
            key,
            move |c| Box::pin(async move { c.group_now(&k, op).await }),
            waits,
        )
        .await
    }

    /// A group request on the owning core. On a replicated shard only a serving leader
    /// answers (the group log is the leader's own: see `docs/queues.md`).
    async fn group_now(
        self: &Rc<Self>,
        key: &Arc<ShardKey>,
        op: crate::groups::GroupOp,
    ) -> Result<crate::groups::GroupAnswer, BrokerError> {
        // A replaced leader's groups may be behind its successor's (an ack taken there).
        match self.replica_of(key)? {
            Some(rs) if !rs.serving() => {
                return Err(BrokerError::ShardUnavailable("not_ready".into()));
            }
            Some(rs) => {
                // A new Quorum leader's log holds the furthest copy's records, group
                // events among them, committed only once its generation start is:
                // groups folded from them could answer a retried ack `done` that a
                // failover of this leader would cut. As cache and state reads do.
                rs.reads_settled().await?;
                self.still_reading(&rs)?;
            }
            None => self.within_lease()?,
        }
        let stream = self.stream_shard(key).await?;
        let groups = self.group_shard(key, &stream).await?;
        stream.group_batches_seen.set(true);
        groups.snapshot_if_due(stream.log.written_bytes(), stream.log.base_offset());
        // On a task of its own: a request dropped mid-write (its client gone) would
        // leave the event in the log and the trackers without it.
        let to_its_end = |op: crate::groups::GroupOp| {
            let (tx, rx) = futures_channel::oneshot::channel();
            let (g, s) = (groups.clone(), stream.clone());
            task::spawn(async move {
                let _ = tx.send(g.serve(&s, op).await);
            })
            .detach();
            async move { rx.await.unwrap_or(Err(BrokerError::Draining)) }
        };
        if let crate::groups::GroupOp::Poll { group, .. } = &op
            && !groups.has(group)
        {
            // A poll creates its group at the oldest retained record: that creation,
            // too, runs to its end once written.
            to_its_end(crate::groups::GroupOp::Seek {
                group: group.clone(),
                start: felix_wire::message::StartPosition::Earliest,
                if_new: true,
            })
            .await?;
        }
        let answer = if op.applies_after_write() {
            to_its_end(op).await
        } else {
            groups.serve(&stream, op).await
        };
        self.metrics
            .group_snapshots
            .fetch_add(groups.take_snapshots(), Ordering::Relaxed);
        answer
    }

    /// Where the groups of stream shard `key` write their events: its log, through this
    /// core's write path.
    fn group_writer(self: &Rc<Self>, key: &Arc<ShardKey>) -> crate::groups::GroupWriter {
        let weak = Rc::downgrade(self);
        let k = key.clone();
        Box::new(move |records| match weak.upgrade() {
            Some(core) => core.write_group(k.clone(), records),
            None => Box::pin(std::future::ready(Err(BrokerError::Draining))),
        })
    }

    /// What a waiting group poll of `key` looks at before each pass: as at the
    /// request's start ([`Self::group_now`]), a replica must still serve and hold its
    /// lease, a plain shard's broker its lease.
    fn group_lead_check(self: &Rc<Self>, key: &Arc<ShardKey>) -> crate::groups::LeadCheck {
        let weak = Rc::downgrade(self);
        let k = key.clone();
        Box::new(move || {
            let core = weak.upgrade().ok_or(BrokerError::Draining)?;
            match core.replica_of(&k)? {
                Some(rs) => core.still_reading(&rs),
                None => core.within_lease(),
            }
        })
    }

    /// The groups of stream shard `key` while this core leads it, built from the
    /// shard's log on first use (one build at a time; others wait for it).
    async fn group_shard(
        self: &Rc<Self>,
        key: &Arc<ShardKey>,
        stream: &Rc<StreamShard>,
    ) -> Result<Rc<crate::groups::GroupShard>, BrokerError> {
        loop {
            if let Some(g) = stream.groups.borrow().as_ref() {
                return Ok(g.clone());
            }
            if !stream.building_groups.replace(true) {
                break;
            }
            task::sleep(std::time::Duration::from_millis(1)).await;
        }
        let building = BuildingGroups(stream);
        // Dropped after a write whose outcome is unknown: built only from a log
        // holding every group write claimed then (see `forget_groups_if_changed`).
        let settled = task::timeout(GROUPS_SETTLE_WAIT, async {
            while stream.log.committed_end() < stream.groups_settle_at.get() {
                task::sleep(std::time::Duration::from_millis(5)).await;
            }
        })
        .await;
        if settled.is_none() {
            return Err(BrokerError::ShardUnavailable("not_ready".into()));
        }
        // Handed over by another core (a re-pin): built from that, claims included.
        if let Some(state) = stream.handed_groups.borrow_mut().take() {
            drop(building);
            let g = Rc::new(crate::groups::GroupShard::from_state(
                state,
                self.shared.group_limits,
                self.group_writer(key),
            ));
            g.set_lead_check(self.group_lead_check(key));
            *stream.groups.borrow_mut() = Some(g.clone());
            return Ok(g);
        }
        // A build that outlived the leadership it began in is stale: another leader
        // may have written group events meanwhile, and taking the shard over again
        // found no groups to drop.
        let term = || self.replica_of(key).ok().flatten().map(|rs| rs.term());
        let began = term();
        let built = crate::groups::GroupShard::build(
            stream,
            self.shared.group_limits,
            self.group_writer(key),
        )
        .await;
        drop(building);
        if term() != began {
            return Err(BrokerError::ShardUnavailable("not_ready".into()));
        }
        let g = Rc::new(built?);
        g.set_lead_check(self.group_lead_check(key));
        if !g.is_empty() {
            stream.group_batches_seen.set(true);
        }
        let built = g.built();
        let m = &self.metrics;
        m.group_folds.fetch_add(1, Ordering::Relaxed);
        m.group_fold_bytes
            .fetch_add(built.read_bytes, Ordering::Relaxed);
        if built.from_snapshot.is_some() {
            m.group_folds_from_snapshot.fetch_add(1, Ordering::Relaxed);
        }
        *stream.groups.borrow_mut() = Some(g.clone());
        Ok(g)
    }

    /// A cache operation, wherever the cache shard lives.
    pub async fn cache(
        self: &Rc<Self>,
        key: Arc<ShardKey>,
        op: CacheOp,
    ) -> Result<CacheAnswer, BrokerError> {
        self.metrics.cache_ops.fetch_add(1, Ordering::Relaxed);
        self.note_load(&key, self.core, 1);
        let owner = self.owner(&key);
        if owner == self.core && self.held(&key) {
            let k = key.clone();
            return self
                .after_arrival(&k, move |c| Box::pin(async move { c.cache(key, op).await }))
                .await;
        }
        if owner == self.core {
            self.cache_owned(key, op).await
        } else {
            match self
                .ask(owner, |reply| CoreMsg::Cache { key, op, reply })
                .await?
            {
                ReplyBody::Cache(r) => r,
                other => Err(BrokerError::Internal(format!(
                    "mismatched answer {other:?}"
                ))),
            }
        }
    }

    /// A cache operation on the core that owns the cache shard. While this broker's
    /// replica takes the shard over (a planned move's or a failover's cut-over) it waits,
    /// behind the operations that came before it, until the replica serves: as
    /// publishes do (see `core/takeover.rs`).
    async fn cache_owned(
        self: &Rc<Self>,
        key: Arc<ShardKey>,
        op: CacheOp,
    ) -> Result<CacheAnswer, BrokerError> {
        let k = key.clone();
        self.through_takeover(&k, move |c| {
            Box::pin(async move { c.cache_local(&key, op).await })
        })
        .await
    }

    async fn cache_local(
        &self,
        key: &Arc<ShardKey>,
        op: CacheOp,
    ) -> Result<CacheAnswer, BrokerError> {
        if let Some(rs) = self.replica_of(key)? {
            return self.cache_replicated(rs, op).await;
        }
        // As a publish to an unreplicated stream: a broker whose lease lapsed may have
        // had the shard placed elsewhere (an operator's abandon), and must neither
        // acknowledge writes the new owner will never hold nor answer from a copy
        // that is no longer the cache's.
        self.within_lease()?;
        let shard = self.cache_shard(key).await?;
        if shard.compaction_due(self.shared.cache_compact_after) {
            let (shard, metrics) = (shard.clone(), self.metrics.clone());
            task::spawn(async move {
                match shard.compact(&crate::shard::LocalWrites(shard.log())).await {
                    Ok(c) => {
                        metrics.cache_compactions.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(shard = %shard.key, ?c, "cache compacted");
                    }
                    Err(e) => tracing::warn!(shard = %shard.key, error = %e, "cache compaction"),
                }
            })
            .detach();
        }
        let now = clock::now();
        match op {
            CacheOp::Get(k) => {
                let e = shard.get(&k, now);
                Ok(CacheAnswer::Value(
                    e.as_ref().map(|e| e.value.clone()),
                    e.map(|e| e.version),
                ))
            }
            // Behind the writes of the key waiting to claim (conditional ones), in
            // arrival order: writes of one key land in the order they came (see
            // `CacheShard::queued`).
            CacheOp::Put(k, v, ttl) => {
                let ticket = shard.ticket_if_queued(&k);
                if let Some(t) = &ticket {
                    t.turn().await;
                }
                let version = shard.put_in_turn(ticket, &k, v, ttl, clock::now()).await?;
                Ok(CacheAnswer::Written(version))
            }
            CacheOp::Delete(k) => {
                let ticket = shard.ticket_if_queued(&k);
                if let Some(t) = &ticket {
                    t.turn().await;
                }
                let removed = shard.delete_in_turn(ticket, &k, clock::now()).await?;
                Ok(CacheAnswer::Value(removed, None))
            }
            CacheOp::CounterAdd(k, d) => Ok(CacheAnswer::Counter(Some(
                shard.counter_add(&k, d, now).await?,
            ))),
            CacheOp::CounterGet(k) => Ok(CacheAnswer::Counter(shard.counter(&k))),
            CacheOp::PutIf(k, v, ttl, condition) => {
                // Checked once every earlier write of the key is applied, and claimed
                // with no wait after the check (put claims before its first await). A
                // stream of writes of the key may keep it from settling: refused
                // `not_ready` after a while, as on a replicated cache.
                let ticket = shard.ticket(&k);
                ticket.turn().await;
                settled(&shard, &k).await?;
                if let Err(current) = shard.condition_holds(&k, &condition, clock::now()) {
                    return Ok(CacheAnswer::Condition(false, current));
                }
                let version = shard
                    .put_in_turn(Some(ticket), &k, v, ttl, clock::now())
                    .await?;
                Ok(CacheAnswer::Condition(true, Some(version)))
            }
            CacheOp::DeleteIf(k, version) => {
                let ticket = shard.ticket(&k);
                ticket.turn().await;
                settled(&shard, &k).await?;
                let condition = felix_wire::message::CacheCondition::Version(version);
                // One instant for the check and the delete: a value expiring between
                // two would be answered deleted with nothing written.
                let now = clock::now();
                if let Err(current) = shard.condition_holds(&k, &condition, now) {
                    return Ok(CacheAnswer::Condition(false, current));
                }
                shard.delete_in_turn(Some(ticket), &k, now).await?;
                Ok(CacheAnswer::Condition(true, None))
            }
            CacheOp::Expire(k, version) => {
                let wrote = shard.expire(&k, version, now).await?;
                Ok(CacheAnswer::Condition(wrote, None))
            }
        }
    }

    /// A cache operation on a replicated cache this broker leads: writes go through the
    /// replica (claimed, durable, a majority for Quorum, the lease read again) and reach
    /// the index only then, in commit order; reads need a serving leader.
    async fn cache_replicated(
        &self,
        rs: Rc<crate::replication::replica::ReplicaShard>,
        op: CacheOp,
    ) -> Result<CacheAnswer, BrokerError> {
        let crate::replication::replica::Held::Cache(cache) = rs.held.clone() else {
            return Err(BrokerError::Internal(
                "a stream replica asked for a cache".into(),
            ));
        };
        if !rs.serving() {
            return Err(BrokerError::ShardUnavailable("not_ready".into()));
        }
        // Reads, conditions, deletes' and adds' answers come from the index it rebuilt
        // and must be current. Housekeeping's expiry never waits (it looks again next
        // round); a put answers nothing from the index, and its own majority wait and
        // lease check cover it.
        // Writes that wait before they claim (deletes, conditional writes) take a place
        // in their key's queue, and so does a put of the key while any waits; each
        // claims in its turn: writes of one key land in the order they came (see
        // `CacheShard::queued`).
        let mut ticket = match &op {
            CacheOp::Delete(k) | CacheOp::PutIf(k, ..) | CacheOp::DeleteIf(k, _) => {
                Some(cache.ticket(k))
            }
            CacheOp::Put(k, ..) => cache.ticket_if_queued(k),
            _ => None,
        };
        if let Some(t) = &ticket {
            t.turn().await;
        }
        match &op {
            CacheOp::Expire(..) => {
                if !rs.reads_ready() {
                    return Ok(CacheAnswer::Condition(false, None));
                }
            }
            CacheOp::Put(..) => {}
            _ => {
                rs.reads_settled().await?;
                self.lease_read(&rs)?;
            }
        }
        if cache.compaction_due(self.shared.cache_compact_after) {
            let (rs, cache, metrics) = (rs.clone(), cache.clone(), self.metrics.clone());
            task::spawn(async move {
                let term = rs.term();
                match cache.compact(&ReplicatedWrites(rs, term)).await {
                    Ok(c) => {
                        metrics.cache_compactions.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(shard = %cache.key, ?c, "replicated cache compacted");
                    }
                    Err(e) => tracing::warn!(shard = %cache.key, error = %e, "cache compaction"),
                }
            })
            .detach();
        }
        let mut now = clock::now();
        let mut counter = None;
        let mut conditional = false;
        let mut expiring = false;
        let op = match op {
            CacheOp::PutIf(k, v, ttl, condition) => {
                settled(&cache, &k).await?;
                // Answered from the index after a wait: still leading, within the lease.
                self.still_reading(&rs)?;
                now = clock::now();
                if let Err(current) = cache.condition_holds(&k, &condition, now) {
                    return Ok(CacheAnswer::Condition(false, current));
                }
                conditional = true;
                CacheOp::Put(k, v, ttl)
            }
            CacheOp::Delete(k) => {
                // A write of the key still in flight (staged, or answered outcome-unknown
                // and committing later) is not in the index: looking first, the delete
                // found nothing, wrote nothing, and the write landed after it.
                settled(&cache, &k).await?;
                self.still_reading(&rs)?;
                now = clock::now();
                CacheOp::Delete(k)
            }
            CacheOp::DeleteIf(k, version) => {
                settled(&cache, &k).await?;
                self.still_reading(&rs)?;
                now = clock::now();
                let condition = felix_wire::message::CacheCondition::Version(version);
                if let Err(current) = cache.condition_holds(&k, &condition, now) {
                    return Ok(CacheAnswer::Condition(false, current));
                }
                conditional = true;
                CacheOp::Delete(k)
            }
            CacheOp::Expire(k, version) => {
                // Housekeeping's own round: never wait for a write of the key (a staged
                // write may wait for the very round that applies it); the next round
                // looks again.
                if cache.write_in_flight(&k) || !cache.expired_at(&k, version, now) {
                    return Ok(CacheAnswer::Condition(false, None));
                }
                conditional = true;
                expiring = true;
                CacheOp::Delete(k)
            }
            CacheOp::CounterAdd(k, d) => {
                // Behind a compaction checkpointing the counter (its adds in flight
                // drain first): waited, still leading within the lease.
                if cache.add_turn(&k).await {
                    self.still_reading(&rs)?;
                    now = clock::now();
                }
                CacheOp::CounterAdd(k, d)
            }
            other => other,
        };
        let (record, old) = match op {
            CacheOp::Get(k) => {
                let e = cache.get(&k, now);
                return Ok(CacheAnswer::Value(
                    e.as_ref().map(|e| e.value.clone()),
                    e.map(|e| e.version),
                ));
            }
            CacheOp::Put(k, v, ttl) => {
                let expires = ttl.map_or(0, |t| now.wall_ms().saturating_add(t.max(1)));
                (
                    crate::shard::encode_cache_record(true, expires, &k, &v),
                    None,
                )
            }
            CacheOp::Delete(k) if expiring => {
                (crate::shard::encode_cache_record(false, 0, &k, &[]), None)
            }
            CacheOp::Delete(k) => match cache.get(&k, now) {
                None => return Ok(CacheAnswer::Value(None, None)),
                Some(old) => (
                    crate::shard::encode_cache_record(false, 0, &k, &[]),
                    Some(old.value),
                ),
            },
            CacheOp::CounterGet(k) => return Ok(CacheAnswer::Counter(cache.counter(&k))),
            CacheOp::PutIf(..) | CacheOp::DeleteIf(..) | CacheOp::Expire(..) => {
                unreachable!("conditional writes were turned into plain ones above")
            }
            CacheOp::CounterAdd(k, d) => {
                counter = Some((k.clone(), d));
                (crate::shard::encode_counter_record(&k, d), None)
            }
        };
        if !self.may_acknowledge(&rs) {
            self.metrics.lease_refusals.fetch_add(1, Ordering::Relaxed);
            return Err(BrokerError::ShardUnavailable("stale".into()));
        }
        if let Some((k, d)) = &counter {
            cache.add_room(k, *d)?;
        }
        let (pending, term) = rs.admit(std::slice::from_ref(&record), now.wall_micros, None)?;
        // From the claim until the index has it, in log order, the write holds its key
        // (conditional writes wait for it) or its counter (a compaction does not
        // checkpoint below it; later adds count it against overflow), whether or not
        // this request is still there when it commits (no wait since the checks).
        let first = pending.first();
        let sum = cache.stage(first, &record, now.instant);
        ticket.take();
        let appended = match rs.log().commit(pending).await {
            Ok(a) => a,
            Err(e) => {
                // Not in the log (its offset may be given back): nothing to apply.
                rs.append_failed(term);
                cache.unstage(first, &sum);
                return Err(e.into());
            }
        };
        rs.durable(appended.end);
        if rs.consistency.get() == crate::catalog::Consistency::Quorum
            && !majority_within(&rs, appended.end, term).await?
        {
            return Err(BrokerError::Unacknowledged(
                "a majority of replicas did not confirm the write in time".into(),
            ));
        }
        // As a stream write's ack: nor one whose replica stopped leading since admission
        // (a follower fenced by a successor refused it; a Leader-mode write waits for
        // no follower that would). It was only the lease and the assignments here.
        if rs.term() != term || !rs.serving() || !self.may_acknowledge(&rs) {
            self.metrics.lease_refusals.fetch_add(1, Ordering::Relaxed);
            return Err(BrokerError::Unacknowledged(
                "the lease lapsed or the shard was reassigned before the write was acknowledged"
                    .into(),
            ));
        }
        cache.apply_through(rs.visible_end().min(rs.log().committed_end()));
        if let Some((k, _)) = counter {
            // The sum right after this add (the index was rebuilt meanwhile: as it is).
            return Ok(CacheAnswer::Counter(
                sum.get().or_else(|| cache.counter(&k)),
            ));
        }
        if conditional {
            return Ok(CacheAnswer::Condition(
                true,
                old.is_none().then_some(appended.first),
            ));
        }
        Ok(match old {
            None => CacheAnswer::Written(appended.first),
            Some(v) => CacheAnswer::Value(Some(v), None),
        })
    }

    /// Handles one message from another core. Deliveries are handled inline, in the
    /// order they arrived; everything that may wait runs in its own task.
    pub fn handle(self: &Rc<Self>, from: CoreId, msg: CoreMsg) {
        let (admit, msg) = self.admit(from, msg);
        let (moves::Admit::Serve(guard), Some(msg)) = (admit, msg) else {
            return;
        };
        match msg {
            CoreMsg::Deliver { key, envelope } => self.deliver_local(&key, &envelope),
            CoreMsg::SubscribersEnd { key } => self.end_local_subscribers(&key),
            CoreMsg::Append {
                key,
                records,
                condition,
                sent,
                reply,
            } => {
                self.metrics.mesh_hop.observe(sent.elapsed());
                let fut = self.append_under(key, records, condition);
                let this = self.clone();
                task::spawn(async move {
                    let _guard = guard;
                    let r = fut.await;
                    this.respond(reply, ReplyBody::Append(r));
                })
                .detach();
            }
            CoreMsg::Reply { id, body } => self.complete(id, body),
            CoreMsg::Move { step, reply } => {
                let this = self.clone();
                task::spawn(async move {
                    let r = this.move_step(step).await;
                    this.respond(reply, ReplyBody::Move(r));
                })
                .detach();
            }
            CoreMsg::Peer { from, msg } => {
                if let Some(r) = &self.replicas {
                    r.deliver(from, msg);
                }
            }
            CoreMsg::Subscribe {
                key,
                start,
                core,
                reply,
            } => {
                let this = self.clone();
                task::spawn(async move {
                    let _guard = guard;
                    let r = this.register_at_owner(&key, start, core).await;
                    this.respond(reply, ReplyBody::Subscribe(r));
                })
                .detach();
            }
            CoreMsg::Unsubscribe { key, core } => {
                drop(guard);
                self.unregister_at_owner(&key, core);
            }
            CoreMsg::Read {
                key,
                from: offset,
                max_bytes,
                reply,
            } => {
                let this = self.clone();
                task::spawn(async move {
                    let _guard = guard;
                    let r = this.read_local(&key, offset, max_bytes).await;
                    this.respond(reply, ReplyBody::Read(r));
                })
                .detach();
            }
            CoreMsg::Cache { key, op, reply } => {
                let this = self.clone();
                task::spawn(async move {
                    let _guard = guard;
                    let r = this.cache_owned(key, op).await;
                    this.respond(reply, ReplyBody::Cache(r));
                })
                .detach();
            }
            CoreMsg::Watch { key, req, reply } => {
                let this = self.clone();
                task::spawn(async move {
                    let _guard = guard;
                    let r = this.watch_local(&key, req).await;
                    this.respond(reply, ReplyBody::Watch(r));
                })
                .detach();
            }
            CoreMsg::State { key, op, reply } => {
                let this = self.clone();
                task::spawn(async move {
                    let _guard = guard;
                    let r = this.state_local(key, op).await;
                    this.respond(reply, ReplyBody::State(r));
                })
                .detach();
            }
            CoreMsg::Group { key, op, reply } => {
                let this = self.clone();
                // A poll that may wait ends when its asker cancels it: dropped, it hands
                // back what it claimed, uncounted (see `GroupCancel`).
                let cancelled = waiting_poll(&op).then(|| {
                    let (tx, rx) = oneshot::channel();
                    self.polls_asked
                        .borrow_mut()
                        .insert((reply.core, reply.id), tx);
                    rx
                });
                task::spawn(async move {
                    let _guard = guard;
                    let served = this.group_local(&key, op);
                    let r = match cancelled {
                        None => served.await,
                        Some(rx) => {
                            let gone = async {
                                let _ = rx.await;
                                Err(BrokerError::Unacknowledged(
                                    "the asking request was dropped".into(),
                                ))
                            };
                            // The asker's leaving first (see `answer_when_done`).
                            futures_lite::future::or(gone, served).await
                        }
                    };
                    {
                        let mut asked = this.polls_asked.borrow_mut();
                        if !asked.is_empty() {
                            asked.remove(&(reply.core, reply.id));
                        }
                    }
                    this.respond(reply, ReplyBody::Group(r));
                })
                .detach();
            }
            CoreMsg::GroupCancel { key: _, asked } => {
                if let Some(tx) = self
                    .polls_asked
                    .borrow_mut()
                    .remove(&(asked.core, asked.id))
                {
                    let _ = tx.send(());
                }
            }
        }
        let _ = from;
    }

    /// Samples the open stream logs' counters into this core's metrics every 250 ms, off
    /// the request path (the HTTP thread and benchmarks read the atomics).
    pub fn sample_log_stats(self: &Rc<Self>) {
        let this = Rc::downgrade(self);
        task::spawn(async move {
            loop {
                task::sleep(Duration::from_millis(250)).await;
                let Some(core) = this.upgrade() else { return };
                if core.draining() {
                    return;
                }
                let mut totals = core.closed_log_stats.get();
                let mut poisoned = 0;
                for slot in core.streams.borrow().values() {
                    if let Slot::Ready(shard) = slot {
                        core.add_device_latency(shard.log.take_device_latency());
                        totals = totals.plus(&shard.log.stats(), &Default::default());
                        poisoned += u64::from(shard.log.poisoned().is_some());
                    }
                }
                for slot in core.caches.borrow().values() {
                    if let Slot::Ready(shard) = slot {
                        core.add_device_latency(shard.log().take_device_latency());
                        poisoned += u64::from(shard.log().poisoned().is_some());
                    }
                }
                core.metrics
                    .poisoned_logs
                    .store(poisoned, Ordering::Relaxed);
                core.sample_shards();
                core.metrics
                    .log_syncs
                    .store(totals.syncs, Ordering::Relaxed);
                core.metrics
                    .log_synced_batches
                    .store(totals.synced_batches, Ordering::Relaxed);
                core.metrics
                    .log_zero_ahead_bytes
                    .store(totals.zero_ahead_bytes, Ordering::Relaxed);
                core.metrics
                    .log_dsync_writes
                    .store(totals.dsync_writes, Ordering::Relaxed);
            }
        })
        .detach();
    }

    fn add_device_latency(&self, d: felix_storage_uring::DeviceLatency) {
        self.metrics.log_write.add(&d.write);
        self.metrics.log_fsync.add(&d.sync);
    }

    /// Samples what `/cores` and `felix top` show: this thread's CPU time, the open
    /// shards, the subscriber queues.
    fn sample_shards(&self) {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid out-pointer; CLOCK_THREAD_CPUTIME_ID needs nothing else.
        if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } == 0 {
            let ns = ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64;
            self.metrics.cpu_ns.store(ns, Ordering::Relaxed);
        }
        let mut shards = Vec::new();
        for slot in self.streams.borrow().values() {
            if let Slot::Ready(s) = slot {
                shards.push(ShardSample {
                    shard: s.key.to_string(),
                    end: s.log.next_offset(),
                    subscriber_cores: s.interest().len(),
                });
            }
        }
        for slot in self.caches.borrow().values() {
            if let Slot::Ready(c) = slot {
                shards.push(ShardSample {
                    shard: c.key.to_string(),
                    end: c.log().next_offset(),
                    subscriber_cores: 0,
                });
            }
        }
        shards.sort_by(|a, b| a.shard.cmp(&b.shard));
        let queued: usize = self
            .subscribers
            .borrow()
            .values()
            .flatten()
            .map(|q| q.len())
            .sum();
        self.metrics
            .subscriber_queued
            .store(queued as u64, Ordering::Relaxed);
        *self.metrics.shards.lock().expect("shard sample lock") = shards;
    }

    /// Starts the housekeeping task: every `housekeeping_interval`, finish deletions
    /// (close this core's shards of deleted streams, remove their data) and enforce each
    /// open stream's retention.
    pub fn start_housekeeping(self: &Rc<Self>) {
        let this = Rc::downgrade(self);
        let interval = self.shared.housekeeping_interval;
        task::spawn(async move {
            loop {
                task::sleep(interval).await;
                let Some(core) = this.upgrade() else { return };
                if core.draining() {
                    return;
                }
                if core.shared.faults.is_some()
                    && core.shared.panic_core.load(Ordering::Relaxed) == core.core.index() as i64
                {
                    panic!("injected panic on core {}", core.core.index());
                }
                core.metrics
                    .subscriber_queue_bytes
                    .store(core.sub_queued.held() as u64, Ordering::Relaxed);
                core.finish_deletions().await;
                core.enforce_retention().await;
                core.remove_copies_left_while_down().await;
                core.expire_cache_values().await;
                core.forget_unwatched_changes();
                core.cut_replicated_caches().await;
                core.snapshot_idle_groups();
                core.snapshot_producers().await;
            }
        })
        .detach();
    }

    /// Group snapshots that came due without a group request (records keep arriving
    /// while the consumers are away): otherwise the next leader would fold everything
    /// written since the last request. A leadership that has served no group request
    /// has no groups built: when its log holds group batches (seen on this core) and
    /// has grown by a snapshot's worth since its groups were last snapshotted, they are
    /// built here, in the background, and snapshotted.
    fn snapshot_idle_groups(self: &Rc<Self>) {
        let every = self.shared.group_limits.snapshot_every_bytes;
        let mut unbuilt = Vec::new();
        for (key, slot) in self.streams.borrow().iter() {
            let Slot::Ready(s) = slot else { continue };
            let size = s.log.written_bytes();
            let Some(groups) = s.groups.borrow().clone() else {
                let grown = size.saturating_sub(s.groups_snapshot_mark.get().min(size));
                if s.group_batches_seen.get() && !s.building_groups.get() && grown >= every {
                    unbuilt.push((key.clone(), s.clone()));
                }
                continue;
            };
            groups.snapshot_if_due(size, s.log.base_offset());
            self.metrics
                .group_snapshots
                .fetch_add(groups.take_snapshots(), Ordering::Relaxed);
        }
        for (key, stream) in unbuilt {
            if stream.closing.get() || !self.serves(&key) || self.draining() {
                continue;
            }
            match self.replica_of(&key) {
                Ok(Some(rs)) if !rs.serving() => continue,
                Err(_) => continue,
                _ => {}
            }
            let core = self.clone();
            task::spawn(async move {
                match core.group_shard(&key, &stream).await {
                    Ok(groups) => {
                        groups.snapshot_if_due(stream.log.written_bytes(), stream.log.base_offset());
                        core.metrics
                            .group_snapshots
                            .fetch_add(groups.take_snapshots(), Ordering::Relaxed);
                    }
                    Err(e) => {
                        // Tried again after another snapshot's worth of log.
                        stream.groups_snapshot_mark.set(stream.log.written_bytes());
                        tracing::warn!(shard = %key, error = %e, "building idle groups for a snapshot")
                    }
                }
            })
            .detach();
        }
    }

    /// Closes this core's shards of deleted streams and caches, ends local
    /// subscriptions to them, and removes their directories (off the core thread).
    pub async fn finish_deletions(self: &Rc<Self>) {
        let catalog = self.shared.catalog.clone();
        let (me, cores) = (self.core.index(), self.shared.metrics.len());
        for d in catalog.pending_deletions(me) {
            // Which shards are this core's is read from the table now, and the part is
            // marked done after awaits: a re-pin begun meanwhile may move one here, and
            // its reopening of this part would come before the mark (see
            // `reopen_deletions_moving_here`). Then the part is looked at again.
            let begun = self.moves_begun.get();
            let mut dirs = Vec::new();
            let mut moving = false;
            for shard in 0..d.shards {
                let key = d.shard_key(shard);
                if let Some(subs) = self.subscribers.borrow_mut().remove(&key) {
                    subs.iter().for_each(|q| q.close(Ending::Deleted));
                }
                if self.leaving(&key) || self.held(&key) {
                    // Moving between cores (a live re-pin): the core it leaves may still
                    // hold its log open. Looked at again at the next round, once moved:
                    // the new owner removed the directory under the old one, which then
                    // wrote its close into it (or into a stream re-created there).
                    moving = true;
                    break;
                }
                if self.owner(&key) != self.core {
                    continue;
                }
                // A replica of it stops too: left in place, it would keep the closed log
                // and stand in for the shard of a stream re-created under this name.
                if let Some(r) = &self.replicas {
                    r.remove(&key);
                }
                self.close_shard(&key, false).await;
                dirs.push(shard_dir(&self.shared.data_dir, &key));
            }
            if moving {
                continue;
            }
            // The stream's directory goes with the last core to finish, which may own none
            // of its shards (then `dirs` is empty): name it from the stream, not from them.
            let parent = shard_dir(&self.shared.data_dir, &d.shard_key(0))
                .parent()
                .map(PathBuf::from);
            // Each removal is made durable (its parent directory synced) before the
            // catalog records the deletion done: after a power cut a shard directory
            // that came back would be taken up, records and all, by a stream of the
            // same name created again (nothing in it names the stream's life).
            let durably = |dir: &std::path::Path| match dir.parent() {
                Some(up) => crate::core::damaged::sync_dir(up)
                    .map_err(|e| format!("syncing {}: {e}", up.display())),
                None => Ok(()),
            };
            let removed = task::spawn_blocking(move || {
                for dir in &dirs {
                    match std::fs::remove_dir_all(dir) {
                        // Gone already (an earlier try removed it, then failed or
                        // stopped before its sync): synced here too.
                        Ok(()) => durably(dir)?,
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => durably(dir)?,
                        Err(e) => return Err(format!("{}: {e}", dir.display())),
                    }
                }
                Ok(())
            })
            .await;
            if removed.is_ok() && self.moves_begun.get() != begun {
                // A re-pin began since this core read which shards are its own.
                continue;
            }
            let finished = removed.is_ok() && catalog.deletion_done(&d, me, cores);
            let catalog2 = catalog.clone();
            let removed = match removed {
                Err(e) => Err(e),
                Ok(()) => {
                    task::spawn_blocking(move || {
                        if finished
                            && let Some(parent) = parent
                            // Empty once every core removed its shards.
                            && std::fs::remove_dir(&parent).is_ok()
                        {
                            durably(&parent)?;
                        }
                        catalog2.persist().map_err(|e| e.to_string())
                    })
                    .await
                }
            };
            match removed {
                Ok(()) => tracing::info!(
                    tenant = %d.tenant, namespace = %d.namespace, name = %d.name,
                    "deleted data of a removed {}", if d.stream { "stream" } else { "cache" }
                ),
                Err(e) => tracing::warn!(error = %e, "removing a deleted stream's data"),
            }
        }
    }

    /// Closes `key`'s log (stream or cache) on this core. With `seal`, a large newest
    /// segment is sealed too, so the core taking the shard over loads its index instead
    /// of scanning it. True when everything went cleanly.
    pub(crate) async fn close_shard(&self, key: &ShardKey, seal: bool) -> bool {
        // A handover waiting for an open here (a deleted stream's) dies with the shard.
        self.pending_takes.borrow_mut().remove(key);
        // An open under way finishes first, and the close takes what it opened. Removing
        // its slot instead left the opener to put the log back as ready after the close
        // (a deleted stream's log, its files unlinked, served to a stream re-created
        // under the same name), and let a request woken meanwhile open the same log a
        // second time beside it. (A re-pin waits for opens before it closes anyway.)
        while matches!(self.streams.borrow().get(key), Some(Slot::Opening(_)))
            || matches!(self.caches.borrow().get(key), Some(Slot::Opening(_)))
        {
            task::sleep(std::time::Duration::from_millis(1)).await;
        }
        let ready = match self.streams.borrow().get(key) {
            Some(Slot::Ready(s)) => Some(s.clone()),
            _ => None,
        };
        if let Some(s) = ready {
            // The core that opens it next builds the table from here on. Saved while
            // the slot still holds the log: a request coming meanwhile finds it, not an
            // empty slot from which it would open the same log a second time.
            self.save_producers(&s).await;
        }
        let stream = self.streams.borrow_mut().remove(key);
        if let Some(Slot::Ready(s)) = &stream
            && let Some(groups) = s.groups.borrow().as_ref()
        {
            // Nothing of them is written after the close: a poll left waiting on them
            // (a deleted stream's) would write into whatever opens under the name next,
            // a stream made again. A re-pin took their state before the close.
            groups.retire();
        }
        let cache = self.caches.borrow_mut().remove(key);
        if let Some(Slot::Ready(c)) = &cache {
            c.release_watches();
        }
        // Its sync counts move to this core's closed-log total at once (a sample taken
        // while it closes must not fall short), and what closing adds after.
        let counted = match &stream {
            Some(Slot::Ready(s)) => {
                let st = s.log.stats();
                let totals = self.closed_log_stats.get();
                self.closed_log_stats
                    .set(totals.plus(&st, &Default::default()));
                Some(st)
            }
            _ => None,
        };
        let logs = [
            match &stream {
                Some(Slot::Ready(s)) => Some(&s.log),
                _ => None,
            },
            match &cache {
                Some(Slot::Ready(c)) => Some(c.log()),
                _ => None,
            },
        ];
        let mut clean = true;
        for log in logs.into_iter().flatten() {
            self.metrics.shards_open.fetch_sub(1, Ordering::Relaxed);
            let mut closed = log.close().await;
            if seal && closed.is_ok() {
                closed = log.seal_active(moves::SEAL_MIN_BYTES).await;
            }
            if let Err(e) = closed {
                tracing::warn!(shard = %key, error = %e, "closing a shard");
                clean = false;
            }
        }
        if let (Some(Slot::Ready(s)), Some(before)) = (&stream, counted) {
            let totals = self.closed_log_stats.get();
            self.closed_log_stats
                .set(totals.plus(&s.log.stats(), &before));
        }
        clean
    }

    /// Removes whole sealed segments each open stream's retention no longer keeps, once
    /// the live state they hold is carried to the tail (`core/carry.rs`). The shards go
    /// [`RETENTION_SHARDS_AT_ONCE`] at a time, each in a task of its own: one that waits
    /// (a Leader stream's carry waits up to 5 s for a majority that may be away) holds up
    /// no other while fewer than that many wait (until 2026-12-07, shard after shard: 5
    /// s for each such shard, every round, and every other housekeeping task of the core
    /// behind).
    pub async fn enforce_retention(self: &Rc<Self>) {
        let shards = ready(&self.streams);
        let now = clock::wall_micros();
        // At most `RETENTION_SHARDS_AT_ONCE` at a time (each may copy up to 4 MiB of
        // state and sync), the next starting when any one ends: waiting for the oldest,
        // a shard waiting 5 s held up every one after it.
        let (done, mut ended) = futures_channel::mpsc::unbounded::<()>();
        let mut running = 0;
        for s in shards {
            if self.retention_due(&s, now).is_none() {
                continue;
            }
            if running >= RETENTION_SHARDS_AT_ONCE {
                // Never `None` here: this loop still holds a sender.
                if futures_lite::StreamExt::next(&mut ended).await.is_none() {
                    return;
                }
                running -= 1;
            }
            let (core, done) = (self.clone(), done.clone());
            task::spawn(async move {
                core.retain_shard(&s, now).await;
                let _ = done.unbounded_send(());
            })
            .detach();
            running += 1;
        }
        // `None` once every task ended or was dropped unfinished (its sender with it).
        drop(done);
        while running > 0 && futures_lite::StreamExt::next(&mut ended).await.is_some() {
            running -= 1;
        }
    }

    /// What `s`'s retention round needs when it has something to remove now: the
    /// stream's bounds, the floor no removal passes (a replicated shard keeps
    /// everything not yet committed, on every replica) and the replica. Looked at
    /// before a round's task is spawned (until 2026-12-07 one was spawned for every
    /// open shard every round), and again when the task starts: the task may wait for
    /// a place among those running, and meanwhile a follower can be started over at a
    /// base past the commit read before (`keep_epochs` with a floor below the base
    /// panics) or its replica replaced (the old one's generations would be kept).
    fn retention_due(&self, s: &StreamShard, now: u64) -> Option<RetentionDue> {
        let k = &s.key;
        let spec = self
            .shared
            .catalog
            .spec(true, &k.tenant, &k.namespace, &k.name)?;
        if !spec.retention.is_set() {
            return None;
        }
        let (floor, replica) = match self.replica_of(k) {
            Ok(Some(rs)) => (rs.commit(), Some(rs)),
            Ok(None) => (u64::MAX, None),
            // Not attached yet: nothing is known to be committed.
            Err(_) => return None,
        };
        let age = spec.retention.max_age_seconds.map(Duration::from_secs);
        let (cut, _) = s
            .log
            .retention_cut(now, spec.retention.max_size_bytes, age, floor);
        (cut > s.log.base_offset()).then_some((spec.retention, floor, replica))
    }

    /// One stream shard's retention round (see [`CoreBroker::enforce_retention`]).
    async fn retain_shard(self: &Rc<Self>, s: &Rc<StreamShard>, now: u64) {
        let Some((retention, floor, replica)) = self.retention_due(s, now) else {
            return;
        };
        let k = &s.key;
        let age = retention.max_age_seconds.map(Duration::from_secs);
        let cut_now = |floor| {
            s.log
                .retention_cut(now, retention.max_size_bytes, age, floor)
        };
        // Written only when something goes (before 2026-12-07 every round: a file
        // written and synced, renamed and its directory synced, each second for
        // each replicated stream with retention, removing or not).
        if let Some(rs) = replica
            && let Err(e) = rs.keep_epochs(floor).await
        {
            tracing::warn!(shard = %k, error = %e, "keeping generation starts");
            return;
        }
        // What a fold of the groups needs stays (`core/carry.rs`).
        let floor = match cut_now(floor) {
            (cut, kinds)
                if cut > s.log.base_offset()
                    && kinds.has(felix_storage_uring::BatchKind::Group) =>
            {
                match self.group_floor(s, cut).await {
                    Ok(f) => floor.min(f),
                    Err(e) => {
                        tracing::warn!(shard = %k, error = %e, "keeping group snapshots past retention");
                        return;
                    }
                }
            }
            _ => floor,
        };
        // Taken again after those waits (a reset meanwhile may have moved the base and
        // sealed other segments below the first cut): what follows uses it with no
        // wait since.
        let (cut, kinds) = cut_now(floor);
        let holds_state = kinds.has(felix_storage_uring::BatchKind::Commit)
            || kinds.has(felix_storage_uring::BatchKind::State);
        let superseding = cut > s.log.base_offset() && holds_state;
        let floor = if superseding {
            match self.state_floor(s, cut).await {
                Ok(f) => floor.min(f),
                Err(e) => {
                    tracing::warn!(shard = %k, error = %e, "carrying state past retention");
                    return;
                }
            }
        } else {
            // Nothing below the cut holds state: remove no further than that (it
            // was computed with no await since), so a state index behind it may
            // skip what went (`catch_up_state`).
            floor.min(cut)
        };
        let (bytes, log) = (retention.max_size_bytes, &s.log);
        // What goes may hold a key's older version, superseded by a newer one not
        // yet on disk under `fsync: none` or `periodic`: synced first, so a crash
        // reverts the key rather than dropping it.
        let removed = if superseding {
            log.remove_superseded_below(now, bytes, age, floor).await
        } else {
            log.enforce_retention_below(now, bytes, age, floor).await
        };
        match removed {
            Ok(0) => {}
            Ok(n) => {
                self.metrics
                    .retention_segments_removed
                    .fetch_add(n as u64, Ordering::Relaxed);
                if let Ok(Some(rs)) = self.replica_of(k) {
                    rs.rebased();
                }
                if let Some(t) = s.producers.borrow_mut().as_mut() {
                    t.trim_below(s.log.base_offset());
                }
                tracing::debug!(shard = %k, segments = n, "retention");
            }
            // Closed meanwhile (moved to another core, deleted): nothing to do.
            Err(felix_storage_uring::StorageError::Closed) => {}
            Err(e) => {
                // Some segments may have gone before the failure.
                if let Ok(Some(rs)) = self.replica_of(k) {
                    rs.rebased();
                }
                if let Some(t) = s.producers.borrow_mut().as_mut() {
                    t.trim_below(s.log.base_offset());
                }
                tracing::warn!(shard = %k, error = %e, "enforcing retention");
            }
        }
    }

    /// Writes a delete for each expired value of every cache this core leads (at most
    /// [`EXPIRE_BATCH`] per shard per round): watchers see expiry as a delete, and the
    /// next compaction leaves the value behind. A key written again meanwhile is kept.
    pub async fn expire_cache_values(self: &Rc<Self>) {
        let now = clock::now();
        let caches: Vec<Rc<CacheShard>> = self
            .caches
            .borrow()
            .values()
            .filter_map(|s| match s {
                Slot::Ready(c) => Some(c.clone()),
                _ => None,
            })
            .collect();
        for cache in caches {
            // A replica expires nothing unless it leads; a plain cache nothing while
            // the lease has lapsed (its writes would be refused `stale`, each one
            // counted a refusal).
            match self.replica_of(&cache.key) {
                Ok(Some(rs)) if !rs.serving() => continue,
                Err(_) => continue,
                Ok(None)
                    if !self
                        .shared
                        .cluster
                        .as_ref()
                        .is_none_or(|c| c.lease_valid(clock::BootTime::now())) =>
                {
                    continue;
                }
                _ => {}
            }
            // Concurrently: the deletes share flushes (group commit).
            let deletes: Vec<_> = cache
                .expired(now, EXPIRE_BATCH)
                .into_iter()
                .map(|(k, version)| {
                    let (this, key) = (self.clone(), cache.key.clone());
                    task::spawn(
                        async move { this.cache_local(&key, CacheOp::Expire(k, version)).await },
                    )
                })
                .collect();
            for delete in deletes {
                match delete.await {
                    Ok(CacheAnswer::Condition(true, _)) => {
                        self.metrics.cache_expired.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::debug!(shard = %cache.key, error = %e, "expiring a cache value");
                    }
                }
            }
        }
    }

    /// Drops the recent changes kept for watchers of each cache no watch asked about for
    /// [`crate::shard::RECENT_IDLE`] (see `shard/recent.rs`).
    fn forget_unwatched_changes(&self) {
        let now = Instant::now();
        for slot in self.caches.borrow().values() {
            if let Slot::Ready(c) = slot {
                c.forget_recent_if_idle(now, crate::shard::RECENT_IDLE);
            }
        }
        if let Some(replicas) = &self.replicas {
            for rs in replicas.all() {
                if let crate::replication::replica::Held::Cache(c) = &rs.held {
                    c.forget_recent_if_idle(now, crate::shard::RECENT_IDLE);
                }
            }
        }
    }

    /// Removes each replicated cache's segments below its newest compaction's cut once
    /// the cut marker is committed (leader and followers alike, each on its own log),
    /// and tells the replica its new base.
    pub async fn cut_replicated_caches(&self) {
        let Some(replicas) = &self.replicas else {
            return;
        };
        let now = clock::wall_micros();
        for rs in replicas.all() {
            let crate::replication::replica::Held::Cache(cache) = &rs.held else {
                continue;
            };
            if rs.serving() {
                // A write whose request stopped waiting (outcome unknown) and that
                // committed since, with no later write to apply it.
                cache.apply_through(rs.visible_end().min(rs.log().committed_end()));
            }
            let Some((marker, cut)) = cache.cut_marker() else {
                continue;
            };
            if rs.commit() <= marker || rs.log().base_offset() >= cut {
                continue;
            }
            if let Err(e) = rs.keep_epochs(cut).await {
                tracing::warn!(shard = %rs.key, error = %e, "keeping generation starts");
                continue;
            }
            // The copies are on this disk before what they replace goes: under
            // `fsync: none` and `periodic` the marker committed before any copy holding
            // it had synced (before 2026-12-05 a power cut after the cut took every
            // value written before the compaction).
            match rs
                .log()
                .remove_superseded_below(now, Some(0), None, cut)
                .await
            {
                Ok(0) => {}
                Ok(n) => {
                    self.metrics
                        .retention_segments_removed
                        .fetch_add(n as u64, Ordering::Relaxed);
                    rs.rebased();
                    tracing::debug!(shard = %rs.key, segments = n, cut, "replicated cache cut");
                }
                Err(e) => {
                    // Some segments may have gone before the failure.
                    rs.rebased();
                    tracing::warn!(shard = %rs.key, error = %e, "cutting a replicated cache");
                }
            }
        }
    }

    /// Starts one task per peer inbox, handing every message to [`CoreBroker::handle`].
    pub fn serve_mesh(
        self: &Rc<Self>,
        inboxes: Vec<(CoreId, felix_core_runtime::mesh::Inbox<CoreMsg>)>,
    ) {
        for (from, inbox) in inboxes {
            let this = self.clone();
            task::spawn(async move {
                while let Some(msg) = inbox.recv().await {
                    this.handle(from, msg);
                }
            })
            .detach();
        }
    }

    /// Stops taking new work, ends subscriptions and flushes every shard's log.
    pub async fn shutdown(&self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        self.draining.set(true);
        for subs in self.subscribers.borrow().values() {
            for s in subs {
                s.close(Ending::Draining);
            }
        }
        for s in ready(&self.streams) {
            // The next open reads the log from here on to build the table.
            self.save_producers(&s).await;
            if let Err(e) = s.log.close().await {
                tracing::warn!(shard = %s.key, error = %e, "closing a log");
            }
        }
        for c in ready(&self.caches) {
            if let Err(e) = c.close().await {
                tracing::warn!(shard = %c.key, error = %e, "closing a cache log");
            }
        }
        self.mesh.close();
    }
}

/// Whether a majority holds everything below `end` in `term` within a Quorum wait
/// (an error when the term ended).
async fn majority_within(
    rs: &crate::replication::replica::ReplicaShard,
    end: u64,
    term: u64,
) -> Result<bool, BrokerError> {
    match task::timeout(
        crate::replication::replica::QUORUM_WAIT,
        rs.committed(end, term),
    )
    .await
    {
        Some(Ok(())) => Ok(true),
        Some(Err(e)) => Err(e),
        None => Ok(false),
    }
}

/// Waits until no write of `key` is in flight, for at most a Quorum wait (on a
/// replicated cache a staged write may wait for a majority that is away; on any cache a
/// stream of writes of the key may keep it from ever settling).
async fn settled(cache: &crate::shard::CacheShard, key: &str) -> Result<(), BrokerError> {
    // On a replicated cache, no longer than the staged writes it waits for wait for
    // their majority: once they gave up (outcome unknown), so does every write queued
    // behind them, at once, instead of each after a full wait of its own in turn.
    // (Writes of an unreplicated one are marked in flight without a stage.)
    let wait = cache
        .settle_by(key)
        .map_or(crate::replication::replica::QUORUM_WAIT, |by| {
            by.saturating_duration_since(clock::now().instant)
                .min(crate::replication::replica::QUORUM_WAIT)
        });
    task::timeout(wait, cache.key_settled(key))
        .await
        .ok_or_else(|| BrokerError::ShardUnavailable("not_ready".into()))
}

/// A compaction of a replicated cache this broker leads: copies go through the replica
/// (fenced by its generation, shipped like any write), and the cut is a marker record;
/// [`CoreBroker::cut_replicated_caches`] removes the segments below once it commits.
/// A replicated cache's compaction copies, written by the leadership (term) that chose
/// its cut and keys: one that lost leadership and won it back meanwhile may hold other
/// records below the cut now (its uncommitted suffix cut, an interim leader's written
/// there), which its list of keys never saw, and its marker would let them go.
struct ReplicatedWrites(Rc<crate::replication::replica::ReplicaShard>, u64);

impl crate::shard::CompactionWrites for ReplicatedWrites {
    /// Staged like client writes and applied with them, in log order, once committed
    /// (applied at once, a copy could land over a newer put claimed after it and
    /// applied first). Waits for the commit here (at most a Quorum wait), so the
    /// compaction goes on with its copies in the index.
    async fn append(&self, records: &[Bytes], now_micros: u64) -> Result<u64, BrokerError> {
        let rs = &self.0;
        let crate::replication::replica::Held::Cache(cache) = &rs.held else {
            return Err(BrokerError::Internal(
                "a stream replica compacted as a cache".into(),
            ));
        };
        if rs.term() != self.1 || !rs.serving() {
            return Err(BrokerError::ShardUnavailable(
                "compaction: leadership changed since its cut was chosen".into(),
            ));
        }
        let (pending, term) = rs.admit(records, now_micros, None)?;
        let claimed_at = clock::now().instant;
        let first = pending.first();
        let staged: Vec<_> = records
            .iter()
            .enumerate()
            .map(|(i, r)| cache.stage(first + i as u64, r, claimed_at))
            .collect();
        let appended = match rs.log().commit(pending).await {
            Ok(a) => a,
            Err(e) => {
                rs.append_failed(term);
                for (i, sum) in staged.iter().enumerate() {
                    cache.unstage(first + i as u64, sum);
                }
                return Err(e.into());
            }
        };
        rs.durable(appended.end);
        let bound = || rs.visible_end().min(rs.log().committed_end());
        if bound() < appended.end && !majority_within(rs, appended.end, term).await? {
            return Err(BrokerError::Overloaded(
                "compaction: a majority did not confirm the copies in time".into(),
            ));
        }
        cache.apply_through(bound());
        Ok(appended.first)
    }

    fn apply(&self, _: &crate::shard::CacheShard, _: u64, _: &[Bytes]) {}

    async fn finish(&self, cut: u64, now_micros: u64) -> Result<usize, BrokerError> {
        let marker = crate::shard::encode_cut_marker(cut);
        self.append(std::slice::from_ref(&marker), now_micros)
            .await?;
        Ok(0)
    }
}

/// After a group event written to a replicated shard whose outcome is unknown (its
/// quorum not confirmed in time, or the lease or leadership lost before the ack): it
/// stays in the log and may yet commit, but the request that wrote it sees a failure
/// and applies nothing (a seek, a delete, a redrive, an ack), so the groups in memory
/// no longer fold the log. They are dropped, and built again from the log once this
/// core's copy holds everything claimed now (this event, and any other group write in
/// flight on the dropped groups, answered from them): a delete answered
/// `unacknowledged` while the group served on at its old cursor came back at a rebuild
/// and replayed what had been acked before it. A snapshot changes no group: kept.
fn forget_groups_if_changed(rs: &crate::replication::replica::ReplicaShard, changes_groups: bool) {
    if let (true, crate::replication::replica::Held::Stream(s)) = (changes_groups, &rs.held) {
        s.forget_groups_until(rs.log().next_offset());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A subscriber's queue holds at most `SUB_QUEUE_BYTES` of records, however few
    /// batches it counts: past that, new batches are dropped (the pump reads them back
    /// from the log). Bounded in batches alone, one subscriber that stopped reading
    /// held 512 of them, up to 8 GiB of large batches, in memory.
    #[test]
    fn a_subscribers_queue_is_bounded_in_bytes_too() {
        let key = Arc::new(ShardKey {
            kind: ShardKind::Stream,
            tenant: "t".into(),
            namespace: "ns".into(),
            name: "s".into(),
            shard: 0,
        });
        let batch = |base: u64, bytes: usize| {
            Arc::new(Envelope::new(
                key.clone(),
                base,
                vec![Bytes::from(vec![0u8; bytes])],
            ))
        };
        let q = SubQueue::new(512, QueuedBytes::new(SUB_QUEUES_BYTES_PER_CORE));
        let four_mib = 4 << 20;
        for i in 0..20 {
            q.push(batch(i, four_mib));
        }
        assert_eq!(q.len(), SUB_QUEUE_BYTES / four_mib);
        assert_eq!(q.dropped.get(), 20 - (SUB_QUEUE_BYTES / four_mib) as u64);
        let mut taken = Vec::new();
        q.take_ready(2, &mut taken);
        assert!(q.push(batch(20, four_mib)), "room again once taken");
        // A batch larger than the bound still goes to an empty queue.
        let q = SubQueue::new(512, QueuedBytes::new(SUB_QUEUES_BYTES_PER_CORE));
        assert!(q.push(batch(0, SUB_QUEUE_BYTES + 1)));
        assert!(!q.push(batch(1, 1)));
    }

    /// The queues of a core hold a bounded number of bytes together: many
    /// subscriptions that stopped reading, each within its own bound, held one each
    /// (1,024 of a connection: 32 GiB). Taken or ended, a queue gives its share back.
    #[test]
    fn a_cores_subscriber_queues_are_bounded_together() {
        let key = Arc::new(ShardKey {
            kind: felix_core_runtime::placement::ShardKind::Stream,
            tenant: "t".into(),
            namespace: "ns".into(),
            name: "s".into(),
            shard: 0,
        });
        let batch = |base: u64| {
            Arc::new(Envelope::new(
                key.clone(),
                base,
                vec![Bytes::from(vec![0u8; 1 << 20])],
            ))
        };
        let core = QueuedBytes::new(10 << 20);
        let queues: Vec<SubQueue> = (0..8).map(|_| SubQueue::new(512, core.clone())).collect();
        for base in 0..4 {
            for q in &queues {
                q.push(batch(base));
            }
        }
        assert_eq!(core.held(), 10 << 20);
        let held: usize = queues.iter().map(SubQueue::len).sum();
        assert_eq!(held, 10, "each queue's own bound (32 MiB) was far off");
        // Past the core's bound an empty queue still takes one (its pump is woken by
        // it), and no more.
        let empty = SubQueue::new(512, core.clone());
        assert!(empty.push(batch(9)));
        assert!(!empty.push(batch(10)));
        let mut taken = Vec::new();
        queues[0].take_ready(2, &mut taken);
        assert!(empty.push(batch(10)), "room again once taken");
        drop(queues);
        assert_eq!(core.held(), 2 << 20, "ended queues gave their share back");
        drop(empty);
        assert_eq!(core.held(), 0);
    }
}
