//! Feature bits: which requests a peer serves or understands.
//!
//! Features are exchanged in `auth` / `auth_ok` and never appear on a frame; they are a
//! different number space from [`crate::flags`]. A client never sends a featured request
//! to a peer that did not advertise the bit. The first word is a `u32`; bit 31
//! ([`Features::EXTENDED`]) marks that a second word (`*_features_hi`) follows, whose bit 0
//! is feature bit 32. The high word is sent only when non-zero, and a broker sends it only
//! to a client that set the marker, because old peers decode the first word as a `u32`.

use std::fmt;

/// A set of feature bits, both words (bit 32 and up are the `_hi` word).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Features(pub u64);

macro_rules! features {
    ($($(#[$doc:meta])* $name:ident = $bit:expr;)*) => {
        impl Features {
            $($(#[$doc])* pub const $name: Features = Features($bit);)*

            /// Every named feature, with its name, in bit order.
            pub const NAMED: &'static [(&'static str, Features)] = &[
                $((stringify!($name), Features($bit)),)*
            ];
        }
    };
}

features! {
    /// The broker answers `topology` (clusters only).
    TOPOLOGY = 0x1;
    /// The client decodes `not_leader` (else it gets `error`).
    REDIRECT = 0x2;
    /// The broker accepts `cache_delete`.
    CACHE_DELETE = 0x4;
    /// Consumer groups: poll / ack / nack.
    CONSUMER_GROUP = 0x8;
    /// Group dead letters: list / discard / redrive.
    GROUP_DEAD_LETTERS = 0x10;
    /// The broker answers `stream_shards`.
    STREAM_SHARDS = 0x20;
    /// `cache_watch` (log-backed cache only).
    CACHE_WATCH = 0x40;
    /// `retained` on `cache_watch`.
    CACHE_WATCH_RETAINED = 0x80;
    /// `counter_add` / `counter_get`.
    COUNTERS = 0x100;
    /// `producer_init`, `publish_idempotent`, `publish_refused`.
    IDEMPOTENT_PRODUCER = 0x200;
    /// The broker answers `cache_shards`.
    CACHE_SHARDS = 0x400;
    /// Errors carry `code`, `retry` and `detail`.
    ERROR_CODES = 0x800;
    /// The client reads `shard_moved`.
    SHARD_MOVED = 0x1000;
    /// Unknown requests are answered `unsupported` instead of closing the stream.
    UNSUPPORTED = 0x2000;
    /// The client reads `sequence_reused`.
    SEQUENCE_REUSED = 0x4000;
    /// Acked publishes are pipelined; the broker grants `publish_window` and answers in
    /// request order.
    PUBLISH_PIPELINE = 0x8000;
    /// `commit`, `state_get`.
    ATOMIC_COMMIT = 0x1_0000;
    /// The publish window is per stream, not per connection.
    STREAM_PUBLISH_WINDOW = 0x2_0000;
    /// The broker answers `shard_owners`.
    SHARD_OWNERS = 0x4_0000;
    /// The client asks for post-write acks with offsets on this connection.
    ACK_ON_COMMIT = 0x8_0000;
    /// Named group members (`consumer`, `reclaim`).
    GROUP_CONSUMER = 0x10_0000;
    /// The client reads `subscription_lagged`; the broker ends durable subscriptions at
    /// their first drop.
    SUBSCRIPTION_LAGGED = 0x20_0000;
    /// `skipped_before` on group records.
    GROUP_SKIPPED = 0x40_0000;
    /// `publisher` on group records.
    GROUP_PUBLISHER = 0x80_0000;
    /// group_seek / group_describe / group_delete.
    GROUP_ADMIN = 0x100_0000;
    /// cache_put_if / cache_delete_if; `version` on cache_value.
    CACHE_CONDITIONAL = 0x200_0000;
    /// `offset_for_time`; `timestamp_micros` on group records.
    RECORD_TIMESTAMPS = 0x400_0000;
    /// group_extend, group_dead_letter, nack delay/attempts, poll visibility.
    GROUP_CLAIM_CONTROL = 0x800_0000;
    /// `publish_if`, `expected_offset` on commit.
    PUBLISH_CONDITIONAL = 0x1000_0000;
    /// `stream_read`.
    STREAM_READ = 0x2000_0000;
    /// `queue_capacity` on subscribe.
    SUBSCRIBE_QUEUE = 0x4000_0000;
    /// Marker in the first word: the `_hi` word is present.
    EXTENDED = 0x8000_0000;
    /// shard_inspect, subscriptions_list (high word bit 0).
    INSPECT = 0x1_0000_0000;
}

impl Features {
    /// No features.
    pub const NONE: Features = Features(0);
    /// Every feature this implementation knows in the first word, marker included.
    pub const KNOWN_LO: u32 = 0xFFFF_FFFF;
    /// Every feature this implementation knows in the high word.
    pub const KNOWN_HI: u32 = 0x1;

    /// The raw bits.
    pub const fn bits(self) -> u64 {
        self.0
    }

    /// True when every bit of `other` is set.
    pub const fn contains(self, other: Features) -> bool {
        self.0 & other.0 == other.0
    }

    /// Bits set in either.
    pub const fn union(self, other: Features) -> Features {
        Features(self.0 | other.0)
    }

    /// Bits set in both.
    pub const fn intersection(self, other: Features) -> Features {
        Features(self.0 & other.0)
    }

    /// The first wire word.
    pub const fn lo(self) -> u32 {
        self.0 as u32
    }

    /// The high wire word.
    pub const fn hi(self) -> u32 {
        (self.0 >> 32) as u32
    }

    /// Reads both words as a peer sent them. The high word counts only when the first
    /// word carries the [`Features::EXTENDED`] marker; absent words mean no features.
    pub fn from_wire(lo: Option<u32>, hi: Option<u32>) -> Features {
        let lo = lo.unwrap_or(0);
        let hi = if lo & (Self::EXTENDED.0 as u32) != 0 {
            hi.unwrap_or(0)
        } else {
            0
        };
        Features(u64::from(lo) | (u64::from(hi) << 32))
    }

    /// The words a client sends in `auth`: the marker is set and `_hi` present exactly
    /// when a high-word feature is offered. `None` means "omit the field".
    pub fn offer(self) -> (Option<u32>, Option<u32>) {
        let hi = self.hi();
        let mut lo = self.lo();
        if hi != 0 {
            lo |= Self::EXTENDED.0 as u32;
        }
        ((lo != 0).then_some(lo), (hi != 0).then_some(hi))
    }

    /// The words a broker sends in `auth_ok` for what it serves, given what the client
    /// offered: `_hi` (and the marker) only to a client that set the marker itself.
    pub fn answer(self, client_offered: Features) -> (Option<u32>, Option<u32>) {
        if client_offered.contains(Self::EXTENDED) {
            self.offer()
        } else {
            let lo = self.lo() & !(Self::EXTENDED.0 as u32);
            ((lo != 0).then_some(lo), None)
        }
    }
}

impl fmt::Debug for Features {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Features({:#x}", self.0)?;
        for (name, bit) in Self::NAMED {
            if self.contains(*bit) {
                write!(f, " {name}")?;
            }
        }
        write!(f, ")")
    }
}

impl std::ops::BitOr for Features {
    type Output = Features;
    fn bitor(self, rhs: Features) -> Features {
        self.union(rhs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn feature_numbers_match_the_frozen_table() {
        assert_eq!(Features::GROUP_CONSUMER.0, 0x10_0000);
        assert_eq!(Features::GROUP_SKIPPED.0, 0x40_0000);
        assert_eq!(Features::SUBSCRIBE_QUEUE.0, 0x4000_0000);
        assert_eq!(Features::INSPECT.hi(), 1);
        assert_eq!(Features::INSPECT.lo(), 0);
        for (i, (_, bit)) in Features::NAMED.iter().enumerate() {
            assert_eq!(
                bit.0,
                1u64 << i,
                "named features are one bit each, in order"
            );
        }
    }

    #[test]
    fn high_word_travels_only_with_the_marker() {
        let f = Features::TOPOLOGY | Features::INSPECT;
        assert_eq!(f.offer(), (Some(0x8000_0001), Some(1)));
        assert_eq!(
            Features::from_wire(Some(0x8000_0001), Some(1)),
            f | Features::EXTENDED
        );
        // Without the marker a stray hi word is ignored.
        assert_eq!(Features::from_wire(Some(1), Some(1)), Features::TOPOLOGY);
        // A broker answers hi only to a client that set the marker.
        assert_eq!(f.answer(Features::TOPOLOGY), (Some(1), None));
        assert_eq!(f.answer(Features::EXTENDED), (Some(0x8000_0001), Some(1)));
        assert_eq!(Features::NONE.offer(), (None, None));
    }
}
