//! `felix-wire`: the Felix client protocol v1, as bytes.
//!
//! This crate owns everything two Felix peers must agree on byte for byte: the 12-byte
//! frame header ([`frame`]), the JSON messages carried in frames with flags 0
//! ([`message`]), the binary hot-path layouts selected by flag bits ([`binary`]), the
//! flag and feature numbering spaces ([`flags`], [`features`]), error codes with their
//! retry classes ([`error_code`]), the key-to-shard routing function ([`routing`]) and the
//! typed ids every other crate uses ([`ids`]). The broker-to-broker replication protocol
//! (`felix-internal/1`) lives in [`internal`].
//!
//! It is pure: no I/O, no async, no clock, no runtime. Encoders append to a caller's
//! buffer; decoders read from a byte slice or shared [`bytes::Bytes`], return payloads as
//! zero-copy slices of the input, distinguish "need more bytes" from "malformed", and
//! never panic on any input.

pub mod binary;
pub mod error_code;
pub mod features;
pub mod flags;
pub mod frame;
#[doc(hidden)]
pub mod fuzzing;
pub mod ids;
pub mod internal;
pub mod message;
pub mod routing;
#[cfg(feature = "tokens")]
pub mod token;

mod b64;
mod cursor;
mod hot;

pub use binary::{
    AckCode, AckPrefix, BinaryError, EventBatch, EventItem, IdempotentPrefix, OwnerHint,
    PublishAck, PublishAckStatus, PublishBatch, PublishBatchHeader, WireStr,
};
pub use error_code::{ErrorCode, ErrorDetail, RetryClass};
pub use features::Features;
pub use flags::Flags;
pub use frame::{Frame, FrameError, FrameHeader, FrameReader};
pub use ids::{Generation, Offset, ProducerId, RequestId, Sequence, ShardId, SubscriptionId};
pub use internal::INTERNAL_ALPN;
pub use message::{AckMode, Message, MessageError, StartPosition};
pub use routing::{ShardRouting, shard_for_key};

/// The ALPN protocol id a client may offer (`felix/1`). Brokers also accept no ALPN.
pub const CLIENT_ALPN: &[u8] = b"felix/1";
