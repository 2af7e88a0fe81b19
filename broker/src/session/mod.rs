//! One client connection, as sans-IO pieces and a thin driver:
//!
//! - [`handshake`]: the first frame of a stream and `now` become a [`Session`] or a
//!   typed refusal; the connection's authentication deadline.
//! - [`dispatch`]: each frame decoded once into a request, decided into one action
//!   against a [`dispatch::Directory`]; one publish path for binary, JSON and forwarded
//!   publishes.
//! - [`answer`]: the one encoder of publish outcomes and errors; every string bounded.
//! - [`outbox`]: answers in request order, bounded by the window; publish bytes in
//!   flight bounded per connection.
//! - [`subscription`]: a subscription's position: history, live batches, gaps.
//! - [`driver`]: the only part that touches QUIC streams, tasks and the clock.
//!
//! Time comes in from outside (`now` on every decision), so the pieces are tested on
//! virtual time without sockets; `broker/fuzz` drives dispatch with arbitrary frames.

pub mod answer;
pub mod dispatch;
pub mod driver;
pub mod handshake;
pub mod held;
pub mod outbox;
pub mod subscription;

#[cfg(any(test, feature = "fuzzing"))]
pub mod testing;

use std::time::Duration;

pub use driver::{close_for_shutdown, serve_connection, watch_keys};
pub use handshake::Session;

use felix_wire::{Features, Flags};

/// Frame layouts this broker reads and writes.
pub const SERVER_FLAGS: Flags = Flags(
    0x0001
        | 0x0004
        | 0x0008
        | 0x0010
        | 0x0020
        | 0x0040
        | 0x0080
        | 0x0200
        | 0x0400
        | 0x0800
        | 0x1000,
);

/// Requests this broker serves. Advertise only what is served.
pub const SERVER_FEATURES: Features = Features(
    Features::TOPOLOGY.0
        | Features::CACHE_DELETE.0
        | Features::STREAM_SHARDS.0
        | Features::CACHE_SHARDS.0
        | Features::ERROR_CODES.0
        | Features::UNSUPPORTED.0
        | Features::PUBLISH_PIPELINE.0
        | Features::STREAM_PUBLISH_WINDOW.0
        | Features::CACHE_WATCH.0
        | Features::CACHE_WATCH_RETAINED.0
        | Features::IDEMPOTENT_PRODUCER.0
        | Features::SEQUENCE_REUSED.0
        | Features::CACHE_CONDITIONAL.0
        | Features::STREAM_READ.0
        | Features::RECORD_TIMESTAMPS.0
        | Features::COUNTERS.0
        | Features::ATOMIC_COMMIT.0
        | Features::PUBLISH_CONDITIONAL.0
        | Features::CONSUMER_GROUP.0
        | Features::GROUP_DEAD_LETTERS.0
        | Features::GROUP_ADMIN.0
        | Features::GROUP_CLAIM_CONTROL.0
        | Features::GROUP_CONSUMER.0
        | Features::GROUP_SKIPPED.0
        | Features::SUBSCRIPTION_LAGGED.0,
);

/// What a broker following a control plane serves on top: redirects and owners.
pub const CLUSTER_FEATURES: Features = Features(
    SERVER_FEATURES.0 | Features::REDIRECT.0 | Features::SHARD_OWNERS.0 | Features::SHARD_MOVED.0,
);

/// The features a broker serves: more when it follows a control plane.
pub fn served_features(clustered: bool) -> Features {
    if clustered {
        CLUSTER_FEATURES
    } else {
        SERVER_FEATURES
    }
}

/// Per-connection bounds (configuration; defaults in `docs/configuration.md`).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// A connection with no authenticated stream is closed after this (`None`: never).
    pub auth_timeout: Option<Duration>,
    /// Subscriptions one connection may hold; more are refused `limit_exceeded`.
    pub subscriptions_per_connection: usize,
    /// Group polls one connection may have waiting for records; a poll past it is
    /// answered at once (its wait taken as 0), so one client's long polls cannot hold
    /// the waiting room every client shares.
    pub waiting_polls_per_connection: usize,
    /// Bytes of begun, unfinished frames one connection's streams may hold together;
    /// past it the connection is closed (`unfinished`).
    pub unfinished_frame_bytes_per_connection: usize,
    /// The same for all of a core's connections; past it the one holding the most is
    /// closed.
    pub unfinished_frame_bytes_per_core: usize,
    /// Bytes of answers one connection's streams have waiting for QUIC to take them (a
    /// client not reading); past it the connection is closed (`held`).
    pub unwritten_answer_bytes_per_connection: usize,
    /// The same for all of a core's connections; past it the one holding the most is
    /// closed.
    pub unwritten_answer_bytes_per_core: usize,
    /// Request bytes in flight per connection (a publish's records, any other
    /// request's frame); past it the broker stops reading requests until earlier ones
    /// complete.
    pub inflight_publish_bytes: usize,
    /// The same for all of a core's connections together (taken after the
    /// connection's own): without it, a core's 10,000 connections could each hold their
    /// 64 MiB in requests waiting for a slow disk.
    pub inflight_request_bytes_per_core: usize,
    /// Bytes of current values that starting cache watches (retained, or starting
    /// over) hold together in this process (`shard::snapshots`).
    pub watch_snapshot_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            auth_timeout: Some(Duration::from_secs(10)),
            subscriptions_per_connection: 1024,
            waiting_polls_per_connection: 256,
            unfinished_frame_bytes_per_connection: 128 << 20,
            unfinished_frame_bytes_per_core: 1 << 30,
            unwritten_answer_bytes_per_connection: 256 << 20,
            unwritten_answer_bytes_per_core: 2 << 30,
            inflight_publish_bytes: 64 << 20,
            inflight_request_bytes_per_core: 1 << 30,
            watch_snapshot_bytes: 1 << 30,
        }
    }
}
