//! Dispatch: each frame is decoded once into a [`Request`], then decided into one
//! [`Action`] against a [`Directory`] (names, shard routes) at `now`. No I/O: the driver
//! carries the action out and encodes its outcome through [`crate::session::answer`].
//!
//! One publish path serves binary and JSON publishes alike: authorize, look the stream
//! up (creating it in dev mode only for a token that may write it), pick the shard,
//! resolve its owner, then append here, forward to the leader, or refuse.

use std::rc::Rc;
use std::sync::Arc;

use bytes::Bytes;
use felix_core_runtime::clock::Now;
use felix_core_runtime::placement::{ShardKey, ShardKind};
use felix_wire::binary::WireStr;
use felix_wire::flags::FrameKind;
use felix_wire::frame::FrameError;
use felix_wire::message::{self, RequestSummary, StartPosition};
use felix_wire::{Features, Frame, Generation, Message, PublishBatch, RequestId, ShardId, routing};

use crate::auth::Action as Perm;
use crate::catalog::Entry;
use crate::cluster::{Resolved, Route};
use crate::core::{CacheOp, WriteIf};
use crate::error::{BrokerError, cut};
use crate::groups::GroupOp;
use crate::session::Session;
use crate::session::answer::{self, AnswerTo};

/// What dispatch needs to know about names and routes. The broker's core implements
/// it; tests and the fuzz target use an in-memory one.
pub trait Directory {
    /// A stream, created with the defaults when `create` (dev mode).
    fn stream(&self, t: &str, ns: &str, s: &str, create: bool) -> Result<Rc<Entry>, BrokerError>;
    /// A cache, created with the defaults when `create` (dev mode).
    fn cache(&self, t: &str, ns: &str, c: &str, create: bool) -> Result<Rc<Entry>, BrokerError>;
    /// Who serves a shard.
    fn resolve(&self, key: &ShardKey) -> Resolved;
    /// Live brokers clients may use: `(node_id, addr)`.
    fn topology(&self) -> Vec<(String, String)>;
    /// The route of every shard of a stream or cache.
    fn owners(&self, kind: ShardKind, t: &str, ns: &str, name: &str) -> Vec<(u32, Route)>;
}

/// A publish, from either layout.
#[derive(Debug, Clone)]
pub struct Publish {
    /// Tenant.
    pub tenant: WireStr,
    /// Namespace.
    pub namespace: WireStr,
    /// Stream.
    pub stream: WireStr,
    /// Routing key.
    pub key: Option<Bytes>,
    /// Explicit shard (JSON only).
    pub shard: Option<u32>,
    /// The records (slices of the received frame).
    pub records: Vec<Bytes>,
    /// Who is owed the answer.
    pub answer: AnswerTo,
    /// The request as received, framed again for a leader if it must be forwarded.
    pub wire: Received,
    /// What it is written under (an idempotent producer's batch, a `publish_if`).
    pub condition: Option<WriteIf>,
}

/// What a record costs in memory beyond its payload until it is written (its `Bytes`
/// handle in the batch, its length prefix in the log's buffer): charged to the
/// connection's publish budget with the payload, so a frame of millions of empty records
/// is not free.
const RECORD_OVERHEAD_BYTES: usize = 48;

/// What any request is held against the request budgets at least: about what its own
/// task and futures take while it is worked on. Charged by their records alone, a
/// stream of unacknowledged publishes of one empty record each (48 bytes) held some
/// 21,000 tasks per MiB of budget waiting for a slow disk or a held shard, 4 KiB each in
/// a debug build (`bounds::unacknowledged_publishes_in_flight_are_charged_a_requests_cost`):
/// the default 64 MiB let one connection hold about 6 GB.
pub const REQUEST_MIN_CHARGE: usize = 4096;

impl Publish {
    /// What the publish holds until it is written: payload bytes and each record's
    /// overhead.
    pub fn bytes(&self) -> usize {
        self.records
            .iter()
            .map(|r| r.len() + RECORD_OVERHEAD_BYTES)
            .sum()
    }
}

/// A bounded read by position.
#[derive(Debug, Clone, Copy)]
pub enum Query {
    /// `stream_read`: from, end, max records, max bytes.
    Range(u64, Option<u64>, Option<u32>, Option<u32>),
    /// `offset_for_time`: the instant, microseconds since the epoch.
    OffsetForTime(u64),
}

/// What a state request does.
#[derive(Debug, Clone)]
pub enum StateRequest {
    /// `commit`.
    Commit {
        /// The event.
        event: Bytes,
        /// The changes.
        changes: Vec<crate::state::Change>,
        /// Optimistic concurrency.
        expected: Option<u64>,
    },
    /// `state_get`.
    Get(String),
}

/// The operation of a cache request.
#[derive(Debug, Clone)]
pub enum CacheRequestOp {
    /// `cache_get`.
    Get,
    /// `cache_put` with an optional TTL.
    Put(Bytes, Option<u64>),
    /// `cache_delete`.
    Delete,
    /// `cache_put_if`.
    PutIf(Bytes, Option<u64>, message::CacheCondition),
    /// `cache_delete_if`.
    DeleteIf(u64),
    /// `counter_add`.
    CounterAdd(i64),
    /// `counter_get`.
    CounterGet,
}

/// A cache request.
#[derive(Debug, Clone)]
pub struct CacheRequest {
    /// Tenant.
    pub tenant: String,
    /// Namespace.
    pub namespace: String,
    /// Cache.
    pub cache: String,
    /// Key.
    pub key: String,
    /// Correlation id.
    pub request_id: Option<RequestId>,
    /// What to do.
    pub op: CacheRequestOp,
    /// The request as received, for forwarding.
    pub wire: Received,
}

/// One request, decoded once.
#[derive(Debug, Clone)]
pub enum Request {
    /// Binary or JSON publish.
    Publish(Publish),
    /// How many shards a stream has.
    StreamShards {
        /// Tenant.
        tenant: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// Correlation.
        request_id: RequestId,
    },
    /// How many shards a cache has.
    CacheShards {
        /// Tenant.
        tenant: String,
        /// Namespace.
        namespace: String,
        /// Cache.
        cache: String,
        /// Correlation.
        request_id: RequestId,
    },
    /// Which brokers a client may use.
    Topology,
    /// An idempotent producer asks for its id.
    ProducerInit(RequestId),
    /// Subscribe to one shard of a stream.
    Subscribe {
        /// Tenant.
        tenant: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// Shard (0 when absent).
        shard: Option<ShardId>,
        /// Where to start.
        start: Option<StartPosition>,
    },
    /// Who leads each shard.
    ShardOwners {
        /// Tenant.
        tenant: String,
        /// Namespace.
        namespace: String,
        /// Stream or cache.
        name: String,
        /// Which.
        kind: message::ShardKind,
        /// Correlation.
        request_id: RequestId,
    },
    /// Cache get, put or delete.
    Cache(CacheRequest),
    /// Watch a cache key or prefix.
    CacheWatch {
        /// Tenant.
        tenant: String,
        /// Namespace.
        namespace: String,
        /// Cache.
        cache: String,
        /// Keys followed.
        filter: crate::shard::WatchFilter,
        /// Shard (prefix watches; a key picks its own).
        shard: Option<ShardId>,
        /// Resume offset.
        from: Option<u64>,
        /// Current values first.
        retained: bool,
    },
    /// `stream_read`.
    StreamRead {
        /// Tenant.
        tenant: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// Shard.
        shard: u32,
        /// Correlation.
        request_id: RequestId,
        /// What to read.
        query: Query,
    },
    /// An atomic commit or a state read on the stream shard `entity_key` routes to.
    State {
        /// Tenant.
        tenant: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// Routing key.
        entity_key: Bytes,
        /// Correlation.
        request_id: RequestId,
        /// The commit (event, changes, expected tail) or the key to read.
        op: StateRequest,
        /// The request as received, for forwarding.
        wire: Received,
    },
    /// A consumer-group request.
    Group {
        /// Tenant.
        tenant: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// Shard.
        shard: u32,
        /// Correlation.
        request_id: RequestId,
        /// What to do.
        op: GroupOp,
    },
    /// A frame that is refused as it stands: malformed, a second `auth`, an ack or
    /// event batch sent by a client. `ends_stream` when the stream cannot go on.
    Refused {
        /// Why.
        error: BrokerError,
        /// Whether the stream ends after the answer.
        ends_stream: bool,
    },
    /// A request this broker does not serve.
    Unsupported(Option<RequestSummary>),
}

/// What the driver does for one request.
#[derive(Debug)]
pub enum Action {
    /// Write this answer.
    Answer(Bytes),
    /// Nothing to write; an unanswered request was refused (counted).
    Refused(BrokerError),
    /// Write the answer (if any), then end the stream.
    Close(Option<Bytes>),
    /// Append to a shard this broker serves.
    Append {
        /// The shard.
        key: Arc<ShardKey>,
        /// The records.
        records: Vec<Bytes>,
        /// Who is owed the answer.
        answer: AnswerTo,
        /// What it is written under, if anything.
        condition: Option<WriteIf>,
    },
    /// Send the request on to the shard's leader and relay its answer.
    Forward {
        /// The leader.
        route: Route,
        /// The request, framed.
        frame: Bytes,
        /// What the answer is.
        answer: Forwarded,
    },
    /// A cache operation on a shard this broker serves.
    Cache {
        /// The shard.
        key: Arc<ShardKey>,
        /// What to do.
        op: CacheOp,
        /// Who is owed the answer, and the names it echoes.
        reply: CacheReply,
    },
    /// A bounded read by position on a stream shard this broker serves.
    Query {
        /// The stream shard.
        key: Arc<ShardKey>,
        /// What to read.
        query: Query,
        /// Correlation.
        request_id: RequestId,
    },
    /// Start a cache watch and its pump.
    CacheWatch {
        /// The cache shard.
        key: Arc<ShardKey>,
        /// Keys followed.
        filter: crate::shard::WatchFilter,
        /// Resume offset.
        from: Option<u64>,
        /// Current values first.
        retained: bool,
    },
    /// A commit or state read on a stream shard this broker serves.
    State {
        /// The stream shard.
        key: Arc<ShardKey>,
        /// What to do.
        op: crate::core::StateOp,
        /// Correlation.
        request_id: RequestId,
    },
    /// A consumer-group request on a stream shard this broker serves.
    Group {
        /// The stream shard.
        key: Arc<ShardKey>,
        /// What to do.
        op: GroupOp,
        /// Correlation.
        request_id: RequestId,
    },
    /// Register a subscription and start its pump.
    Subscribe {
        /// The shard.
        key: Arc<ShardKey>,
        /// Where to start.
        start: Option<StartPosition>,
    },
}

/// The answer owed for a forwarded request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forwarded {
    /// A publish's answer, re-encoded for this client with the leader named.
    Publish(AnswerTo),
    /// A JSON answer passed through.
    Json,
    /// A read's JSON answer passed through (a cache or counter get, a state get): one
    /// lost on the way is `shard_unavailable`, safe to retry, not `unacknowledged`.
    JsonRead,
}

/// The names a cache answer echoes.
#[derive(Debug, Clone)]
pub struct CacheReply {
    /// Tenant.
    pub tenant: String,
    /// Namespace.
    pub namespace: String,
    /// Cache.
    pub cache: String,
    /// Key.
    pub key: String,
    /// Correlation.
    pub request_id: Option<RequestId>,
    /// Whether the request was a put (answered `cache_ok`).
    pub put: bool,
    /// Whether the request was a delete (answered with the value it removed).
    pub delete: bool,
}

/// A request as it came (its frame's flags and payload, shared with the received
/// buffer), framed again only if it is forwarded to the shard's leader: every request
/// was copied into a new frame when decoded, whether or not it was forwarded (nearly
/// none are), a copy of each publish and cache value on the request path.
#[derive(Debug, Clone)]
pub struct Received {
    flags: felix_wire::Flags,
    payload: Bytes,
}

impl Received {
    /// A JSON request's payload.
    fn json(raw: &Bytes) -> Received {
        Received {
            flags: felix_wire::Flags::JSON,
            payload: raw.clone(),
        }
    }

    /// The request framed as it came, for the leader.
    pub fn framed(&self) -> Bytes {
        crate::forward::reframe_parts(self.flags, &self.payload)
    }
}

/// Longest cache key.
pub const CACHE_KEY_MAX_BYTES: usize = 4096;

/// Longest cache or state value: its base64 and 64 KiB of names and fields fit one
/// frame, so every answer and watch event that carries it can be sent. Until
/// 2026-12-07 a put of a frame's full size was taken, and its `cache_value` (a longer
/// type name, a version) came out a few bytes over: refused by the reader, the
/// acknowledged value could never be read.
pub const VALUE_MAX_BYTES: usize =
    (felix_wire::frame::DEFAULT_MAX_PAYLOAD_BYTES as usize - 64 * 1024) / 4 * 3;

/// Decodes one frame read after the handshake. `answered` is false on a client's
/// unidirectional stream: publishes there are never answered.
pub fn decode(frame: &Frame, answered: bool) -> Request {
    let owed = |a: AnswerTo| if answered { a } else { AnswerTo::Nothing };
    match frame.kind {
        FrameKind::PublishBatch => match PublishBatch::decode(frame.flags, &frame.payload) {
            Ok(b) => Request::Publish(Publish {
                // Idempotent binary frames are answered in JSON (publish_ok /
                // publish_error / publish_refused).
                answer: owed(b.ack.map_or(AnswerTo::Nothing, |a| {
                    if b.idempotent.is_some() {
                        AnswerTo::Json(a.request_id)
                    } else {
                        AnswerTo::Binary(a.request_id)
                    }
                })),
                condition: b
                    .idempotent
                    .map(|i| WriteIf::Idempotent(i.producer_id.0, i.sequence.0)),
                tenant: b.tenant,
                namespace: b.namespace,
                stream: b.stream,
                key: b.key,
                shard: None,
                records: b.payloads,
                wire: Received {
                    flags: frame.flags,
                    payload: frame.payload.clone(),
                },
            }),
            Err(e) => Request::Refused {
                error: BrokerError::InvalidRequest(e.to_string()),
                ends_stream: false,
            },
        },
        FrameKind::Json => match Message::decode_request(&frame.payload) {
            Ok(m) => from_message(m, &frame.payload, owed),
            Err(e) => Request::Refused {
                error: BrokerError::InvalidRequest(e.to_string()),
                ends_stream: false,
            },
        },
        FrameKind::PublishAck | FrameKind::EventBatch => Request::Refused {
            error: BrokerError::InvalidRequest("clients do not send acks or event batches".into()),
            ends_stream: false,
        },
    }
}

/// The request for a frame the reader could not read whole.
pub fn undecodable(e: &FrameError) -> Request {
    Request::Refused {
        error: BrokerError::InvalidRequest(e.to_string()),
        ends_stream: !e.stream_still_aligned(),
    }
}

#[allow(clippy::too_many_arguments)]
fn json_publish(
    raw: &Bytes,
    owed: impl Fn(AnswerTo) -> AnswerTo,
    (tenant, namespace, stream): (String, String, String),
    records: Vec<Bytes>,
    key: Option<Bytes>,
    shard: Option<ShardId>,
    request_id: Option<RequestId>,
    ack: Option<message::AckMode>,
) -> Request {
    let acked = ack.is_some_and(|a| a != message::AckMode::None);
    let answer = match (acked, request_id) {
        (false, _) => AnswerTo::Nothing,
        (true, Some(rid)) => AnswerTo::Json(rid),
        (true, None) => {
            return Request::Refused {
                error: BrokerError::InvalidRequest("an acked publish needs a request_id".into()),
                ends_stream: false,
            };
        }
    };
    Request::Publish(Publish {
        tenant: tenant.into(),
        namespace: namespace.into(),
        stream: stream.into(),
        key,
        shard: shard.map(|s| s.0),
        records,
        answer: owed(answer),
        wire: Received::json(raw),
        condition: None,
    })
}

/// A decoded publish written under `condition` (a refusal stays one).
fn conditional_publish(request: Request, condition: WriteIf) -> Request {
    match request {
        Request::Publish(mut p) => {
            p.condition = Some(condition);
            Request::Publish(p)
        }
        other => other,
    }
}

fn from_message(m: Message, raw: &Bytes, owed: impl Fn(AnswerTo) -> AnswerTo) -> Request {
    match m {
        Message::Publish {
            tenant_id,
            namespace,
            stream,
            payload,
            key,
            shard,
            request_id,
            ack,
        } => json_publish(
            raw,
            owed,
            (tenant_id, namespace, stream),
            vec![payload],
            key,
            shard,
            request_id,
            ack,
        ),
        Message::PublishBatch {
            tenant_id,
            namespace,
            stream,
            payloads,
            key,
            shard,
            request_id,
            ack,
        } => json_publish(
            raw,
            owed,
            (tenant_id, namespace, stream),
            payloads,
            key,
            shard,
            request_id,
            ack,
        ),
        Message::ProducerInit { request_id } => Request::ProducerInit(request_id),
        Message::PublishIdempotent {
            tenant_id,
            namespace,
            stream,
            payloads,
            key,
            shard,
            request_id,
            producer_id,
            sequence,
        } => conditional_publish(
            json_publish(
                raw,
                owed,
                (tenant_id, namespace, stream),
                payloads,
                key,
                shard,
                Some(request_id),
                Some(message::AckMode::PerBatch),
            ),
            WriteIf::Idempotent(producer_id.0, sequence.0),
        ),
        Message::PublishIf {
            tenant_id,
            namespace,
            stream,
            payloads,
            key,
            shard,
            expected_offset,
            request_id,
        } => conditional_publish(
            json_publish(
                raw,
                owed,
                (tenant_id, namespace, stream),
                payloads,
                key,
                shard,
                Some(request_id),
                Some(message::AckMode::PerBatch),
            ),
            WriteIf::Tail(expected_offset.0),
        ),
        Message::StreamShards {
            tenant_id,
            namespace,
            stream,
            request_id,
        } => Request::StreamShards {
            tenant: tenant_id,
            namespace,
            stream,
            request_id,
        },
        Message::CacheShards {
            tenant_id,
            namespace,
            cache,
            request_id,
        } => Request::CacheShards {
            tenant: tenant_id,
            namespace,
            cache,
            request_id,
        },
        Message::Topology => Request::Topology,
        Message::Subscribe {
            tenant_id,
            namespace,
            stream,
            start,
            shard,
            ..
        } => Request::Subscribe {
            tenant: tenant_id,
            namespace,
            stream,
            shard,
            start,
        },
        Message::ShardOwners {
            tenant_id,
            namespace,
            name,
            kind,
            request_id,
        } => Request::ShardOwners {
            tenant: tenant_id,
            namespace,
            name,
            kind,
            request_id,
        },
        Message::CacheGet {
            tenant_id,
            namespace,
            cache,
            key,
            request_id,
        } => cache_request(
            raw,
            (tenant_id, namespace, cache, key),
            request_id,
            CacheRequestOp::Get,
        ),
        Message::CachePut {
            tenant_id,
            namespace,
            cache,
            key,
            value,
            request_id,
            ttl_ms,
        } => cache_request(
            raw,
            (tenant_id, namespace, cache, key),
            request_id,
            CacheRequestOp::Put(value, ttl_ms),
        ),
        Message::CacheDelete {
            tenant_id,
            namespace,
            cache,
            key,
            request_id,
        } => cache_request(
            raw,
            (tenant_id, namespace, cache, key),
            request_id,
            CacheRequestOp::Delete,
        ),
        Message::CachePutIf {
            tenant_id,
            namespace,
            cache,
            key,
            value,
            ttl_ms,
            condition,
            request_id,
        } => cache_request(
            raw,
            (tenant_id, namespace, cache, key),
            Some(request_id),
            CacheRequestOp::PutIf(value, ttl_ms, condition),
        ),
        Message::CacheDeleteIf {
            tenant_id,
            namespace,
            cache,
            key,
            version,
            request_id,
        } => cache_request(
            raw,
            (tenant_id, namespace, cache, key),
            Some(request_id),
            CacheRequestOp::DeleteIf(version),
        ),
        Message::CounterAdd {
            tenant_id,
            namespace,
            cache,
            key,
            delta,
            request_id,
        } => cache_request(
            raw,
            (tenant_id, namespace, cache, key),
            Some(request_id),
            CacheRequestOp::CounterAdd(delta),
        ),
        Message::CounterGet {
            tenant_id,
            namespace,
            cache,
            key,
            request_id,
        } => cache_request(
            raw,
            (tenant_id, namespace, cache, key),
            Some(request_id),
            CacheRequestOp::CounterGet,
        ),
        Message::CacheWatch {
            tenant_id,
            namespace,
            cache,
            key,
            prefix,
            shard,
            from_offset,
            retained,
            ..
        } => {
            let filter = match (key, prefix) {
                (Some(k), None) => crate::shard::WatchFilter::Key(k),
                (None, Some(p)) => crate::shard::WatchFilter::Prefix(p),
                _ => {
                    return Request::Refused {
                        error: BrokerError::InvalidRequest(
                            "a cache watch names a key or a prefix, not both".into(),
                        ),
                        ends_stream: false,
                    };
                }
            };
            let (crate::shard::WatchFilter::Key(k) | crate::shard::WatchFilter::Prefix(k)) =
                &filter;
            if k.len() > CACHE_KEY_MAX_BYTES {
                // Kept for the watch's life and compared with every write: bounded as
                // keys are.
                return Request::Refused {
                    error: BrokerError::InvalidRequest(format!(
                        "a watched key or prefix is at most {CACHE_KEY_MAX_BYTES} bytes"
                    )),
                    ends_stream: false,
                };
            }
            if retained && from_offset.is_some() {
                return Request::Refused {
                    error: BrokerError::InvalidRequest(
                        "a retained watch starts from the current values, not an offset".into(),
                    ),
                    ends_stream: false,
                };
            }
            Request::CacheWatch {
                tenant: tenant_id,
                namespace,
                cache,
                filter,
                shard,
                from: from_offset.map(|o| o.0),
                retained,
            }
        }
        Message::StreamRead {
            tenant_id,
            namespace,
            stream,
            shard,
            from,
            end,
            max_records,
            max_bytes,
            request_id,
        } => Request::StreamRead {
            tenant: tenant_id,
            namespace,
            stream,
            shard: shard.0,
            request_id,
            query: Query::Range(from.0, end.map(|o| o.0), max_records, max_bytes),
        },
        Message::OffsetForTime {
            tenant_id,
            namespace,
            stream,
            shard,
            at_micros,
            request_id,
        } => Request::StreamRead {
            tenant: tenant_id,
            namespace,
            stream,
            shard: shard.0,
            request_id,
            query: Query::OffsetForTime(at_micros),
        },
        Message::Commit {
            tenant_id,
            namespace,
            stream,
            entity_key,
            event,
            changes,
            request_id,
            expected_offset,
        } => Request::State {
            tenant: tenant_id,
            namespace,
            stream,
            entity_key,
            request_id,
            op: StateRequest::Commit {
                event,
                changes: changes
                    .into_iter()
                    .map(|c| match c {
                        message::StateChange::Put { key, value } => {
                            crate::state::Change::Put(key, value)
                        }
                        message::StateChange::Delete { key } => crate::state::Change::Delete(key),
                    })
                    .collect(),
                expected: expected_offset.map(|o| o.0),
            },
            wire: Received::json(raw),
        },
        Message::StateGet {
            tenant_id,
            namespace,
            stream,
            entity_key,
            key,
            request_id,
        } => Request::State {
            tenant: tenant_id,
            namespace,
            stream,
            entity_key,
            request_id,
            op: StateRequest::Get(key),
            wire: Received::json(raw),
        },
        Message::Auth { .. } => Request::Refused {
            error: BrokerError::InvalidRequest("second auth on an authenticated stream".into()),
            ends_stream: false,
        },
        m => group_request(m).unwrap_or_else(|| Request::Unsupported(message::peek_request(raw))),
    }
}

/// The longest name a group member (`consumer`) may have, in bytes.
const MEMBER_NAME_MAX: usize = 128;

/// A consumer-group message as a request; `None` for any other message.
fn group_request(m: Message) -> Option<Request> {
    let req = |tenant_id, namespace, stream, shard: ShardId, request_id, op| Request::Group {
        tenant: tenant_id,
        namespace,
        stream,
        shard: shard.0,
        request_id,
        op,
    };
    Some(match m {
        Message::GroupPoll {
            tenant_id,
            namespace,
            stream,
            shard,
            group,
            max_records,
            wait_ms,
            request_id,
            visibility_ms,
            consumer,
            reclaim,
        } => {
            let member = match (consumer, reclaim) {
                (None, false) => None,
                (None, true) => {
                    return Some(Request::Refused {
                        error: BrokerError::InvalidRequest(
                            "group_poll: reclaim names no consumer".into(),
                        ),
                        ends_stream: false,
                    });
                }
                (Some(name), reclaim) if (1..=MEMBER_NAME_MAX).contains(&name.len()) => {
                    Some(crate::groups::Member {
                        name: name.into(),
                        reclaim,
                    })
                }
                (Some(name), _) => {
                    return Some(Request::Refused {
                        error: BrokerError::InvalidRequest(format!(
                            "group_poll: a consumer name is 1-{MEMBER_NAME_MAX} bytes, not {}",
                            name.len()
                        )),
                        ends_stream: false,
                    });
                }
            };
            req(
                tenant_id,
                namespace,
                stream,
                shard,
                request_id,
                GroupOp::Poll {
                    group,
                    max: max_records,
                    wait_ms,
                    visibility_ms: visibility_ms.unwrap_or(0),
                    member,
                },
            )
        }
        Message::GroupAck {
            tenant_id,
            namespace,
            stream,
            shard,
            group,
            offset,
            request_id,
        } => req(
            tenant_id,
            namespace,
            stream,
            shard,
            request_id,
            GroupOp::Ack(group, offset.0),
        ),
        Message::GroupNack {
            tenant_id,
            namespace,
            stream,
            shard,
            group,
            offset,
            request_id,
            delay_ms,
            attempts,
        } => req(
            tenant_id,
            namespace,
            stream,
            shard,
            request_id,
            GroupOp::Nack(
                group,
                offset.0,
                delay_ms.unwrap_or(0),
                attempts.unwrap_or(0),
            ),
        ),
        Message::GroupExtend {
            tenant_id,
            namespace,
            stream,
            shard,
            group,
            offset,
            request_id,
            attempts,
            extend_ms,
        } => req(
            tenant_id,
            namespace,
            stream,
            shard,
            request_id,
            GroupOp::Extend(group, offset.0, attempts, extend_ms),
        ),
        Message::GroupDeadLetter {
            tenant_id,
            namespace,
            stream,
            shard,
            group,
            offset,
            request_id,
        } => req(
            tenant_id,
            namespace,
            stream,
            shard,
            request_id,
            GroupOp::DeadLetter(group, offset.0),
        ),
        Message::GroupDeadLetters {
            tenant_id,
            namespace,
            stream,
            shard,
            group,
            request_id,
        } => req(
            tenant_id,
            namespace,
            stream,
            shard,
            request_id,
            GroupOp::DeadLetters(group),
        ),
        Message::GroupDiscard {
            tenant_id,
            namespace,
            stream,
            shard,
            group,
            offset,
            request_id,
        } => req(
            tenant_id,
            namespace,
            stream,
            shard,
            request_id,
            GroupOp::Discard(group, offset.0),
        ),
        Message::GroupRedrive {
            tenant_id,
            namespace,
            stream,
            shard,
            group,
            offset,
            request_id,
        } => req(
            tenant_id,
            namespace,
            stream,
            shard,
            request_id,
            GroupOp::Redrive(group, offset.0),
        ),
        Message::GroupSeek {
            tenant_id,
            namespace,
            stream,
            shard,
            group,
            start,
            if_new,
            request_id,
        } => req(
            tenant_id,
            namespace,
            stream,
            shard,
            request_id,
            GroupOp::Seek {
                group,
                start,
                if_new,
            },
        ),
        Message::GroupDescribe {
            tenant_id,
            namespace,
            stream,
            shard,
            group,
            request_id,
        } => req(
            tenant_id,
            namespace,
            stream,
            shard,
            request_id,
            GroupOp::Describe(group),
        ),
        Message::GroupDelete {
            tenant_id,
            namespace,
            stream,
            shard,
            group,
            request_id,
        } => req(
            tenant_id,
            namespace,
            stream,
            shard,
            request_id,
            GroupOp::Delete(group),
        ),
        _ => return None,
    })
}

fn cache_request(
    raw: &Bytes,
    (tenant, namespace, cache, key): (String, String, String, String),
    request_id: Option<RequestId>,
    op: CacheRequestOp,
) -> Request {
    Request::Cache(CacheRequest {
        tenant,
        namespace,
        cache,
        key,
        request_id,
        op,
        wire: Received::json(raw),
    })
}

/// Decides what to do with `request`. `answered` is false on a client's
/// unidirectional stream, where only publishes may travel and nothing is answered.
pub fn decide(
    session: &Session,
    dir: &impl Directory,
    request: Request,
    answered: bool,
    now: Now,
) -> Action {
    let error = |e: BrokerError| Action::Answer(answer::error(session, &e));
    if !answered && !matches!(request, Request::Publish(_)) {
        return Action::Close(None);
    }
    match request {
        Request::Publish(p) => publish(session, dir, p, answered, now),
        Request::Refused {
            error: e,
            ends_stream,
        } => {
            let frame = answer::error(session, &e);
            if ends_stream {
                Action::Close(Some(frame))
            } else {
                Action::Answer(frame)
            }
        }
        Request::StreamShards {
            tenant,
            namespace,
            stream,
            request_id,
        } => {
            let create = session.may_create(true, &namespace, &stream);
            match session
                .check_visible(false, &tenant, &namespace, &stream, now)
                .and_then(|()| dir.stream(&tenant, &namespace, &stream, create))
            {
                Ok(e) => Action::Answer(
                    Message::StreamShardsView {
                        shards: e.spec.shards,
                        request_id,
                        routing: (e.spec.routing == routing::ShardRouting::JumpHash)
                            .then_some(e.spec.routing),
                    }
                    .to_frame(),
                ),
                // A stream this broker has not heard of has no shards: the SDK's
                // sharded subscribe fails rather than reading shard 0 of nothing.
                Err(BrokerError::NotFound(_)) => Action::Answer(
                    Message::StreamShardsView {
                        shards: 0,
                        request_id,
                        routing: None,
                    }
                    .to_frame(),
                ),
                Err(e) => error(e),
            }
        }
        Request::CacheShards {
            tenant,
            namespace,
            cache,
            request_id,
        } => {
            let create = session.may_create(false, &namespace, &cache);
            match session
                .check_visible(true, &tenant, &namespace, &cache, now)
                .and_then(|()| dir.cache(&tenant, &namespace, &cache, create))
            {
                Ok(e) => Action::Answer(
                    Message::CacheShardsView {
                        shards: e.spec.shards,
                        request_id,
                    }
                    .to_frame(),
                ),
                Err(e) => error(e),
            }
        }
        Request::ProducerInit(request_id) => Action::Answer(
            Message::ProducerInitOk {
                request_id,
                producer_id: felix_wire::ProducerId(rand::random::<u64>()),
            }
            .to_frame(),
        ),
        Request::Topology => Action::Answer(
            Message::TopologyView {
                brokers: dir
                    .topology()
                    .into_iter()
                    .map(|(node_id, addr)| message::BrokerEndpoint { node_id, addr })
                    .collect(),
            }
            .to_frame(),
        ),
        Request::Subscribe {
            tenant,
            namespace,
            stream,
            shard,
            start,
        } => {
            let key = session
                .authorize(Perm::StreamSubscribe, &tenant, &namespace, &stream, now)
                .and_then(|()| {
                    let create = session.may_create(true, &namespace, &stream);
                    let entry = dir.stream(&tenant, &namespace, &stream, create)?;
                    shard_key(
                        &entry,
                        &tenant,
                        &namespace,
                        &stream,
                        shard.map_or(0, |s| s.0),
                    )
                });
            match key.map(|k| (dir.resolve(&k), k)) {
                Ok((Resolved::Local, key)) => Action::Subscribe { key, start },
                Ok((Resolved::Remote(route), _)) => Action::Answer(not_leader(session, &route)),
                Ok((Resolved::Unavailable(reason), _)) => {
                    error(BrokerError::ShardUnavailable(reason.into()))
                }
                Err(e) => error(e),
            }
        }
        Request::ShardOwners {
            tenant,
            namespace,
            name,
            kind,
            request_id,
        } => match session.check_visible(
            kind == message::ShardKind::Cache,
            &tenant,
            &namespace,
            &name,
            now,
        ) {
            Ok(()) => {
                let kind = match kind {
                    message::ShardKind::Stream => ShardKind::Stream,
                    message::ShardKind::Cache => ShardKind::Cache,
                };
                let owners = dir
                    .owners(kind, &tenant, &namespace, &name)
                    .into_iter()
                    .map(|(shard, r)| message::ShardOwner {
                        shard: ShardId(shard),
                        node_id: r.addr.is_some().then(|| r.leader.to_string()),
                        unavailable: r.addr.is_none().then(|| "owner_unavailable".into()),
                        addr: r.addr.map(|a| a.to_string()),
                        generation: Generation(r.generation),
                    })
                    .collect();
                Action::Answer(Message::ShardOwnersView { owners, request_id }.to_frame())
            }
            Err(e) => error(e),
        },
        Request::Cache(c) => cache(session, dir, c, now),
        Request::StreamRead {
            tenant,
            namespace,
            stream,
            shard,
            request_id,
            query,
        } => {
            let key = session
                .authorize(Perm::StreamSubscribe, &tenant, &namespace, &stream, now)
                .and_then(|()| {
                    let entry = dir.stream(&tenant, &namespace, &stream, false)?;
                    shard_key(&entry, &tenant, &namespace, &stream, shard)
                });
            match key.map(|k| (dir.resolve(&k), k)) {
                Ok((Resolved::Local, key)) => Action::Query {
                    key,
                    query,
                    request_id,
                },
                // Not forwarded: the client reads from the leader.
                Ok((Resolved::Remote(route), _)) => Action::Answer(not_leader(session, &route)),
                Ok((Resolved::Unavailable(reason), _)) => {
                    error(BrokerError::ShardUnavailable(reason.into()))
                }
                Err(e) => error(e),
            }
        }
        Request::CacheWatch {
            tenant,
            namespace,
            cache,
            filter,
            shard,
            from,
            retained,
        } => {
            let key = session
                .authorize(Perm::CacheRead, &tenant, &namespace, &cache, now)
                .and_then(|()| {
                    let create = session.may_create(false, &namespace, &cache);
                    let entry = dir.cache(&tenant, &namespace, &cache, create)?;
                    let shard = match &filter {
                        crate::shard::WatchFilter::Key(k) => {
                            routing::shard_for_key(
                                Some(k.as_bytes()),
                                entry.spec.shards,
                                entry.spec.routing,
                            )
                            .0
                        }
                        // A prefix spans every shard: one shard of a cache of several
                        // must be named, as the reference has it (watching shard 0
                        // silently missed every key on the others).
                        crate::shard::WatchFilter::Prefix(_) => match shard {
                            Some(s) => s.0,
                            None if entry.spec.shards > 1 => {
                                return Err(BrokerError::InvalidRequest(format!(
                                    "a prefix watch of cache {cache} ({} shards) names its shard",
                                    entry.spec.shards
                                )));
                            }
                            None => 0,
                        },
                    };
                    shard_key(&entry, &tenant, &namespace, &cache, shard)
                });
            match key.map(|k| (dir.resolve(&k), k)) {
                Ok((Resolved::Local, key)) => Action::CacheWatch {
                    key,
                    filter,
                    from,
                    retained,
                },
                Ok((Resolved::Remote(route), _)) => Action::Answer(not_leader(session, &route)),
                Ok((Resolved::Unavailable(reason), _)) => {
                    error(BrokerError::ShardUnavailable(reason.into()))
                }
                Err(e) => error(e),
            }
        }
        Request::State {
            tenant,
            namespace,
            stream,
            entity_key,
            request_id,
            op,
            wire,
        } => {
            let perm = match op {
                StateRequest::Commit { .. } => Perm::StreamPublish,
                StateRequest::Get(_) => Perm::StreamSubscribe,
            };
            let read = matches!(op, StateRequest::Get(_));
            let key = session
                .authorize(perm, &tenant, &namespace, &stream, now)
                .and_then(|()| {
                    let create = session.may_create(true, &namespace, &stream);
                    let entry = dir.stream(&tenant, &namespace, &stream, create)?;
                    let shard = routing::shard_for_key(
                        Some(&entity_key),
                        entry.spec.shards,
                        entry.spec.routing,
                    )
                    .0;
                    shard_key(&entry, &tenant, &namespace, &stream, shard)
                });
            match key.map(|k| (dir.resolve(&k), k)) {
                Ok((Resolved::Local, key)) => {
                    let op = match op {
                        StateRequest::Commit {
                            event,
                            changes,
                            expected,
                        } => {
                            if let Err(e) = crate::state::check(&changes) {
                                return error(e);
                            }
                            crate::core::StateOp::Commit {
                                write: crate::core::CommitWrite {
                                    record: crate::state::encode(&event, &changes),
                                    expected,
                                },
                                event,
                            }
                        }
                        StateRequest::Get(k) => crate::core::StateOp::Get(k),
                    };
                    Action::State {
                        key,
                        op,
                        request_id,
                    }
                }
                Ok((Resolved::Remote(route), _)) => match forwardable(session, &route) {
                    Ok(()) => Action::Forward {
                        route,
                        frame: wire.framed(),
                        answer: if read {
                            Forwarded::JsonRead
                        } else {
                            Forwarded::Json
                        },
                    },
                    Err(e) => error(e),
                },
                Ok((Resolved::Unavailable(reason), _)) => {
                    error(BrokerError::ShardUnavailable(reason.into()))
                }
                Err(e) => error(e),
            }
        }
        Request::Group {
            tenant,
            namespace,
            stream,
            shard,
            request_id,
            op,
        } => {
            // Consuming through a group takes `group.consume` on it, or reading the
            // stream (`stream.subscribe`), which implies it, as the reference has it.
            // Redriving or discarding its dead letters manages the group, as the
            // reference has it: `group.manage` (or `stream.manage`); so do deleting it
            // (its cursor, claims and dead letters) and moving its cursor (a seek that
            // only creates a group where there is none is a consumer's).
            use crate::groups::GroupOp;
            let authorized = match &op {
                GroupOp::Redrive(g, _)
                | GroupOp::Discard(g, _)
                | GroupOp::Delete(g)
                | GroupOp::Seek {
                    group: g,
                    if_new: false,
                    ..
                } => session.authorize_group(true, (&tenant, &namespace, &stream, g), now),
                _ => {
                    session.authorize_group(false, (&tenant, &namespace, &stream, op.group()), now)
                }
            };
            let key = authorized
                .and_then(|()| crate::groups::check_name(op.group()))
                .and_then(|()| {
                    let entry = dir.stream(&tenant, &namespace, &stream, false)?;
                    shard_key(&entry, &tenant, &namespace, &stream, shard)
                });
            match key.map(|k| (dir.resolve(&k), k)) {
                Ok((Resolved::Local, key)) => Action::Group {
                    key,
                    op,
                    request_id,
                },
                Ok((Resolved::Remote(route), _)) => Action::Answer(not_leader(session, &route)),
                Ok((Resolved::Unavailable(reason), _)) => {
                    error(BrokerError::ShardUnavailable(reason.into()))
                }
                Err(e) => error(e),
            }
        }
        Request::Unsupported(summary) => unsupported(session, summary),
    }
}

fn shard_key(
    entry: &Entry,
    t: &str,
    ns: &str,
    name: &str,
    shard: u32,
) -> Result<Arc<ShardKey>, BrokerError> {
    entry.key(shard).cloned().ok_or_else(|| {
        BrokerError::InvalidRequest(format!(
            "shard {shard} out of range: {t}/{ns}/{name} has {} shards",
            entry.spec.shards
        ))
    })
}

fn publish(
    session: &Session,
    dir: &impl Directory,
    p: Publish,
    answered: bool,
    now: Now,
) -> Action {
    let answer = p.answer;
    let refuse = |e: BrokerError| match answer {
        AnswerTo::Nothing if answered && matches!(e, BrokerError::InvalidRequest(_)) => {
            // An unacked publish that cannot be read gets an `error`: the client
            // would otherwise never learn its publishes are malformed.
            Action::Answer(answer::error(session, &e))
        }
        AnswerTo::Nothing => Action::Refused(e),
        to => {
            Action::Answer(answer::publish(session, to, Err(e), None).expect("an answer is owed"))
        }
    };
    let (t, ns, s) = (p.tenant.as_str(), p.namespace.as_str(), p.stream.as_str());
    if let Err(e) = session.authorize(Perm::StreamPublish, t, ns, s, now) {
        return refuse(e);
    }
    if p.records.is_empty() {
        return refuse(BrokerError::InvalidRequest(
            "a publish batch needs at least one record".into(),
        ));
    }
    // One batch ships to followers in one replication message, which carries at most
    // this many records (as the reference's does): a larger batch could never be
    // shipped, and its shard's followers never caught up.
    if p.records.len() > felix_wire::internal::MAX_RECORDS_PER_MESSAGE {
        return refuse(BrokerError::InvalidRequest(format!(
            "a publish batch holds at most {} records",
            felix_wire::internal::MAX_RECORDS_PER_MESSAGE
        )));
    }
    let entry = match dir.stream(t, ns, s, session.may_create(true, ns, s)) {
        Ok(e) => e,
        Err(e) => return refuse(e),
    };
    let shard = match p.shard {
        Some(n) => n,
        None => routing::shard_for_key(p.key.as_deref(), entry.spec.shards, entry.spec.routing).0,
    };
    let key = match shard_key(&entry, t, ns, s, shard) {
        Ok(k) => k,
        Err(e) => return refuse(e),
    };
    if p.condition.is_some() && !answer.owed() {
        return refuse(BrokerError::InvalidRequest(
            "an idempotent or conditional publish must be acknowledged".into(),
        ));
    }
    match dir.resolve(&key) {
        Resolved::Local => Action::Append {
            key,
            records: p.records,
            answer,
            condition: p.condition,
        },
        Resolved::Remote(route) => match forwardable(session, &route) {
            Ok(()) => Action::Forward {
                route,
                frame: p.wire.framed(),
                answer: Forwarded::Publish(answer),
            },
            Err(e) => refuse(e),
        },
        Resolved::Unavailable(reason) => refuse(BrokerError::ShardUnavailable(reason.into())),
    }
}

fn cache(session: &Session, dir: &impl Directory, c: CacheRequest, now: Now) -> Action {
    let error = |e: BrokerError| Action::Answer(answer::error(session, &e));
    let perm = match c.op {
        CacheRequestOp::Get => Perm::CacheRead,
        CacheRequestOp::Put(..)
        | CacheRequestOp::Delete
        | CacheRequestOp::PutIf(..)
        | CacheRequestOp::DeleteIf(_)
        | CacheRequestOp::CounterAdd(_) => Perm::CacheWrite,
        CacheRequestOp::CounterGet => Perm::CacheRead,
    };
    let key = session
        .authorize(perm, &c.tenant, &c.namespace, &c.cache, now)
        .and_then(|()| {
            if c.key.len() > CACHE_KEY_MAX_BYTES {
                return Err(BrokerError::InvalidRequest(format!(
                    "cache keys are at most {CACHE_KEY_MAX_BYTES} bytes"
                )));
            }
            if let CacheRequestOp::Put(v, _) | CacheRequestOp::PutIf(v, ..) = &c.op
                && v.len() > VALUE_MAX_BYTES
            {
                return Err(BrokerError::InvalidRequest(format!(
                    "cache values are at most {VALUE_MAX_BYTES} bytes (this one is {}), so \
                     that every answer carrying one fits a frame",
                    v.len()
                )));
            }
            let create = session.may_create(false, &c.namespace, &c.cache);
            let entry = dir.cache(&c.tenant, &c.namespace, &c.cache, create)?;
            let shard = routing::shard_for_key(
                Some(c.key.as_bytes()),
                entry.spec.shards,
                entry.spec.routing,
            )
            .0;
            shard_key(&entry, &c.tenant, &c.namespace, &c.cache, shard)
        });
    let key = match key {
        Ok(k) => k,
        Err(e) => return error(e),
    };
    match dir.resolve(&key) {
        Resolved::Local => {
            let put = matches!(c.op, CacheRequestOp::Put(..));
            let delete = matches!(c.op, CacheRequestOp::Delete);
            let op = match c.op {
                CacheRequestOp::Get => CacheOp::Get(c.key.clone()),
                CacheRequestOp::Put(v, ttl) => CacheOp::Put(c.key.clone(), v, ttl),
                CacheRequestOp::Delete => CacheOp::Delete(c.key.clone()),
                CacheRequestOp::PutIf(v, ttl, cond) => CacheOp::PutIf(c.key.clone(), v, ttl, cond),
                CacheRequestOp::DeleteIf(version) => CacheOp::DeleteIf(c.key.clone(), version),
                CacheRequestOp::CounterAdd(d) => CacheOp::CounterAdd(c.key.clone(), d),
                CacheRequestOp::CounterGet => CacheOp::CounterGet(c.key.clone()),
            };
            Action::Cache {
                key,
                op,
                reply: CacheReply {
                    tenant: c.tenant,
                    namespace: c.namespace,
                    cache: c.cache,
                    key: c.key,
                    request_id: c.request_id,
                    put,
                    delete,
                },
            }
        }
        Resolved::Remote(route) => match forwardable(session, &route) {
            Ok(()) => Action::Forward {
                route,
                frame: c.wire.framed(),
                answer: if matches!(c.op, CacheRequestOp::Get | CacheRequestOp::CounterGet) {
                    Forwarded::JsonRead
                } else {
                    Forwarded::Json
                },
            },
            Err(e) => error(e),
        },
        Resolved::Unavailable(reason) => error(BrokerError::ShardUnavailable(reason.into())),
    }
}

/// Whether a request for a shard `route`'s leader leads may be forwarded there: not one
/// forwarded twice already. A request forwarded once comes from a broker whose view of
/// the shard trails this one's (a move it has not synced): sent on, it reaches the
/// leader this broker knows. Forwarded again and again, it went to and fro between two
/// brokers whose views disagreed until they agreed, each hop holding a copy against the
/// forwarders' budgets. Refused retryably, nothing written.
fn forwardable(session: &Session, route: &Route) -> Result<(), BrokerError> {
    if session.forwarded >= 2 {
        return Err(BrokerError::ShardUnavailable(format!(
            "forwarded here twice, and this broker's view names another leader ({}): the \
             brokers' views of the shard disagree for now",
            route.leader
        )));
    }
    Ok(())
}

/// A subscribe for a shard another broker leads: `not_leader` to clients that take
/// redirects, a coded error to the rest.
fn not_leader(session: &Session, route: &Route) -> Bytes {
    if session.features.contains(Features::REDIRECT) {
        Message::NotLeader {
            node_id: route.leader.to_string(),
            addr: route.addr.map(|a| a.to_string()),
            generation: Generation(route.generation),
        }
        .to_frame()
    } else {
        answer::error(
            session,
            &BrokerError::NotLeader {
                node_id: route.leader.to_string(),
                addr: route.addr.map(|a| a.to_string()),
            },
        )
    }
}

/// A request we do not serve (an unknown type, or one whose feature we did not
/// advertise): `unsupported` when both sides offered it; otherwise say why and end the
/// stream. What the client sent is echoed only in part.
fn unsupported(session: &Session, summary: Option<RequestSummary>) -> Action {
    if session.features.contains(Features::UNSUPPORTED) {
        Action::Answer(
            Message::Unsupported {
                request_type: summary
                    .as_ref()
                    .map_or_else(|| "unknown".into(), |s| cut(&s.request_type).to_owned()),
                extension: summary
                    .as_ref()
                    .and_then(|s| s.name.as_deref().map(|n| cut(n).to_owned())),
                request_id: summary.and_then(|s| s.request_id),
            }
            .to_frame(),
        )
    } else {
        let kind = summary.map(|s| cut(&s.request_type).to_owned());
        Action::Close(Some(answer::error(
            session,
            &BrokerError::InvalidRequest(format!(
                "unsupported request {:?}",
                kind.unwrap_or_default()
            )),
        )))
    }
}

#[cfg(test)]
mod tests {
    use bytes::BytesMut;
    use felix_wire::binary::AckPrefix;
    use felix_wire::{AckMode, ErrorCode, Flags, PublishAck, PublishBatchHeader};

    use super::*;
    use crate::session::testing::{MemDirectory, TENANT, at, parse_frame, session, session_with};

    fn binary_publish(t: &str, ns: &str, s: &str, key: Option<&[u8]>, rid: Option<u64>) -> Frame {
        let mut buf = BytesMut::new();
        PublishBatchHeader {
            tenant: t,
            namespace: ns,
            stream: s,
            ack: rid.map(|id| AckPrefix {
                request_id: RequestId(id),
                ack_mode: AckMode::PerMessage,
            }),
            idempotent: None,
            key,
        }
        .encode_frame(&mut buf, &[b"one".as_slice(), b"two"])
        .unwrap();
        parse_frame(&buf.freeze())
    }

    fn json(m: Message) -> Frame {
        parse_frame(&m.to_frame())
    }

    fn decide_frame(s: &Session, dir: &MemDirectory, f: &Frame, answered: bool) -> Action {
        decide(s, dir, decode(f, answered), answered, at(2_000))
    }

    /// The error code of an `error` frame or a failed binary ack.
    fn refusal_code(a: &Action) -> ErrorCode {
        let (Action::Answer(b) | Action::Close(Some(b))) = a else {
            panic!("not an answer: {a:?}");
        };
        let f = parse_frame(b);
        match f.kind {
            FrameKind::PublishAck => {
                PublishAck::decode(f.flags, &f.payload)
                    .unwrap()
                    .code
                    .unwrap()
                    .code
            }
            _ => match Message::decode(&f.payload).unwrap() {
                Message::Error { code, .. } | Message::PublishError { code, .. } => code.unwrap(),
                other => panic!("not a refusal: {other:?}"),
            },
        }
    }

    #[test]
    fn a_poll_names_its_member_within_the_bounds_or_is_refused() {
        let poll = |consumer: Option<String>, reclaim| Message::GroupPoll {
            tenant_id: TENANT.into(),
            namespace: "ns".into(),
            stream: "s".into(),
            shard: ShardId(0),
            group: "g".into(),
            max_records: 4,
            wait_ms: 0,
            request_id: RequestId(1),
            consumer,
            reclaim,
            visibility_ms: None,
        };
        let member = |r: Option<Request>| match r {
            Some(Request::Group {
                op: GroupOp::Poll { member, .. },
                ..
            }) => Ok(member),
            Some(Request::Refused { error, .. }) => Err(error.to_string()),
            _ => Err("not a group poll".into()),
        };
        assert_eq!(member(group_request(poll(None, false))), Ok(None));
        assert_eq!(
            member(group_request(poll(Some("w".into()), true))),
            Ok(Some(crate::groups::Member {
                name: "w".into(),
                reclaim: true,
            }))
        );
        assert!(member(group_request(poll(Some("x".repeat(128)), false))).is_ok());
        for (consumer, reclaim) in [
            (None, true),
            (Some(String::new()), false),
            (Some("x".repeat(129)), true),
        ] {
            let refused = member(group_request(poll(consumer.clone(), reclaim)));
            assert!(
                refused
                    .as_ref()
                    .is_err_and(|e| e.contains("invalid request")),
                "{consumer:?}/{reclaim}: {refused:?}"
            );
        }
    }

    #[test]
    fn binary_and_json_publishes_take_the_same_path_to_the_same_shard() {
        let dir = MemDirectory::new(4);
        let s = session();
        let bin = decide_frame(
            &s,
            &dir,
            &binary_publish(TENANT, "ns", "orders", Some(b"k1"), Some(9)),
            true,
        );
        let js = decide_frame(
            &s,
            &dir,
            &json(Message::PublishBatch {
                tenant_id: TENANT.into(),
                namespace: "ns".into(),
                stream: "orders".into(),
                payloads: vec![Bytes::from_static(b"one"), Bytes::from_static(b"two")],
                key: Some(Bytes::from_static(b"k1")),
                shard: None,
                request_id: Some(RequestId(9)),
                ack: Some(message::AckMode::PerMessage),
            }),
            true,
        );
        let (
            Action::Append {
                key: k1,
                records: r1,
                answer: a1,
                ..
            },
            Action::Append {
                key: k2,
                records: r2,
                answer: a2,
                ..
            },
        ) = (bin, js)
        else {
            panic!("both append");
        };
        assert_eq!(k1, k2, "one routing decision");
        assert_eq!(r1, r2);
        assert_eq!(a1, AnswerTo::Binary(RequestId(9)));
        assert_eq!(a2, AnswerTo::Json(RequestId(9)));
    }

    /// A `publish_if` is an acknowledged append to the shard it names, carrying the tail
    /// it expects; a `publish_batch` to the same place carries none.
    #[test]
    fn a_conditional_publish_appends_under_the_tail_it_expects() {
        let dir = MemDirectory::new(4);
        let s = session();
        let conditional = decide_frame(
            &s,
            &dir,
            &json(Message::PublishIf {
                tenant_id: TENANT.into(),
                namespace: "ns".into(),
                stream: "orders".into(),
                payloads: vec![Bytes::from_static(b"one"), Bytes::from_static(b"two")],
                key: None,
                shard: Some(felix_wire::ShardId(2)),
                expected_offset: felix_wire::Offset(17),
                request_id: RequestId(5),
            }),
            true,
        );
        let Action::Append {
            key,
            records,
            answer,
            condition,
        } = conditional
        else {
            panic!("a conditional publish appends: {conditional:?}");
        };
        assert_eq!(key.shard, 2);
        assert_eq!(records.len(), 2);
        assert_eq!(answer, AnswerTo::Json(RequestId(5)));
        assert_eq!(condition, Some(WriteIf::Tail(17)));
        let plain = decide_frame(
            &s,
            &dir,
            &json(Message::PublishBatch {
                tenant_id: TENANT.into(),
                namespace: "ns".into(),
                stream: "orders".into(),
                payloads: vec![Bytes::from_static(b"one")],
                key: None,
                shard: Some(felix_wire::ShardId(2)),
                request_id: Some(RequestId(6)),
                ack: Some(message::AckMode::PerBatch),
            }),
            true,
        );
        assert!(matches!(
            plain,
            Action::Append {
                condition: None,
                ..
            }
        ));
    }

    #[test]
    fn a_publish_of_empty_records_is_charged_for_each() {
        let p = Publish {
            tenant: TENANT.into(),
            namespace: "ns".into(),
            stream: "orders".into(),
            key: None,
            shard: None,
            records: vec![Bytes::new(); 100_000],
            answer: AnswerTo::Nothing,
            wire: Received::json(&Bytes::new()),
            condition: None,
        };
        assert!(p.bytes() >= 100_000 * 32, "charged {} bytes", p.bytes());
    }

    #[test]
    fn a_watched_key_or_prefix_is_bounded_as_keys_are() {
        let dir = MemDirectory::new(1);
        let s = session();
        for (key, prefix) in [
            (Some("k".repeat(CACHE_KEY_MAX_BYTES + 1)), None),
            (None, Some("p".repeat(CACHE_KEY_MAX_BYTES + 1))),
        ] {
            let a = decide_frame(
                &s,
                &dir,
                &json(Message::CacheWatch {
                    tenant_id: TENANT.into(),
                    namespace: "ns".into(),
                    cache: "c".into(),
                    key,
                    prefix,
                    shard: None,
                    from_offset: None,
                    retained: false,
                    subscription_id: None,
                }),
                true,
            );
            assert_eq!(refusal_code(&a), ErrorCode::InvalidRequest);
            assert!(matches!(a, Action::Answer(_)), "the stream goes on: {a:?}");
        }
    }

    /// A cache value is refused past `VALUE_MAX_BYTES`, and one of that size fits every
    /// answer and event carrying it, with the longest names and a key of the worst JSON
    /// escaping (a put of a frame's full size used to be taken, its `cache_value` a few
    /// bytes over a frame).
    #[test]
    fn a_cache_value_is_bounded_so_its_answers_fit_a_frame() {
        let dir = MemDirectory::new(1);
        let s = session();
        let put = |value: Bytes| {
            json(Message::CachePut {
                tenant_id: TENANT.into(),
                namespace: "ns".into(),
                cache: "c".into(),
                key: "k".into(),
                value,
                request_id: Some(RequestId(1)),
                ttl_ms: None,
            })
        };
        let a = decide_frame(
            &s,
            &dir,
            &put(Bytes::from(vec![7u8; VALUE_MAX_BYTES + 1])),
            true,
        );
        assert_eq!(refusal_code(&a), ErrorCode::InvalidRequest);
        let a = decide_frame(
            &s,
            &dir,
            &put(Bytes::from(vec![7u8; VALUE_MAX_BYTES])),
            true,
        );
        assert!(matches!(a, Action::Cache { .. }), "taken: {a:?}");
        let (name, key) = ("n".repeat(128), "\u{1}".repeat(CACHE_KEY_MAX_BYTES));
        let value = Some(Bytes::from(vec![7u8; VALUE_MAX_BYTES]));
        let max = felix_wire::frame::DEFAULT_MAX_PAYLOAD_BYTES as usize;
        for m in [
            Message::CacheValue {
                tenant_id: name.clone(),
                namespace: name.clone(),
                cache: name.clone(),
                key: key.clone(),
                value: value.clone(),
                request_id: Some(RequestId(u64::MAX)),
                version: Some(u64::MAX),
            },
            Message::CacheEvent {
                key,
                value,
                offset: felix_wire::Offset(u64::MAX),
                expires_at_millis: u64::MAX,
            },
        ] {
            let payload = m.to_frame().len() - felix_wire::frame::HEADER_LEN;
            assert!(payload <= max, "{payload} bytes");
        }
    }

    #[test]
    fn names_near_the_protocols_limit_are_refused_with_an_answer_that_encodes() {
        let dir = MemDirectory::new(1);
        let s = session();
        let long = "n".repeat(65_000);
        let a = decide_frame(
            &s,
            &dir,
            &binary_publish(TENANT, &long, &long, None, Some(1)),
            true,
        );
        assert_eq!(refusal_code(&a), ErrorCode::InvalidRequest);
        let Action::Answer(b) = a else { unreachable!() };
        assert!(
            b.len() < 2_048,
            "the echoed names are cut: {} bytes",
            b.len()
        );
        // Another tenant's name, huge: forbidden, and bounded too.
        let a = decide_frame(
            &s,
            &dir,
            &binary_publish(&long, "ns", "s", None, Some(2)),
            true,
        );
        assert_eq!(refusal_code(&a), ErrorCode::Forbidden);
    }

    #[test]
    fn an_unanswered_publish_is_refused_silently_and_a_uni_stream_carries_only_publishes() {
        let dir = MemDirectory::new(1);
        let s = session();
        let a = decide_frame(
            &s,
            &dir,
            &binary_publish("t2", "ns", "s", None, None),
            false,
        );
        assert!(
            matches!(a, Action::Refused(BrokerError::Forbidden(_))),
            "{a:?}"
        );
        // A publish with an ack prefix on a uni stream is still never answered.
        let a = decide_frame(
            &s,
            &dir,
            &binary_publish(TENANT, "ns", "s", None, Some(3)),
            false,
        );
        assert!(
            matches!(
                a,
                Action::Append {
                    answer: AnswerTo::Nothing,
                    ..
                }
            ),
            "{a:?}"
        );
        let a = decide_frame(&s, &dir, &json(Message::Topology), false);
        assert!(matches!(a, Action::Close(None)), "{a:?}");
    }

    /// Which shards a name has and who leads them is the name's to tell: a token with
    /// no permission on it is refused, as a read would be; any permission on it will
    /// do.
    /// Redriving or discarding a group's dead letters, deleting the group or moving its
    /// cursor manages the group: a token that may only read the stream is refused (it
    /// passed before), one with `group.manage` on the group or `stream.manage` on the
    /// stream goes through.
    #[test]
    fn managing_a_group_needs_group_manage() {
        let dir = MemDirectory::new(2);
        let reader = session_with(
            vec![format!("stream.subscribe:stream:{TENANT}/ns1/s")],
            Features::ERROR_CODES,
        );
        let manager = session_with(
            vec![
                format!("stream.subscribe:stream:{TENANT}/ns1/s"),
                format!("group.manage:group:{TENANT}/ns1/s/g"),
            ],
            Features::ERROR_CODES,
        );
        let owner = session_with(
            vec![format!("stream.manage:stream:{TENANT}/ns1/s")],
            Features::ERROR_CODES,
        );
        let redrive = |group: &str| {
            json(Message::GroupRedrive {
                tenant_id: TENANT.into(),
                namespace: "ns1".into(),
                stream: "s".into(),
                shard: ShardId(0),
                group: group.into(),
                offset: felix_wire::Offset(0),
                request_id: RequestId(1),
            })
        };
        let discard = json(Message::GroupDiscard {
            tenant_id: TENANT.into(),
            namespace: "ns1".into(),
            stream: "s".into(),
            shard: ShardId(0),
            group: "g".into(),
            offset: felix_wire::Offset(0),
            request_id: RequestId(2),
        });
        let forbidden = |s: &Session, f: &Frame| match decide_frame(s, &dir, f, true) {
            a @ Action::Answer(_) => refusal_code(&a) == ErrorCode::Forbidden,
            _ => false,
        };
        assert!(forbidden(&reader, &redrive("g")));
        assert!(forbidden(&reader, &discard));
        assert!(!forbidden(&manager, &redrive("g")));
        assert!(!forbidden(&manager, &discard));
        assert!(forbidden(&manager, &redrive("h")), "another group");
        assert!(!forbidden(&owner, &redrive("h")));
        // Deleting the group, or moving its cursor, manages it too; a seek that only
        // creates the group is a consumer's.
        let delete = json(Message::GroupDelete {
            tenant_id: TENANT.into(),
            namespace: "ns1".into(),
            stream: "s".into(),
            shard: ShardId(0),
            group: "g".into(),
            request_id: RequestId(3),
        });
        let seek = |if_new: bool| {
            json(Message::GroupSeek {
                tenant_id: TENANT.into(),
                namespace: "ns1".into(),
                stream: "s".into(),
                shard: ShardId(0),
                group: "g".into(),
                start: message::StartPosition::Latest,
                if_new,
                request_id: RequestId(4),
            })
        };
        assert!(forbidden(&reader, &delete));
        assert!(forbidden(&reader, &seek(false)));
        assert!(!forbidden(&reader, &seek(true)));
        assert!(!forbidden(&manager, &delete));
        assert!(!forbidden(&manager, &seek(false)));
    }

    /// Consuming through a group takes `group.consume` on it or `stream.subscribe` on
    /// its stream: a token granted only `group.consume` (as the control plane hands
    /// out to a queue's workers) was refused every poll.
    #[test]
    fn consuming_through_a_group_takes_group_consume() {
        let dir = MemDirectory::new(2);
        let consumer = session_with(
            vec![format!("group.consume:group:{TENANT}/ns1/s/g")],
            Features::ERROR_CODES,
        );
        let poll = |group: &str| {
            json(Message::GroupPoll {
                tenant_id: TENANT.into(),
                namespace: "ns1".into(),
                stream: "s".into(),
                shard: ShardId(0),
                group: group.into(),
                max_records: 1,
                wait_ms: 0,
                request_id: RequestId(1),
                consumer: None,
                reclaim: false,
                visibility_ms: None,
            })
        };
        let ack = json(Message::GroupAck {
            tenant_id: TENANT.into(),
            namespace: "ns1".into(),
            stream: "s".into(),
            shard: ShardId(0),
            group: "g".into(),
            offset: felix_wire::Offset(0),
            request_id: RequestId(2),
        });
        let forbidden = |f: &Frame| match decide_frame(&consumer, &dir, f, true) {
            a @ Action::Answer(_) => refusal_code(&a) == ErrorCode::Forbidden,
            _ => false,
        };
        assert!(!forbidden(&poll("g")));
        assert!(!forbidden(&ack));
        assert!(forbidden(&poll("h")), "another group");
    }

    #[test]
    fn shard_questions_need_a_permission_on_the_name() {
        let dir = MemDirectory::new(2);
        let cache_reader = session_with(
            vec![format!("cache.read:cache:{TENANT}/ns1/c")],
            Features::ERROR_CODES,
        );
        let publisher = session_with(
            vec![format!("stream.publish:stream:{TENANT}/ns1/s")],
            Features::ERROR_CODES,
        );
        let stream_shards = |ns: &str| {
            json(Message::StreamShards {
                tenant_id: TENANT.into(),
                namespace: ns.into(),
                stream: "s".into(),
                request_id: RequestId(1),
            })
        };
        let cache_shards = |ns: &str| {
            json(Message::CacheShards {
                tenant_id: TENANT.into(),
                namespace: ns.into(),
                cache: "c".into(),
                request_id: RequestId(2),
            })
        };
        let owners = |ns: &str, kind| {
            json(Message::ShardOwners {
                tenant_id: TENANT.into(),
                namespace: ns.into(),
                name: if kind == message::ShardKind::Cache {
                    "c"
                } else {
                    "s"
                }
                .into(),
                kind,
                request_id: RequestId(3),
            })
        };
        let refused = |s: &Session, f: &Frame| {
            refusal_code(&decide_frame(s, &dir, f, true)) == ErrorCode::Forbidden
        };
        // Answered, or refused for another reason (a cache a reader may not create is
        // not found).
        let answered = |s: &Session, f: &Frame| {
            let a = decide_frame(s, &dir, f, true);
            let Action::Answer(b) = &a else { return false };
            match Message::decode(&parse_frame(b).payload) {
                Ok(Message::Error { .. }) => refusal_code(&a) != ErrorCode::Forbidden,
                other => other.is_ok(),
            }
        };
        // Another namespace, or the other kind: nothing to tell.
        assert!(refused(&cache_reader, &stream_shards("ns1")));
        assert!(refused(&cache_reader, &cache_shards("secret")));
        assert!(refused(
            &cache_reader,
            &owners("secret", message::ShardKind::Cache)
        ));
        assert!(refused(
            &cache_reader,
            &owners("ns1", message::ShardKind::Stream)
        ));
        assert!(refused(&publisher, &stream_shards("secret")));
        // Its own names: answered.
        assert!(answered(&cache_reader, &cache_shards("ns1")));
        assert!(answered(
            &cache_reader,
            &owners("ns1", message::ShardKind::Cache)
        ));
        assert!(answered(&publisher, &stream_shards("ns1")));
        assert!(answered(
            &publisher,
            &owners("ns1", message::ShardKind::Stream)
        ));
    }

    #[test]
    fn dev_mode_creates_a_stream_only_for_a_token_that_may_write_it() {
        let dir = MemDirectory::new(2);
        let reader = session_with(
            vec![format!("stream.subscribe:stream:{TENANT}/*/*")],
            Features::ERROR_CODES,
        );
        let shards = |s: &Session| {
            let a = decide_frame(
                s,
                &dir,
                &json(Message::StreamShards {
                    tenant_id: TENANT.into(),
                    namespace: "ns".into(),
                    stream: "fresh".into(),
                    request_id: RequestId(1),
                }),
                true,
            );
            let Action::Answer(b) = a else {
                panic!("{a:?}")
            };
            match Message::decode(&parse_frame(&b).payload).unwrap() {
                Message::StreamShardsView { shards, .. } => shards,
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(shards(&reader), 0, "unknown to a reader, and not created");
        assert!(dir.catalog().spec(true, TENANT, "ns", "fresh").is_none());
        let sub = decide_frame(
            &reader,
            &dir,
            &json(Message::Subscribe {
                tenant_id: TENANT.into(),
                namespace: "ns".into(),
                stream: "fresh".into(),
                subscription_id: None,
                start: None,
                shard: None,
                queue_capacity: None,
            }),
            true,
        );
        assert_eq!(refusal_code(&sub), ErrorCode::NotFound);
        assert_eq!(shards(&session()), 2, "a writer creates it");
        assert_eq!(shards(&reader), 2, "then everyone sees it");
    }

    #[test]
    fn routes_decide_between_append_forward_and_refusal() {
        let dir = MemDirectory::new(2);
        let s = session();
        let frame = binary_publish(TENANT, "ns", "s", None, Some(1));
        let Action::Append { key, .. } = decide_frame(&s, &dir, &frame, true) else {
            panic!()
        };
        dir.remote.borrow_mut().insert(
            (*key).clone(),
            Route {
                leader: "node-b".into(),
                addr: Some(([127, 0, 0, 1], 6000).into()),
                generation: 4,
                replicas: vec!["node-b".into()].into(),
                learners: Vec::new().into(),
                handoff_from: None,
                abandoned: None,
            },
        );
        let a = decide_frame(&s, &dir, &frame, true);
        let Action::Forward {
            frame: wire,
            answer,
            route,
        } = a
        else {
            panic!("{a:?}")
        };
        assert_eq!(&*route.leader, "node-b");
        assert_eq!(answer, Forwarded::Publish(AnswerTo::Binary(RequestId(1))));
        assert_eq!(
            parse_frame(&wire).payload,
            frame.payload,
            "forwarded as received"
        );
        // A cache read forwarded is owed a retryable refusal should its answer be
        // lost (nothing was written); a write an outcome-unknown one.
        let cache_dir = MemDirectory::new(2);
        cache_dir.odd_shards.set(Some(true));
        let (mut reads, mut writes) = (0, 0);
        for i in 0..64 {
            let key = format!("k{i}");
            let get = json(Message::CacheGet {
                tenant_id: TENANT.into(),
                namespace: "ns".into(),
                cache: "c".into(),
                key: key.clone(),
                request_id: Some(RequestId(1)),
            });
            let put = json(Message::CachePut {
                tenant_id: TENANT.into(),
                namespace: "ns".into(),
                cache: "c".into(),
                key,
                value: Bytes::from_static(b"v"),
                request_id: Some(RequestId(2)),
                ttl_ms: None,
            });
            if let Action::Forward { answer, .. } = decide_frame(&s, &cache_dir, &get, true) {
                assert_eq!(answer, Forwarded::JsonRead);
                reads += 1;
            }
            if let Action::Forward { answer, .. } = decide_frame(&s, &cache_dir, &put, true) {
                assert_eq!(answer, Forwarded::Json);
                writes += 1;
            }
        }
        assert!(reads > 0 && reads == writes, "{reads} {writes}");
        let lost = answer::relay_json(
            &s,
            Err(answer::read_lost_is_retryable(BrokerError::Unacknowledged(
                "lost".into(),
            ))),
        );
        assert!(matches!(
            Message::decode(&parse_frame(&lost).payload).unwrap(),
            Message::Error {
                code: Some(ErrorCode::ShardUnavailable),
                ..
            }
        ));
        // Forwarded here once by another broker (its view trails this one's): sent on
        // to the leader this broker knows.
        let mut forwarded = s.clone();
        forwarded.forwarded = 1;
        assert!(matches!(
            decide_frame(&forwarded, &dir, &frame, true),
            Action::Forward { .. }
        ));
        // Forwarded twice: refused, not sent on (two brokers whose views disagreed sent
        // it to and fro).
        forwarded.forwarded = 2;
        assert_eq!(
            refusal_code(&decide_frame(&forwarded, &dir, &frame, true)),
            ErrorCode::ShardUnavailable
        );
        dir.remote.borrow_mut().clear();
        dir.unavailable.borrow_mut().insert((*key).clone());
        assert_eq!(
            refusal_code(&decide_frame(&s, &dir, &frame, true)),
            ErrorCode::ShardUnavailable
        );
    }

    #[test]
    fn a_shard_out_of_range_and_an_empty_batch_are_invalid() {
        let dir = MemDirectory::new(2);
        let s = session();
        let sub = json(Message::Subscribe {
            tenant_id: TENANT.into(),
            namespace: "ns".into(),
            stream: "s".into(),
            subscription_id: None,
            start: None,
            shard: Some(ShardId(7)),
            queue_capacity: None,
        });
        assert_eq!(
            refusal_code(&decide_frame(&s, &dir, &sub, true)),
            ErrorCode::InvalidRequest
        );
        let empty = json(Message::PublishBatch {
            tenant_id: TENANT.into(),
            namespace: "ns".into(),
            stream: "s".into(),
            payloads: vec![],
            key: None,
            shard: None,
            request_id: Some(RequestId(5)),
            ack: Some(message::AckMode::PerBatch),
        });
        assert_eq!(
            refusal_code(&decide_frame(&s, &dir, &empty, true)),
            ErrorCode::InvalidRequest
        );
        // More records than one replication message carries: never shippable.
        let batch = |n: usize| {
            json(Message::PublishBatch {
                tenant_id: TENANT.into(),
                namespace: "ns".into(),
                stream: "s".into(),
                payloads: vec![Bytes::new(); n],
                key: None,
                shard: None,
                request_id: Some(RequestId(6)),
                ack: Some(message::AckMode::PerBatch),
            })
        };
        let max = felix_wire::internal::MAX_RECORDS_PER_MESSAGE;
        assert_eq!(
            refusal_code(&decide_frame(&s, &dir, &batch(max + 1), true)),
            ErrorCode::InvalidRequest
        );
        assert!(matches!(
            decide_frame(&s, &dir, &batch(max), true),
            Action::Append { .. }
        ));
    }

    #[test]
    fn unknown_requests_end_the_stream_unless_the_client_takes_unsupported() {
        let dir = MemDirectory::new(1);
        let mut buf = BytesMut::new();
        felix_wire::frame::write_frame(
            &mut buf,
            Flags::JSON,
            format!(
                r#"{{"type":"frobnicate","request_id":4,"name":"{}"}}"#,
                "x".repeat(10_000)
            )
            .as_bytes(),
        )
        .unwrap();
        let frame = parse_frame(&buf.freeze());
        let plain = decide_frame(&session(), &dir, &frame, true);
        assert!(matches!(plain, Action::Close(Some(_))), "{plain:?}");
        let taker = session_with(crate::auth::all_data_perms(TENANT), Features::UNSUPPORTED);
        let Action::Answer(b) = decide_frame(&taker, &dir, &frame, true) else {
            panic!()
        };
        assert!(b.len() < 1_024, "the request type is echoed cut");
        assert!(matches!(
            Message::decode(&parse_frame(&b).payload).unwrap(),
            Message::Unsupported {
                request_id: Some(RequestId(4)),
                ..
            }
        ));
    }

    /// A stream's session outlives its token's expiry, as the protocol has it (the
    /// token is checked when the stream opens).
    #[test]
    fn a_session_outlives_its_tokens_expiry_on_virtual_time() {
        let dir = MemDirectory::new(1);
        let token =
            crate::session::testing::token(crate::auth::all_data_perms(TENANT), 1_000, 5_000);
        let grant = crate::session::testing::keys()
            .verify(&token, TENANT, 1_000)
            .unwrap();
        let s = Session::new(grant, &token, Flags(0xffff), Features::ERROR_CODES);
        let f = binary_publish(TENANT, "ns", "s", None, Some(1));
        assert!(matches!(
            decide(&s, &dir, decode(&f, true), true, at(4_999)),
            Action::Append { .. }
        ));
        assert!(matches!(
            decide(&s, &dir, decode(&f, true), true, at(5_000 + 3_600)),
            Action::Append { .. }
        ));
    }
}
