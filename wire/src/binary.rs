//! The binary hot-path layouts: publish batches, publish acks and event batches.
//!
//! All integers are big-endian; strings are raw UTF-8 with a length prefix. Which
//! optional parts are present is decided by the frame's flags, never by guessing from
//! the bytes. Decoders take the frame payload as [`Bytes`] and return record payloads as
//! zero-copy slices of it; counts are checked against the bytes left before anything is
//! allocated for them.

use bytes::{BufMut, Bytes, BytesMut};

use crate::cursor::Reader;
use crate::error_code::{ErrorCode, RetryClass};
use crate::flags::Flags;
use crate::frame::{self, FrameError};
use crate::ids::{Generation, Offset, ProducerId, RequestId, Sequence, SubscriptionId};
use crate::message::AckMode;

/// Why a binary payload cannot be read or written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BinaryError {
    /// The payload ended inside a field.
    #[error("truncated {field}: needs {needed} bytes, {available} left")]
    Truncated {
        /// The field being read.
        field: &'static str,
        /// Bytes it needs.
        needed: usize,
        /// Bytes left.
        available: usize,
    },
    /// A string field is not UTF-8.
    #[error("{field} is not valid UTF-8")]
    InvalidUtf8 {
        /// The field.
        field: &'static str,
    },
    /// An element count larger than the rest of the payload could hold.
    #[error("{field} claims {count} elements but only {remaining} bytes remain")]
    CountTooLarge {
        /// The field.
        field: &'static str,
        /// Claimed count.
        count: usize,
        /// Bytes left.
        remaining: usize,
    },
    /// Bytes after the last field.
    #[error("{count} unexpected bytes after the last field")]
    TrailingBytes {
        /// How many.
        count: usize,
    },
    /// An ack-mode byte other than 1 or 2.
    #[error("invalid ack_mode byte {byte} (1 = per_message, 2 = per_batch)")]
    InvalidAckMode {
        /// The byte.
        byte: u8,
    },
    /// An idempotent batch whose ack mode is not per_batch.
    #[error("idempotent publish batches must use ack_mode per_batch")]
    IdempotentNotPerBatch,
    /// A status byte other than 0 or 1.
    #[error("invalid publish ack status byte {byte}")]
    InvalidStatus {
        /// The byte.
        byte: u8,
    },
    /// The flags do not select this layout.
    #[error("flags {flags:?} do not select the {layout} layout")]
    WrongLayout {
        /// The flags.
        flags: Flags,
        /// The layout asked for.
        layout: &'static str,
    },
    /// A field too long for its length prefix (encoding).
    #[error("{field} is {len} bytes; its length prefix allows {max}")]
    FieldTooLong {
        /// The field.
        field: &'static str,
        /// Its length.
        len: usize,
        /// The prefix's maximum.
        max: usize,
    },
    /// The frame around the layout could not be written.
    #[error(transparent)]
    Frame(#[from] FrameError),
}

/// A UTF-8 string that is a zero-copy slice of a received frame.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct WireStr(Bytes);

impl WireStr {
    /// Validates `bytes` as UTF-8.
    pub fn from_utf8(bytes: Bytes) -> Result<WireStr, std::str::Utf8Error> {
        std::str::from_utf8(&bytes)?;
        Ok(WireStr(bytes))
    }

    /// A static string.
    pub const fn from_static(s: &'static str) -> WireStr {
        WireStr(Bytes::from_static(s.as_bytes()))
    }

    /// The string.
    pub fn as_str(&self) -> &str {
        // SAFETY: every constructor validated (or was given) UTF-8, and the bytes are
        // immutable.
        unsafe { std::str::from_utf8_unchecked(&self.0) }
    }

    /// The raw bytes.
    pub fn as_bytes(&self) -> &Bytes {
        &self.0
    }
}

impl From<&str> for WireStr {
    fn from(s: &str) -> Self {
        WireStr(Bytes::copy_from_slice(s.as_bytes()))
    }
}

impl From<String> for WireStr {
    fn from(s: String) -> Self {
        WireStr(Bytes::from(s))
    }
}

impl std::ops::Deref for WireStr {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl std::fmt::Debug for WireStr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self.as_str(), f)
    }
}

impl std::fmt::Display for WireStr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

fn put_str16(buf: &mut BytesMut, field: &'static str, s: &[u8]) -> Result<(), BinaryError> {
    let len = u16::try_from(s.len()).map_err(|_| BinaryError::FieldTooLong {
        field,
        len: s.len(),
        max: u16::MAX as usize,
    })?;
    buf.put_u16(len);
    buf.put_slice(s);
    Ok(())
}

fn put_u32_len(buf: &mut BytesMut, field: &'static str, len: usize) -> Result<(), BinaryError> {
    let len32 = u32::try_from(len).map_err(|_| BinaryError::FieldTooLong {
        field,
        len,
        max: u32::MAX as usize,
    })?;
    buf.put_u32(len32);
    Ok(())
}

// ---- Publish batch (0x0001 + 0x0008 / 0x0040 / 0x0100) ----------------------------------

/// The acked prefix (flag 0x0008): the publish is owed an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AckPrefix {
    /// Correlation id, echoed in the ack.
    pub request_id: RequestId,
    /// per_message or per_batch.
    pub ack_mode: AckMode,
}

/// The idempotent prefix (flag 0x0100).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdempotentPrefix {
    /// Producer.
    pub producer_id: ProducerId,
    /// Batch number on this shard.
    pub sequence: Sequence,
}

/// What precedes the records of a publish batch, for encoding without building a
/// [`PublishBatch`].
#[derive(Debug, Clone, Copy)]
pub struct PublishBatchHeader<'a> {
    /// Tenant.
    pub tenant: &'a str,
    /// Namespace.
    pub namespace: &'a str,
    /// Stream.
    pub stream: &'a str,
    /// Present when acked.
    pub ack: Option<AckPrefix>,
    /// Present when idempotent (requires `ack`).
    pub idempotent: Option<IdempotentPrefix>,
    /// Routing key (an empty key is a real key).
    pub key: Option<&'a [u8]>,
}

impl PublishBatchHeader<'_> {
    /// The flags this batch is framed with.
    pub fn flags(&self) -> Flags {
        Flags::BINARY_PUBLISH_BATCH
            .with(Flags::BINARY_PUBLISH_ACKED, self.ack.is_some())
            .with(Flags::BINARY_PUBLISH_IDEMPOTENT, self.idempotent.is_some())
            .with(Flags::BINARY_PUBLISH_KEYED, self.key.is_some())
    }

    /// Appends the whole frame: header, prefixes, body and `payloads`.
    pub fn encode_frame<P: AsRef<[u8]>>(
        &self,
        buf: &mut BytesMut,
        payloads: &[P],
    ) -> Result<(), BinaryError> {
        let start = buf.len();
        let result = self.encode_frame_inner(buf, payloads);
        if result.is_err() {
            buf.truncate(start);
        }
        result
    }

    fn encode_frame_inner<P: AsRef<[u8]>>(
        &self,
        buf: &mut BytesMut,
        payloads: &[P],
    ) -> Result<(), BinaryError> {
        let body: usize = payloads.iter().map(|p| 4 + p.as_ref().len()).sum();
        buf.reserve(frame::HEADER_LEN + 64 + body);
        let start = frame::begin_frame(buf, self.flags());
        match (self.ack, self.idempotent) {
            (Some(ack), idem) => {
                let byte = ack
                    .ack_mode
                    .byte()
                    .ok_or(BinaryError::InvalidAckMode { byte: 0 })?;
                if idem.is_some() && ack.ack_mode != AckMode::PerBatch {
                    return Err(BinaryError::IdempotentNotPerBatch);
                }
                buf.put_u64(ack.request_id.0);
                buf.put_u8(byte);
                if let Some(idem) = idem {
                    buf.put_u64(idem.producer_id.0);
                    buf.put_u64(idem.sequence.0);
                }
            }
            (None, Some(_)) => {
                return Err(BinaryError::WrongLayout {
                    flags: self.flags(),
                    layout: "idempotent publish (needs the acked prefix)",
                });
            }
            (None, None) => {}
        }
        if let Some(key) = self.key {
            put_str16(buf, "key", key)?;
        }
        put_str16(buf, "tenant", self.tenant.as_bytes())?;
        put_str16(buf, "namespace", self.namespace.as_bytes())?;
        put_str16(buf, "stream", self.stream.as_bytes())?;
        put_u32_len(buf, "record count", payloads.len())?;
        for p in payloads {
            let p = p.as_ref();
            put_u32_len(buf, "payload", p.len())?;
            buf.put_slice(p);
        }
        frame::finish_frame(buf, start)?;
        Ok(())
    }
}

/// A decoded publish batch. Strings, key and payloads are slices of the frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishBatch {
    /// Present when acked (0x0008).
    pub ack: Option<AckPrefix>,
    /// Present when idempotent (0x0100).
    pub idempotent: Option<IdempotentPrefix>,
    /// Present when keyed (0x0040).
    pub key: Option<Bytes>,
    /// Tenant.
    pub tenant: WireStr,
    /// Namespace.
    pub namespace: WireStr,
    /// Stream.
    pub stream: WireStr,
    /// The records: past [`crate::internal::MAX_RECORDS_PER_MESSAGE`], only one more
    /// than that (a batch no broker takes; the rest were read, not kept).
    pub payloads: Vec<Bytes>,
}

impl PublishBatch {
    /// Decodes the payload of a frame whose flags select a publish batch.
    pub fn decode(flags: Flags, payload: &Bytes) -> Result<PublishBatch, BinaryError> {
        if !flags.contains(Flags::BINARY_PUBLISH_BATCH)
            || flags.intersects(Flags(!(0x0001 | 0x0008 | 0x0040 | 0x0100)))
        {
            return Err(BinaryError::WrongLayout {
                flags,
                layout: "publish batch",
            });
        }
        let mut r = Reader::new(payload);
        let ack = if flags.contains(Flags::BINARY_PUBLISH_ACKED) {
            let request_id = RequestId(r.u64("request_id")?);
            let ack_mode = match r.u8("ack_mode")? {
                1 => AckMode::PerMessage,
                2 => AckMode::PerBatch,
                byte => return Err(BinaryError::InvalidAckMode { byte }),
            };
            Some(AckPrefix {
                request_id,
                ack_mode,
            })
        } else {
            None
        };
        let idempotent = if flags.contains(Flags::BINARY_PUBLISH_IDEMPOTENT) {
            match ack {
                None => {
                    return Err(BinaryError::WrongLayout {
                        flags,
                        layout: "idempotent publish (needs the acked prefix)",
                    });
                }
                Some(a) if a.ack_mode != AckMode::PerBatch => {
                    return Err(BinaryError::IdempotentNotPerBatch);
                }
                Some(_) => {}
            }
            Some(IdempotentPrefix {
                producer_id: ProducerId(r.u64("producer_id")?),
                sequence: Sequence(r.u64("sequence")?),
            })
        } else {
            None
        };
        let key = if flags.contains(Flags::BINARY_PUBLISH_KEYED) {
            Some(r.bytes16("key")?)
        } else {
            None
        };
        let tenant = r.str16("tenant")?;
        let namespace = r.str16("namespace")?;
        let stream = r.str16("stream")?;
        let count = r.count(4, "record count")?;
        // Past the most one message carries, only one record more is kept (the frame is
        // still read whole): a frame of empty records can claim millions (a 16 MiB frame
        // about 4 million), a list of hundreds of MB for a batch the broker refuses by
        // its count anyway, and the refusal still names the batch's request.
        let keep = count.min(crate::internal::MAX_RECORDS_PER_MESSAGE + 1);
        let mut payloads = Vec::with_capacity(keep);
        for _ in 0..count {
            let len = r.u32("payload length")? as usize;
            let payload = r.bytes(len, "payload")?;
            if payloads.len() < keep {
                payloads.push(payload);
            }
        }
        r.finish()?;
        Ok(PublishBatch {
            ack,
            idempotent,
            key,
            tenant,
            namespace,
            stream,
            payloads,
        })
    }

    /// The header view of this batch.
    pub fn header(&self) -> PublishBatchHeader<'_> {
        PublishBatchHeader {
            tenant: &self.tenant,
            namespace: &self.namespace,
            stream: &self.stream,
            ack: self.ack,
            idempotent: self.idempotent,
            key: self.key.as_deref(),
        }
    }

    /// The flags this batch is framed with.
    pub fn flags(&self) -> Flags {
        self.header().flags()
    }

    /// Appends this batch as a whole frame.
    pub fn encode_frame(&self, buf: &mut BytesMut) -> Result<(), BinaryError> {
        self.header().encode_frame(buf, &self.payloads)
    }
}

// ---- Publish ack (0x0010 + 0x0080 / 0x0200 / 0x0400 / 0x1000) ----------------------------

/// Outcome of an acked publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublishAckStatus {
    /// Appended (and durable per the stream's policy).
    Ok,
    /// Refused or failed; see the message and code.
    Error,
}

/// The owner of a forwarded publish (flag 0x0080): a routing hint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnerHint {
    /// Owner node id.
    pub node_id: String,
    /// Its client address, if advertised.
    pub addr: Option<String>,
    /// Assignment generation.
    pub generation: Generation,
}

/// Code and retry class of a failed ack (flag 0x0200), with optional detail (0x0400).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AckCode {
    /// The code.
    pub code: ErrorCode,
    /// What to do.
    pub retry: RetryClass,
    /// `(reason, retry_after_ms)`; 0 ms means none.
    pub detail: Option<(String, u64)>,
}

/// A binary publish acknowledgement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishAck {
    /// Ok or error.
    pub status: PublishAckStatus,
    /// The publish's correlation id.
    pub request_id: RequestId,
    /// Error text (empty on ok).
    pub message: String,
    /// Code for a failed ack.
    pub code: Option<AckCode>,
    /// Owner hint for a forwarded publish.
    pub owner: Option<OwnerHint>,
    /// First offset of a successful ack.
    pub first_offset: Option<Offset>,
}

impl PublishAck {
    /// A successful ack.
    pub fn ok(request_id: RequestId, first_offset: Option<Offset>) -> PublishAck {
        PublishAck {
            status: PublishAckStatus::Ok,
            request_id,
            message: String::new(),
            code: None,
            owner: None,
            first_offset,
        }
    }

    /// A failed ack with a code.
    pub fn error(request_id: RequestId, message: impl Into<String>, code: ErrorCode) -> PublishAck {
        let retry = code.default_retry();
        PublishAck {
            status: PublishAckStatus::Error,
            request_id,
            message: message.into(),
            code: Some(AckCode {
                code,
                retry,
                detail: None,
            }),
            owner: None,
            first_offset: None,
        }
    }

    /// The flags this ack is framed with, limited to what the peer reads (`peer`).
    /// Fields whose bit the peer did not offer are left out.
    pub fn flags(&self, peer: Flags) -> Flags {
        let failed = self.status == PublishAckStatus::Error;
        let code = failed && self.code.is_some() && peer.contains(Flags::BINARY_PUBLISH_ACK_CODE);
        let detail = code
            && self.code.as_ref().is_some_and(|c| c.detail.is_some())
            && peer.contains(Flags::BINARY_PUBLISH_ACK_DETAIL);
        Flags::BINARY_PUBLISH_ACK
            .with(Flags::BINARY_PUBLISH_ACK_CODE, code)
            .with(Flags::BINARY_PUBLISH_ACK_DETAIL, detail)
            .with(
                Flags::BINARY_PUBLISH_ACK_OWNER,
                self.owner.is_some() && peer.contains(Flags::BINARY_PUBLISH_ACK_OWNER),
            )
            .with(
                Flags::BINARY_PUBLISH_ACK_OFFSET,
                !failed
                    && self.first_offset.is_some()
                    && peer.contains(Flags::BINARY_PUBLISH_ACK_OFFSET),
            )
    }

    /// Appends this ack as a whole frame, with only the parts `peer` reads.
    pub fn encode_frame(&self, buf: &mut BytesMut, peer: Flags) -> Result<(), BinaryError> {
        let start = buf.len();
        let result = self.encode_frame_inner(buf, peer);
        if result.is_err() {
            buf.truncate(start);
        }
        result
    }

    fn encode_frame_inner(&self, buf: &mut BytesMut, peer: Flags) -> Result<(), BinaryError> {
        let flags = self.flags(peer);
        let start = frame::begin_frame(buf, flags);
        buf.put_u8(match self.status {
            PublishAckStatus::Ok => 0,
            PublishAckStatus::Error => 1,
        });
        buf.put_u64(self.request_id.0);
        put_str16(buf, "message", self.message.as_bytes())?;
        if flags.contains(Flags::BINARY_PUBLISH_ACK_CODE)
            && let Some(code) = &self.code
        {
            buf.put_u16(code.code.number().unwrap_or(0));
            buf.put_u8(code.retry.byte());
            if flags.contains(Flags::BINARY_PUBLISH_ACK_DETAIL)
                && let Some((reason, retry_after_ms)) = &code.detail
            {
                put_str16(buf, "reason", reason.as_bytes())?;
                buf.put_u64(*retry_after_ms);
            }
        }
        if flags.contains(Flags::BINARY_PUBLISH_ACK_OWNER)
            && let Some(owner) = &self.owner
        {
            put_str16(buf, "node_id", owner.node_id.as_bytes())?;
            put_str16(buf, "addr", owner.addr.as_deref().unwrap_or("").as_bytes())?;
            buf.put_u64(owner.generation.0);
        }
        if flags.contains(Flags::BINARY_PUBLISH_ACK_OFFSET)
            && let Some(offset) = self.first_offset
        {
            buf.put_u64(offset.0);
        }
        frame::finish_frame(buf, start)?;
        Ok(())
    }

    /// Decodes the payload of a frame whose flags select a publish ack.
    pub fn decode(flags: Flags, payload: &Bytes) -> Result<PublishAck, BinaryError> {
        if !flags.contains(Flags::BINARY_PUBLISH_ACK)
            || flags.intersects(Flags(!(0x0010 | 0x0080 | 0x0200 | 0x0400 | 0x1000)))
        {
            return Err(BinaryError::WrongLayout {
                flags,
                layout: "publish ack",
            });
        }
        let mut r = Reader::new(payload);
        let status = match r.u8("status")? {
            0 => PublishAckStatus::Ok,
            1 => PublishAckStatus::Error,
            byte => return Err(BinaryError::InvalidStatus { byte }),
        };
        let request_id = RequestId(r.u64("request_id")?);
        let message = r.str16("message")?.as_str().to_owned();
        let failed = status == PublishAckStatus::Error;
        let code = if failed && flags.contains(Flags::BINARY_PUBLISH_ACK_CODE) {
            let code = ErrorCode::from_number(r.u16("code")?);
            let retry = RetryClass::from_byte(r.u8("retry")?);
            let detail = if flags.contains(Flags::BINARY_PUBLISH_ACK_DETAIL) {
                let reason = r.str16("reason")?.as_str().to_owned();
                Some((reason, r.u64("retry_after_ms")?))
            } else {
                None
            };
            Some(AckCode {
                code,
                retry,
                detail,
            })
        } else {
            None
        };
        let owner = if flags.contains(Flags::BINARY_PUBLISH_ACK_OWNER) {
            let node_id = r.str16("node_id")?.as_str().to_owned();
            let addr = r.str16("addr")?;
            Some(OwnerHint {
                node_id,
                addr: (!addr.is_empty()).then(|| addr.as_str().to_owned()),
                generation: Generation(r.u64("generation")?),
            })
        } else {
            None
        };
        let first_offset = if !failed && flags.contains(Flags::BINARY_PUBLISH_ACK_OFFSET) {
            Some(Offset(r.u64("first_offset")?))
        } else {
            None
        };
        r.finish()?;
        Ok(PublishAck {
            status,
            request_id,
            message,
            code,
            owner,
            first_offset,
        })
    }
}

// ---- Event batch (0x0002 / 0x0004 + 0x0020 / 0x0800 / 0x2000 / 0x4000) -------------------

/// One delivered record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventItem {
    /// Append time (with 0x4000).
    pub timestamp_micros: Option<u64>,
    /// The record.
    pub payload: Bytes,
}

/// A batch of delivered records. Record `i` is at `base_offset + i`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventBatch {
    /// Legacy per-subscriber batches (0x0002) name the subscription; shared batches
    /// (0x0004) do not.
    pub subscription_id: Option<SubscriptionId>,
    /// First record's offset (0x0020).
    pub base_offset: Option<Offset>,
    /// Offsets before the first record that hold no event (0x0800).
    pub skipped_before: Option<u64>,
    /// Publisher principal, at most 255 bytes (0x2000).
    pub publisher: Option<WireStr>,
    /// Whether per-event timestamps are carried (0x4000).
    pub timestamps: bool,
    /// The records.
    pub events: Vec<EventItem>,
}

impl EventBatch {
    /// The flags this batch is framed with.
    pub fn flags(&self) -> Flags {
        let base = if self.subscription_id.is_some() {
            Flags::BINARY_EVENT_BATCH
        } else {
            Flags::BINARY_EVENT_BATCH_SHARED
        };
        base.with(Flags::EVENT_BATCH_OFFSETS, self.base_offset.is_some())
            .with(
                Flags::EVENT_BATCH_SKIPPED,
                self.base_offset.is_some() && self.skipped_before.is_some(),
            )
            .with(Flags::EVENT_BATCH_PUBLISHER, self.publisher.is_some())
            .with(Flags::EVENT_BATCH_TIMESTAMPS, self.timestamps)
    }

    /// Appends this batch as a whole frame.
    pub fn encode_frame(&self, buf: &mut BytesMut) -> Result<(), BinaryError> {
        let start = buf.len();
        let result = self.encode_frame_inner(buf);
        if result.is_err() {
            buf.truncate(start);
        }
        result
    }

    fn encode_frame_inner(&self, buf: &mut BytesMut) -> Result<(), BinaryError> {
        let flags = self.flags();
        let per_event = if self.timestamps { 12 } else { 4 };
        let body: usize = self
            .events
            .iter()
            .map(|e| per_event + e.payload.len())
            .sum();
        buf.reserve(frame::HEADER_LEN + 32 + 256 + body);
        let start = frame::begin_frame(buf, flags);
        if let Some(id) = self.subscription_id {
            buf.put_u64(id.0);
        }
        if let Some(base) = self.base_offset {
            buf.put_u64(base.0);
            if let Some(skipped) = self.skipped_before {
                buf.put_u64(skipped);
            }
        }
        if let Some(publisher) = &self.publisher {
            let len = u8::try_from(publisher.len()).map_err(|_| BinaryError::FieldTooLong {
                field: "publisher",
                len: publisher.len(),
                max: 255,
            })?;
            buf.put_u8(len);
            buf.put_slice(publisher.as_bytes());
        }
        put_u32_len(buf, "event count", self.events.len())?;
        for e in &self.events {
            if self.timestamps {
                buf.put_u64(e.timestamp_micros.unwrap_or(0));
            }
            put_u32_len(buf, "payload", e.payload.len())?;
            buf.put_slice(&e.payload);
        }
        frame::finish_frame(buf, start)?;
        Ok(())
    }

    /// Decodes the payload of a frame whose flags select an event batch.
    pub fn decode(flags: Flags, payload: &Bytes) -> Result<EventBatch, BinaryError> {
        let legacy = flags.contains(Flags::BINARY_EVENT_BATCH);
        let shared = flags.contains(Flags::BINARY_EVENT_BATCH_SHARED);
        if legacy == shared
            || flags.intersects(Flags(
                !(0x0002 | 0x0004 | 0x0020 | 0x0800 | 0x2000 | 0x4000),
            ))
            || (flags.contains(Flags::EVENT_BATCH_SKIPPED)
                && !flags.contains(Flags::EVENT_BATCH_OFFSETS))
        {
            return Err(BinaryError::WrongLayout {
                flags,
                layout: "event batch",
            });
        }
        let mut r = Reader::new(payload);
        let subscription_id = if legacy {
            Some(SubscriptionId(r.u64("subscription_id")?))
        } else {
            None
        };
        let base_offset = if flags.contains(Flags::EVENT_BATCH_OFFSETS) {
            Some(Offset(r.u64("base_offset")?))
        } else {
            None
        };
        let skipped_before = if flags.contains(Flags::EVENT_BATCH_SKIPPED) {
            Some(r.u64("skipped_before")?)
        } else {
            None
        };
        let publisher = if flags.contains(Flags::EVENT_BATCH_PUBLISHER) {
            Some(r.str8("publisher")?)
        } else {
            None
        };
        let timestamps = flags.contains(Flags::EVENT_BATCH_TIMESTAMPS);
        let count = r.count(if timestamps { 12 } else { 4 }, "event count")?;
        let mut events = Vec::with_capacity(count);
        for _ in 0..count {
            let timestamp_micros = if timestamps {
                Some(r.u64("timestamp_micros")?)
            } else {
                None
            };
            let len = r.u32("payload length")? as usize;
            events.push(EventItem {
                timestamp_micros,
                payload: r.bytes(len, "payload")?,
            });
        }
        r.finish()?;
        Ok(EventBatch {
            subscription_id,
            base_offset,
            skipped_before,
            publisher,
            timestamps,
            events,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{Decoded, decode_frame};

    fn reframe(buf: BytesMut) -> crate::Frame {
        match decode_frame(&buf.freeze(), u32::MAX).unwrap() {
            Decoded::Complete { value, .. } => value,
            Decoded::NeedMore(n) => panic!("need {n}"),
        }
    }

    #[test]
    fn every_truncation_of_a_publish_batch_is_a_typed_error() {
        let mut buf = BytesMut::new();
        PublishBatchHeader {
            tenant: "t1",
            namespace: "default",
            stream: "demo",
            ack: Some(AckPrefix {
                request_id: RequestId(7),
                ack_mode: AckMode::PerBatch,
            }),
            idempotent: Some(IdempotentPrefix {
                producer_id: ProducerId(9),
                sequence: Sequence(1),
            }),
            key: Some(b"k"),
        }
        .encode_frame(&mut buf, &[b"hello".as_slice(), b"world"])
        .unwrap();
        let frame = reframe(buf);
        let whole = PublishBatch::decode(frame.flags, &frame.payload).unwrap();
        assert_eq!(whole.payloads.len(), 2);
        for cut in 0..frame.payload.len() {
            let short = frame.payload.slice(..cut);
            assert!(
                PublishBatch::decode(frame.flags, &short).is_err(),
                "cut {cut}"
            );
        }
    }

    #[test]
    fn a_lying_count_does_not_allocate() {
        let mut payload = BytesMut::new();
        for s in ["t", "n", "s"] {
            payload.put_u16(1);
            payload.put_slice(s.as_bytes());
        }
        payload.put_u32(u32::MAX);
        let err = PublishBatch::decode(Flags(0x0001), &payload.freeze()).unwrap_err();
        assert!(matches!(err, BinaryError::CountTooLarge { .. }), "{err:?}");
    }

    /// A batch of more records than one message carries keeps one record more than
    /// that, however many it claims (the broker refuses it by its count, naming its
    /// request); one at the limit decodes whole.
    #[test]
    fn a_batch_of_more_records_than_a_message_carries_keeps_one_more_than_that() {
        let batch = |count: u32| {
            let mut payload = BytesMut::new();
            for s in ["t", "n", "s"] {
                payload.put_u16(1);
                payload.put_slice(s.as_bytes());
            }
            payload.put_u32(count);
            for _ in 0..count {
                payload.put_u32(0);
            }
            payload.freeze()
        };
        let max = crate::internal::MAX_RECORDS_PER_MESSAGE as u32;
        let at = PublishBatch::decode(Flags(0x0001), &batch(max)).unwrap();
        assert_eq!(at.payloads.len(), max as usize);
        for over in [max + 1, max * 4] {
            let kept = PublishBatch::decode(Flags(0x0001), &batch(over)).unwrap();
            assert_eq!(kept.payloads.len(), max as usize + 1, "{over}");
            assert!(kept.payloads.capacity() <= max as usize + 1, "{over}");
        }
    }

    #[test]
    fn ack_fields_are_limited_to_what_the_peer_reads() {
        let mut ack = PublishAck::error(RequestId(1), "full", ErrorCode::Overloaded);
        ack.code.as_mut().unwrap().detail = Some(("publish_queue_full".into(), 50));
        let legacy = ack.flags(Flags::ORIGINAL_V1);
        assert_eq!(legacy, Flags::BINARY_PUBLISH_ACK);
        let mut buf = BytesMut::new();
        ack.encode_frame(&mut buf, Flags::KNOWN).unwrap();
        let frame = reframe(buf);
        assert_eq!(frame.flags, Flags(0x0610));
        assert_eq!(
            PublishAck::decode(frame.flags, &frame.payload).unwrap(),
            ack
        );
    }

    #[test]
    fn event_batch_without_offsets_cannot_carry_skipped() {
        let payload = Bytes::from_static(&[0, 0, 0, 0]);
        assert!(EventBatch::decode(Flags(0x0804), &payload).is_err());
        assert!(EventBatch::decode(Flags(0x0006), &payload).is_err());
        assert_eq!(
            EventBatch::decode(Flags(0x0004), &payload)
                .unwrap()
                .events
                .len(),
            0
        );
    }
}
