//! Client errors. Typed where the broker says something typed; `#[non_exhaustive]` so
//! new causes can be added.

use felix_wire::message::CursorErrorReason;
use felix_wire::{ErrorCode, ErrorDetail, RetryClass};

/// A coded refusal from a broker (brokers advertising FEATURE_ERROR_CODES), or an
/// uncoded one from a legacy broker (`code` None).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{context}: {message}")]
pub struct BrokerError {
    /// The code, when the broker sent one.
    pub code: Option<ErrorCode>,
    /// What to do (the code's default when the broker sent none).
    pub retry: Option<RetryClass>,
    /// Detail.
    pub detail: Option<ErrorDetail>,
    /// The broker's text.
    pub message: String,
    /// What the client was doing.
    pub context: &'static str,
}

impl BrokerError {
    /// `detail.reason`.
    pub fn reason(&self) -> Option<&str> {
        self.detail.as_ref()?.reason.as_deref()
    }
}

/// Another broker owns the shard.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("shard is owned by {node_id} at {addr:?} (generation {generation})")]
pub struct NotLeaderError {
    /// The owner's node id.
    pub node_id: String,
    /// Its client address.
    pub addr: Option<String>,
    /// Assignment generation.
    pub generation: u64,
}

/// A subscribe offset outside the retained log.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("subscribe offset {requested} is {reason:?}; available {available}")]
pub struct SubscribeCursorError {
    /// Too old or in the future.
    pub reason: CursorErrorReason,
    /// Asked.
    pub requested: u64,
    /// Oldest retained (too old) or the tail (in future).
    pub available: u64,
}

/// Everything a client call can fail with.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The broker refused or failed the request.
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// Follow the redirect.
    #[error(transparent)]
    NotLeader(#[from] NotLeaderError),
    /// Bad subscribe offset.
    #[error(transparent)]
    Cursor(#[from] SubscribeCursorError),
    /// The connection failed or closed.
    #[error("connection to {addr}: {reason}")]
    Connection {
        /// Broker.
        addr: String,
        /// Why.
        reason: String,
    },
    /// The event stream broke before the broker ended it.
    #[error("subscription lost: {0}")]
    SubscriptionLost(String),
    /// The broker ended a durable subscription at its first drop: it could not send
    /// `resume_from` (retention removed it before it was read). Every event before it was
    /// delivered; subscribing from `resume_from` says whether it is still there. Also
    /// how a cache watch ends with `cache_watch_lagged` (it fell behind the changes its
    /// broker keeps, the shard is being taken over, or the cache was made again): watch
    /// again from `resume_from`.
    #[error("subscription lagged; resume from {resume_from}")]
    SubscriptionLagged {
        /// The first offset not delivered.
        resume_from: u64,
    },
    /// The broker said something the protocol does not allow here.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// The broker does not serve this request: its feature bit was not advertised
    /// (refused locally, never sent), or the broker answered `unsupported` (it ran
    /// nothing).
    #[error("this broker does not support {0}")]
    Unsupported(&'static str),
    /// Bad configuration or arguments.
    #[error("configuration: {0}")]
    Config(String),
    /// Every endpoint failed for every attempt.
    #[error(
        "gave up after {attempts} attempts across {endpoints} endpoints{}: {last}",
        if *in_doubt { " (an attempt's outcome is unknown)" } else { "" }
    )]
    GaveUp {
        /// Attempts made.
        attempts: usize,
        /// Endpoints tried.
        endpoints: usize,
        /// Some attempt ended without knowing whether it applied (the broker said the
        /// outcome is unknown, or the connection was lost or timed out after the
        /// request may have been sent): a write may have happened even though `last`
        /// says otherwise.
        in_doubt: bool,
        /// The last error.
        last: Box<ClientError>,
    },
    /// No answer in time.
    #[error("timed out: {0}")]
    Timeout(&'static str),
    /// An idempotent or conditional publish was refused before anything was written
    /// (a sequence gap, an unknown producer, a tail that did not match). Never retried.
    #[error("publish refused ({reason:?}): {message}")]
    Refused {
        /// Why.
        reason: felix_wire::message::PublishRefusalReason,
        /// The broker's text.
        message: String,
    },
}

impl ClientError {
    /// The broker's refusal of an idempotent or conditional publish, also when it
    /// came after an attempt whose outcome was unknown (wrapped in `GaveUp`).
    pub fn refusal(&self) -> Option<&felix_wire::message::PublishRefusalReason> {
        match self {
            ClientError::Refused { reason, .. } => Some(reason),
            ClientError::GaveUp { last, .. } => last.refusal(),
            _ => None,
        }
    }

    /// The broker's refusal of a subscription's start, also when it came after an
    /// attempt that failed otherwise (wrapped in `GaveUp`: a subscribe that timed out
    /// once and was then refused `too_old` came back so, and a resume that follows
    /// retention did not see the refusal, until 2026-12-08).
    pub fn cursor(&self) -> Option<&SubscribeCursorError> {
        match self {
            ClientError::Cursor(c) => Some(c),
            ClientError::GaveUp { last, .. } => last.cursor(),
            _ => None,
        }
    }

    pub(crate) fn connection(addr: impl ToString, reason: impl ToString) -> ClientError {
        ClientError::Connection {
            addr: addr.to_string(),
            reason: reason.to_string(),
        }
    }

    /// True for a credential failure: the same on every broker, never retried.
    pub fn is_credential_failure(&self) -> bool {
        match self {
            ClientError::Broker(b) => match &b.code {
                Some(c) => matches!(c, ErrorCode::Unauthenticated | ErrorCode::Forbidden),
                None => b.message.contains("forbidden") || b.message.contains("unauthenticated"),
            },
            ClientError::GaveUp { last, .. } => last.is_credential_failure(),
            _ => false,
        }
    }
}
