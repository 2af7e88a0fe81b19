//! Replicated shards: a sans-IO state machine per replica ([`machine`]), driven over the
//! broker-to-broker protocol, and a deterministic simulator that checks it
//! ([`sim`], tests only). The design, its invariants and where each is enforced:
//! `docs/replication.md`.

pub mod machine;
pub mod peer;
pub mod replica;
#[cfg(test)]
pub mod sim;
