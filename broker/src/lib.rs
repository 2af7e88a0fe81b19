//! `felix-broker`: the Felix protocol on a thread-per-core core.
//!
//! Each shard is owned by one core ([`core`]); a client connection lives on the core the
//! kernel hashed it to and reaches shards elsewhere through the mesh ([`session`]).
//! Streams are logs ([`shard`]) with fanout after durability; caches are logs with a
//! derived key index; consumer groups are durable cursors over a stream shard
//! ([`groups`]). Tokens are verified per stream ([`auth`]); names and shard counts
//! come from the catalog ([`catalog`]). `felix-broker dev` ([`dev`]) prepares a single
//! node with everything embedded.

pub mod auth;
pub mod catalog;
pub mod cli;
pub mod cluster;
pub mod config;
pub mod core;
pub mod dev;
pub mod embedded;
pub mod error;
pub mod forward;
pub mod groups;
pub mod histogram;
pub mod http;
pub mod producers;
pub mod reads;
pub mod replication;
pub mod server;
pub mod session;
pub mod shard;
pub mod state;
#[cfg(test)]
mod wakes;
