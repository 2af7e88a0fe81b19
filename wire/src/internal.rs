//! The broker-to-broker replication protocol (`felix-internal/1`), as bytes.
//!
//! Brokers speak it to each other on a QUIC connection of its own (ALPN
//! [`INTERNAL_ALPN`]), never on a client connection. A frame is a 12-byte big-endian
//! header, `magic u32` ([`MAGIC`], `FLXI`), `version u16` ([`VERSION`]), `kind u16`
//! ([`kind`]), `length u32`, then `length` payload bytes. Every payload starts with a
//! `correlation_id u64` that the answer echoes. `docs/wire.md` ("Broker-to-broker
//! protocol") lists every message, and what a receiver does with each refusal code.
//!
//! What must stay true:
//! - "Need more bytes" is `Ok(None)` from [`InternalReader::next`] (or
//!   [`Decoded::NeedMore`](crate::frame::Decoded) from [`decode_frame`]), never an error.
//!   The payload limit is checked on the header alone, before the body is buffered.
//! - A wrong magic, a wrong version or an over-long length is fatal: the stream cannot be
//!   re-aligned. Anything wrong inside a whole frame is [`InternalError::Malformed`],
//!   raised after the frame was consumed, so the stream survives and the receiver can
//!   answer the correlation id (when it could be read).
//! - An unknown kind is not an error: it decodes to [`InternalMessage::Unknown`], which
//!   the receiver answers with [`UnsupportedKind`].
//! - Every string has an explicit per-field limit ([`MAX_IDENT_BYTES`],
//!   [`MAX_TEXT_BYTES`], [`MAX_TOKEN_BYTES`]); every length and count is checked against
//!   the bytes left before anything is allocated for it; trailing bytes are refused.
//! - Shard names and record payloads are zero-copy slices of the received buffer.
//! - The batches section of [`Records`] is covered by a CRC-32C, checked before the
//!   section is parsed, so a corrupted record is [`BodyError::ChecksumMismatch`] and never
//!   a mis-parse. Its batches are non-empty and contiguous, at most
//!   [`MAX_RECORDS_PER_MESSAGE`] records in all.
//! - Encoders refuse exactly what the decoder refuses, so whatever encodes decodes; and
//!   the encoding is canonical: decoding then encoding gives back the same bytes
//!   (`tests/internal-vectors/` pins them).
//! - No input from a peer panics a decoder.

mod codec;
mod error;
mod message;
mod reader;
mod records;

pub use error::{BodyError, EncodeError, InternalError};
pub use message::{
    Bootstrap, Fence, FenceOk, Fetch, Hello, HelloOk, HelloRefused, InternalMessage, Ping, Pong,
    RefusalCode, ReplicateOk, ReplicateRefused, ShardRef, UnsupportedKind,
};
pub use reader::{InternalHeader, InternalReader, decode_frame};
pub use records::{BatchKind, Records, ShipBatch};

/// The ALPN protocol id of the broker-to-broker connection.
pub const INTERNAL_ALPN: &[u8] = b"felix-internal/1";

/// The ALPN a broker offers (before `felix/1`) on the client connections it forwards
/// its clients' requests to a shard's leader on: the receiver knows they were forwarded
/// once, and forwards one on at most once more, with [`FORWARD_AGAIN_ALPN`] (a view
/// that lags by one change: a move the forwarder has not synced, the receiver has).
/// A broker that does not serve it picks `felix/1`.
pub const FORWARD_ALPN: &[u8] = b"felix-forward/1";

/// The ALPN of a connection carrying requests forwarded a second time: the receiver
/// forwards none of them again. Without a bound, two brokers whose views of a shard
/// disagreed sent a request back and forth until the views agreed.
pub const FORWARD_AGAIN_ALPN: &[u8] = b"felix-forward-again/1";
/// `FLXI`.
pub const MAGIC: u32 = 0x464C_5849;
/// The only version of the internal protocol.
pub const VERSION: u16 = 1;
/// Header size in bytes.
pub const HEADER_LEN: usize = 12;
/// Default payload limit (64 MiB).
pub const DEFAULT_MAX_PAYLOAD_BYTES: u32 = 64 * 1024 * 1024;
/// A payload limit for a connection that has not completed `Hello`: room for the
/// largest `Hello` (a 16 KiB token), not for records.
pub const PREHELLO_MAX_PAYLOAD_BYTES: u32 = 64 * 1024;
/// Limit of identifier strings: node ids, leader ids, tenant, namespace, shard name.
pub const MAX_IDENT_BYTES: usize = 512;
/// Limit of free-text strings: `HelloRefused::reason`, `ReplicateRefused::detail`.
pub const MAX_TEXT_BYTES: usize = 1024;
/// Limit of `Hello::token`.
pub const MAX_TOKEN_BYTES: usize = 16 * 1024;
/// Records carried by one [`Records`] message, all batches together.
pub const MAX_RECORDS_PER_MESSAGE: usize = 65_536;

/// Message kinds (the header's `kind` field).
pub mod kind {
    /// [`Hello`](super::Hello).
    pub const HELLO: u16 = 1;
    /// [`HelloOk`](super::HelloOk).
    pub const HELLO_OK: u16 = 2;
    /// [`HelloRefused`](super::HelloRefused).
    pub const HELLO_REFUSED: u16 = 3;
    /// [`Fence`](super::Fence).
    pub const FENCE: u16 = 10;
    /// [`FenceOk`](super::FenceOk).
    pub const FENCE_OK: u16 = 11;
    /// [`Fetch`](super::Fetch).
    pub const FETCH: u16 = 12;
    /// [`Records`](super::Records).
    pub const RECORDS: u16 = 20;
    /// [`ReplicateOk`](super::ReplicateOk).
    pub const REPLICATE_OK: u16 = 21;
    /// [`ReplicateRefused`](super::ReplicateRefused).
    pub const REPLICATE_REFUSED: u16 = 22;
    /// [`Bootstrap`](super::Bootstrap).
    pub const BOOTSTRAP: u16 = 23;
    /// [`Ping`](super::Ping).
    pub const PING: u16 = 30;
    /// [`Pong`](super::Pong).
    pub const PONG: u16 = 31;
    /// [`UnsupportedKind`](super::UnsupportedKind).
    pub const UNSUPPORTED_KIND: u16 = 40;

    /// Every kind this implementation decodes, with its name.
    pub const NAMED: &[(u16, &str)] = &[
        (HELLO, "Hello"),
        (HELLO_OK, "HelloOk"),
        (HELLO_REFUSED, "HelloRefused"),
        (FENCE, "Fence"),
        (FENCE_OK, "FenceOk"),
        (FETCH, "Fetch"),
        (RECORDS, "Records"),
        (REPLICATE_OK, "ReplicateOk"),
        (REPLICATE_REFUSED, "ReplicateRefused"),
        (BOOTSTRAP, "Bootstrap"),
        (PING, "Ping"),
        (PONG, "Pong"),
        (UNSUPPORTED_KIND, "UnsupportedKind"),
    ];

    /// The name of a known kind.
    pub fn name(kind: u16) -> Option<&'static str> {
        NAMED.iter().find(|(k, _)| *k == kind).map(|(_, n)| *n)
    }

    /// True for a kind this implementation decodes.
    pub fn is_known(kind: u16) -> bool {
        name(kind).is_some()
    }
}

/// Capability bits exchanged in `Hello` / `HelloOk`. A peer sends a request only if the
/// other side offered its bit. Unknown bits are kept as received, never refused or masked.
pub mod capabilities {
    /// The peer answers `Fence`.
    pub const FENCE: u64 = 1 << 0;
    /// The peer answers `Fetch`.
    pub const FETCH: u64 = 1 << 1;
    /// Every bit this implementation knows.
    pub const KNOWN: u64 = FENCE | FETCH;
}
