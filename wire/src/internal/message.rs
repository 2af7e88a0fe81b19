//! Every internal message but `Records` (see `records.rs`), and [`InternalMessage`].
//!
//! Each message is a struct whose first field is the `correlation_id` every payload
//! starts with; its body follows in field order. `encode` writes a whole frame.

use bytes::{BufMut, Bytes, BytesMut};

use super::codec::{
    self, Cursor, DETAIL, INCARNATION, LEADER, NAME, NAMESPACE, NODE_ID, REASON, TENANT, TOKEN,
};
use super::error::{BodyError, EncodeError, InternalError};
use super::kind;
use super::records::Records;
use crate::binary::WireStr;
use crate::ids::{Generation, Offset, ShardId};
use crate::message::ShardKind;

/// How a message body is written and read, after the correlation id.
pub(super) trait Body: Sized {
    /// Bytes to reserve for the body (a hint).
    fn len_hint(&self) -> usize {
        64
    }
    /// Appends the body, refusing what the decoder would refuse.
    fn put(&self, buf: &mut BytesMut) -> Result<(), BodyError>;
    /// Reads the body.
    fn get(correlation_id: u64, r: &mut Cursor<'_>) -> Result<Self, BodyError>;
}

/// One shard of one stream or cache: `kind u8` (1 stream, 2 cache), `tenant`,
/// `namespace`, `name` (strings of at most 512 bytes each), `shard u32`. A reference
/// that names the stream's or cache's incarnation (the control plane's id of one life of
/// the name) has kind 3 (stream) or 4 (cache) and the `incarnation` string (1 to 512
/// bytes) after `name`: a broker holding another life of the name ignores it, so the
/// copies of a deleted stream never answer for one created again under its name.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ShardRef {
    /// Stream or cache.
    pub kind: ShardKind,
    /// Tenant (zero-copy when decoded).
    pub tenant: WireStr,
    /// Namespace.
    pub namespace: WireStr,
    /// Stream or cache name.
    pub name: WireStr,
    /// The incarnation of the name; empty when not known (encoded as kind 1 or 2).
    pub incarnation: WireStr,
    /// Shard index.
    pub shard: ShardId,
}

impl ShardRef {
    fn kind_byte(&self) -> u8 {
        let base = match self.kind {
            ShardKind::Stream => 1,
            ShardKind::Cache => 2,
        };
        if self.incarnation.is_empty() {
            base
        } else {
            base + 2
        }
    }

    pub(super) fn len(&self) -> usize {
        let incarnation = if self.incarnation.is_empty() {
            0
        } else {
            4 + self.incarnation.len()
        };
        1 + 12 + self.tenant.len() + self.namespace.len() + self.name.len() + incarnation + 4
    }

    pub(super) fn put(&self, buf: &mut BytesMut) -> Result<(), BodyError> {
        buf.put_u8(self.kind_byte());
        codec::put_str(buf, TENANT, &self.tenant)?;
        codec::put_str(buf, NAMESPACE, &self.namespace)?;
        codec::put_str(buf, NAME, &self.name)?;
        if !self.incarnation.is_empty() {
            codec::put_str(buf, INCARNATION, &self.incarnation)?;
        }
        buf.put_u32(self.shard.0);
        Ok(())
    }

    pub(super) fn get(r: &mut Cursor<'_>) -> Result<ShardRef, BodyError> {
        let (kind, named) = match r.u8("shard kind")? {
            1 => (ShardKind::Stream, false),
            2 => (ShardKind::Cache, false),
            3 => (ShardKind::Stream, true),
            4 => (ShardKind::Cache, true),
            byte => return Err(BodyError::UnknownShardKind { byte }),
        };
        let (tenant, namespace, name) = (
            r.wire_str(TENANT)?,
            r.wire_str(NAMESPACE)?,
            r.wire_str(NAME)?,
        );
        let incarnation = if named {
            let incarnation = r.wire_str(INCARNATION)?;
            if incarnation.is_empty() {
                // Kinds 3 and 4 carry one; no incarnation is kinds 1 and 2 (canonical).
                return Err(BodyError::EmptyIncarnation);
            }
            incarnation
        } else {
            WireStr::default()
        };
        Ok(ShardRef {
            kind,
            tenant,
            namespace,
            name,
            incarnation,
            shard: ShardId(r.u32("shard")?),
        })
    }
}

/// Kind 1, first message on a connection, dialer to listener: `node_id`, `token`
/// (at most 16 KiB), `capabilities u64`. Answered [`HelloOk`] or [`HelloRefused`].
#[derive(Clone, PartialEq, Eq)]
pub struct Hello {
    /// Echoed in the answer.
    pub correlation_id: u64,
    /// The dialing broker's node id (at most 512 bytes).
    pub node_id: String,
    /// Its credential for the listener (at most 16 KiB).
    pub token: String,
    /// [`capabilities`](super::capabilities) bits; unknown bits are kept.
    pub capabilities: u64,
}

impl std::fmt::Debug for Hello {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The token is a credential: never in logs.
        f.debug_struct("Hello")
            .field("correlation_id", &self.correlation_id)
            .field("node_id", &self.node_id)
            .field("token", &format_args!("<{} bytes>", self.token.len()))
            .field("capabilities", &format_args!("{:#x}", self.capabilities))
            .finish()
    }
}

impl Body for Hello {
    fn len_hint(&self) -> usize {
        16 + self.node_id.len() + self.token.len()
    }
    fn put(&self, buf: &mut BytesMut) -> Result<(), BodyError> {
        codec::put_str(buf, NODE_ID, &self.node_id)?;
        codec::put_str(buf, TOKEN, &self.token)?;
        buf.put_u64(self.capabilities);
        Ok(())
    }
    fn get(correlation_id: u64, r: &mut Cursor<'_>) -> Result<Self, BodyError> {
        Ok(Hello {
            correlation_id,
            node_id: r.string(NODE_ID)?,
            token: r.string(TOKEN)?,
            capabilities: r.u64("capabilities")?,
        })
    }
}

/// Kind 2, the listener accepts `Hello`: `node_id`, `capabilities u64`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HelloOk {
    /// The `Hello`'s correlation id.
    pub correlation_id: u64,
    /// The listening broker's node id (at most 512 bytes).
    pub node_id: String,
    /// Its [`capabilities`](super::capabilities) bits; unknown bits are kept.
    pub capabilities: u64,
}

impl Body for HelloOk {
    fn put(&self, buf: &mut BytesMut) -> Result<(), BodyError> {
        codec::put_str(buf, NODE_ID, &self.node_id)?;
        buf.put_u64(self.capabilities);
        Ok(())
    }
    fn get(correlation_id: u64, r: &mut Cursor<'_>) -> Result<Self, BodyError> {
        Ok(HelloOk {
            correlation_id,
            node_id: r.string(NODE_ID)?,
            capabilities: r.u64("capabilities")?,
        })
    }
}

/// Kind 3, the listener refuses `Hello` and closes the connection: `reason`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HelloRefused {
    /// The `Hello`'s correlation id.
    pub correlation_id: u64,
    /// Why, for operators (at most 1 KiB).
    pub reason: String,
}

impl Body for HelloRefused {
    fn put(&self, buf: &mut BytesMut) -> Result<(), BodyError> {
        codec::put_str(buf, REASON, &self.reason)
    }
    fn get(correlation_id: u64, r: &mut Cursor<'_>) -> Result<Self, BodyError> {
        Ok(HelloRefused {
            correlation_id,
            reason: r.string(REASON)?,
        })
    }
}

/// Kind 10, a new leader fences a replica: `shard`, `generation u64`, `leader`. The
/// replica persists the generation and leader before answering [`FenceOk`], and from
/// then on refuses older generations and other leaders (`Fenced`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    /// Echoed in the answer.
    pub correlation_id: u64,
    /// The shard.
    pub shard: ShardRef,
    /// The leader's generation.
    pub generation: Generation,
    /// The leader's node id (at most 512 bytes).
    pub leader: String,
}

impl Body for Fence {
    fn len_hint(&self) -> usize {
        self.shard.len() + 12 + self.leader.len()
    }
    fn put(&self, buf: &mut BytesMut) -> Result<(), BodyError> {
        self.shard.put(buf)?;
        buf.put_u64(self.generation.0);
        codec::put_str(buf, LEADER, &self.leader)
    }
    fn get(correlation_id: u64, r: &mut Cursor<'_>) -> Result<Self, BodyError> {
        Ok(Fence {
            correlation_id,
            shard: ShardRef::get(r)?,
            generation: Generation(r.u64("generation")?),
            leader: r.string(LEADER)?,
        })
    }
}

/// Kind 11, the replica took the fence: `generation`, `log_base`, `log_end`, `commit`,
/// `last_generation` (all `u64`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FenceOk {
    /// The `Fence`'s correlation id.
    pub correlation_id: u64,
    /// The generation now accepted (the fence's).
    pub generation: Generation,
    /// The first offset the replica's log holds.
    pub log_base: Offset,
    /// One past the last record it holds durably.
    pub log_end: Offset,
    /// Its commit offset: everything below is never rewritten.
    pub commit: Offset,
    /// The generation that wrote its last record (0 when the log is empty).
    pub last_generation: Generation,
}

impl Body for FenceOk {
    fn put(&self, buf: &mut BytesMut) -> Result<(), BodyError> {
        buf.put_u64(self.generation.0);
        buf.put_u64(self.log_base.0);
        buf.put_u64(self.log_end.0);
        buf.put_u64(self.commit.0);
        buf.put_u64(self.last_generation.0);
        Ok(())
    }
    fn get(correlation_id: u64, r: &mut Cursor<'_>) -> Result<Self, BodyError> {
        Ok(FenceOk {
            correlation_id,
            generation: Generation(r.u64("generation")?),
            log_base: Offset(r.u64("log_base")?),
            log_end: Offset(r.u64("log_end")?),
            commit: Offset(r.u64("commit")?),
            last_generation: Generation(r.u64("last_generation")?),
        })
    }
}

/// Kind 12, a fencing leader reads a replica's log: `shard`, `generation u64`, `leader`,
/// `from_offset u64`, `max_bytes u32`. Answered with [`Records`] starting at
/// `from_offset` (no batches when there is nothing there), or `ReplicateRefused`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fetch {
    /// Echoed in the answer.
    pub correlation_id: u64,
    /// The shard.
    pub shard: ShardRef,
    /// The leader's generation; only the fenced generation's leader is answered.
    pub generation: Generation,
    /// The leader's node id (at most 512 bytes).
    pub leader: String,
    /// First offset wanted.
    pub from_offset: Offset,
    /// Record bytes wanted at most (at least one batch is sent when there is one).
    pub max_bytes: u32,
}

impl Body for Fetch {
    fn len_hint(&self) -> usize {
        self.shard.len() + 24 + self.leader.len()
    }
    fn put(&self, buf: &mut BytesMut) -> Result<(), BodyError> {
        self.shard.put(buf)?;
        buf.put_u64(self.generation.0);
        codec::put_str(buf, LEADER, &self.leader)?;
        buf.put_u64(self.from_offset.0);
        buf.put_u32(self.max_bytes);
        Ok(())
    }
    fn get(correlation_id: u64, r: &mut Cursor<'_>) -> Result<Self, BodyError> {
        Ok(Fetch {
            correlation_id,
            shard: ShardRef::get(r)?,
            generation: Generation(r.u64("generation")?),
            leader: r.string(LEADER)?,
            from_offset: Offset(r.u64("from_offset")?),
            max_bytes: r.u32("max_bytes")?,
        })
    }
}

/// Kind 21, the follower holds the records durably: `generation u64`, `durable_end u64`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicateOk {
    /// The request's correlation id.
    pub correlation_id: u64,
    /// The generation the follower accepted the request at.
    pub generation: Generation,
    /// One past the last record the follower holds on disk: the next offset to send.
    pub durable_end: Offset,
}

impl Body for ReplicateOk {
    fn put(&self, buf: &mut BytesMut) -> Result<(), BodyError> {
        buf.put_u64(self.generation.0);
        buf.put_u64(self.durable_end.0);
        Ok(())
    }
    fn get(correlation_id: u64, r: &mut Cursor<'_>) -> Result<Self, BodyError> {
        Ok(ReplicateOk {
            correlation_id,
            generation: Generation(r.u64("generation")?),
            durable_end: Offset(r.u64("durable_end")?),
        })
    }
}

/// Why a replica refused a request (`u16` on the wire). `docs/wire.md` says what the
/// leader does with each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RefusalCode {
    /// The batch starts past the follower's tail: resume at `expected_offset`.
    Gap,
    /// The logs disagree at or before the batch: resume at `expected_offset` (the
    /// follower's commit, or the start of its last generation).
    Mismatch,
    /// A newer generation or another leader was accepted; `generation` is that one.
    Fenced,
    /// This generation was never fenced here: fence first.
    NotFenced,
    /// Accepting would rewrite committed records: the follower halted.
    BelowCommit,
    /// The follower is empty or behind the leader's base: send `Bootstrap`.
    Bootstrap,
    /// The follower cannot serve now: retry later.
    Unavailable,
    /// The request did not decode (or its checksum failed): resend.
    Malformed,
    /// The replica lost its copy and is rebuilding it from its peers: it accepted the
    /// fence's generation and takes records (ship from `expected_offset`, its durable
    /// end), but it must not be counted toward a majority that elects a leader. It is
    /// whole again at this generation once it verified its start record.
    Rebuilding,
    /// As `Rebuilding`, but the copy was lost at this generation (or a later one): it
    /// can be whole again only at a newer generation, which its leader reports.
    RebuildingNeedsGeneration,
    /// A code this implementation does not know.
    Unknown(u16),
}

impl RefusalCode {
    /// The wire number.
    pub fn number(self) -> u16 {
        match self {
            RefusalCode::Gap => 1,
            RefusalCode::Mismatch => 2,
            RefusalCode::Fenced => 3,
            RefusalCode::NotFenced => 4,
            RefusalCode::BelowCommit => 5,
            RefusalCode::Bootstrap => 6,
            RefusalCode::Unavailable => 7,
            RefusalCode::Malformed => 8,
            RefusalCode::Rebuilding => 9,
            RefusalCode::RebuildingNeedsGeneration => 10,
            RefusalCode::Unknown(n) => n,
        }
    }

    /// Reads a wire number; unknown numbers are kept.
    pub fn from_number(number: u16) -> RefusalCode {
        match number {
            1 => RefusalCode::Gap,
            2 => RefusalCode::Mismatch,
            3 => RefusalCode::Fenced,
            4 => RefusalCode::NotFenced,
            5 => RefusalCode::BelowCommit,
            6 => RefusalCode::Bootstrap,
            7 => RefusalCode::Unavailable,
            8 => RefusalCode::Malformed,
            9 => RefusalCode::Rebuilding,
            10 => RefusalCode::RebuildingNeedsGeneration,
            n => RefusalCode::Unknown(n),
        }
    }
}

/// Kind 22, a replica refuses `Fence`, `Fetch`, `Records` or `Bootstrap`:
/// `generation u64`, `code u16`, `expected_offset u64`, `detail`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicateRefused {
    /// The request's correlation id.
    pub correlation_id: u64,
    /// The generation the replica has accepted (for `Fenced`: the newer one).
    pub generation: Generation,
    /// Why.
    pub code: RefusalCode,
    /// Where to resume (`Gap`, `Mismatch`); otherwise the replica's durable end.
    pub expected_offset: Offset,
    /// For operators (at most 1 KiB).
    pub detail: String,
}

impl Body for ReplicateRefused {
    fn put(&self, buf: &mut BytesMut) -> Result<(), BodyError> {
        buf.put_u64(self.generation.0);
        buf.put_u16(self.code.number());
        buf.put_u64(self.expected_offset.0);
        codec::put_str(buf, DETAIL, &self.detail)
    }
    fn get(correlation_id: u64, r: &mut Cursor<'_>) -> Result<Self, BodyError> {
        Ok(ReplicateRefused {
            correlation_id,
            generation: Generation(r.u64("generation")?),
            code: RefusalCode::from_number(r.u16("code")?),
            expected_offset: Offset(r.u64("expected_offset")?),
            detail: r.string(DETAIL)?,
        })
    }
}

/// Kind 23, the leader places an empty log at its base on a follower that is empty or
/// behind it: `shard`, `generation u64`, `leader`, `base_offset u64`. Answered
/// `ReplicateOk` with `durable_end = base_offset`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bootstrap {
    /// Echoed in the answer.
    pub correlation_id: u64,
    /// The shard.
    pub shard: ShardRef,
    /// The leader's generation.
    pub generation: Generation,
    /// The leader's node id (at most 512 bytes).
    pub leader: String,
    /// The first offset of the leader's log.
    pub base_offset: Offset,
}

impl Body for Bootstrap {
    fn len_hint(&self) -> usize {
        self.shard.len() + 20 + self.leader.len()
    }
    fn put(&self, buf: &mut BytesMut) -> Result<(), BodyError> {
        self.shard.put(buf)?;
        buf.put_u64(self.generation.0);
        codec::put_str(buf, LEADER, &self.leader)?;
        buf.put_u64(self.base_offset.0);
        Ok(())
    }
    fn get(correlation_id: u64, r: &mut Cursor<'_>) -> Result<Self, BodyError> {
        Ok(Bootstrap {
            correlation_id,
            shard: ShardRef::get(r)?,
            generation: Generation(r.u64("generation")?),
            leader: r.string(LEADER)?,
            base_offset: Offset(r.u64("base_offset")?),
        })
    }
}

/// Kind 30, liveness probe: the correlation id only. Answered [`Pong`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ping {
    /// Echoed in the `Pong`.
    pub correlation_id: u64,
}

impl Body for Ping {
    fn put(&self, _: &mut BytesMut) -> Result<(), BodyError> {
        Ok(())
    }
    fn get(correlation_id: u64, _: &mut Cursor<'_>) -> Result<Self, BodyError> {
        Ok(Ping { correlation_id })
    }
}

/// Kind 31, the answer to [`Ping`]: the correlation id only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pong {
    /// The `Ping`'s correlation id.
    pub correlation_id: u64,
}

impl Body for Pong {
    fn put(&self, _: &mut BytesMut) -> Result<(), BodyError> {
        Ok(())
    }
    fn get(correlation_id: u64, _: &mut Cursor<'_>) -> Result<Self, BodyError> {
        Ok(Pong { correlation_id })
    }
}

/// Kind 40, the answer to a kind the receiver does not know: `kind u16`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnsupportedKind {
    /// The unknown request's correlation id.
    pub correlation_id: u64,
    /// Its kind.
    pub kind: u16,
}

impl Body for UnsupportedKind {
    fn put(&self, buf: &mut BytesMut) -> Result<(), BodyError> {
        buf.put_u16(self.kind);
        Ok(())
    }
    fn get(correlation_id: u64, r: &mut Cursor<'_>) -> Result<Self, BodyError> {
        Ok(UnsupportedKind {
            correlation_id,
            kind: r.u16("kind")?,
        })
    }
}

/// Any internal message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InternalMessage {
    /// Kind 1.
    Hello(Hello),
    /// Kind 2.
    HelloOk(HelloOk),
    /// Kind 3.
    HelloRefused(HelloRefused),
    /// Kind 10.
    Fence(Fence),
    /// Kind 11.
    FenceOk(FenceOk),
    /// Kind 12.
    Fetch(Fetch),
    /// Kind 20.
    Records(Records),
    /// Kind 21.
    ReplicateOk(ReplicateOk),
    /// Kind 22.
    ReplicateRefused(ReplicateRefused),
    /// Kind 23.
    Bootstrap(Bootstrap),
    /// Kind 30.
    Ping(Ping),
    /// Kind 31.
    Pong(Pong),
    /// Kind 40.
    UnsupportedKind(UnsupportedKind),
    /// A kind this implementation does not know; its body after the correlation id was
    /// skipped. Answer it with [`UnsupportedKind`].
    Unknown {
        /// The header's kind.
        kind: u16,
        /// The correlation id.
        correlation_id: u64,
    },
}

macro_rules! messages {
    ($($ty:ident = $kind:ident),* $(,)?) => {
        $(
            impl $ty {
                /// This message's kind.
                pub const KIND: u16 = kind::$kind;

                /// Appends this message as one whole frame, header included. Refuses
                /// (leaving `buf` as it was) what a receiver would refuse.
                pub fn encode(&self, buf: &mut BytesMut) -> Result<(), EncodeError> {
                    codec::encode_frame(
                        buf,
                        Self::KIND,
                        self.correlation_id,
                        Body::len_hint(self),
                        |buf| Body::put(self, buf),
                    )
                }
            }

            impl From<$ty> for InternalMessage {
                fn from(message: $ty) -> Self {
                    InternalMessage::$ty(message)
                }
            }
        )*

        impl InternalMessage {
            /// The header kind.
            pub fn kind(&self) -> u16 {
                match self {
                    $(InternalMessage::$ty(_) => kind::$kind,)*
                    InternalMessage::Unknown { kind, .. } => *kind,
                }
            }

            /// The correlation id.
            pub fn correlation_id(&self) -> u64 {
                match self {
                    $(InternalMessage::$ty(m) => m.correlation_id,)*
                    InternalMessage::Unknown { correlation_id, .. } => *correlation_id,
                }
            }

            /// Appends this message as one whole frame. `Unknown` is written as a frame
            /// of its kind holding only the correlation id, and refused for a known kind.
            pub fn encode(&self, buf: &mut BytesMut) -> Result<(), EncodeError> {
                match self {
                    $(InternalMessage::$ty(m) => m.encode(buf),)*
                    InternalMessage::Unknown { kind, correlation_id } => {
                        if kind::is_known(*kind) {
                            return Err(EncodeError::KnownKind { kind: *kind });
                        }
                        codec::encode_frame(buf, *kind, *correlation_id, 0, |_| Ok(()))
                    }
                }
            }

            fn decode_body(
                kind: u16,
                correlation_id: u64,
                r: &mut Cursor<'_>,
            ) -> Result<InternalMessage, BodyError> {
                Ok(match kind {
                    $(kind::$kind => InternalMessage::$ty(<$ty as Body>::get(correlation_id, r)?),)*
                    _ => {
                        // Forward compatibility: the body is skipped, not judged.
                        let _ = r.rest();
                        InternalMessage::Unknown { kind, correlation_id }
                    }
                })
            }
        }
    };
}

messages! {
    Hello = HELLO,
    HelloOk = HELLO_OK,
    HelloRefused = HELLO_REFUSED,
    Fence = FENCE,
    FenceOk = FENCE_OK,
    Fetch = FETCH,
    Records = RECORDS,
    ReplicateOk = REPLICATE_OK,
    ReplicateRefused = REPLICATE_REFUSED,
    Bootstrap = BOOTSTRAP,
    Ping = PING,
    Pong = PONG,
    UnsupportedKind = UNSUPPORTED_KIND,
}

impl InternalMessage {
    /// Decodes the payload of a whole frame of `kind`. Strings and records are slices
    /// of `payload`. Errors are always [`InternalError::Malformed`] (the frame is whole).
    pub fn decode_payload(kind: u16, payload: &Bytes) -> Result<InternalMessage, InternalError> {
        let mut r = Cursor::new(payload);
        let correlation_id =
            r.u64("correlation_id")
                .map_err(|problem| InternalError::Malformed {
                    kind,
                    correlation_id: None,
                    problem,
                })?;
        InternalMessage::decode_body(kind, correlation_id, &mut r)
            .and_then(|message| r.finish().map(|()| message))
            .map_err(|problem| InternalError::Malformed {
                kind,
                correlation_id: Some(correlation_id),
                problem,
            })
    }
}
