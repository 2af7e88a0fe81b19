//! Broker errors, each mapped to a protocol error code and retry class.

use felix_storage_uring::StorageError;
use felix_wire::{ErrorCode, ErrorDetail, Message, RetryClass};

/// The most of a peer's own text (a name, a key) an answer echoes back.
pub const ECHO_MAX_BYTES: usize = 128;
/// The longest error text an answer carries. Every answer's strings are bounded before
/// encoding, so encoding an answer cannot fail (a binary ack's strings have 16-bit
/// lengths).
pub const ERROR_TEXT_MAX_BYTES: usize = 1024;

/// `s` cut to at most `max` bytes at a character boundary.
pub fn cut_to(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// A peer's text as it may be echoed in an answer.
pub fn cut(s: &str) -> &str {
    cut_to(s, ECHO_MAX_BYTES)
}

/// What a request can fail with.
#[derive(Debug, Clone, thiserror::Error)]
pub enum BrokerError {
    /// Bad or missing credentials.
    #[error("unauthenticated: {0}")]
    Unauthenticated(String),
    /// The token lacks the permission, or names another tenant.
    #[error("forbidden: {0}")]
    Forbidden(String),
    /// Unknown stream or cache.
    #[error("{0}")]
    NotFound(String),
    /// A malformed or unserviceable request.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The shard cannot be served now.
    #[error("shard unavailable: {0}")]
    ShardUnavailable(String),
    /// A queue is full.
    #[error("overloaded: {0}")]
    Overloaded(String),
    /// A per-connection bound was reached (too many subscriptions, say). Not retried:
    /// the client must use fewer, or another connection.
    #[error("limit exceeded: {0}")]
    LimitExceeded(String),
    /// Storage failed; the write may or may not be durable.
    #[error("storage: {0}")]
    Storage(String),
    /// The broker is shutting down.
    #[error("broker is draining")]
    Draining,
    /// Anything else; outcome unknown.
    #[error("internal: {0}")]
    Internal(String),
    /// A forwarded request got no answer; it may or may not have been applied.
    #[error("unacknowledged: {0}")]
    Unacknowledged(String),
    /// Another broker leads the shard (for clients that cannot take `not_leader`).
    #[error("not leader: {node_id} leads it{}", addr.as_deref().map(|a| format!(" at {a}")).unwrap_or_default())]
    NotLeader {
        /// The leader.
        node_id: String,
        /// Its client address.
        addr: Option<String>,
    },
    /// A group settle for a record this group's claims do not hold (never handed out,
    /// or its claim lapsed and it went out again).
    #[error("stale claim: {0}")]
    StaleClaim(String),
    /// An extend, or a nack naming its attempt, of a claim this consumer no longer
    /// holds: `stale_claim`, and fatal (the reference's table), since no retry can
    /// make the claim its again.
    #[error("stale claim: {0}")]
    ClaimGone(String),
    /// An idempotent (or conditional) publish refused before anything was written.
    #[error("publish refused: {0:?}")]
    Refused(felix_wire::message::PublishRefusalReason),
    /// A conditional write's expected tail did not match; nothing was written.
    #[error("the shard's tail is {tail}, not the expected offset")]
    OffsetMismatch {
        /// The actual tail.
        tail: u64,
    },
    /// A subscribe offset outside the retained log.
    #[error("cursor {reason:?}: requested {requested}, available {available}")]
    Cursor {
        /// Why.
        reason: felix_wire::message::CursorErrorReason,
        /// Asked.
        requested: u64,
        /// Oldest retained or tail.
        available: u64,
    },
}

impl BrokerError {
    /// The protocol code.
    pub fn code(&self) -> ErrorCode {
        match self {
            BrokerError::Unauthenticated(_) => ErrorCode::Unauthenticated,
            BrokerError::Forbidden(_) => ErrorCode::Forbidden,
            BrokerError::NotFound(_) => ErrorCode::NotFound,
            BrokerError::InvalidRequest(_) | BrokerError::Cursor { .. } => {
                ErrorCode::InvalidRequest
            }
            BrokerError::ShardUnavailable(_) => ErrorCode::ShardUnavailable,
            BrokerError::Overloaded(_) => ErrorCode::Overloaded,
            BrokerError::LimitExceeded(_) => ErrorCode::LimitExceeded,
            BrokerError::Storage(_) => ErrorCode::Storage,
            BrokerError::Draining => ErrorCode::Draining,
            BrokerError::Internal(_) => ErrorCode::Internal,
            BrokerError::Unacknowledged(_) => ErrorCode::Unacknowledged,
            BrokerError::NotLeader { .. } => ErrorCode::NotLeader,
            BrokerError::StaleClaim(_) | BrokerError::ClaimGone(_) => ErrorCode::StaleClaim,
            BrokerError::OffsetMismatch { .. } | BrokerError::Refused(_) => {
                ErrorCode::InvalidRequest
            }
        }
    }

    /// Structured detail for the code.
    pub fn detail(&self) -> Option<ErrorDetail> {
        match self {
            BrokerError::Overloaded(reason) => Some(ErrorDetail {
                reason: Some(reason.clone()),
                // A full disk frees slowly; a full queue drains in milliseconds.
                // (and out of file descriptors or memory).
                retry_after_ms: Some(if reason == "disk_full" || reason.starts_with("out_of_") {
                    1000
                } else {
                    50
                }),
            }),
            BrokerError::NotFound(_) => Some(ErrorDetail {
                reason: None,
                retry_after_ms: Some(200),
            }),
            // Reasons are wire tokens (`not_assigned`, `owner_unavailable`, ...).
            BrokerError::ShardUnavailable(reason)
                if reason.bytes().all(|b| b.is_ascii_lowercase() || b == b'_') =>
            {
                Some(ErrorDetail {
                    reason: Some(reason.clone()),
                    retry_after_ms: None,
                })
            }
            _ => None,
        }
    }

    /// The text sent to a client: the error's description, bounded.
    pub fn wire_text(&self) -> String {
        let mut text = self.to_string();
        if text.len() > ERROR_TEXT_MAX_BYTES {
            let end = cut_to(&text, ERROR_TEXT_MAX_BYTES - 3).len();
            text.truncate(end);
            text.push_str("...");
        }
        text
    }

    /// What the client should do about it: the code's class, but for a claim gone
    /// for good.
    pub fn retry_class(&self) -> RetryClass {
        match self {
            BrokerError::ClaimGone(_) => RetryClass::Fatal,
            e => e.code().default_retry(),
        }
    }

    /// The `error` message for a client (`coded` when it offered ERROR_CODES).
    pub fn to_message(&self, coded: bool) -> Message {
        Message::error(
            self.wire_text(),
            self.code(),
            self.retry_class(),
            self.detail(),
            coded,
        )
    }
}

impl From<StorageError> for BrokerError {
    fn from(e: StorageError) -> Self {
        match e {
            StorageError::Closed => BrokerError::Draining,
            StorageError::BatchTooLarge { .. } | StorageError::EmptyBatch => {
                BrokerError::InvalidRequest(e.to_string())
            }
            // The write was refused before anything reached the disk: nothing was
            // appended, and the log takes writes again once space is freed.
            StorageError::NoSpace { .. } => BrokerError::Overloaded("disk_full".into()),
            // A read below what retention kept: the reader's cursor is too old.
            StorageError::Trimmed { requested, oldest } => BrokerError::Cursor {
                reason: felix_wire::message::CursorErrorReason::TooOld,
                requested,
                available: oldest,
            },
            other => BrokerError::Storage(other.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `stale_claim` retries by default (an ack the rebuilt claims do not know may be
    /// taken later), but an extend or a nack naming its attempt of a claim gone is
    /// fatal, as the reference's table has it: a client retried it for nothing.
    #[test]
    fn a_claim_gone_is_a_fatal_stale_claim() {
        let class = |e: BrokerError| match e.to_message(true) {
            Message::Error { code, retry, .. } => (code, retry),
            m => panic!("{m:?}"),
        };
        assert_eq!(
            class(BrokerError::ClaimGone("x".into())),
            (Some(ErrorCode::StaleClaim), Some(RetryClass::Fatal))
        );
        assert_eq!(
            class(BrokerError::StaleClaim("x".into())),
            (Some(ErrorCode::StaleClaim), Some(RetryClass::Retry))
        );
    }
}
