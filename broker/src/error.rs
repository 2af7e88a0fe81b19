//! Broker errors, each mapped to a protocol error code and retry class.

use felix_storage_uring::StorageError;
use felix_wire::{ErrorCode, ErrorDetail, Message};

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
            BrokerError::Storage(_) => ErrorCode::Storage,
            BrokerError::Draining => ErrorCode::Draining,
            BrokerError::Internal(_) => ErrorCode::Internal,
            BrokerError::Unacknowledged(_) => ErrorCode::Unacknowledged,
            BrokerError::NotLeader { .. } => ErrorCode::NotLeader,
        }
    }

    /// Structured detail for the code.
    pub fn detail(&self) -> Option<ErrorDetail> {
        match self {
            BrokerError::Overloaded(reason) => Some(ErrorDetail {
                reason: Some(reason.clone()),
                retry_after_ms: Some(50),
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

    /// The `error` message for a client (`coded` when it offered ERROR_CODES).
    pub fn to_message(&self, coded: bool) -> Message {
        Message::error(self.to_string(), self.code(), self.detail(), coded)
    }
}

impl From<StorageError> for BrokerError {
    fn from(e: StorageError) -> Self {
        match e {
            StorageError::Closed => BrokerError::Draining,
            StorageError::BatchTooLarge { .. } | StorageError::EmptyBatch => {
                BrokerError::InvalidRequest(e.to_string())
            }
            other => BrokerError::Storage(other.to_string()),
        }
    }
}
