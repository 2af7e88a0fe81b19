//! Error codes and retry classes.
//!
//! A coded error names what went wrong ([`ErrorCode`]) and what the client should do
//! about it ([`RetryClass`]). Codes travel as snake_case names in JSON and as `u16`
//! numbers in binary acks; classes as names in JSON and bytes 1..=5 in binary. An
//! unknown code is kept (its class still decides); an unknown class reads as fatal.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// What the client should do about an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RetryClass {
    /// Retry now (possibly elsewhere).
    Retry,
    /// Retry after a delay (`detail.retry_after_ms` when given).
    RetryAfter,
    /// Go to the broker named in the answer.
    Redirect,
    /// The write may or may not have happened.
    OutcomeUnknown,
    /// Do not retry.
    Fatal,
}

impl RetryClass {
    /// The JSON name.
    pub const fn name(self) -> &'static str {
        match self {
            RetryClass::Retry => "retry",
            RetryClass::RetryAfter => "retry_after",
            RetryClass::Redirect => "redirect",
            RetryClass::OutcomeUnknown => "outcome_unknown",
            RetryClass::Fatal => "fatal",
        }
    }

    /// Reads a JSON name; unknown names are fatal.
    pub fn from_name(name: &str) -> RetryClass {
        match name {
            "retry" => RetryClass::Retry,
            "retry_after" => RetryClass::RetryAfter,
            "redirect" => RetryClass::Redirect,
            "outcome_unknown" => RetryClass::OutcomeUnknown,
            _ => RetryClass::Fatal,
        }
    }

    /// The binary byte.
    pub const fn byte(self) -> u8 {
        match self {
            RetryClass::Retry => 1,
            RetryClass::RetryAfter => 2,
            RetryClass::Redirect => 3,
            RetryClass::OutcomeUnknown => 4,
            RetryClass::Fatal => 5,
        }
    }

    /// Reads a binary byte; unknown bytes are fatal.
    pub const fn from_byte(byte: u8) -> RetryClass {
        match byte {
            1 => RetryClass::Retry,
            2 => RetryClass::RetryAfter,
            3 => RetryClass::Redirect,
            4 => RetryClass::OutcomeUnknown,
            _ => RetryClass::Fatal,
        }
    }
}

impl Serialize for RetryClass {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for RetryClass {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = std::borrow::Cow::<'de, str>::deserialize(d)?;
        Ok(RetryClass::from_name(&name))
    }
}

macro_rules! codes {
    ($($(#[$doc:meta])* $variant:ident = $num:literal, $name:literal, $class:ident;)*) => {
        /// An error code. `Unknown` keeps a code this implementation does not know.
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum ErrorCode {
            $($(#[$doc])* $variant,)*
            /// A code this implementation does not know: its number when it came in a
            /// binary ack (`code_<n>` as a name), or its name when it came in JSON.
            Unknown(UnknownCode),
        }

        impl ErrorCode {
            /// Every known code.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$variant,)*];

            /// The binary number, if known.
            pub fn number(&self) -> Option<u16> {
                match self {
                    $(ErrorCode::$variant => Some($num),)*
                    ErrorCode::Unknown(UnknownCode::Number(n)) => Some(*n),
                    ErrorCode::Unknown(UnknownCode::Name(_)) => None,
                }
            }

            /// Reads a binary number.
            pub fn from_number(number: u16) -> ErrorCode {
                match number {
                    $($num => ErrorCode::$variant,)*
                    n => ErrorCode::Unknown(UnknownCode::Number(n)),
                }
            }

            /// Reads a JSON name.
            pub fn from_name(name: &str) -> ErrorCode {
                match name {
                    $($name => ErrorCode::$variant,)*
                    other => match other.strip_prefix("code_").and_then(|n| n.parse().ok()) {
                        Some(n) => ErrorCode::from_number(n),
                        None => ErrorCode::Unknown(UnknownCode::Name(other.to_owned())),
                    },
                }
            }

            /// The class a client assumes when the broker sent none. Unknown codes are
            /// fatal.
            pub fn default_retry(&self) -> RetryClass {
                match self {
                    $(ErrorCode::$variant => RetryClass::$class,)*
                    ErrorCode::Unknown(_) => RetryClass::Fatal,
                }
            }

            /// The JSON name.
            pub fn name(&self) -> std::borrow::Cow<'_, str> {
                match self {
                    $(ErrorCode::$variant => std::borrow::Cow::Borrowed($name),)*
                    ErrorCode::Unknown(UnknownCode::Number(n)) => {
                        std::borrow::Cow::Owned(format!("code_{n}"))
                    }
                    ErrorCode::Unknown(UnknownCode::Name(name)) => {
                        std::borrow::Cow::Borrowed(name.as_str())
                    }
                }
            }
        }
    };
}

codes! {
    /// Request before auth, or a bad token.
    Unauthenticated = 1, "unauthenticated", Fatal;
    /// Missing permission, or another tenant's data.
    Forbidden = 2, "forbidden", Fatal;
    /// Unknown tenant, namespace, stream or cache (may not be synced yet).
    NotFound = 3, "not_found", RetryAfter;
    /// Malformed frame or batch, unknown flags, missing request_id, second auth.
    InvalidRequest = 4, "invalid_request", Fatal;
    /// The shard cannot be served here now; `detail.reason` says why.
    ShardUnavailable = 5, "shard_unavailable", Retry;
    /// Another broker leads the shard (when `not_leader` cannot be used).
    NotLeader = 6, "not_leader", Redirect;
    /// A Quorum write was not confirmed by a majority in time.
    QuorumTimeout = 7, "quorum_timeout", OutcomeUnknown;
    /// Leadership moved before a majority held the write.
    LeadershipLost = 8, "leadership_lost", OutcomeUnknown;
    /// A forwarded or committed write went unanswered.
    Unacknowledged = 9, "unacknowledged", OutcomeUnknown;
    /// A queue or the disk is full; `detail.reason` says which.
    Overloaded = 10, "overloaded", RetryAfter;
    /// A per-connection limit was exceeded.
    LimitExceeded = 11, "limit_exceeded", Fatal;
    /// The broker is shutting down.
    Draining = 12, "draining", Retry;
    /// An internal failure.
    Internal = 13, "internal", OutcomeUnknown;
    /// A storage failure.
    Storage = 14, "storage", OutcomeUnknown;
    /// A group ack or nack for an offset the broker no longer tracks.
    StaleClaim = 15, "stale_claim", Retry;
}

/// A code this implementation does not know.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum UnknownCode {
    /// From a binary ack.
    Number(u16),
    /// From a JSON error.
    Name(String),
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

impl Serialize for ErrorCode {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.name())
    }
}

impl<'de> Deserialize<'de> for ErrorCode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = std::borrow::Cow::<'de, str>::deserialize(d)?;
        Ok(ErrorCode::from_name(&name))
    }
}

/// Structured detail on a coded error.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// A machine-readable sub-reason (`not_assigned`, `publish_queue_full`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// How long to wait before retrying, for `retry_after`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_names_and_classes_round_trip() {
        for code in ErrorCode::ALL {
            let n = code.number().expect("known codes have numbers");
            assert_eq!(&ErrorCode::from_number(n), code);
            assert_eq!(&ErrorCode::from_name(&code.name()), code);
        }
        assert_eq!(ErrorCode::NotFound.number(), Some(3));
        assert_eq!(ErrorCode::StaleClaim.number(), Some(15));
        assert_eq!(
            ErrorCode::QuorumTimeout.default_retry(),
            RetryClass::OutcomeUnknown
        );
    }

    #[test]
    fn unknown_codes_are_kept_and_unknown_classes_are_fatal() {
        let code = ErrorCode::from_number(99);
        assert_eq!(code.name(), "code_99");
        assert_eq!(ErrorCode::from_name("code_99"), code);
        assert_eq!(
            ErrorCode::from_name("revoked"),
            ErrorCode::Unknown(UnknownCode::Name("revoked".into()))
        );
        assert_eq!(RetryClass::from_byte(0), RetryClass::Fatal);
        assert_eq!(RetryClass::from_byte(200), RetryClass::Fatal);
        assert_eq!(RetryClass::from_name("later"), RetryClass::Fatal);
        for class in [
            RetryClass::Retry,
            RetryClass::RetryAfter,
            RetryClass::Redirect,
            RetryClass::OutcomeUnknown,
            RetryClass::Fatal,
        ] {
            assert_eq!(RetryClass::from_byte(class.byte()), class);
            assert_eq!(RetryClass::from_name(class.name()), class);
        }
    }
}
