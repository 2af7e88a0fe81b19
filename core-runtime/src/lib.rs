//! `felix-core-runtime`: the thread-per-core substrate.
//!
//! It owns the per-core glommio executors and their lifecycle ([`runtime`]), the
//! core-to-shard placement operators can pin ([`placement`]), the bounded cross-core
//! mesh ([`mesh`]), per-core statistics ([`stats`]) and QUIC on quinn-proto driven from
//! those executors ([`quic`]). It and `felix-storage-uring` are the only crates that
//! name glommio; everything above sees these types.

pub mod clock;
pub mod cores;
pub mod mesh;
pub mod placement;
pub mod quic;
pub mod runtime;
pub mod stats;
pub mod task;

pub use cores::{CoreId, CoreSet};
