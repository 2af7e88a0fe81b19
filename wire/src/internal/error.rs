//! Errors of the internal protocol: reading a stream, reading one body, encoding.

use crate::ids::Offset;

/// Why the next internal frame cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InternalError {
    /// The first four bytes are not `FLXI`. Fatal: close the connection.
    #[error("bad internal frame magic {found:#010x}, expected 0x464c5849 (FLXI)")]
    BadMagic {
        /// What was there.
        found: u32,
    },
    /// A version other than 1. Fatal: close the connection.
    #[error("unsupported internal protocol version {found}; this peer speaks version 1")]
    UnsupportedVersion {
        /// What was there.
        found: u16,
    },
    /// The header announces more payload than this receiver accepts. Fatal: the body was
    /// not read, so the stream cannot be re-aligned.
    #[error("internal frame payload of {length} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// Declared length.
        length: u32,
        /// This receiver's limit.
        max: u32,
    },
    /// A whole frame whose body is wrong. The frame was consumed: the stream is still
    /// aligned, and the receiver may answer `correlation_id` (e.g. `ReplicateRefused`
    /// with `Malformed`) and keep reading.
    #[error(
        "malformed internal frame of kind {kind} (correlation id {correlation_id:?}): {problem}"
    )]
    Malformed {
        /// The header's kind.
        kind: u16,
        /// The correlation id, when the payload was long enough to hold one.
        correlation_id: Option<u64>,
        /// What is wrong.
        problem: BodyError,
    },
}

impl InternalError {
    /// True when the stream cannot be read further (bad magic, version or length).
    /// After any other error the refused frame was consumed and reading may continue.
    pub fn is_fatal(&self) -> bool {
        !matches!(self, InternalError::Malformed { .. })
    }
}

/// What is wrong with one message body. Raised by decoding a whole frame, and by an
/// encoder asked to write something the decoder would refuse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    /// The body ended inside a field.
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
    /// A string longer than its field allows.
    #[error("{field} is {len} bytes; the limit is {max}")]
    StringTooLong {
        /// The field.
        field: &'static str,
        /// Its (claimed) length.
        len: usize,
        /// The field's limit.
        max: usize,
    },
    /// An element count larger than the rest of the body could hold.
    #[error("{field} claims {count} elements but only {remaining} bytes remain")]
    CountTooLarge {
        /// The field.
        field: &'static str,
        /// Claimed count.
        count: usize,
        /// Bytes left.
        remaining: usize,
    },
    /// More records than one message may carry.
    #[error("{count} records in one message; the limit is {max}")]
    TooManyRecords {
        /// Records counted so far.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// A batch with no records.
    #[error("batch {index} has no records")]
    EmptyBatch {
        /// The batch's index in the message.
        index: usize,
    },
    /// A batch that does not start where the previous one ended.
    #[error("batch {index} starts at offset {found}, expected {expected}")]
    NotContiguous {
        /// The batch's index in the message.
        index: usize,
        /// Where the previous batch ended.
        expected: Offset,
        /// Where this one starts.
        found: Offset,
    },
    /// A commit batch of other than one record (a commit is one record: its event and
    /// its state changes).
    #[error("batch {index} is a commit of {count} records; a commit is one record")]
    CommitNotOneRecord {
        /// The batch's index in the message.
        index: usize,
        /// Its records.
        count: usize,
    },
    /// A batch whose offsets run past `u64::MAX`.
    #[error("batch {index} runs past the largest offset")]
    OffsetOverflow {
        /// The batch's index in the message.
        index: usize,
    },
    /// `prev_offset` is not the record just before the first batch (and not 0/0).
    #[error("prev_offset {prev_offset} is not just before the first batch at {first_base}")]
    PrevMismatch {
        /// The message's `prev_offset`.
        prev_offset: Offset,
        /// The first batch's base offset.
        first_base: Offset,
    },
    /// The batches section does not match its CRC-32C.
    #[error("batches checksum mismatch: carried {carried:#010x}, computed {computed:#010x}")]
    ChecksumMismatch {
        /// The CRC the message carried.
        carried: u32,
        /// The CRC of the bytes received.
        computed: u32,
    },
    /// A shard kind byte other than 1 (stream), 2 (cache), 3 or 4 (the same with an
    /// incarnation).
    #[error(
        "unknown shard kind byte {byte} (1 = stream, 2 = cache, 3 and 4 = the same with an incarnation)"
    )]
    UnknownShardKind {
        /// The byte.
        byte: u8,
    },
    /// A shard reference of kind 3 or 4 whose incarnation is empty.
    #[error("shard kinds 3 and 4 carry an incarnation; this one is empty")]
    EmptyIncarnation,
    /// A batch kind byte other than 0 (data) or 1 (generation start).
    #[error("unknown batch kind byte {byte} (0 = data, 1 = generation start)")]
    UnknownBatchKind {
        /// The byte.
        byte: u8,
    },
    /// Bytes after the last field.
    #[error("{count} unexpected bytes after the last field")]
    TrailingBytes {
        /// How many.
        count: usize,
    },
}

/// Why a message cannot be encoded. Nothing is left in the buffer when encoding fails.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// The message breaks a rule the decoder enforces.
    #[error("cannot encode internal message of kind {kind}: {problem}")]
    Invalid {
        /// The message's kind.
        kind: u16,
        /// The rule it breaks.
        problem: BodyError,
    },
    /// The payload does not fit the header's `u32` length.
    #[error("payload of {length} bytes cannot be framed (limit u32::MAX)")]
    PayloadTooLong {
        /// Attempted length.
        length: usize,
    },
    /// [`InternalMessage::Unknown`](super::InternalMessage::Unknown) names a kind this
    /// implementation knows; its frame would not decode as that kind.
    #[error("kind {kind} is known: an Unknown message cannot be encoded under it")]
    KnownKind {
        /// The kind.
        kind: u16,
    },
}
