//! Frame flag bits: which payload layout a frame carries.
//!
//! Flags select a layout; they are not a version number and never mix with feature bits
//! (see [`crate::features`]). A receiver rejects an unknown bit rather than masking it,
//! because masking one means confidently misparsing the body. A sender sets only bits
//! the peer advertised in `auth` / `auth_ok`.

use std::fmt;

/// A set of frame flag bits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Flags(pub u16);

impl Flags {
    /// No bits: the payload is a JSON [`crate::Message`].
    pub const JSON: Flags = Flags(0);
    /// Payload is a binary publish batch.
    pub const BINARY_PUBLISH_BATCH: Flags = Flags(0x0001);
    /// Binary event batch with a per-subscriber id (legacy).
    pub const BINARY_EVENT_BATCH: Flags = Flags(0x0002);
    /// Shared encode-once event batch (no subscription id).
    pub const BINARY_EVENT_BATCH_SHARED: Flags = Flags(0x0004);
    /// Modifier on 0x0001: request_id + ack_mode prefix; the publish is owed an ack.
    pub const BINARY_PUBLISH_ACKED: Flags = Flags(0x0008);
    /// Payload is a binary publish ack (broker to client).
    pub const BINARY_PUBLISH_ACK: Flags = Flags(0x0010);
    /// Modifier on an event batch: carries `base_offset`.
    pub const EVENT_BATCH_OFFSETS: Flags = Flags(0x0020);
    /// Modifier on 0x0001: routing-key prefix.
    pub const BINARY_PUBLISH_KEYED: Flags = Flags(0x0040);
    /// Modifier on 0x0010: the publish was forwarded; the ack names the owner.
    pub const BINARY_PUBLISH_ACK_OWNER: Flags = Flags(0x0080);
    /// Modifier on 0x0008: producer_id + sequence prefix.
    pub const BINARY_PUBLISH_IDEMPOTENT: Flags = Flags(0x0100);
    /// Modifier on 0x0010: a failed ack carries code + retry class.
    pub const BINARY_PUBLISH_ACK_CODE: Flags = Flags(0x0200);
    /// Modifier on 0x0200: adds reason + retry_after_ms.
    pub const BINARY_PUBLISH_ACK_DETAIL: Flags = Flags(0x0400);
    /// Modifier on 0x0020: adds `skipped_before`.
    pub const EVENT_BATCH_SKIPPED: Flags = Flags(0x0800);
    /// Modifier on 0x0010: a successful ack ends with the first offset; also enables
    /// `offset` on JSON `publish_ok`.
    pub const BINARY_PUBLISH_ACK_OFFSET: Flags = Flags(0x1000);
    /// Modifier on an event batch: publisher principal.
    pub const EVENT_BATCH_PUBLISHER: Flags = Flags(0x2000);
    /// Modifier on an event batch: per-event append time.
    pub const EVENT_BATCH_TIMESTAMPS: Flags = Flags(0x4000);

    /// Every bit this implementation knows.
    pub const KNOWN: Flags = Flags(0x7FFF);
    /// What a legacy broker (one that answers `auth` with plain `ok`) is assumed to speak.
    pub const ORIGINAL_V1: Flags = Flags(0x0007);

    /// The raw bits.
    pub const fn bits(self) -> u16 {
        self.0
    }

    /// True when every bit of `other` is set here.
    pub const fn contains(self, other: Flags) -> bool {
        self.0 & other.0 == other.0
    }

    /// True when any bit of `other` is set here.
    pub const fn intersects(self, other: Flags) -> bool {
        self.0 & other.0 != 0
    }

    /// Bits set in either.
    pub const fn union(self, other: Flags) -> Flags {
        Flags(self.0 | other.0)
    }

    /// Bits set in both.
    pub const fn intersection(self, other: Flags) -> Flags {
        Flags(self.0 & other.0)
    }

    /// Bits this implementation does not know.
    pub const fn unknown(self) -> Flags {
        Flags(self.0 & !Self::KNOWN.0)
    }

    /// True when no bit is set.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// `self` with the bits of `other` set when `on`.
    pub const fn with(self, other: Flags, on: bool) -> Flags {
        if on { self.union(other) } else { self }
    }
}

impl fmt::Debug for Flags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Flags({:#06x})", self.0)
    }
}

impl std::ops::BitOr for Flags {
    type Output = Flags;
    fn bitor(self, rhs: Flags) -> Flags {
        self.union(rhs)
    }
}

/// The payload layout a frame's flags select.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    /// Flags 0: a JSON message.
    Json,
    /// 0x0001 with its modifiers.
    PublishBatch,
    /// 0x0010 with its modifiers.
    PublishAck,
    /// 0x0002 or 0x0004 with their modifiers.
    EventBatch,
}

/// Why a set of known flag bits does not describe one layout.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("flags {flags:?} do not name one payload layout: {reason}")]
pub struct FlagComboError {
    /// The offending flags.
    pub flags: Flags,
    /// Which rule they break.
    pub reason: &'static str,
}

const PUBLISH_MODIFIERS: Flags = Flags(0x0008 | 0x0040 | 0x0100);
const ACK_MODIFIERS: Flags = Flags(0x0080 | 0x0200 | 0x0400 | 0x1000);
const EVENT_MODIFIERS: Flags = Flags(0x0020 | 0x0800 | 0x2000 | 0x4000);

impl FrameKind {
    /// Classifies known flags, refusing modifiers without their base bit and mixtures of
    /// layouts. Call only after unknown bits were refused.
    pub fn of(flags: Flags) -> Result<FrameKind, FlagComboError> {
        let err = |reason| Err(FlagComboError { flags, reason });
        let publish = flags.contains(Flags::BINARY_PUBLISH_BATCH);
        let ack = flags.contains(Flags::BINARY_PUBLISH_ACK);
        let legacy_events = flags.contains(Flags::BINARY_EVENT_BATCH);
        let shared_events = flags.contains(Flags::BINARY_EVENT_BATCH_SHARED);
        let bases = [publish, ack, legacy_events, shared_events]
            .into_iter()
            .filter(|b| *b)
            .count();
        if bases > 1 {
            return err("more than one base layout bit");
        }
        if flags.is_empty() {
            return Ok(FrameKind::Json);
        }
        if publish {
            if flags.intersects(ACK_MODIFIERS.union(EVENT_MODIFIERS)) {
                return err("publish batch with ack or event modifiers");
            }
            if flags.contains(Flags::BINARY_PUBLISH_IDEMPOTENT)
                && !flags.contains(Flags::BINARY_PUBLISH_ACKED)
            {
                return err("idempotent publish without the acked modifier");
            }
            return Ok(FrameKind::PublishBatch);
        }
        if ack {
            if flags.intersects(PUBLISH_MODIFIERS.union(EVENT_MODIFIERS)) {
                return err("publish ack with publish or event modifiers");
            }
            if flags.contains(Flags::BINARY_PUBLISH_ACK_DETAIL)
                && !flags.contains(Flags::BINARY_PUBLISH_ACK_CODE)
            {
                return err("ack detail without the ack code modifier");
            }
            return Ok(FrameKind::PublishAck);
        }
        if legacy_events || shared_events {
            if flags.intersects(PUBLISH_MODIFIERS.union(ACK_MODIFIERS)) {
                return err("event batch with publish or ack modifiers");
            }
            if flags.contains(Flags::EVENT_BATCH_SKIPPED)
                && !flags.contains(Flags::EVENT_BATCH_OFFSETS)
            {
                return err("skipped_before without base offsets");
            }
            return Ok(FrameKind::EventBatch);
        }
        err("modifier bits without a base layout bit")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vectors_flags_classify() {
        assert_eq!(FrameKind::of(Flags(0)), Ok(FrameKind::Json));
        assert_eq!(FrameKind::of(Flags(0x0009)), Ok(FrameKind::PublishBatch));
        assert_eq!(FrameKind::of(Flags(0x0010)), Ok(FrameKind::PublishAck));
        assert_eq!(FrameKind::of(Flags(0x0024)), Ok(FrameKind::EventBatch));
    }

    #[test]
    fn modifiers_without_their_base_are_refused() {
        assert!(
            FrameKind::of(Flags(0x0101)).is_err(),
            "idempotent without acked"
        );
        assert!(FrameKind::of(Flags(0x0410)).is_err(), "detail without code");
        assert!(
            FrameKind::of(Flags(0x0804)).is_err(),
            "skipped without offsets"
        );
        assert!(FrameKind::of(Flags(0x0020)).is_err(), "offsets alone");
        assert!(FrameKind::of(Flags(0x0011)).is_err(), "two bases");
        assert!(FrameKind::of(Flags(0x0006)).is_err(), "two event bases");
    }

    #[test]
    fn unknown_bits_are_reported_not_masked() {
        assert_eq!(Flags(0x8001).unknown(), Flags(0x8000));
        assert!(Flags::KNOWN.unknown().is_empty());
    }
}
