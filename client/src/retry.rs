//! Retries: bounded by attempts and full-jitter exponential backoff, optionally by a
//! deadline; the broker's retry class decides whether to retry at all.

use std::time::Duration;

use felix_wire::{ErrorCode, RetryClass};

use crate::error::ClientError;

/// How hard a `ClusterClient` tries before giving up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReconnectPolicy {
    /// Attempts; each attempt tries every endpoint. A retried call makes this many in
    /// all, reconnecting after a lost connection with one round over the endpoints.
    pub attempts: usize,
    /// The first backoff ceiling: the first retry waits uniform in `[0, backoff]`.
    pub backoff: Duration,
    /// The ceiling doubles per attempt up to this.
    pub max_backoff: Duration,
    /// A cap on the whole operation, sleeps included. Off by default: a deadline shorter
    /// than one attempt prevents any retry.
    pub deadline: Option<Duration>,
}

impl Default for ReconnectPolicy {
    fn default() -> Self {
        Self {
            attempts: 5,
            backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(2),
            deadline: None,
        }
    }
}

impl ReconnectPolicy {
    /// The ceiling before retry number `attempt` (0-based): `backoff * 2^attempt`,
    /// capped at `max_backoff` (the shift is capped at 16).
    pub fn ceiling(&self, attempt: usize) -> Duration {
        let shift = attempt.min(16) as u32;
        self.backoff
            .checked_mul(1u32 << shift)
            .unwrap_or(self.max_backoff)
            .min(self.max_backoff)
    }

    /// Full jitter: uniform in `[0, ceiling]` given `unit` uniform in `[0, 1)`.
    pub fn delay(&self, attempt: usize, unit: f64) -> Duration {
        self.ceiling(attempt).mul_f64(unit.clamp(0.0, 1.0))
    }

    /// One round over the endpoints, no backoff: how a reconnect inside a retried call
    /// connects, the call's own loop being the one that backs off and counts attempts.
    /// With this policy there, a call with the cluster down made `attempts x attempts`
    /// rounds (25 at the defaults, each up to a 6 s handshake an endpoint: minutes).
    pub fn one_round(&self) -> ReconnectPolicy {
        ReconnectPolicy {
            attempts: 1,
            ..*self
        }
    }
}

/// What to do after an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Return it.
    Fail,
    /// Reconnect (the connection is suspect) and try again after the backoff.
    Reconnect,
    /// Try again after at least this.
    Retry {
        /// The broker's `retry_after_ms`, if any.
        at_least: Duration,
    },
    /// The write may have happened: only retry when duplicates are acceptable.
    OutcomeUnknown,
}

/// How long `not_found` is retried: a broker promoted a moment ago reports the stream it
/// is about to serve as missing. Also how often a lost shard, which retries it for good,
/// says so.
pub const NOT_FOUND_GRACE: Duration = Duration::from_secs(5);

/// True for the broker's `not_found`.
pub(crate) fn is_not_found(e: &ClientError) -> bool {
    matches!(e, ClientError::Broker(b) if b.code == Some(ErrorCode::NotFound))
}

/// Classifies an error. `since_first_not_found` is how long `not_found` has been seen.
pub fn classify(e: &ClientError, since_first_not_found: Duration) -> Decision {
    match e {
        ClientError::Broker(b) => match (&b.code, b.retry) {
            (Some(ErrorCode::NotFound), _) if since_first_not_found >= NOT_FOUND_GRACE => {
                Decision::Fail
            }
            (Some(ErrorCode::Draining), _) => Decision::Reconnect,
            (Some(code), retry) => match retry.unwrap_or_else(|| code.default_retry()) {
                RetryClass::Fatal => Decision::Fail,
                RetryClass::Retry | RetryClass::Redirect => Decision::Retry {
                    at_least: Duration::ZERO,
                },
                RetryClass::RetryAfter => Decision::Retry {
                    at_least: Duration::from_millis(
                        b.detail
                            .as_ref()
                            .and_then(|d| d.retry_after_ms)
                            .unwrap_or(0),
                    ),
                },
                RetryClass::OutcomeUnknown => Decision::OutcomeUnknown,
            },
            // Uncoded (legacy broker): only a credential failure is terminal.
            (None, _) if b.message.contains("forbidden") => Decision::Fail,
            (None, _) => Decision::Reconnect,
        },
        ClientError::Connection { .. } | ClientError::Timeout(_) | ClientError::Protocol(_) => {
            Decision::Reconnect
        }
        ClientError::NotLeader(_) => Decision::Retry {
            at_least: Duration::ZERO,
        },
        ClientError::Cursor(_)
        | ClientError::SubscriptionLagged { .. }
        | ClientError::Refused { .. }
        | ClientError::Config(_)
        | ClientError::Unsupported(_)
        | ClientError::GaveUp { .. } => Decision::Fail,
        ClientError::SubscriptionLost(_) => Decision::Reconnect,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::BrokerError;

    fn coded(code: ErrorCode, retry_after_ms: Option<u64>) -> ClientError {
        ClientError::Broker(BrokerError {
            retry: Some(code.default_retry()),
            code: Some(code),
            detail: retry_after_ms.map(|ms| felix_wire::ErrorDetail {
                reason: None,
                retry_after_ms: Some(ms),
            }),
            message: "x".into(),
            context: "test",
        })
    }

    #[test]
    fn ceilings_double_to_the_cap_and_jitter_stays_under_them() {
        let p = ReconnectPolicy::default();
        assert_eq!(p.ceiling(0), Duration::from_millis(200));
        assert_eq!(p.ceiling(1), Duration::from_millis(400));
        assert_eq!(p.ceiling(3), Duration::from_millis(1600));
        assert_eq!(p.ceiling(4), Duration::from_secs(2));
        assert_eq!(
            p.ceiling(100),
            Duration::from_secs(2),
            "shift capped, no overflow"
        );
        for unit in [0.0, 0.25, 0.999] {
            assert!(p.delay(2, unit) <= p.ceiling(2));
        }
        assert_eq!(
            p.delay(2, 0.0),
            Duration::ZERO,
            "full jitter starts at zero"
        );
    }

    #[test]
    fn the_retry_class_decides() {
        let z = Duration::ZERO;
        assert_eq!(
            classify(&coded(ErrorCode::Forbidden, None), z),
            Decision::Fail
        );
        assert_eq!(
            classify(&coded(ErrorCode::Unauthenticated, None), z),
            Decision::Fail
        );
        assert_eq!(
            classify(&coded(ErrorCode::QuorumTimeout, None), z),
            Decision::OutcomeUnknown
        );
        assert_eq!(
            classify(&coded(ErrorCode::Overloaded, Some(50)), z),
            Decision::Retry {
                at_least: Duration::from_millis(50)
            }
        );
        assert!(matches!(
            classify(&coded(ErrorCode::NotFound, None), z),
            Decision::Retry { .. }
        ));
        assert_eq!(
            classify(&coded(ErrorCode::NotFound, None), NOT_FOUND_GRACE),
            Decision::Fail
        );
        assert_eq!(
            classify(&ClientError::connection("a", "b"), z),
            Decision::Reconnect
        );
        let legacy = |m: &str| {
            ClientError::Broker(BrokerError {
                code: None,
                retry: None,
                detail: None,
                message: m.into(),
                context: "t",
            })
        };
        assert_eq!(classify(&legacy("forbidden: no"), z), Decision::Fail);
        assert_eq!(
            classify(&legacy("something new"), z),
            Decision::Reconnect,
            "unknown errors are retried"
        );
    }
}
