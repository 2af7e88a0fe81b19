//! `felix-storage-uring`: the durable per-shard segment log.
//!
//! Every stream, cache and queue is a reading of one append-only log per shard. This
//! crate owns that log: its on-disk format ([`format`], documented in
//! `docs/storage-format.md`), the append path with group commit and in-order commits
//! ([`log`]), recovery that repairs a torn tail and refuses interior damage, sparse
//! derived indexes ([`index`]), retention, the cuts and small state files replication
//! needs (`truncate_from`, `reset_empty_at`, `write_meta`), and the I/O backends behind
//! one trait ([`io`]): io_uring O_DIRECT through glommio, and an in-memory backend that
//! fails, tears, loses writes and forgets unsynced directory changes on command. It knows offsets, records and its own format;
//! never QUIC or frames.

pub mod error;
pub mod format;
#[doc(hidden)]
pub mod fuzzing;
pub mod index;
pub mod io;
pub mod log;
pub mod memlock;
pub mod segment;

pub use error::{Corruption, CorruptionKind, StorageError};
pub use format::{BatchKind, KindSet, ProducerTag};
pub use io::dma::DmaBackend;
pub use io::faults::{FaultTimes, StorageFaults};
pub use io::is_out_of_descriptors;
pub use io::memory::{MemBackend, MemOp};
pub use log::{
    Appended, DeviceLatency, EARLY_ACK_STAGED_MAX, FsyncMode, LATENCY_BOUNDS_US, LatencyBuckets,
    LogConfig, LogStats, PendingAppend, ReadBatch, RecoveryReport, SegmentLog, TornTail,
    VerifyOnOpen,
};
