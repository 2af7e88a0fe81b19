//! Typed ids and positions shared by every crate.
//!
//! Each is a newtype, never an alias, so an offset cannot be passed where a sequence
//! number is expected. On the wire they are plain integers (`#[serde(transparent)]`).

use serde::{Deserialize, Serialize};

macro_rules! id_newtype {
    ($(#[$doc:meta])* $name:ident($inner:ty)) => {
        $(#[$doc])*
        #[derive(
            Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
        )]
        #[serde(transparent)]
        pub struct $name(pub $inner);

        impl $name {
            /// The raw integer.
            pub const fn get(self) -> $inner {
                self.0
            }
        }

        impl From<$inner> for $name {
            fn from(value: $inner) -> Self {
                Self(value)
            }
        }

        impl From<$name> for $inner {
            fn from(value: $name) -> Self {
                value.0
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                self.0.fmt(f)
            }
        }
    };
}

id_newtype!(
    /// A record's position in one shard's log. Offsets start at 0 and are dense except
    /// for generation-start records, which take an offset but are never delivered.
    Offset(u64)
);
id_newtype!(
    /// A shard's index within its stream or cache, `0..shards`.
    ShardId(u32)
);
id_newtype!(
    /// A shard assignment's epoch. A larger generation supersedes a smaller one.
    Generation(u64)
);
id_newtype!(
    /// A client-chosen correlation id, echoed in the answer.
    RequestId(u64)
);
id_newtype!(
    /// An idempotent producer's id, picked by the broker.
    ProducerId(u64)
);
id_newtype!(
    /// An idempotent producer's per-shard batch number, starting at 0.
    Sequence(u64)
);
id_newtype!(
    /// A subscription or cache watch, named in `event_stream_hello`.
    SubscriptionId(u64)
);

impl Offset {
    /// The offset `n` records after this one.
    pub const fn plus(self, n: u64) -> Offset {
        Offset(self.0 + n)
    }

    /// The next offset.
    pub const fn next(self) -> Offset {
        Offset(self.0 + 1)
    }
}
