//! JSON messages: frames with flags 0 carry one object tagged by `"type"`.
//!
//! Field names, their order (which fixes the encoded bytes) and which are optional are
//! the interface; optional fields are omitted when unset so old and new peers exchange
//! byte-identical frames. Byte fields (payloads, values, publish keys) are base64
//! strings; cache keys are plain strings. Unknown fields are ignored (a negotiating
//! client may talk to a legacy broker). An unknown `type` decodes to
//! [`Message::Unknown`], never an error: whether it closes the stream or is answered
//! `unsupported` is the receiver's decision ([`peek_request`] names it).

use bytes::{BufMut, Bytes, BytesMut};
use serde::{Deserialize, Serialize};

use crate::error_code::{ErrorCode, ErrorDetail, RetryClass};
use crate::flags::Flags;
use crate::frame::{self, FrameError};
use crate::ids::{Generation, Offset, ProducerId, RequestId, Sequence, ShardId, SubscriptionId};
use crate::routing::ShardRouting;

/// How a publish is acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AckMode {
    /// No answer.
    None,
    /// One answer per message.
    #[default]
    PerMessage,
    /// One answer per batch.
    PerBatch,
}

impl AckMode {
    /// The byte in a binary acked publish (`None` has no byte: unacked frames have no
    /// prefix).
    pub const fn byte(self) -> Option<u8> {
        match self {
            AckMode::None => None,
            AckMode::PerMessage => Some(1),
            AckMode::PerBatch => Some(2),
        }
    }
}

/// Where a subscription starts. On the wire: `"latest"`, `"earliest"` or
/// `{"offset": n}` (inclusive). Absent means latest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StartPosition {
    /// Only records appended after the subscription registered.
    Latest,
    /// The oldest retained record.
    Earliest,
    /// This offset and everything after it.
    Offset(Offset),
}

/// Why a subscribe offset cannot be served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CursorErrorReason {
    /// Below the oldest retained offset.
    TooOld,
    /// Beyond the tail.
    InFuture,
}

/// Whether a name is a stream or a cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShardKind {
    /// A stream.
    Stream,
    /// A cache.
    Cache,
}

/// A broker a client may use.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BrokerEndpoint {
    /// The broker's node id.
    pub node_id: String,
    /// Where clients reach it (`host:port`).
    pub addr: String,
}

/// Who owns one shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardOwner {
    /// The shard.
    pub shard: ShardId,
    /// The owner's node id, when one can serve it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
    /// The owner's client address, when it advertised one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addr: Option<String>,
    /// The assignment generation.
    pub generation: Generation,
    /// Why no broker can serve the shard now (`owner_unavailable`, `not_assigned`), as
    /// the standard SDK reads it (a string: a flag failed its whole answer's decoding).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unavailable: Option<String>,
}

/// Why an idempotent or conditional publish was refused before anything was written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PublishRefusalReason {
    /// The sequence skipped ahead; `expected` is the next one the broker accepts.
    SequenceGap {
        /// The next accepted sequence.
        expected: Sequence,
    },
    /// The broker does not know the producer (never initialised, or forgotten).
    UnknownProducer,
    /// The sequence is older than the broker remembers.
    SequenceExpired,
    /// The sequence was used for a different batch.
    SequenceReused,
    /// `publish_if` expected another tail.
    OffsetMismatch {
        /// The actual tail.
        tail: Offset,
    },
    /// Another broker leads the shard.
    NotLeader {
        /// Its node id.
        node_id: String,
        /// Its client address, if known.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        addr: Option<String>,
    },
}

/// A conditional cache put's precondition: `"absent"` or `{"version": n}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheCondition {
    /// The key has no live value.
    Absent,
    /// The key's current version is this.
    Version(u64),
}

/// One state change in an atomic commit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum StateChange {
    /// Set a key.
    Put {
        /// The key.
        key: String,
        /// The value.
        #[serde(with = "crate::b64")]
        value: Bytes,
    },
    /// Remove a key.
    Delete {
        /// The key.
        key: String,
    },
}

/// A record handed out by a consumer group poll. (`hot::strict_records` mirrors its
/// fields for the fast decode path: a field added here goes there too, or every poll
/// answer falls back to the generic decoder.)
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupRecord {
    /// The record's offset.
    pub offset: Offset,
    /// The payload.
    #[serde(with = "crate::b64")]
    pub payload: Bytes,
    /// Delivery attempt (1 = first delivery, 0 = not reported).
    #[serde(default)]
    pub attempts: u32,
    /// Offsets immediately before this one that hold no record.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub skipped_before: u64,
    /// The publisher principal, when negotiated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publisher: Option<String>,
    /// Append time, when negotiated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp_micros: Option<u64>,
}

/// A record returned by `stream_read`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamRecord {
    /// The record's offset.
    pub offset: Offset,
    /// The payload.
    #[serde(with = "crate::b64")]
    pub payload: Bytes,
    /// The publisher principal, if recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publisher: Option<String>,
    /// Append time.
    pub timestamp_micros: u64,
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// Every JSON message of protocol v1. `C->B` requests, `B->C` answers and events.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Message {
    // ---- Session and generic -------------------------------------------------------
    /// C->B: authenticates the stream; first message on every client stream.
    Auth {
        /// The tenant the token is for.
        tenant_id: String,
        /// A broker-audience JWT.
        token: String,
        /// Frame flags the client reads (absent: a legacy client).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        client_flags: Option<u16>,
        /// First feature word.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        client_features: Option<u32>,
        /// High feature word (only with the EXTENDED marker).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        client_features_hi: Option<u32>,
    },
    /// B->C: the stream is authenticated; what the broker reads and serves.
    AuthOk {
        /// Frame flags the broker reads and may send.
        server_flags: u16,
        /// First feature word.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        server_features: Option<u32>,
        /// High feature word.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        server_features_hi: Option<u32>,
        /// Extra UDP ports the broker listens on.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        listener_ports: Option<Vec<u16>>,
        /// Acked publishes a stream may have unanswered (with PUBLISH_PIPELINE).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        publish_window: Option<u32>,
    },
    /// B->C: legacy answer to `auth`, and some acks.
    Ok,
    /// B->C: a refusal.
    Error {
        /// Human-readable text.
        message: String,
        /// The code (to clients that offered ERROR_CODES).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        code: Option<ErrorCode>,
        /// What to do about it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        retry: Option<RetryClass>,
        /// Structured detail.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        detail: Option<ErrorDetail>,
    },
    /// B->C: the request type is not served (both sides offered UNSUPPORTED).
    Unsupported {
        /// The `type` of the refused request.
        request_type: String,
        /// The extension name, for `extension` requests.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        extension: Option<String>,
        /// The refused request's id, if it had one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        request_id: Option<RequestId>,
    },
    /// Both: reserved for extensions; brokers answer `unsupported`.
    Extension {
        /// Extension name.
        name: String,
        /// Correlation id.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        request_id: Option<RequestId>,
        /// Free-form body.
        #[serde(default)]
        body: serde_json::Value,
    },

    // ---- Topology and routing ------------------------------------------------------
    /// C->B: which brokers may a client use?
    Topology,
    /// B->C: brokers able to serve that advertised a client address (may be empty).
    TopologyView {
        /// The brokers.
        brokers: Vec<BrokerEndpoint>,
    },
    /// B->C: another broker owns the shard.
    NotLeader {
        /// The owner's node id.
        node_id: String,
        /// Its client address, if advertised.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        addr: Option<String>,
        /// The assignment generation this answer reflects.
        generation: Generation,
    },
    /// C->B: how many shards does a stream have?
    StreamShards {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// Correlation id.
        request_id: RequestId,
    },
    /// B->C: the stream's shard count (0 = unknown stream).
    StreamShardsView {
        /// Shard count.
        shards: u32,
        /// Correlation id.
        request_id: RequestId,
        /// Present only for jump_hash (absent = modulo).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        routing: Option<ShardRouting>,
    },
    /// C->B: how many shards does a cache have?
    CacheShards {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Cache.
        cache: String,
        /// Correlation id.
        request_id: RequestId,
    },
    /// B->C: the cache's shard count.
    CacheShardsView {
        /// Shard count.
        shards: u32,
        /// Correlation id.
        request_id: RequestId,
    },
    /// C->B: who owns each shard of a stream or cache?
    ShardOwners {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream or cache name.
        name: String,
        /// Which.
        kind: ShardKind,
        /// Correlation id.
        request_id: RequestId,
    },
    /// B->C: one owner per shard.
    ShardOwnersView {
        /// The owners.
        owners: Vec<ShardOwner>,
        /// Correlation id.
        request_id: RequestId,
    },

    // ---- Publishing ----------------------------------------------------------------
    /// C->B: publish one record (JSON fallback).
    Publish {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// The record.
        #[serde(with = "crate::b64")]
        payload: Bytes,
        /// Routing key (an empty key is a real key).
        #[serde(
            default,
            with = "crate::b64::option",
            skip_serializing_if = "Option::is_none"
        )]
        key: Option<Bytes>,
        /// Explicit shard, when the client routed it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        shard: Option<ShardId>,
        /// Correlation id (required when acked).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        request_id: Option<RequestId>,
        /// none or per_message.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ack: Option<AckMode>,
    },
    /// C->B: publish several records (JSON fallback).
    PublishBatch {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// The records.
        #[serde(with = "crate::b64::vec_capped")]
        payloads: Vec<Bytes>,
        /// Routing key.
        #[serde(
            default,
            with = "crate::b64::option",
            skip_serializing_if = "Option::is_none"
        )]
        key: Option<Bytes>,
        /// Explicit shard.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        shard: Option<ShardId>,
        /// Correlation id.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        request_id: Option<RequestId>,
        /// none or per_batch.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ack: Option<AckMode>,
    },
    /// B->C: a publish was accepted.
    PublishOk {
        /// Correlation id.
        request_id: RequestId,
        /// First offset (only to clients that offered flag 0x1000).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        offset: Option<Offset>,
    },
    /// B->C: a publish failed.
    PublishError {
        /// Correlation id.
        request_id: RequestId,
        /// Human-readable text.
        message: String,
        /// Code.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        code: Option<ErrorCode>,
        /// Retry class.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        retry: Option<RetryClass>,
        /// Detail.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        detail: Option<ErrorDetail>,
    },
    /// C->B: ask for an idempotent producer id.
    ProducerInit {
        /// Correlation id.
        request_id: RequestId,
    },
    /// B->C: the producer id.
    ProducerInitOk {
        /// Correlation id.
        request_id: RequestId,
        /// The id.
        producer_id: ProducerId,
    },
    /// C->B: an idempotent batch (JSON fallback of flag 0x0100).
    PublishIdempotent {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// The records.
        #[serde(with = "crate::b64::vec_capped")]
        payloads: Vec<Bytes>,
        /// Routing key.
        #[serde(
            default,
            with = "crate::b64::option",
            skip_serializing_if = "Option::is_none"
        )]
        key: Option<Bytes>,
        /// Explicit shard.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        shard: Option<ShardId>,
        /// Correlation id.
        request_id: RequestId,
        /// Producer.
        producer_id: ProducerId,
        /// Batch number on this shard.
        sequence: Sequence,
    },
    /// C->B: append only if the shard's tail is `expected_offset`.
    PublishIf {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// The records.
        #[serde(with = "crate::b64::vec_capped")]
        payloads: Vec<Bytes>,
        /// Routing key.
        #[serde(
            default,
            with = "crate::b64::option",
            skip_serializing_if = "Option::is_none"
        )]
        key: Option<Bytes>,
        /// Explicit shard.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        shard: Option<ShardId>,
        /// The tail the client expects.
        expected_offset: Offset,
        /// Correlation id.
        request_id: RequestId,
    },
    /// B->C: an idempotent or conditional publish was refused; nothing was written.
    PublishRefused {
        /// Correlation id.
        request_id: RequestId,
        /// Why.
        reason: PublishRefusalReason,
        /// Human-readable text.
        message: String,
    },

    // ---- Subscribing and reading ---------------------------------------------------
    /// C->B: open a subscription on one shard.
    Subscribe {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// Clients leave it to the broker.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        subscription_id: Option<SubscriptionId>,
        /// Where to start (absent = latest).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        start: Option<StartPosition>,
        /// Shard (absent = 0).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        shard: Option<ShardId>,
        /// Requested broker-side queue size, in batches.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        queue_capacity: Option<u32>,
    },
    /// B->C: the subscription is registered; events follow on a uni stream.
    Subscribed {
        /// Named again in `event_stream_hello`.
        subscription_id: SubscriptionId,
        /// First offset that will be delivered (durable, with a start).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        start_offset: Option<Offset>,
        /// Offset where live delivery begins.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        live_offset: Option<Offset>,
        /// Granted queue size.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        queue_capacity: Option<u32>,
    },
    /// B->C: the requested start offset cannot be served.
    SubscribeCursorError {
        /// Why.
        reason: CursorErrorReason,
        /// What was asked.
        requested: Offset,
        /// Oldest retained (too_old) or the tail (in_future).
        available: Offset,
    },
    /// B->C (uni): first message of an event stream.
    EventStreamHello {
        /// Which subscription or watch this stream carries.
        subscription_id: SubscriptionId,
    },
    /// B->C (uni, last): the shard moved; resume at its new owner.
    ShardMoved {
        /// The subscription.
        subscription_id: SubscriptionId,
        /// Where to resume.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        resume_from: Option<Offset>,
        /// New owner.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        node_id: Option<String>,
        /// Its address.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        addr: Option<String>,
        /// Assignment generation.
        generation: Generation,
    },
    /// B->C (uni, last): the stream was deleted.
    StreamDeleted {
        /// The subscription.
        subscription_id: SubscriptionId,
    },
    /// B->C (uni, last): the subscription dropped a record and ends; resume here.
    SubscriptionLagged {
        /// The subscription.
        subscription_id: SubscriptionId,
        /// The first offset not delivered.
        resume_from: Offset,
    },
    /// B->C: one event (JSON alternative to a binary batch).
    Event {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// The record.
        #[serde(with = "crate::b64")]
        payload: Bytes,
        /// Its offset (durable streams).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        offset: Option<Offset>,
    },
    /// B->C: several events (JSON alternative to a binary batch).
    EventBatch {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// The records.
        #[serde(with = "crate::b64::vec")]
        payloads: Vec<Bytes>,
        /// Offset of the first (record i is at base + i).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        base_offset: Option<Offset>,
    },
    /// C->B: read a bounded range of one shard.
    StreamRead {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// Shard.
        shard: ShardId,
        /// First offset.
        from: Offset,
        /// Exclusive end.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        end: Option<Offset>,
        /// Record cap.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_records: Option<u32>,
        /// Byte cap.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_bytes: Option<u32>,
        /// Correlation id.
        request_id: RequestId,
    },
    /// B->C: records read.
    StreamRecords {
        /// The records.
        records: Vec<StreamRecord>,
        /// Where the next read starts.
        next_offset: Offset,
        /// Correlation id.
        request_id: RequestId,
    },
    /// C->B: the first offset appended at or after a time.
    OffsetForTime {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// Shard.
        shard: ShardId,
        /// Microseconds since the epoch.
        at_micros: u64,
        /// Correlation id.
        request_id: RequestId,
    },
    /// B->C: the answer (absent = nothing that recent).
    OffsetValue {
        /// The offset.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        offset: Option<Offset>,
        /// Correlation id.
        request_id: RequestId,
    },

    // ---- Cache and counters --------------------------------------------------------
    /// C->B: set a key.
    CachePut {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Cache.
        cache: String,
        /// Key.
        key: String,
        /// Value.
        #[serde(with = "crate::b64")]
        value: Bytes,
        /// Correlation id.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        request_id: Option<RequestId>,
        /// Time to live (number or null; null = forever).
        #[serde(default)]
        ttl_ms: Option<u64>,
    },
    /// C->B: read a key.
    CacheGet {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Cache.
        cache: String,
        /// Key.
        key: String,
        /// Correlation id.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        request_id: Option<RequestId>,
    },
    /// C->B: remove a key (needs CACHE_DELETE).
    CacheDelete {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Cache.
        cache: String,
        /// Key.
        key: String,
        /// Correlation id.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        request_id: Option<RequestId>,
    },
    /// B->C: a key's value (null when missing or expired; for a delete, the removed
    /// value).
    CacheValue {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Cache.
        cache: String,
        /// Key.
        key: String,
        /// Value or null.
        #[serde(with = "crate::b64::option")]
        value: Option<Bytes>,
        /// Correlation id.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        request_id: Option<RequestId>,
        /// The value's version (with CACHE_CONDITIONAL).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        version: Option<u64>,
    },
    /// B->C: a put or a group settle was applied.
    CacheOk {
        /// Correlation id.
        request_id: RequestId,
    },
    /// C->B: set a key if a condition holds.
    CachePutIf {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Cache.
        cache: String,
        /// Key.
        key: String,
        /// Value.
        #[serde(with = "crate::b64")]
        value: Bytes,
        /// Time to live.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ttl_ms: Option<u64>,
        /// The precondition.
        condition: CacheCondition,
        /// Correlation id.
        request_id: RequestId,
    },
    /// C->B: remove a key if its version matches.
    CacheDeleteIf {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Cache.
        cache: String,
        /// Key.
        key: String,
        /// Expected version.
        version: u64,
        /// Correlation id.
        request_id: RequestId,
    },
    /// B->C: whether a conditional write applied.
    CacheConditionResult {
        /// Applied?
        applied: bool,
        /// The key's version now.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        version: Option<u64>,
        /// Correlation id.
        request_id: RequestId,
    },
    /// C->B: watch a key or a prefix.
    CacheWatch {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Cache.
        cache: String,
        /// One key (xor `prefix`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        key: Option<String>,
        /// A prefix (xor `key`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        prefix: Option<String>,
        /// Shard, for prefix watches.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        shard: Option<ShardId>,
        /// Resume point.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        from_offset: Option<Offset>,
        /// Deliver current values first.
        #[serde(default, skip_serializing_if = "is_false")]
        retained: bool,
        /// Clients leave it to the broker.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        subscription_id: Option<SubscriptionId>,
    },
    /// B->C: the watch is registered.
    CacheWatchStarted {
        /// Named again in `event_stream_hello`.
        subscription_id: SubscriptionId,
        /// Where it resumes.
        resume_offset: Offset,
        /// The resume point was compacted; current values follow.
        #[serde(default, skip_serializing_if = "is_false")]
        resnapshot: bool,
        /// Number of retained values that follow (0 = empty).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        retained_count: Option<u64>,
    },
    /// B->C (uni): one applied cache write.
    CacheEvent {
        /// Key.
        key: String,
        /// New value (absent = delete).
        #[serde(
            default,
            with = "crate::b64::option",
            skip_serializing_if = "Option::is_none"
        )]
        value: Option<Bytes>,
        /// The write's offset.
        offset: Offset,
        /// Absolute expiry (0 = never).
        expires_at_millis: u64,
    },
    /// B->C (uni, last): the watch lagged and ends.
    CacheWatchLagged {
        /// Resume here.
        resume_from: Offset,
    },
    /// C->B: add to a counter.
    CounterAdd {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Cache.
        cache: String,
        /// Key.
        key: String,
        /// Signed delta.
        delta: i64,
        /// Correlation id.
        request_id: RequestId,
    },
    /// C->B: read a counter.
    CounterGet {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Cache.
        cache: String,
        /// Key.
        key: String,
        /// Correlation id.
        request_id: RequestId,
    },
    /// B->C: a counter's value (absent = never written).
    CounterValue {
        /// The sum.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        value: Option<i64>,
        /// Correlation id.
        request_id: RequestId,
    },

    // ---- Atomic commit and state ---------------------------------------------------
    /// C->B: append one event and apply state changes atomically.
    Commit {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// The entity (routing key, base64 on the wire as every byte field).
        #[serde(with = "crate::b64")]
        entity_key: Bytes,
        /// The event.
        #[serde(with = "crate::b64")]
        event: Bytes,
        /// State changes.
        changes: Vec<StateChange>,
        /// Correlation id.
        request_id: RequestId,
        /// Optimistic concurrency check.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        expected_offset: Option<Offset>,
    },
    /// B->C: the commit's offset (the version of every key written).
    CommitOk {
        /// Correlation id.
        request_id: RequestId,
        /// Offset.
        offset: Offset,
    },
    /// C->B: read one key of an entity's state.
    StateGet {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// Entity (base64 on the wire as every byte field).
        #[serde(with = "crate::b64")]
        entity_key: Bytes,
        /// Key.
        key: String,
        /// Correlation id.
        request_id: RequestId,
    },
    /// B->C: a state value.
    StateValue {
        /// Value or null.
        #[serde(with = "crate::b64::option")]
        value: Option<Bytes>,
        /// Its version.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        version: Option<u64>,
        /// As of this offset.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        as_of: Option<Offset>,
        /// Correlation id.
        request_id: RequestId,
    },

    // ---- Consumer groups -----------------------------------------------------------
    /// C->B: claim records.
    GroupPoll {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// Shard.
        shard: ShardId,
        /// Group.
        group: String,
        /// Record cap.
        max_records: u32,
        /// Long-poll wait.
        #[serde(default)]
        wait_ms: u64,
        /// Correlation id.
        request_id: RequestId,
        /// Named member.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        consumer: Option<String>,
        /// Reclaim the member's claims.
        #[serde(default, skip_serializing_if = "is_false")]
        reclaim: bool,
        /// Claim visibility.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        visibility_ms: Option<u64>,
    },
    /// B->C: claimed records (may be empty).
    GroupRecords {
        /// Records.
        records: Vec<GroupRecord>,
        /// Correlation id.
        request_id: RequestId,
    },
    /// C->B: acknowledge a claimed record.
    GroupAck {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// Shard.
        shard: ShardId,
        /// Group.
        group: String,
        /// Record.
        offset: Offset,
        /// Correlation id.
        request_id: RequestId,
    },
    /// C->B: release a claimed record for redelivery.
    GroupNack {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// Shard.
        shard: ShardId,
        /// Group.
        group: String,
        /// Record.
        offset: Offset,
        /// Correlation id.
        request_id: RequestId,
        /// Redeliver after.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        delay_ms: Option<u64>,
        /// The attempt being nacked.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        attempts: Option<u32>,
    },
    /// C->B: extend a claim.
    GroupExtend {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// Shard.
        shard: ShardId,
        /// Group.
        group: String,
        /// Record.
        offset: Offset,
        /// Correlation id.
        request_id: RequestId,
        /// The attempt being extended.
        attempts: u32,
        /// Extension.
        extend_ms: u64,
    },
    /// B->C: the claim's new visibility.
    GroupExtended {
        /// Granted.
        visible_ms: u64,
        /// Correlation id.
        request_id: RequestId,
    },
    /// C->B: dead-letter a claimed record (answered `cache_ok`).
    GroupDeadLetter {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// Shard.
        shard: ShardId,
        /// Group.
        group: String,
        /// Record.
        offset: Offset,
        /// Correlation id.
        request_id: RequestId,
    },
    /// C->B: list dead letters.
    GroupDeadLetters {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// Shard.
        shard: ShardId,
        /// Group.
        group: String,
        /// Correlation id.
        request_id: RequestId,
    },
    /// B->C: dead-lettered offsets.
    GroupDeadLetterList {
        /// Offsets.
        offsets: Vec<Offset>,
        /// Correlation id.
        request_id: RequestId,
    },
    /// C->B: drop a dead letter.
    GroupDiscard {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// Shard.
        shard: ShardId,
        /// Group.
        group: String,
        /// Record.
        offset: Offset,
        /// Correlation id.
        request_id: RequestId,
    },
    /// C->B: make a dead letter owed again.
    GroupRedrive {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// Shard.
        shard: ShardId,
        /// Group.
        group: String,
        /// Record.
        offset: Offset,
        /// Correlation id.
        request_id: RequestId,
    },
    /// C->B: move (or create) a group's cursor.
    GroupSeek {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// Shard.
        shard: ShardId,
        /// Group.
        group: String,
        /// Target.
        start: StartPosition,
        /// Only when the group does not exist yet.
        #[serde(default, skip_serializing_if = "is_false")]
        if_new: bool,
        /// Correlation id.
        request_id: RequestId,
    },
    /// B->C: the group's position.
    GroupPosition {
        /// Cursor.
        offset: Offset,
        /// Did it move?
        moved: bool,
        /// Correlation id.
        request_id: RequestId,
    },
    /// C->B: describe a group.
    GroupDescribe {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// Shard.
        shard: ShardId,
        /// Group.
        group: String,
        /// Correlation id.
        request_id: RequestId,
    },
    /// B->C: a group's state.
    GroupInfo {
        /// Committed cursor.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        committed: Option<Offset>,
        /// Shard tail.
        tail: Offset,
        /// Claimed records.
        in_flight: u64,
        /// Records owed redelivery.
        owed: u64,
        /// Dead letters.
        dead_letters: u64,
        /// Correlation id.
        request_id: RequestId,
    },
    /// C->B: delete a group.
    GroupDelete {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// Shard.
        shard: ShardId,
        /// Group.
        group: String,
        /// Correlation id.
        request_id: RequestId,
    },
    /// B->C: whether it existed.
    GroupDeleted {
        /// Existed?
        existed: bool,
        /// Correlation id.
        request_id: RequestId,
    },

    // ---- Operator inspection (FEATURE_INSPECT) -------------------------------------
    /// C->B: inspect one shard.
    ShardInspect {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream or cache.
        name: String,
        /// Which.
        kind: ShardKind,
        /// Shard.
        shard: ShardId,
        /// Correlation id.
        request_id: RequestId,
    },
    /// B->C: the shard's view (operator-facing; kept as free-form JSON).
    ShardInspectInfo {
        /// View.
        view: serde_json::Value,
        /// Correlation id.
        request_id: RequestId,
    },
    /// C->B: list subscriptions on this broker.
    SubscriptionsList {
        /// Filter.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        filter: Option<serde_json::Value>,
        /// Page size (default 100, max 1000).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        limit: Option<u32>,
        /// Page cursor.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cursor: Option<String>,
        /// Correlation id.
        request_id: RequestId,
    },
    /// B->C: one page of subscriptions.
    SubscriptionsListInfo {
        /// This broker.
        node_id: String,
        /// Subscriptions.
        subscriptions: Vec<serde_json::Value>,
        /// Next page.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        next_cursor: Option<String>,
        /// Correlation id.
        request_id: RequestId,
    },

    /// A `type` this implementation does not know. Never sent; see [`peek_request`].
    #[serde(other)]
    Unknown,
}

/// Why a JSON payload is not a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MessageError {
    /// Not JSON, or not an object.
    #[error("message is not a JSON object: {detail}")]
    Syntax {
        /// The parser's complaint.
        detail: String,
    },
    /// No string `type` field.
    #[error("message has no string \"type\" field")]
    MissingType,
    /// A known type whose fields are missing or of the wrong type.
    #[error("`{message_type}` message has invalid fields: {detail}")]
    InvalidFields {
        /// The message's `type`.
        message_type: String,
        /// Which field and why.
        detail: String,
    },
    /// More values than a message may hold ([`JSON_VALUES_MAX`]).
    #[error("message holds more than {max} values")]
    TooManyValues {
        /// The bound.
        max: usize,
    },
    /// Encoding failed (a frame longer than u32::MAX).
    #[error(transparent)]
    Frame(#[from] FrameError),
}

/// The `type` and `request_id` of a payload, read without decoding the rest: how a
/// broker names a request it does not know in `unsupported`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct RequestSummary {
    /// The `type` field.
    #[serde(rename = "type")]
    pub request_type: String,
    /// The `request_id` field, when it is an integer.
    #[serde(default, deserialize_with = "lenient_request_id")]
    pub request_id: Option<RequestId>,
    /// The `name` field of an `extension`.
    #[serde(default, deserialize_with = "lenient_string")]
    pub name: Option<String>,
}

fn lenient_request_id<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<RequestId>, D::Error> {
    let v = serde_json::Value::deserialize(d)?;
    Ok(v.as_u64().map(RequestId))
}

fn lenient_string<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    let v = serde_json::Value::deserialize(d)?;
    Ok(v.as_str().map(str::to_owned))
}

/// Reads `type` and `request_id` from a payload; `None` when it has no string `type`.
pub fn peek_request(payload: &[u8]) -> Option<RequestSummary> {
    serde_json::from_slice(payload).ok()
}

/// Writes the messages that carry record payloads (`group_records`, `cache_value`,
/// `stream_records`, `event_batch`) straight into `out`, byte for byte as serde writes
/// them; `false` for any other message. serde_json writes a byte field by building its
/// base64 string and then scanning every character of it for escapes, which base64
/// never needs: for a poll's answer of 1 KiB records that scan and copy were about a
/// sixth of the broker's CPU. Here base64 is written in place and only the other
/// strings are escaped (by serde). Each field is written as its opening (`,"name":`)
/// then its value; every struct is taken apart whole, so a field added later does not
/// compile until it is written here.
fn encode_payload_answer(m: &Message, out: &mut BytesMut) -> bool {
    match m {
        Message::GroupRecords {
            records,
            request_id,
        } => {
            out.put_slice(br#"{"type":"group_records""#);
            put_list(
                out,
                br#","records":"#,
                records,
                |r| &r.payload,
                |out, r| {
                    let GroupRecord {
                        offset,
                        payload,
                        attempts,
                        skipped_before,
                        publisher,
                        timestamp_micros,
                    } = r;
                    put_number(out, br#"{"offset":"#, offset.0);
                    put_base64(out, br#","payload":"#, payload);
                    put_number(out, br#","attempts":"#, u64::from(*attempts));
                    if *skipped_before != 0 {
                        put_number(out, br#","skipped_before":"#, *skipped_before);
                    }
                    if let Some(p) = publisher {
                        put_string(out, br#","publisher":"#, p);
                    }
                    if let Some(t) = timestamp_micros {
                        put_number(out, br#","timestamp_micros":"#, *t);
                    }
                    out.put_u8(b'}');
                },
            );
            put_number(out, br#","request_id":"#, request_id.0);
        }
        Message::CacheValue {
            tenant_id,
            namespace,
            cache,
            key,
            value,
            request_id,
            version,
        } => {
            put_string(out, br#"{"type":"cache_value","tenant_id":"#, tenant_id);
            put_string(out, br#","namespace":"#, namespace);
            put_string(out, br#","cache":"#, cache);
            put_string(out, br#","key":"#, key);
            match value {
                Some(v) => put_base64(out, br#","value":"#, v),
                None => out.put_slice(br#","value":null"#),
            }
            if let Some(r) = request_id {
                put_number(out, br#","request_id":"#, r.0);
            }
            if let Some(v) = version {
                put_number(out, br#","version":"#, *v);
            }
        }
        Message::StreamRecords {
            records,
            next_offset,
            request_id,
        } => {
            out.put_slice(br#"{"type":"stream_records""#);
            put_list(
                out,
                br#","records":"#,
                records,
                |r| &r.payload,
                |out, r| {
                    let StreamRecord {
                        offset,
                        payload,
                        publisher,
                        timestamp_micros,
                    } = r;
                    put_number(out, br#"{"offset":"#, offset.0);
                    put_base64(out, br#","payload":"#, payload);
                    if let Some(p) = publisher {
                        put_string(out, br#","publisher":"#, p);
                    }
                    put_number(out, br#","timestamp_micros":"#, *timestamp_micros);
                    out.put_u8(b'}');
                },
            );
            put_number(out, br#","next_offset":"#, next_offset.0);
            put_number(out, br#","request_id":"#, request_id.0);
        }
        Message::EventBatch {
            tenant_id,
            namespace,
            stream,
            payloads,
            base_offset,
        } => {
            put_string(out, br#"{"type":"event_batch","tenant_id":"#, tenant_id);
            put_string(out, br#","namespace":"#, namespace);
            put_string(out, br#","stream":"#, stream);
            put_list(
                out,
                br#","payloads":"#,
                payloads,
                |p| p,
                |out, p| put_base64(out, b"", p),
            );
            if let Some(o) = base_offset {
                put_number(out, br#","base_offset":"#, o.0);
            }
        }
        _ => return false,
    }
    out.put_u8(b'}');
    true
}

/// `name`, then `items` as a JSON array, each written by `put`; room is reserved first
/// for every item's `payload` as base64 and some bytes more for its other fields.
fn put_list<T>(
    out: &mut BytesMut,
    name: &[u8],
    items: &[T],
    payload: impl Fn(&T) -> &[u8],
    put: impl Fn(&mut BytesMut, &T),
) {
    let bytes: usize = items.iter().map(|i| payload(i).len()).sum();
    out.reserve(name.len() + 2 + bytes.div_ceil(3) * 4 + items.len() * 64);
    out.put_slice(name);
    out.put_u8(b'[');
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.put_u8(b',');
        }
        put(out, item);
    }
    out.put_u8(b']');
}

/// `name` (a field's opening, up to its colon) then `n` in decimal.
fn put_number(out: &mut BytesMut, name: &[u8], n: u64) {
    out.put_slice(name);
    out.put_slice(itoa::Buffer::new().format(n).as_bytes());
}

/// `name` then `s` as a JSON string, escaped as serde_json escapes it.
fn put_string(out: &mut BytesMut, name: &[u8], s: &str) {
    out.put_slice(name);
    serde_json::to_writer(out.writer(), s).expect("a string serializes");
}

/// `name` then `bytes` as a quoted standard base64 string, encoded in place.
fn put_base64(out: &mut BytesMut, name: &[u8], bytes: &[u8]) {
    use base64::Engine;
    out.put_slice(name);
    let len = bytes.len().div_ceil(3) * 4;
    out.put_u8(b'"');
    let at = out.len();
    out.resize(at + len, 0);
    let written = base64::engine::general_purpose::STANDARD
        .encode_slice(bytes, &mut out[at..])
        .expect("sized for padded base64");
    debug_assert_eq!(written, len);
    out.put_u8(b'"');
}

/// Most values (array elements and object fields, counted by the commas between them)
/// a client's JSON request may hold. Decoding an internally tagged message buffers every field
/// as a generic value first, about 32 bytes an element: a 16 MiB frame of `[0,0,...]`
/// took over 256 MiB to decode. A million is far past any message's need (a publish
/// batch's payloads are one value each).
pub const JSON_VALUES_MAX: usize = 1 << 20;

/// Whether `payload` holds at most `max` commas outside strings.
fn json_values_within(payload: &[u8], max: usize) -> bool {
    let mut commas = 0usize;
    let mut i = 0;
    while i < payload.len() {
        match payload[i] {
            b'"' => i = string_end(payload, i + 1),
            b',' => {
                commas += 1;
                if commas > max {
                    return false;
                }
            }
            _ => {}
        }
        i += 1;
    }
    true
}

/// Where the JSON string whose text starts at `i` ends: its closing quote, or past the
/// payload's end. Byte by byte for the first 32 bytes (names, ids), then memchr's
/// vector search (a request's base64 values are most of its bytes).
#[inline]
fn string_end(payload: &[u8], mut i: usize) -> usize {
    let short = payload.len().min(i + 32);
    while i < short {
        match payload[i] {
            b'\\' => i += 2,
            b'"' => return i,
            _ => i += 1,
        }
    }
    while let Some(k) = payload
        .get(i..)
        .and_then(|rest| memchr::memchr2(b'"', b'\\', rest))
    {
        i += k;
        if payload[i] == b'"' {
            return i;
        }
        i += 2;
    }
    payload.len()
}

impl Message {
    /// Decodes a client's request: as [`Message::decode`], refusing first a payload of
    /// more than [`JSON_VALUES_MAX`] values. (Only requests: a broker's answers, such
    /// as a long dead-letter list, may hold more.)
    pub fn decode_request(payload: &[u8]) -> Result<Message, MessageError> {
        if !json_values_within(payload, JSON_VALUES_MAX) {
            return Err(MessageError::TooManyValues {
                max: JSON_VALUES_MAX,
            });
        }
        Message::decode(payload)
    }

    /// Decodes a JSON payload (a frame with flags 0).
    pub fn decode(payload: &[u8]) -> Result<Message, MessageError> {
        if let Some(m) = crate::hot::decode(payload) {
            return Ok(m);
        }
        match serde_json::from_slice::<Message>(payload) {
            Ok(m) => Ok(m),
            Err(e) if e.is_data() => match peek_request(payload) {
                Some(summary) => Err(MessageError::InvalidFields {
                    message_type: summary.request_type,
                    detail: e.to_string(),
                }),
                None => Err(MessageError::MissingType),
            },
            Err(e) => Err(MessageError::Syntax {
                detail: e.to_string(),
            }),
        }
    }

    /// The JSON payload.
    pub fn to_payload(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("every Message variant but Unknown serializes")
    }

    /// Appends this message as a whole frame (flags 0) to `buf`.
    pub fn encode_frame(&self, buf: &mut BytesMut) -> Result<(), MessageError> {
        let start = frame::begin_frame(buf, Flags::JSON);
        if !encode_payload_answer(self, buf) {
            serde_json::to_writer(buf.writer(), self)
                .expect("every Message variant but Unknown serializes");
        }
        let written = frame::finish_frame(buf, start);
        if written.is_err() {
            buf.truncate(start);
        }
        Ok(written?)
    }

    /// This message as one frame.
    pub fn to_frame(&self) -> Bytes {
        let mut buf = BytesMut::with_capacity(128);
        self.encode_frame(&mut buf)
            .expect("a JSON message fits a frame");
        buf.freeze()
    }

    /// The `request_id` this message carries, if any.
    pub fn request_id(&self) -> Option<RequestId> {
        use Message::*;
        match self {
            Unsupported { request_id, .. }
            | Extension { request_id, .. }
            | Publish { request_id, .. }
            | PublishBatch { request_id, .. }
            | CachePut { request_id, .. }
            | CacheGet { request_id, .. }
            | CacheDelete { request_id, .. }
            | CacheValue { request_id, .. } => *request_id,
            StreamShards { request_id, .. }
            | StreamShardsView { request_id, .. }
            | CacheShards { request_id, .. }
            | CacheShardsView { request_id, .. }
            | ShardOwners { request_id, .. }
            | ShardOwnersView { request_id, .. }
            | PublishOk { request_id, .. }
            | PublishError { request_id, .. }
            | ProducerInit { request_id }
            | ProducerInitOk { request_id, .. }
            | PublishIdempotent { request_id, .. }
            | PublishIf { request_id, .. }
            | PublishRefused { request_id, .. }
            | StreamRead { request_id, .. }
            | StreamRecords { request_id, .. }
            | OffsetForTime { request_id, .. }
            | OffsetValue { request_id, .. }
            | CacheOk { request_id }
            | CachePutIf { request_id, .. }
            | CacheDeleteIf { request_id, .. }
            | CacheConditionResult { request_id, .. }
            | CounterAdd { request_id, .. }
            | CounterGet { request_id, .. }
            | CounterValue { request_id, .. }
            | Commit { request_id, .. }
            | CommitOk { request_id, .. }
            | StateGet { request_id, .. }
            | StateValue { request_id, .. }
            | GroupPoll { request_id, .. }
            | GroupRecords { request_id, .. }
            | GroupAck { request_id, .. }
            | GroupNack { request_id, .. }
            | GroupExtend { request_id, .. }
            | GroupExtended { request_id, .. }
            | GroupDeadLetter { request_id, .. }
            | GroupDeadLetters { request_id, .. }
            | GroupDeadLetterList { request_id, .. }
            | GroupDiscard { request_id, .. }
            | GroupRedrive { request_id, .. }
            | GroupSeek { request_id, .. }
            | GroupPosition { request_id, .. }
            | GroupDescribe { request_id, .. }
            | GroupInfo { request_id, .. }
            | GroupDelete { request_id, .. }
            | GroupDeleted { request_id, .. }
            | ShardInspect { request_id, .. }
            | ShardInspectInfo { request_id, .. }
            | SubscriptionsList { request_id, .. }
            | SubscriptionsListInfo { request_id, .. } => Some(*request_id),
            Auth { .. }
            | AuthOk { .. }
            | Ok
            | Error { .. }
            | Topology
            | TopologyView { .. }
            | NotLeader { .. }
            | Subscribe { .. }
            | Subscribed { .. }
            | SubscribeCursorError { .. }
            | EventStreamHello { .. }
            | ShardMoved { .. }
            | StreamDeleted { .. }
            | SubscriptionLagged { .. }
            | Event { .. }
            | EventBatch { .. }
            | CacheWatch { .. }
            | CacheWatchStarted { .. }
            | CacheEvent { .. }
            | CacheWatchLagged { .. }
            | Unknown => None,
        }
    }

    /// A coded `error` message of class `retry` (usually the code's
    /// [`ErrorCode::default_retry`]). The code and class are included only when the
    /// peer offered ERROR_CODES (`coded`).
    pub fn error(
        message: impl Into<String>,
        code: ErrorCode,
        retry: RetryClass,
        detail: Option<ErrorDetail>,
        coded: bool,
    ) -> Message {
        if coded {
            Message::Error {
                message: message.into(),
                code: Some(code),
                retry: Some(retry),
                detail,
            }
        } else {
            Message::Error {
                message: message.into(),
                code: None,
                retry: None,
                detail: None,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The byte fields the reference names (a commit's and a state read's entity key
    /// among them) are base64 on the wire, and a shard owner's `unavailable` is a
    /// reason string: as the standard SDK writes and reads them (the entity key was
    /// read as text, so commits routed by the base64 of the SDK's key; the flag failed
    /// the SDK's decoding of a whole owners answer).
    #[test]
    fn entity_keys_are_base64_and_an_owners_unavailability_a_reason() {
        let commit = Message::decode(
            br#"{"type":"state_get","tenant_id":"t","namespace":"n","stream":"s","entity_key":"aw==","key":"x","request_id":1}"#,
        )
        .unwrap();
        assert!(
            matches!(&commit, Message::StateGet { entity_key, .. } if entity_key.as_ref() == b"k"),
            "{commit:?}"
        );
        let view = br#"{"type":"shard_owners_view","owners":[{"shard":0,"generation":3,"unavailable":"owner_unavailable"}],"request_id":2}"#;
        let m = Message::decode(view).unwrap();
        let Message::ShardOwnersView { owners, .. } = &m else {
            panic!("{m:?}")
        };
        assert_eq!(owners[0].unavailable.as_deref(), Some("owner_unavailable"));
        assert_eq!(m.to_payload().as_slice(), view.as_slice());
    }

    /// A message of more values than any needs is refused before it is decoded: a
    /// 16 MiB frame of `[0,0,...]` took over 256 MiB to decode (every field buffered
    /// as a generic value first). Commas inside strings, escaped quotes included, are
    /// not values.
    #[test]
    fn a_message_of_too_many_values_is_refused_before_decoding() {
        let mut padded = br#"{"type":"topology","x":["#.to_vec();
        padded.extend(std::iter::repeat_n(&b"0,"[..], JSON_VALUES_MAX + 1).flatten());
        padded.extend_from_slice(b"0]}");
        assert_eq!(
            Message::decode_request(&padded).unwrap_err(),
            MessageError::TooManyValues {
                max: JSON_VALUES_MAX
            }
        );
        let text = format!(
            r#"{{"type":"topology","note":"a \",{}"}}"#,
            ",".repeat(JSON_VALUES_MAX + 1)
        );
        assert!(json_values_within(text.as_bytes(), JSON_VALUES_MAX));
        assert!(!json_values_within(b"[1,2,3]", 1));
        assert!(json_values_within(b"[1,2,3]", 2));
    }

    /// The count byte by byte, as it was before it searched with memchr.
    fn values_within_bytewise(payload: &[u8], max: usize) -> bool {
        let mut commas = 0usize;
        let mut i = 0;
        while i < payload.len() {
            match payload[i] {
                b'"' => {
                    i += 1;
                    while i < payload.len() {
                        match payload[i] {
                            b'\\' => i += 2,
                            b'"' => break,
                            _ => i += 1,
                        }
                    }
                }
                b',' => {
                    commas += 1;
                    if commas > max {
                        return false;
                    }
                }
                _ => {}
            }
            i += 1;
        }
        true
    }

    proptest::proptest! {
        /// The vector search counts as the byte loop did, on text made of the bytes
        /// that matter (quotes, escapes, commas) and others, cut anywhere.
        #[test]
        fn the_value_count_is_the_bytewise_one(
            bytes in proptest::collection::vec(
                proptest::prop_oneof![
                    40 => proptest::strategy::Just(b'a'),
                    2 => proptest::strategy::Just(b'"'),
                    1 => proptest::strategy::Just(b'\\'),
                    2 => proptest::strategy::Just(b','),
                    1 => proptest::strategy::Just(b'{'),
                ],
                0..400,
            ),
            max in 0usize..12,
        ) {
            proptest::prop_assert_eq!(
                json_values_within(&bytes, max),
                values_within_bytewise(&bytes, max)
            );
        }
    }

    /// The payload answers written in place are byte for byte what serde writes,
    /// whatever their optional fields and whatever their strings need escaped.
    #[test]
    fn payload_answers_written_in_place_match_serde_byte_for_byte() {
        let record =
            |offset: u64, size: usize, attempts, skipped, publisher: Option<&str>, t| GroupRecord {
                offset: Offset(offset),
                payload: Bytes::from((0..size).map(|i| i as u8).collect::<Vec<u8>>()),
                attempts,
                skipped_before: skipped,
                publisher: publisher.map(str::to_owned),
                timestamp_micros: t,
            };
        let messages = [
            Message::GroupRecords {
                records: vec![],
                request_id: RequestId(0),
            },
            Message::GroupRecords {
                records: vec![
                    record(0, 0, 0, 0, None, None),
                    record(1, 1, 1, 0, None, None),
                    record(2, 2, 2, 3, Some("svc \"a\"\n\u{1}\u{e9}/\\"), Some(0)),
                    record(u64::MAX, 1024, u32::MAX, u64::MAX, Some(""), Some(u64::MAX)),
                    record(10, 1025, 7, 1, None, Some(17)),
                ],
                request_id: RequestId(u64::MAX),
            },
            Message::CacheValue {
                tenant_id: "t".into(),
                namespace: "n\ts".into(),
                cache: "c\"".into(),
                key: "k\u{7f}\u{2028}\u{1f600}".into(),
                value: Some(Bytes::from_static(b"\x00\xff\xfe value")),
                request_id: Some(RequestId(12345678901)),
                version: Some(0),
            },
            Message::CacheValue {
                tenant_id: String::new(),
                namespace: "ns".into(),
                cache: "c".into(),
                key: "k".into(),
                value: None,
                request_id: None,
                version: None,
            },
            Message::CacheValue {
                tenant_id: "t".into(),
                namespace: "ns".into(),
                cache: "c".into(),
                key: "k".into(),
                value: Some(Bytes::new()),
                request_id: Some(RequestId(1)),
                version: None,
            },
            Message::StreamRecords {
                records: vec![],
                next_offset: Offset(0),
                request_id: RequestId(0),
            },
            Message::StreamRecords {
                records: vec![
                    StreamRecord {
                        offset: Offset(5),
                        payload: Bytes::from_static(b"ab"),
                        publisher: None,
                        timestamp_micros: 0,
                    },
                    StreamRecord {
                        offset: Offset(u64::MAX),
                        payload: Bytes::from(vec![9u8; 1025]),
                        publisher: Some("p\"\u{0}\u{e9}".into()),
                        timestamp_micros: u64::MAX,
                    },
                ],
                next_offset: Offset(u64::MAX),
                request_id: RequestId(42),
            },
            Message::EventBatch {
                tenant_id: "t\\".into(),
                namespace: "ns".into(),
                stream: "s\u{1f}".into(),
                payloads: vec![],
                base_offset: None,
            },
            Message::EventBatch {
                tenant_id: "t".into(),
                namespace: "ns".into(),
                stream: "s".into(),
                payloads: vec![
                    Bytes::new(),
                    Bytes::from_static(b"x"),
                    Bytes::from(vec![1u8; 3000]),
                ],
                base_offset: Some(Offset(7)),
            },
        ];
        for m in messages {
            let mut direct = BytesMut::new();
            assert!(encode_payload_answer(&m, &mut direct), "{m:?}");
            let serde = serde_json::to_vec(&m).unwrap();
            assert_eq!(
                std::str::from_utf8(&direct).unwrap(),
                std::str::from_utf8(&serde).unwrap()
            );
            // And through the frame encoder, decoding back to the message.
            let frame = m.to_frame();
            assert_eq!(&frame[frame.len() - serde.len()..], &serde[..]);
            assert_eq!(Message::decode(&serde), Ok(m));
        }
    }

    #[test]
    fn unknown_type_is_not_an_error() {
        let payload = br#"{"type":"teleport","request_id":5,"x":1}"#;
        assert_eq!(Message::decode(payload), Ok(Message::Unknown));
        let summary = peek_request(payload).unwrap();
        assert_eq!(summary.request_type, "teleport");
        assert_eq!(summary.request_id, Some(RequestId(5)));
    }

    #[test]
    fn bad_json_is_typed_and_names_the_message() {
        assert!(matches!(
            Message::decode(b"{not json"),
            Err(MessageError::Syntax { .. })
        ));
        assert!(matches!(
            Message::decode(b"[1,2]"),
            Err(MessageError::MissingType) | Err(MessageError::Syntax { .. })
        ));
        assert_eq!(
            Message::decode(br#"{"tenant_id":"t"}"#),
            Err(MessageError::MissingType)
        );
        match Message::decode(br#"{"type":"publish","tenant_id":7}"#) {
            Err(MessageError::InvalidFields { message_type, .. }) => {
                assert_eq!(message_type, "publish")
            }
            other => panic!("{other:?}"),
        }
        match Message::decode(br#"{"type":"cache_put","tenant_id":"t","namespace":"n","cache":"c","key":"k","value":"!!","ttl_ms":null}"#) {
            Err(MessageError::InvalidFields { detail, .. }) => assert!(detail.contains("base64"), "{detail}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn unknown_fields_are_ignored() {
        let m = Message::decode(br#"{"type":"ok","future":true}"#).unwrap();
        assert_eq!(m, Message::Ok);
    }

    #[test]
    fn start_positions_use_the_documented_shapes() {
        let json = |p: StartPosition| serde_json::to_string(&p).unwrap();
        assert_eq!(json(StartPosition::Latest), r#""latest""#);
        assert_eq!(json(StartPosition::Earliest), r#""earliest""#);
        assert_eq!(json(StartPosition::Offset(Offset(9))), r#"{"offset":9}"#);
    }

    #[test]
    fn refusal_reasons_use_the_documented_shapes() {
        let json = |r: PublishRefusalReason| serde_json::to_string(&r).unwrap();
        assert_eq!(
            json(PublishRefusalReason::SequenceGap {
                expected: Sequence(3)
            }),
            r#"{"sequence_gap":{"expected":3}}"#
        );
        assert_eq!(
            json(PublishRefusalReason::UnknownProducer),
            r#""unknown_producer""#
        );
        assert_eq!(
            json(PublishRefusalReason::OffsetMismatch { tail: Offset(4) }),
            r#"{"offset_mismatch":{"tail":4}}"#
        );
        assert_eq!(
            serde_json::to_string(&CacheCondition::Version(2)).unwrap(),
            r#"{"version":2}"#
        );
        assert_eq!(
            serde_json::to_string(&CacheCondition::Absent).unwrap(),
            r#""absent""#
        );
    }

    #[test]
    fn cache_put_without_ttl_sends_null_and_accepts_absent() {
        let m = Message::CachePut {
            tenant_id: "t".into(),
            namespace: "n".into(),
            cache: "c".into(),
            key: "k".into(),
            value: Bytes::from_static(b"v"),
            request_id: None,
            ttl_ms: None,
        };
        let s = String::from_utf8(m.to_payload()).unwrap();
        assert!(s.ends_with(r#""ttl_ms":null}"#), "{s}");
        let absent = br#"{"type":"cache_put","tenant_id":"t","namespace":"n","cache":"c","key":"k","value":"dg=="}"#;
        assert_eq!(Message::decode(absent).unwrap(), m);
    }
}
