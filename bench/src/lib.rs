//! `felix-bench`: benchmarks that print numbers and ratios against a baseline measured in
//! the same run. See `docs/benchmarks.md` for the method.

pub mod broker;
pub mod cache;
pub mod client;
pub mod compare;
pub mod drivers;
pub mod peers;
pub mod queue;
pub mod quic;
pub mod replication;
pub mod report;
pub mod stats;
