//! The per-shard segment log: offsets claimed at once, durability waited on later.
//!
//! One log lives on one core; its state is touched only from that core's executor, so
//! it is a `RefCell` and never a lock. The durability protocol, in order:
//!
//! 1. `begin_append` (synchronous, no `.await`): checks the log is healthy, claims the
//!    batch's offsets, encodes it into the staging buffer of the segment it belongs to
//!    (deciding a roll from the projected size), and takes a commit turn. The batch's
//!    place in the order is fixed here, before any disk wait.
//! 2. The flusher task takes what is staged, up to [`format::ROUND_BYTES_MAX`] bytes of
//!    batches (staging starts a new chunk rather than let one pass the bound, and a
//!    round takes whole chunks, so only a batch larger than the bound makes a round
//!    larger, and then it is the round's only batch). What is left waits for the next
//!    round, which starts at once. It writes the round with one block-aligned O_DIRECT
//!    write per segment (rewriting the last partial block with the new bytes behind it).
//!    Rolling to a new segment first fdatasyncs the old one, then creates the new file,
//!    writes and fdatasyncs its header, and fsyncs the directory.
//! 3. Under `FsyncMode::OnCommit` the flusher then issues one fdatasync for the round:
//!    every batch written in the round becomes durable together (group commit). Under
//!    `Periodic` a timer asks for that fdatasync; under `None` only close does (every
//!    round once the log is closing). Because a round is bounded and the next one starts
//!    only after this fdatasync, a power cut finds at most one round of the newest
//!    segment unsynced; recovery relies on that to cut a torn last round
//!    (`docs/storage-format.md`, "Recovery").
//!    (`LogConfig::unsafe_skip_fdatasync` leaves this call out: a mutant the power-loss
//!    tests must catch.) With `LogConfig::dsync_writes`, the round's write is itself
//!    durable (O_DSYNC: the kernel ends it with that same sync), its batches are durable
//!    when it completes and no fdatasync follows; the first round after open still
//!    fdatasyncs, because a durable write vouches only for its own bytes and what the
//!    last life wrote unsynced must be durable before anything behind it is acked.
//! 4. `commit` resolves once its batch is acknowledged *and* every earlier turn has
//!    resolved: success, failure and cancellation (dropping a `PendingAppend`) all
//!    release the next turn, so commits complete in offset order. Work the caller does
//!    right after `commit` returns, before its next `.await`, therefore also happens in
//!    offset order. Under `OnCommit` a batch is acknowledged once durable. Under `None`
//!    and `Periodic` it is acknowledged once sequenced (step 1): the ack does not wait
//!    for the device, and a reader asking for such a batch before the flusher has
//!    written it waits for that write. What was acknowledged but not yet written is the
//!    loss window of those modes: a crash, or a failed write, loses it.
//!
//! 5. Running out of space is not poison. When the flusher's write of a chunk, or any
//!    step of creating the next segment (truncate, fallocate, header write, header
//!    fdatasync, directory fsync), fails with ENOSPC or EDQUOT, it rolls back:
//!    - (5a) Cleanup first: a half-made segment file is removed and the directory
//!      fsynced; a file whose write failed is cut back to `align_up(data_len)` if the
//!      write grew it (or zeros were written ahead of the data: they go too), the block holding `data_len` is written back as it was (a short
//!      write may have landed whole batches of the failing chunk in it, and those are
//!      refused) and the file is fdatasynced. If cleanup fails, the log is poisoned
//!      instead.
//!    - (5b) Every batch not yet written fails with `NoSpace`: the failing chunk, the
//!      rest of the round, and everything staged meanwhile. Batches written earlier in
//!      the round are untouched, and the round still fdatasyncs them.
//!    - (5c) Their offsets are given back: `next_offset` returns to `written_end`, the
//!      append position to the newest segment's written end. The next append claims the
//!      same offsets and rewrites the segment's last partial block, as every append does.
//!    - (5d) The era ends. A `PendingAppend` remembers its era; one at or past the era's
//!      rollback point fails with `NoSpace` for good, even after a later batch reuses
//!      and acknowledges its offsets. Releasing it leaves the commit order alone: the
//!      sequencer forgets turns at or past the point and resumes there.
//!
//!    This is safe because under `OnCommit` nothing at or past `written_end` was
//!    acknowledged (an ack needs the durable write), and after cleanup the file holds
//!    nothing past the valid end except, at most, inside the last partial block, which
//!    the next write rewrites. (Under `None` and `Periodic` the staged batches *were*
//!    acknowledged, step 4, and readers may have seen them: giving their offsets back
//!    would let other records take offsets already read, so there running out of space
//!    poisons the log, as below, instead.)
//!    A crash before that leaves what a crash mid-write always leaves: a torn tail that
//!    recovery cuts, or a whole unacknowledged batch that it may keep; never data after
//!    a gap, which recovery would have to refuse as interior damage.
//!
//! Any other failed write, and a failed fdatasync of data (whatever the errno), poisons
//! the log: the staged bytes behind a failed write already own their offsets, and after a
//! failed fdatasync the kernel may have dropped dirty pages, so what is on disk is
//! unknowable. Nothing is acknowledged again until the process restarts and recovery
//! reads what actually reached the disk.
//!
//! Replication cuts the log and stores state beside it ([`cut`], [`meta`]):
//!
//! 6. `truncate_from(o)` removes every record at or after `o` (a batch boundary), and
//!    `reset_empty_at(b)` turns an empty log into an empty log starting at `b`. Both
//!    hold the log and go through a durable intent file, `LOG-INTENT`:
//!    - (6a) The log is marked busy: `begin` and retention refuse with `Busy`. The
//!      flusher writes (and, under `OnCommit`, fdatasyncs) what was staged before the
//!      call, then parks. The preconditions are checked again after that wait, and the
//!      cut's byte position is found by reading batch headers (`NotBatchBoundary` if
//!      `o` falls inside a batch). Nothing has changed yet: any failure returns as is.
//!    - (6b) Commit point: the intent (kind, offset, CRC) is written to `LOG-INTENT.tmp`
//!      and fdatasynced, renamed over `LOG-INTENT`, and the directory fsynced. Before the
//!      rename a crash leaves the old log and a leftover temporary that nothing reads.
//!      From the rename on, recovery finishes the change (6d) whatever else reached the
//!      disk, so a crash leaves the new log. A failure from the rename on therefore
//!      poisons the log (the intent may be durable), and so does dropping the call.
//!    - (6c) Memory becomes the new log: the era ends at `o` (a `PendingAppend` at or
//!      past it fails with `RemovedByTruncation`, and the sequencer forgets its turn, as
//!      in 5d); next, written and durable ends, append position, index, tail block and
//!      last batch are those of the cut. A read or `sync` that spans the change starts
//!      over on the new log, so no read begun after the call returns a removed record.
//!    - (6d) Disk: segment files after the one holding `o` and their indexes are removed
//!      and the directory fsynced; then that segment is cut to `o`'s byte position
//!      (ftruncate, fdatasync) and its last block rewritten with zeros after the cut
//!      (write, fdatasync). The first fdatasync makes the shorter size durable before the
//!      zeros are written, so a crash can never leave zeros followed by removed bytes
//!      (which recovery would call interior damage). A reset instead removes every
//!      segment and creates the one at `b` (durable header, directory fsync). Recovery,
//!      finding an intent, does the same: removes segments past `o` (or all, for a
//!      reset) before scanning, cuts the newest at `o` if it extends past it, or creates
//!      the segment at `b`. Each step is idempotent, so a crash during recovery is safe.
//!    - (6e) The intent is removed and the directory fsynced before the call returns and
//!      before an append is accepted again. The cut is durable by then, so a new batch
//!      is never written into a file that still holds removed bytes behind it, and a
//!      crash never shows a removed record after a new one; and no intent survives to
//!      cut records acknowledged later.
//!
//! 7. `write_meta(name, bytes)` writes `name.tmp` and fdatasyncs it, renames it over
//!    `name`, and fsyncs the directory. Before the rename a crash leaves the old file
//!    (the temporary is ignored and rewritten next time); between the rename and the
//!    directory fsync, the old or the new one; after it, the new one. Rename replaces
//!    the name atomically, so a reader never sees a mix. Recovery ignores these files:
//!    their names cannot end in `.seg` or `.idx`. `close` waits for one in progress, and
//!    a log closing or closed refuses the next (another core may own the files by then).
//!
//! 8. `save_snapshot(name, as_of, body)` stores state the caller derived from the records
//!    below `as_of` ([`snapshot`]; `name.snap`, written as in 7, with its offset and a
//!    CRC), so that rebuilding it reads the log from `as_of` only. The log keeps a
//!    snapshot true to the records below its offset: a truncation removes those past
//!    its cut, and a reset every one, durably and before appends resume (6d, under
//!    the metadata turn, so a save in progress is installed first and removed then; a
//!    save whose state was derived before a cut is refused `Busy`); an open removes
//!    those outside `[base, end]` recovery found, and damaged ones, before the first
//!    append. `load_snapshot` hands back none outside `[base_offset(), next_offset()]`.

use std::cell::{OnceCell, RefCell};
use std::collections::{BTreeMap, VecDeque};
use std::future::poll_fn;
use std::io;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::error::{Corruption, CorruptionKind, StorageError};
use crate::format::{
    self, BATCH_HEADER_BYTES, BLOCK_BYTES, BatchKind, HeaderRead, KindSet, MAX_BATCH_BODY_BYTES,
    ProducerTag, SEGMENT_HEADER_BYTES, SegmentHeader,
};
use crate::index::SparseIndex;
use crate::io::{Backend, SegmentFile, is_out_of_descriptors};
use crate::segment::{Segment, index_name, segment_name};

pub mod cut;
pub mod meta;
mod recover;
pub mod snapshot;

use recover::recover;

/// Under `None` and `Periodic`, batches are acknowledged at sequencing while at most this
/// many bytes are staged and not yet being written; past it a batch waits for its write.
/// With the round being written (at most [`format::ROUND_BYTES_MAX`], unless one batch is
/// larger) this bounds what a crash can take back.
pub const EARLY_ACK_STAGED_MAX: usize = 16 << 20;

/// The flusher lingers only while less than this is staged.
const LINGER_BYTES_MAX: usize = 1 << 20;

/// Emptied chunk buffers kept for reuse, in bytes of capacity: one round's worth. A
/// flood fills chunks to a round's size, and keeping four of them (as a count alone
/// allowed) held 32 MiB per log after it ended.
const SPARE_BYTES_MAX: usize = format::ROUND_BYTES_MAX;

/// A log holding more than this in buffers it is not using (the flusher's write buffer
/// and the spare chunks) gives them back once it has written nothing for
/// [`IDLE_BUFFERS_RELEASE`]: a burst's buffers are not held for the log's whole life, so
/// a core's memory follows its busy logs, not every log that was ever busy.
const IDLE_BUFFERS_KEEP: usize = 1 << 20;
/// See [`IDLE_BUFFERS_KEEP`].
const IDLE_BUFFERS_RELEASE: Duration = Duration::from_secs(1);

/// When an acknowledged append is on stable storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsyncMode {
    /// Never fsynced except at close. Acks mean "sequenced": the batch has its offsets
    /// and readers see it; the flusher writes it moments later. A crash (or a failed
    /// write) loses what was acknowledged but not yet written, and a power cut what was
    /// not yet synced.
    None,
    /// As `None`, and fsynced at this interval: a power cut loses at most one interval.
    Periodic(Duration),
    /// Acks wait for the fdatasync that covers them (group commit).
    OnCommit,
}

impl FsyncMode {
    /// Whether an append is acknowledged once sequenced, before its write (step 4).
    pub fn acks_before_write(self) -> bool {
        !matches!(self, FsyncMode::OnCommit)
    }
}

impl std::str::FromStr for FsyncMode {
    type Err = String;

    /// `none`, `on-commit`, or `periodic:<ms>`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(FsyncMode::None),
            "on-commit" | "on_commit" => Ok(FsyncMode::OnCommit),
            other => match other.strip_prefix("periodic:") {
                Some(ms) => ms
                    .parse::<u64>()
                    .ok()
                    .filter(|ms| *ms > 0)
                    .map(|ms| FsyncMode::Periodic(Duration::from_millis(ms)))
                    .ok_or_else(|| format!("bad periodic interval {ms:?} (milliseconds > 0)")),
                None => Err(format!(
                    "unknown fsync mode {other:?}: expected none, on-commit or periodic:<ms>"
                )),
            },
        }
    }
}

/// How much of the sealed segments recovery checksums at open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VerifyOnOpen {
    /// Every batch of every segment.
    All,
    /// Sealed segments: header, index and the batches after the last index entry; the
    /// newest segment is always scanned in full.
    Tail,
}

/// Log configuration.
#[derive(Debug, Clone)]
pub struct LogConfig {
    /// Roll to a new segment when the next batch would pass this size.
    pub segment_bytes_max: u64,
    /// Sparse index spacing.
    pub index_interval_bytes: u64,
    /// Durability of acknowledgements.
    pub fsync: FsyncMode,
    /// Under `None` and `Periodic` (which acknowledge before the write): how long the
    /// flusher lets appends gather before it writes them, so that one device write
    /// carries many one-at-a-time appends; an append made after half of it starts the
    /// write at once. Adds this much to the crash loss window and
    /// to the wait of a reader asking for a record not yet written; acks do not wait.
    /// Zero writes at once.
    pub write_linger: Duration,
    /// Reserve each segment's space up front (fallocate KEEP_SIZE).
    pub preallocate: bool,
    /// Keep zeros written past the newest segment's data: whenever less than half of
    /// this many bytes is left, up to 64 KiB more (0: off). Appends then overwrite blocks the file already holds
    /// instead of growing it: on ext4 an O_DIRECT write that grows a file cannot
    /// complete without blocking, so io_uring hands it to a kernel worker thread, and
    /// its fdatasync must commit the new size through the journal. The flusher writes
    /// the zeros after a round (its acks are out), 64 KiB at a time and only when
    /// nothing is staged, and behind the data of a round that would grow the file
    /// anyway; a sealed segment is cut back to its data when the log rolls, and
    /// recovery reads zeros past the data as the end.
    pub zero_ahead_bytes: u64,
    /// Delete whole sealed segments from the head while the log is larger than this.
    pub retention_bytes: Option<u64>,
    /// Delete whole sealed segments whose newest record is older than this.
    pub retention_age: Option<Duration>,
    /// Checksumming at open.
    pub verify_on_open: VerifyOnOpen,
    /// Bytes fetched per read call.
    pub read_window_bytes: usize,
    /// Open without changing anything: recovery reports what it would repair instead of
    /// repairing it, and appends are refused. For inspection tools.
    pub read_only: bool,
    /// A deliberate bug: under `OnCommit` the flusher acknowledges a round as if the
    /// fdatasync of step 3 had run, without calling it. The log then believes those
    /// bytes durable, so a later `sync` or `close` does not fsync them either; a roll
    /// still fdatasyncs the segment it seals. For tests that must show a missing fsync
    /// is caught; never set it otherwise.
    pub unsafe_skip_fdatasync: bool,
    /// Under `OnCommit`: write each round's data with one durable write (O_DSYNC,
    /// [`SegmentFile::write_durable_at`]) instead of a write and then an fdatasync
    /// (step 3). Durability is the same (the kernel makes that sync at the end of the
    /// write); saved are the second io_uring request, its completion and the second
    /// wake-up of the core per round. Headers, rolls and cuts are synced as without it;
    /// zeros written ahead on their own are never made durable (they need not be: a
    /// lost sector of zeros reads as zeros).
    pub dsync_writes: bool,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            segment_bytes_max: 256 * 1024 * 1024,
            index_interval_bytes: 4096,
            fsync: FsyncMode::OnCommit,
            write_linger: Duration::ZERO,
            preallocate: true,
            zero_ahead_bytes: 0,
            retention_bytes: None,
            retention_age: None,
            verify_on_open: VerifyOnOpen::All,
            read_window_bytes: 1024 * 1024,
            read_only: false,
            unsafe_skip_fdatasync: false,
            dsync_writes: false,
        }
    }
}

/// What recovery found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Segments in the log after recovery.
    pub segments: usize,
    /// Oldest retained offset.
    pub base_offset: u64,
    /// Next offset to be assigned.
    pub next_offset: u64,
    /// Bytes of torn or zeroed tail cut from the newest segment.
    pub truncated_bytes: u64,
    /// Segment files discarded because their creation never completed.
    pub discarded_segments: usize,
    /// Index files rebuilt from their segments.
    pub rebuilt_indexes: usize,
    /// Bytes checksummed.
    pub verified_bytes: u64,
    /// An interrupted truncation or reset was found and finished (step 6d).
    pub finished_intent: bool,
    /// The torn tail cut from the newest segment (read-only: that would be cut).
    pub torn_tail: Option<TornTail>,
    /// The last life ran under `none` or `periodic` and did not close cleanly (its
    /// [`UNSYNCED_LIFE`] mark was there): records it acknowledged may be gone, those it
    /// counted durable at sequencing among them.
    pub unsynced_life: bool,
    /// Index files whose segment was gone, removed.
    pub orphan_indexes_removed: usize,
    /// Wall time.
    pub duration: Duration,
}

/// What recovery cut from the end of the newest segment, never acknowledged data:
/// - a torn tail: a batch whose write never completed, followed by nothing but zeros;
/// - a torn last round: damage with more data after it, all within
///   [`format::LAST_ROUND_REACH_BYTES`] of the damage, as a power cut during a round's
///   fdatasync leaves it. The batches after the damage are cut too, whole or not: the
///   log cannot keep records after a gap in its offsets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TornTail {
    /// The segment file.
    pub segment: String,
    /// Where the cut is: the end of the last whole batch, the file's new length.
    pub position: u64,
    /// Bytes cut: the damaged batch, whatever follows it, and the zeros after that.
    pub bytes: u64,
    /// The offset the damaged batch starts at: the log's next offset after the cut.
    pub first_offset: u64,
    /// Records the cut loses, offsets `first_offset..first_offset + records`, when they
    /// can be counted: the batch headers from the damage to the end of the data are
    /// walked, and where one is damaged the walk resumes at the next header that
    /// verifies and continues the offsets. `None` when a batch whose header is damaged
    /// has no such header after it (it may be the last batch), so no count is certain.
    pub records: Option<u64>,
    /// Where non-zero bytes resume after the damaged batch: `Some` for a torn last
    /// round, `None` for a torn tail.
    pub data_after: Option<u64>,
    /// What is wrong with the batch.
    pub cause: format::FormatError,
}

/// A batch read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadBatch {
    /// Offset of `records[0]`.
    pub base_offset: u64,
    /// Append time.
    pub timestamp_micros: u64,
    /// Data or generation start.
    pub kind: BatchKind,
    /// Producer tag.
    pub producer: Option<ProducerTag>,
    /// The records (zero-copy slices of the read buffer).
    pub records: Vec<Bytes>,
}

impl ReadBatch {
    /// One past the last record.
    pub fn end_offset(&self) -> u64 {
        self.base_offset + self.records.len() as u64
    }
}

/// Counters for metrics and benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LogStats {
    /// Batches appended.
    pub appends: u64,
    /// Flush rounds (one write per touched segment each).
    pub flush_rounds: u64,
    /// Device syncs of segment data: fdatasync calls, and durable writes of a round's
    /// data ([`LogConfig::dsync_writes`]).
    pub syncs: u64,
    /// Batches made durable by those syncs.
    pub synced_batches: u64,
    /// Of [`LogStats::syncs`], the durable writes.
    pub dsync_writes: u64,
    /// Bytes written, padding included.
    pub bytes_written: u64,
    /// Most bytes of batches one flush round took: at most [`format::ROUND_BYTES_MAX`],
    /// unless a single batch is larger (step 2).
    pub largest_round_bytes: u64,
    /// Segment rolls.
    pub rolls: u64,
    /// Tries of a roll that found no file descriptor to create its segment with, and
    /// waited for one.
    pub roll_descriptor_waits: u64,
    /// Times the disk was full and unwritten batches were rolled back (step 5).
    pub no_space_rollbacks: u64,
    /// Truncations and resets (step 6).
    pub cuts: u64,
    /// Zeros written ahead of the newest segment's data
    /// ([`LogConfig::zero_ahead_bytes`]).
    pub zero_ahead_bytes: u64,
    /// Writes of those zeros that failed (no more are written to that segment).
    pub zero_ahead_failures: u64,
}

/// Upper bounds (µs) of the latency buckets the log keeps for its device calls; one more,
/// unbounded, follows. The broker's histograms use the same bounds.
pub const LATENCY_BOUNDS_US: [u64; 14] = [
    25, 50, 100, 200, 300, 500, 1_000, 2_000, 5_000, 10_000, 50_000, 100_000, 500_000, 1_000_000,
];

/// Observations per latency bucket and their sum, kept by the log's own core (no
/// atomics) and drained by whoever reports them ([`SegmentLog::take_device_latency`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LatencyBuckets {
    /// Per bucket, [`LATENCY_BOUNDS_US`] order, the unbounded one last.
    pub counts: [u64; LATENCY_BOUNDS_US.len() + 1],
    /// Sum of observations, µs.
    pub sum_us: u64,
}

impl LatencyBuckets {
    /// Records one observation.
    pub fn observe(&mut self, d: Duration) {
        let us = d.as_micros().min(u128::from(u64::MAX)) as u64;
        self.counts[LATENCY_BOUNDS_US.partition_point(|b| *b < us)] += 1;
        self.sum_us = self.sum_us.saturating_add(us);
    }
}

/// How long the device took, per flush round: the data write(s), and the fdatasync.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceLatency {
    /// One round's writes (one per segment the round touched).
    pub write: LatencyBuckets,
    /// One fdatasync of a round (group commit) or of a sealed segment.
    pub sync: LatencyBuckets,
}

/// Offsets `[first, end)` of an appended batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Appended {
    /// First offset.
    pub first: u64,
    /// One past the last.
    pub end: u64,
}

/// Encoded bytes waiting for the flusher, all for one segment.
#[derive(Debug)]
struct Chunk {
    segment_base: u64,
    /// The flusher must roll to a new segment at `segment_base` before writing.
    opens_segment: bool,
    bytes: Vec<u8>,
    end_offset: u64,
    batches: u64,
    max_timestamp_micros: u64,
    index: Vec<(u64, u64)>,
    last_batch: Option<(u64, BatchKind)>,
    kinds: KindSet,
}

#[derive(Debug, Default)]
struct Sequencer {
    /// First offset whose turn it is.
    next: u64,
    /// Ranges resolved out of order: first -> end.
    resolved: BTreeMap<u64, u64>,
    waiters: BTreeMap<u64, Waker>,
}

impl Sequencer {
    fn resolve(&mut self, first: u64, end: u64) {
        if first == self.next {
            self.next = end;
            while let Some(end) = self.resolved.remove(&self.next) {
                self.next = end;
            }
            if let Some(w) = self.waiters.remove(&self.next) {
                w.wake();
            }
        } else {
            self.resolved.insert(first, end);
        }
    }
}

/// The appends between two rollbacks (no space, step 5; truncation, step 6). Each
/// `PendingAppend` holds its era, so a rollback's record lives exactly as long as a batch
/// that may ask about it.
#[derive(Debug, Default)]
struct Era {
    number: u64,
    ended: OnceCell<Rollback>,
}

/// How an era ended.
#[derive(Debug)]
struct Rollback {
    /// Batches from here on were given back: `written_end` at a no-space rollback, the
    /// cut at a truncation.
    point: u64,
    cause: RollbackCause,
    /// The era that followed: a truncation may give back, in a later era, a batch that
    /// this rollback kept.
    next: Rc<Era>,
}

#[derive(Debug)]
enum RollbackCause {
    NoSpace { op: &'static str, detail: String },
    Truncated,
}

impl Rollback {
    fn error(&self) -> StorageError {
        match &self.cause {
            RollbackCause::NoSpace { op, detail } => StorageError::NoSpace {
                op,
                detail: detail.clone(),
            },
            RollbackCause::Truncated => StorageError::RemovedByTruncation { from: self.point },
        }
    }
}

struct State<F> {
    segments: VecDeque<Segment<F>>,
    staged: VecDeque<Chunk>,
    /// Emptied chunk buffers for reuse, at most [`SPARE_BYTES_MAX`] of capacity.
    spare: Vec<Vec<u8>>,
    /// Capacity of the flusher's write buffer (the buffer is the flusher's own).
    write_buf_bytes: usize,
    /// Next offset to assign.
    next_offset: u64,
    /// Where the next batch goes in the segment appends are filling.
    append_base: u64,
    append_pos: u64,
    append_last_indexed: Option<u64>,
    /// One past the last record written / fsynced.
    written_end: u64,
    /// Under `None` and `Periodic`: one past the last batch acknowledged at sequencing
    /// (step 4); batches past it wait for their write (too much was staged).
    early_end: u64,
    durable_end: u64,
    sequencer: Sequencer,
    era: Rc<Era>,
    /// Waiters for the acknowledged end to pass a value: end needed -> wakers.
    ack_waiters: BTreeMap<u64, Vec<Waker>>,
    flusher: Option<Waker>,
    /// A lingering flusher's waker and the time from which an append may end its linger
    /// (see [`flusher`]).
    linger_kick: Option<(Instant, Waker)>,
    /// Device times since they were last taken.
    device_latency: DeviceLatency,
    sync_requested: bool,
    /// Wakers of `sync()` callers, woken after the next fsync.
    poisoned: Option<(&'static str, String)>,
    closing: bool,
    closed: bool,
    /// Data is written with durable writes ([`LogConfig::dsync_writes`]): set once an
    /// fdatasync has covered what the log held when it opened.
    dsync_ready: bool,
    stats: LogStats,
    /// Base offset and kind of the last batch claimed.
    last_batch: Option<(u64, BatchKind)>,
    /// A truncation or reset holds the log (step 6a).
    exclusive: bool,
    /// The next batch starts a new segment (a compaction's cut).
    roll_requested: bool,
    /// The flusher is in a round.
    flushing: bool,
    /// Woken when the flusher ends a round or stops.
    idle_waiter: Option<Waker>,
    /// Truncations and resets begun: a read or sync spanning one starts over (step 6c).
    cuts: u64,
    /// Bytes of the segments retention took from the head since the log opened
    /// ([`SegmentLog::written_bytes`]).
    retired_bytes: u64,
    /// A `write_meta` is in progress; the others wait here.
    meta_writing: bool,
    meta_waiters: Vec<Waker>,
    /// Retention passes removing files; a close waits here for them to stop.
    removing: usize,
    removing_waiters: Vec<Waker>,
}

/// A retention pass removing files (see [`SegmentLog::enforce_retention_below`]);
/// dropped, it lets a waiting close go on.
struct Removing<'a, B: Backend>(&'a SegmentLog<B>);

impl<'a, B: Backend> Removing<'a, B> {
    fn start(log: &'a SegmentLog<B>) -> Self {
        log.shared.state.borrow_mut().removing += 1;
        Removing(log)
    }
}

impl<B: Backend> Drop for Removing<'_, B> {
    fn drop(&mut self) {
        let mut st = self.0.shared.state.borrow_mut();
        st.removing -= 1;
        for w in std::mem::take(&mut st.removing_waiters) {
            w.wake();
        }
    }
}

struct Shared<B: Backend> {
    backend: B,
    config: LogConfig,
    state: RefCell<State<B::File>>,
    /// [`RecoveryReport::unsynced_life`] of this open, until its owner says it has
    /// recorded it ([`SegmentLog::unsynced_life_recorded`]).
    unsynced_life: std::cell::Cell<bool>,
    /// An `on-commit` life's open could not remove an earlier life's [`UNSYNCED_LIFE`]
    /// mark (a full device): retention's next removal and the close try again.
    mark_left: std::cell::Cell<bool>,
}

/// A segment log over backend `B`. Cloning shares the log.
pub struct SegmentLog<B: Backend> {
    shared: Rc<Shared<B>>,
    tasks: Rc<RefCell<Vec<glommio::Task<()>>>>,
}

impl<B: Backend> Clone for SegmentLog<B> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
            tasks: self.tasks.clone(),
        }
    }
}

impl<B: Backend> std::fmt::Debug for SegmentLog<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.shared.state.borrow();
        f.debug_struct("SegmentLog")
            .field("segments", &st.segments.len())
            .field("next_offset", &st.next_offset)
            .field("written_end", &st.written_end)
            .field("durable_end", &st.durable_end)
            .finish()
    }
}

/// A batch whose offsets are claimed. Commit it, or drop it to give up waiting (the
/// batch is still written: its offsets are taken).
#[must_use = "a pending append holds a commit turn until committed or dropped"]
pub struct PendingAppend {
    first: u64,
    end: u64,
    era: Rc<Era>,
    resolve: Option<Rc<dyn Fn(u64, u64)>>,
}

impl std::fmt::Debug for PendingAppend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingAppend")
            .field("first", &self.first)
            .field("end", &self.end)
            .field("era", &self.era.number)
            .finish()
    }
}

impl PendingAppend {
    /// First offset claimed.
    pub fn first(&self) -> u64 {
        self.first
    }

    /// One past the last offset claimed.
    pub fn end(&self) -> u64 {
        self.end
    }

    /// The rollback that gave this batch's offsets back, if one did (steps 5d, 6c).
    fn rolled_back(&self) -> Option<&Rollback> {
        let mut era = &*self.era;
        while let Some(rb) = era.ended.get() {
            if self.first >= rb.point {
                return Some(rb);
            }
            era = &rb.next;
        }
        None
    }

    fn release(&mut self) {
        if let Some(resolve) = self.resolve.take() {
            // A rolled-back batch's offsets are the next era's turns now.
            if self.rolled_back().is_none() {
                resolve(self.first, self.end);
            }
        }
    }
}

impl Drop for PendingAppend {
    fn drop(&mut self) {
        self.release();
    }
}

/// Present while a life under `none` or `periodic` runs (written durably at its open,
/// removed once its close synced): recovery then reads damage anywhere in the newest
/// segment that shows a lost sector as a power cut's, not only within one round of the
/// end (`docs/storage-format.md`, "Recovery").
pub(crate) const UNSYNCED_LIFE: &str = "unsynced-life";

/// Writes ([`UNSYNCED_LIFE`] for a life that may leave more than a round unsynced) or
/// removes the mark, durably, before this life writes.
async fn mark_life<B: Backend>(backend: &B, unsynced: bool) -> Result<(), StorageError> {
    let io = |op: &'static str| move |e| StorageError::io(op, UNSYNCED_LIFE, e);
    let marked = backend
        .read_small(UNSYNCED_LIFE)
        .await
        .map_err(io("read"))?
        .is_some();
    match (unsynced, marked) {
        (true, false) => backend
            .write_synced(UNSYNCED_LIFE, b"")
            .await
            .map_err(io("write"))?,
        (false, true) => backend.remove(UNSYNCED_LIFE).await.map_err(io("remove"))?,
        // Already as wanted, perhaps by an open whose directory sync then failed: the
        // sync below makes it durable all the same.
        _ => {}
    }
    backend.sync_dir().await.map_err(io("sync_dir"))
}

fn now_micros() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

impl<B: Backend> SegmentLog<B> {
    /// Opens the log in `backend`, recovering what is there (or creating an empty log),
    /// and starts its flusher on the current glommio executor.
    pub async fn open(
        backend: B,
        config: LogConfig,
    ) -> Result<(SegmentLog<B>, RecoveryReport), StorageError> {
        if config.segment_bytes_max < (SEGMENT_HEADER_BYTES + BATCH_HEADER_BYTES) as u64
            || config.index_interval_bytes == 0
            || config.read_window_bytes == 0
            || config.retention_bytes == Some(0)
            || config.retention_age == Some(Duration::ZERO)
        {
            return Err(StorageError::Config(format!("{config:?}")));
        }
        let started = Instant::now();
        let (segments, mut report) = recover(&backend, &config).await?;
        let mut mark_left = false;
        if !config.read_only {
            // Before the first append: a snapshot past the end describes a tail a crash
            // took (or a truncation it interrupted), one below the base the old life of
            // a reset it interrupted.
            let keep = match (segments.front(), segments.back()) {
                (Some(first), Some(last)) => Some(first.base..=last.end_offset),
                _ => None,
            };
            snapshot::remove_outside(&backend, keep)
                .await
                .map_err(|(op, e)| StorageError::io(op, "log directory", e))?;
        }
        if !config.read_only {
            // Not best effort: without its mark, a `none` or `periodic` life that a power
            // cut ends is recovered with the strict reach, and damage further back than
            // one round (such a life leaves a whole segment unsynced) is refused as
            // interior; and a mark left from such a life makes an `on-commit` life's
            // recovery cut acknowledged records it should refuse to. The open fails
            // instead (out of descriptors: the next request opens it again). Except on
            // a full device or quota: failed, the shard would stay closed until a
            // restart, its own retention unable to free the space; it opens unmarked
            // (its appends meet the full disk too, and are refused retryably).
            // An `on-commit` life that cannot remove an earlier life's mark there
            // tries again once its retention freed space, and at its close: it kept the
            // mark for its whole life, so the next open after a clean close still read
            // the log as after an unsynced life, and recovery after a crash of this one
            // cut acknowledged records it should refuse to (until 2026-12-08).
            let unsynced = config.fsync != FsyncMode::OnCommit;
            match mark_life(&backend, unsynced).await {
                Err(StorageError::Io { source, .. }) if is_no_space(&source) => {
                    mark_left = !unsynced;
                }
                marked => marked?,
            }
        }
        let last = segments
            .back()
            .expect("recovery leaves at least one segment");
        let next_offset = last.end_offset;
        let (append_base, append_pos) = (last.base, last.data_len);
        let last_batch = written_last_batch(&segments);
        report.segments = segments.len();
        report.base_offset = segments.front().map_or(0, |s| s.base);
        report.next_offset = next_offset;
        report.duration = started.elapsed();
        let state = State {
            segments,
            staged: VecDeque::new(),
            spare: Vec::new(),
            write_buf_bytes: 0,
            next_offset,
            append_base,
            append_pos,
            append_last_indexed: None,
            written_end: next_offset,
            early_end: next_offset,
            durable_end: next_offset,
            sequencer: Sequencer {
                next: next_offset,
                ..Sequencer::default()
            },
            era: Rc::default(),
            ack_waiters: BTreeMap::new(),
            flusher: None,
            linger_kick: None,
            device_latency: DeviceLatency::default(),
            sync_requested: false,
            poisoned: None,
            closing: false,
            closed: false,
            dsync_ready: false,
            stats: LogStats::default(),
            last_batch,
            exclusive: false,
            roll_requested: false,
            flushing: false,
            idle_waiter: None,
            cuts: 0,
            retired_bytes: 0,
            meta_writing: false,
            meta_waiters: Vec::new(),
            removing: 0,
            removing_waiters: Vec::new(),
        };
        let log = SegmentLog {
            shared: Rc::new(Shared {
                backend,
                config,
                state: RefCell::new(state),
                unsynced_life: std::cell::Cell::new(report.unsynced_life),
                mark_left: std::cell::Cell::new(mark_left),
            }),
            tasks: Rc::new(RefCell::new(Vec::new())),
        };
        // The newest segment's index covers every batch, so the next entry is due one
        // interval after its last.
        {
            let mut st = log.shared.state.borrow_mut();
            st.append_last_indexed = st
                .segments
                .back()
                .and_then(|s| s.index.last().map(|(_, p)| p));
        }
        if log.shared.config.read_only {
            log.shared.state.borrow_mut().closed = true;
            return Ok((log, report));
        }
        let flusher = glommio::spawn_local(flusher(log.shared.clone()));
        log.tasks.borrow_mut().push(flusher);
        if let FsyncMode::Periodic(interval) = log.shared.config.fsync {
            let ticker = glommio::spawn_local(periodic_sync(Rc::downgrade(&log.shared), interval));
            log.tasks.borrow_mut().push(ticker);
        }
        Ok((log, report))
    }

    /// Claims offsets for `records` and stages them; see the module docs, step 1.
    pub fn begin_append<R: AsRef<[u8]>>(
        &self,
        records: &[R],
        timestamp_micros: u64,
        producer: Option<ProducerTag>,
    ) -> Result<PendingAppend, StorageError> {
        self.begin(records, timestamp_micros, BatchKind::Data, producer)
    }

    /// A follower's append: as `begin_append`, but only at `first_offset`, which must be
    /// the log's next offset (`NotAtTail` otherwise, and nothing changes). `kind` is the
    /// leader's: a generation-start batch is stored as shipped, and must be one 8-byte
    /// record.
    pub fn begin_append_at<R: AsRef<[u8]>>(
        &self,
        first_offset: u64,
        records: &[R],
        timestamp_micros: u64,
        kind: BatchKind,
    ) -> Result<PendingAppend, StorageError> {
        self.begin_append_at_tagged(first_offset, records, timestamp_micros, kind, None)
    }

    /// As [`SegmentLog::begin_append_at`], keeping the leader's producer tag.
    pub fn begin_append_at_tagged<R: AsRef<[u8]>>(
        &self,
        first_offset: u64,
        records: &[R],
        timestamp_micros: u64,
        kind: BatchKind,
        producer: Option<ProducerTag>,
    ) -> Result<PendingAppend, StorageError> {
        if kind == BatchKind::GenerationStart && !matches!(records, [r] if r.as_ref().len() == 8) {
            return Err(StorageError::InvalidBatch(
                "a generation-start batch holds one 8-byte record",
            ));
        }
        if kind == BatchKind::Commit && records.len() != 1 {
            return Err(StorageError::InvalidBatch(
                "a commit batch holds one record",
            ));
        }
        {
            let st = self.shared.state.borrow();
            admit(&st)?;
            if st.next_offset != first_offset {
                return Err(StorageError::NotAtTail {
                    expected: st.next_offset,
                    found: first_offset,
                });
            }
        }
        self.begin(records, timestamp_micros, kind, producer)
    }

    /// Claims one offset for an atomic commit (one record, stored as a `Commit` batch:
    /// readers of the data see only its event; the broker owns the encoding).
    pub fn begin_commit(
        &self,
        record: &[u8],
        timestamp_micros: u64,
    ) -> Result<PendingAppend, StorageError> {
        self.begin(&[record], timestamp_micros, BatchKind::Commit, None)
    }

    /// Claims offsets for consumer-group events (a `Group` batch: replicated with the
    /// shard, skipped by readers of the data; the broker owns the encoding).
    pub fn begin_group<R: AsRef<[u8]>>(
        &self,
        records: &[R],
        timestamp_micros: u64,
    ) -> Result<PendingAppend, StorageError> {
        self.begin(records, timestamp_micros, BatchKind::Group, None)
    }

    /// Claims offsets for copies of state entries (a `State` batch: replicated with the
    /// shard, skipped by readers of the data; the broker owns the encoding).
    pub fn begin_state<R: AsRef<[u8]>>(
        &self,
        records: &[R],
        timestamp_micros: u64,
    ) -> Result<PendingAppend, StorageError> {
        self.begin(records, timestamp_micros, BatchKind::State, None)
    }

    /// Claims one offset for a generation-start record stamped `timestamp_micros`.
    pub fn begin_generation_start(
        &self,
        generation: u64,
        timestamp_micros: u64,
    ) -> Result<PendingAppend, StorageError> {
        self.begin(
            &[generation.to_be_bytes()],
            timestamp_micros,
            BatchKind::GenerationStart,
            None,
        )
    }

    fn begin<R: AsRef<[u8]>>(
        &self,
        records: &[R],
        timestamp_micros: u64,
        kind: BatchKind,
        producer: Option<ProducerTag>,
    ) -> Result<PendingAppend, StorageError> {
        if records.is_empty() {
            return Err(StorageError::EmptyBatch);
        }
        let len = format::batch_len(records);
        if len - BATCH_HEADER_BYTES > MAX_BATCH_BODY_BYTES {
            return Err(StorageError::BatchTooLarge {
                bytes: len - BATCH_HEADER_BYTES,
                max: MAX_BATCH_BODY_BYTES,
            });
        }
        let cfg = &self.shared.config;
        let mut st = self.shared.state.borrow_mut();
        let st = &mut *st;
        admit(st)?;
        let first = st.next_offset;
        let end = first + records.len() as u64;
        // A batch is never split: roll first if it would pass the size limit (unless
        // the segment is empty, so an oversized batch gets a segment to itself).
        let roll = st.append_pos > SEGMENT_HEADER_BYTES as u64
            && (st.roll_requested || st.append_pos + len as u64 > cfg.segment_bytes_max);
        st.roll_requested = false;
        if roll {
            st.append_base = first;
            st.append_pos = SEGMENT_HEADER_BYTES as u64;
            st.append_last_indexed = None;
        }
        // A chunk never grows past a round's bound (step 2): a round takes whole chunks.
        let needs_chunk = roll
            || st.staged.back().is_none_or(|c| {
                c.segment_base != st.append_base || c.bytes.len() + len > format::ROUND_BYTES_MAX
            });
        if needs_chunk {
            let bytes = st.spare.pop().unwrap_or_default();
            st.staged.push_back(Chunk {
                segment_base: st.append_base,
                opens_segment: roll,
                bytes,
                end_offset: first,
                batches: 0,
                max_timestamp_micros: 0,
                index: Vec::new(),
                last_batch: None,
                kinds: KindSet::default(),
            });
        }
        let chunk = st.staged.back_mut().expect("a chunk was just ensured");
        // Grown by doubling, but never past a round (unless this batch alone is larger):
        // a full chunk then fits the spares' bound and is kept for reuse, where doubling
        // gave it up to twice a round's capacity and recycling dropped it.
        let need = chunk.bytes.len() + len;
        if need > chunk.bytes.capacity() {
            let grown = (chunk.bytes.capacity() * 2).clamp(need, format::ROUND_BYTES_MAX.max(need));
            chunk.bytes.reserve_exact(grown - chunk.bytes.len());
        }
        format::encode_batch(
            &mut chunk.bytes,
            first,
            timestamp_micros,
            kind,
            producer,
            records,
        );
        let pos = st.append_pos;
        if st
            .append_last_indexed
            .is_none_or(|last| pos >= last + cfg.index_interval_bytes)
        {
            chunk.index.push((first, pos));
            st.append_last_indexed = Some(pos);
        }
        chunk.end_offset = end;
        chunk.last_batch = Some((first, kind));
        chunk.kinds.add(kind);
        chunk.batches += 1;
        chunk.max_timestamp_micros = chunk.max_timestamp_micros.max(timestamp_micros);
        st.append_pos += len as u64;
        st.next_offset = end;
        st.last_batch = Some((first, kind));
        st.stats.appends += 1;
        if let Some(w) = st.flusher.take() {
            w.wake();
        }
        if st
            .linger_kick
            .as_ref()
            .is_some_and(|(from, _)| Instant::now() >= *from)
            && let Some((_, w)) = st.linger_kick.take()
        {
            w.wake();
        }
        // Acknowledged now, unless the flusher is far behind: then this batch waits for
        // its write, which is what bounds staged memory (and the loss window).
        if cfg.fsync.acks_before_write()
            && st.staged.iter().map(|c| c.bytes.len()).sum::<usize>() <= EARLY_ACK_STAGED_MAX
        {
            st.early_end = end;
        }
        if cfg.fsync.acks_before_write() && !st.ack_waiters.is_empty() {
            // Acknowledged now: a tailing reader need not wait for the write.
            wake_acked(st, cfg.fsync);
        }
        let weak = Rc::downgrade(&self.shared);
        Ok(PendingAppend {
            first,
            end,
            era: st.era.clone(),
            resolve: Some(Rc::new(move |first, end| {
                if let Some(shared) = weak.upgrade() {
                    shared.state.borrow_mut().sequencer.resolve(first, end);
                }
            })),
        })
    }

    /// Waits until the batch is acknowledged and its turn has come; see step 4.
    pub async fn commit(&self, mut pending: PendingAppend) -> Result<Appended, StorageError> {
        let result = poll_fn(|cx| self.poll_commit(&pending, cx)).await;
        pending.release();
        result.map(|()| Appended {
            first: pending.first,
            end: pending.end,
        })
    }

    fn poll_commit(
        &self,
        p: &PendingAppend,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(), StorageError>> {
        // Before the ack check: a later era may have acknowledged these very offsets.
        if let Some(rb) = p.rolled_back() {
            return Poll::Ready(Err(rb.error()));
        }
        let mut st = self.shared.state.borrow_mut();
        let acked = ack_end(&st, self.shared.config.fsync);
        if acked < p.end {
            if let Some((op, detail)) = &st.poisoned {
                return Poll::Ready(Err(StorageError::Poisoned {
                    op,
                    detail: detail.clone(),
                }));
            }
            if st.closed {
                return Poll::Ready(Err(StorageError::Closed));
            }
            wait_ack(&mut st, p.end, cx.waker());
            return Poll::Pending;
        }
        if st.sequencer.next < p.first {
            st.sequencer.waiters.insert(p.first, cx.waker().clone());
            return Poll::Pending;
        }
        Poll::Ready(Ok(()))
    }

    /// `begin_append` then `commit`.
    pub async fn append<R: AsRef<[u8]>>(
        &self,
        records: &[R],
        timestamp_micros: u64,
    ) -> Result<Appended, StorageError> {
        let pending = self.begin_append(records, timestamp_micros, None)?;
        self.commit(pending).await
    }

    /// Whether the life before this open ran under `none` or `periodic` and did not
    /// close cleanly ([`RecoveryReport::unsynced_life`]), and its owner has not said it
    /// recorded that yet.
    pub fn opened_after_unsynced_life(&self) -> bool {
        self.shared.unsynced_life.get()
    }

    /// The owner recorded [`SegmentLog::opened_after_unsynced_life`] where it needs it
    /// (a replica, durably in its metadata): an owner made again over this open log
    /// does not take it for a crash of its own life.
    pub fn unsynced_life_recorded(&self) {
        self.shared.unsynced_life.set(false);
    }

    /// Oldest retained offset.
    pub fn base_offset(&self) -> u64 {
        self.shared
            .state
            .borrow()
            .segments
            .front()
            .map_or(0, |s| s.base)
    }

    /// Next offset to be assigned.
    pub fn next_offset(&self) -> u64 {
        self.shared.state.borrow().next_offset
    }

    /// Base offset and kind of the last batch in the log (the one ending at
    /// `next_offset()`, staged or written), from memory; `None` when the log holds no
    /// record. A replication state machine's "last entry": its generation is the
    /// payload of the latest generation-start batch, which a read returns.
    pub fn last_batch(&self) -> Option<(u64, BatchKind)> {
        let st = self.shared.state.borrow();
        let base = st.segments.front().map_or(0, |s| s.base);
        st.last_batch.filter(|&(first, _)| first >= base)
    }

    /// One past the last acknowledged record: what readers may see.
    pub fn committed_end(&self) -> u64 {
        ack_end(&self.shared.state.borrow(), self.shared.config.fsync)
    }

    /// One past the last fsynced record.
    pub fn durable_end(&self) -> u64 {
        self.shared.state.borrow().durable_end
    }

    /// The device times observed since the last call (then reset): the caller adds
    /// them to its own histograms.
    pub fn take_device_latency(&self) -> DeviceLatency {
        std::mem::take(&mut self.shared.state.borrow_mut().device_latency)
    }

    /// Counters.
    pub fn stats(&self) -> LogStats {
        self.shared.state.borrow().stats
    }

    /// Bytes of buffer capacity the log holds: staged chunks, spare chunk buffers and
    /// the flusher's write buffer.
    pub fn buffer_bytes(&self) -> usize {
        let st = self.shared.state.borrow();
        st.staged.iter().map(|c| c.bytes.capacity()).sum::<usize>() + idle_buffer_bytes(&st)
    }

    /// Times the disk was full and unwritten batches were rolled back; also in
    /// [`LogStats::no_space_rollbacks`].
    pub fn no_space_rollbacks(&self) -> u64 {
        self.shared.state.borrow().stats.no_space_rollbacks
    }

    /// The poison, if a write or fsync failed.
    pub fn poisoned(&self) -> Option<String> {
        self.shared
            .state
            .borrow()
            .poisoned
            .as_ref()
            .map(|(op, d)| format!("{op}: {d}"))
    }

    /// Number of segments.
    pub fn segment_count(&self) -> usize {
        self.shared.state.borrow().segments.len()
    }

    /// The first offset of each segment, oldest first (the first may lie below
    /// [`SegmentLog::base_offset`] once records were cut from its front).
    pub fn segment_bases(&self) -> Vec<u64> {
        self.shared
            .state
            .borrow()
            .segments
            .iter()
            .map(|s| s.base)
            .collect()
    }

    /// Whether the log may hold a batch of `kind`: false only when every segment is
    /// known not to (read in full this life, or sealed with an index that says so).
    pub fn may_hold(&self, kind: BatchKind) -> bool {
        self.shared
            .state
            .borrow()
            .segments
            .iter()
            .any(|s| s.kinds.has(kind))
    }

    /// Bytes of data across all segments.
    pub fn size_bytes(&self) -> u64 {
        self.shared
            .state
            .borrow()
            .segments
            .iter()
            .map(|s| s.data_len)
            .sum()
    }

    /// The log's size and what retention removed since it opened: grows with every
    /// append and stays as retention removes, so "written since" measures by it hold
    /// under retention, where the size stops growing (a cut or reset shrinks it).
    pub fn written_bytes(&self) -> u64 {
        self.size_bytes() + self.shared.state.borrow().retired_bytes
    }

    /// Resolves once the acknowledged end passes `offset` (a record at `offset` is
    /// readable), or the log is poisoned or closed: a tailing reader's wait.
    pub async fn wait_for(&self, offset: u64) -> Result<(), StorageError> {
        poll_fn(|cx| {
            let mut st = self.shared.state.borrow_mut();
            if ack_end(&st, self.shared.config.fsync) > offset {
                return Poll::Ready(Ok(()));
            }
            if let Some(e) = stopped(&st) {
                return Poll::Ready(Err(e));
            }
            wait_ack(&mut st, offset + 1, cx.waker());
            Poll::Pending
        })
        .await
    }

    /// Resolves once `offset` is written (or the log was cut, poisoned or closed): a
    /// read of a record acknowledged at sequencing waits here for its write.
    async fn written_past(&self, offset: u64) -> Result<(), StorageError> {
        let cuts = self.shared.state.borrow().cuts;
        poll_fn(|cx| {
            let mut st = self.shared.state.borrow_mut();
            if st.written_end > offset || st.cuts != cuts || st.next_offset <= offset {
                return Poll::Ready(Ok(()));
            }
            if let Some(e) = stopped(&st) {
                return Poll::Ready(Err(e));
            }
            // A reader waits for a write: a write linger ends now (see `flusher`).
            wake_flusher_now(&mut st);
            // Woken by the write that passes it (every write wakes the waiters at or
            // below the acknowledged end, which is past `offset`).
            wait_ack(&mut st, offset + 1, cx.waker());
            Poll::Pending
        })
        .await
    }

    /// Makes everything written so far durable and waits for it: an fdatasync, unless
    /// durable writes ([`LogConfig::dsync_writes`]) already made it so. Batches a
    /// no-space rollback gave back are not waited for: they were never written.
    pub async fn sync(&self) -> Result<(), StorageError> {
        let (claimed, era, cuts) = {
            let mut st = self.shared.state.borrow_mut();
            st.sync_requested = true;
            wake_flusher_now(&mut st);
            (st.next_offset, st.era.clone(), st.cuts)
        };
        poll_fn(|cx| {
            let target = era.ended.get().map_or(claimed, |rb| claimed.min(rb.point));
            let mut st = self.shared.state.borrow_mut();
            if st.durable_end >= target {
                return Poll::Ready(Ok(()));
            }
            if let Some((op, detail)) = &st.poisoned {
                return Poll::Ready(Err(StorageError::Poisoned {
                    op,
                    detail: detail.clone(),
                }));
            }
            if st.cuts != cuts && !st.exclusive {
                // A truncation or reset finished since: it left everything durable.
                return Poll::Ready(Ok(()));
            }
            st.sync_requested = true;
            wake_flusher_now(&mut st);
            // Durable waiters share the ack waiter list: a sync always wakes them.
            wait_ack(&mut st, target, cx.waker());
            Poll::Pending
        })
        .await
    }

    /// Reads acknowledged records from `from`: whole batches (the first trimmed to
    /// start at `from`) until about `max_bytes` of payload, at least one batch when any
    /// exists. Empty at or past the acknowledged end; `Trimmed` below the base.
    pub async fn read(&self, from: u64, max_bytes: usize) -> Result<Vec<ReadBatch>, StorageError> {
        self.read_to(from, u64::MAX, max_bytes).await
    }

    /// As [`SegmentLog::read`], stopping at `until` (exclusive): the last batch may
    /// reach past it, but no batch starting at or after it is read (with `until <= from`,
    /// the batch holding `from`), and the device read is bounded by the index to the
    /// batches that can hold offsets below it. A reader that knows which offsets it
    /// wants (a consumer group's claim) reads those, not a whole read window.
    pub async fn read_to(
        &self,
        from: u64,
        until: u64,
        max_bytes: usize,
    ) -> Result<Vec<ReadBatch>, StorageError> {
        let mut out = Vec::new();
        let mut offset = from;
        let mut budget = max_bytes;
        let mut cuts = self.shared.state.borrow().cuts;
        'locate: loop {
            if self.shared.state.borrow().cuts != cuts {
                // A truncation or reset ran across an await: start over on the new log.
                (out, offset, budget) = (Vec::new(), from, max_bytes);
                cuts = self.shared.state.borrow().cuts;
            }
            // Locate under the borrow; await with none held.
            let located = {
                let st = self.shared.state.borrow();
                let end =
                    ack_end(&st, self.shared.config.fsync).min(until.max(from.saturating_add(1)));
                let base = st.segments.front().map_or(0, |s| s.base);
                if offset < base {
                    return Err(StorageError::Trimmed {
                        requested: offset,
                        oldest: base,
                    });
                }
                if offset >= end || (!out.is_empty() && budget == 0) {
                    return Ok(out);
                }
                if offset >= st.written_end {
                    if !out.is_empty() {
                        return Ok(out);
                    }
                    None
                } else {
                    let i = st.segments.partition_point(|s| s.base <= offset) - 1;
                    let s = &st.segments[i];
                    // The batch holding `end - 1` ends at or before the next batch
                    // the index names past it.
                    let stop = s.index.next_after(end - 1).unwrap_or(s.data_len);
                    Some((
                        s.file.clone(),
                        s.name.clone(),
                        s.index.seek(offset),
                        stop.min(s.data_len),
                        end.min(st.written_end),
                    ))
                }
            };
            let Some((file, name, mut pos, data_len, end)) = located else {
                // Acknowledged at sequencing, not yet written (step 4): wait for it.
                self.written_past(offset).await?;
                continue 'locate;
            };
            let window = self
                .shared
                .config
                .read_window_bytes
                .max(budget.min(16 << 20));
            let len = ((data_len - pos) as usize).min(window);
            let read = file.read_at(pos, len).await;
            if self.shared.state.borrow().cuts != cuts {
                continue 'locate;
            }
            let mut bytes = read.map_err(|e| StorageError::io("read", &name, e))?;
            let mut progressed = false;
            let mut at = 0usize;
            while offset < end {
                if at + BATCH_HEADER_BYTES > bytes.len() {
                    // The window ends at or inside a batch's header: read on from
                    // there, not from the index, which may point back to where this
                    // window began (a window ending there again, for ever).
                    let next = pos + at as u64;
                    if next >= data_len {
                        break;
                    }
                    let len = ((data_len - next) as usize).min(window);
                    let read = file.read_at(next, len).await;
                    if self.shared.state.borrow().cuts != cuts {
                        continue 'locate;
                    }
                    bytes = read.map_err(|e| StorageError::io("read", &name, e))?;
                    (pos, at) = (next, 0);
                    if bytes.len() < BATCH_HEADER_BYTES {
                        break;
                    }
                    continue;
                }
                let corrupt = |kind: CorruptionKind, position: u64| {
                    StorageError::Corrupt(Corruption {
                        segment: name.clone(),
                        position,
                        offset: Some(offset),
                        kind,
                    })
                };
                let h = match format::decode_batch_header(&bytes[at..]) {
                    Ok(HeaderRead::Batch(h)) => h,
                    Ok(HeaderRead::Zero) => {
                        return Err(corrupt(
                            CorruptionKind::Format(format::FormatError::BatchMagic { found: 0 }),
                            pos + at as u64,
                        ));
                    }
                    Err(e) => return Err(corrupt(e.into(), pos + at as u64)),
                };
                if at + h.total_len() > bytes.len() {
                    // The window ends inside this batch. Read on from here, not from the
                    // index again: the index may point before this batch, and a window
                    // from there would end inside it once more, for ever. The batch
                    // holding `offset` is fetched whole (it may be larger than a
                    // window); one before it is stepped over by its header's length.
                    let start = pos + at as u64;
                    let wanted = h.end_offset() > offset;
                    let (from, len) = if wanted {
                        (start, h.total_len())
                    } else {
                        let next = start + h.total_len() as u64;
                        (next, (data_len.saturating_sub(next) as usize).min(window))
                    };
                    if len == 0 {
                        // Nothing past it in this segment, though `offset` lies in it: a
                        // gap, which recovery rules out.
                        return Err(corrupt(
                            CorruptionKind::OffsetGap {
                                expected: offset,
                                found: h.end_offset(),
                            },
                            start,
                        ));
                    }
                    let read = file.read_at(from, len).await;
                    if self.shared.state.borrow().cuts != cuts {
                        continue 'locate;
                    }
                    bytes = read.map_err(|e| StorageError::io("read", &name, e))?;
                    (pos, at) = (from, 0);
                    if wanted && bytes.len() < h.total_len() {
                        return Err(corrupt(
                            CorruptionKind::Format(format::FormatError::Truncated {
                                needed: h.total_len(),
                                available: bytes.len(),
                            }),
                            pos,
                        ));
                    }
                    continue;
                }
                let body = bytes.slice(at + BATCH_HEADER_BYTES..at + h.total_len());
                at += h.total_len();
                progressed = true;
                if h.end_offset() <= offset {
                    continue;
                }
                if h.base_offset > offset {
                    return Err(corrupt(
                        CorruptionKind::OffsetGap {
                            expected: offset,
                            found: h.base_offset,
                        },
                        pos + (at - h.total_len()) as u64,
                    ));
                }
                let mut records = format::decode_batch_body(&h, &body)
                    .map_err(|e| corrupt(e.into(), pos + (at - h.total_len()) as u64))?;
                let skip = (offset - h.base_offset) as usize;
                records.drain(..skip);
                let payload: usize = records.iter().map(Bytes::len).sum();
                out.push(ReadBatch {
                    base_offset: offset,
                    timestamp_micros: h.timestamp_micros,
                    kind: h.kind,
                    producer: h.producer,
                    records,
                });
                offset = h.end_offset();
                budget = budget.saturating_sub(payload);
                if budget == 0 {
                    return Ok(out);
                }
            }
            pos += at as u64;
            if !progressed && pos >= data_len {
                // The segment holds nothing more at or after `offset`: that would be a
                // gap between segments, which recovery rules out.
                return Err(StorageError::Corrupt(Corruption {
                    segment: name,
                    position: pos,
                    offset: Some(offset),
                    kind: CorruptionKind::OffsetGap {
                        expected: offset,
                        found: offset,
                    },
                }));
            }
        }
    }

    /// Makes the next batch start a new segment (unless the current one is empty), so
    /// that everything below the offset it gets lies in sealed segments: a compaction
    /// copies what is live past that cut, then removes the segments below it.
    pub fn roll_next(&self) {
        self.shared.state.borrow_mut().roll_requested = true;
    }

    /// Deletes whole sealed segments from the head that the configured retention no
    /// longer keeps. Returns how many were removed. The active segment is never removed.
    pub async fn enforce_retention(&self, now_micros: u64) -> Result<usize, StorageError> {
        let cfg = &self.shared.config;
        self.enforce_retention_with(now_micros, cfg.retention_bytes, cfg.retention_age)
            .await
    }

    /// [`SegmentLog::enforce_retention`] with the bounds passed in (a stream's current
    /// retention) instead of the configured ones: segments go while the log is larger
    /// than `max_bytes` or while their newest record is older than `max_age`.
    pub async fn enforce_retention_with(
        &self,
        now_micros: u64,
        max_bytes: Option<u64>,
        max_age: Option<Duration>,
    ) -> Result<usize, StorageError> {
        self.enforce_retention_below(now_micros, max_bytes, max_age, u64::MAX)
            .await
    }

    /// Resolves once no retention pass is removing files (its directory sync
    /// included), registering its task's waker once however often it is polled.
    pub(crate) async fn no_removals(&self) {
        poll_fn(|cx| {
            let mut st = self.shared.state.borrow_mut();
            if st.removing > 0 {
                if !st.removing_waiters.iter().any(|w| w.will_wake(cx.waker())) {
                    st.removing_waiters.push(cx.waker().clone());
                }
                return Poll::Pending;
            }
            Poll::Ready(())
        })
        .await
    }

    /// [`SegmentLog::enforce_retention_with`], never removing a segment holding a
    /// record at or after `floor` (a replicated shard's commit mark: records not yet
    /// committed everywhere must stay for followers and a successor).
    pub async fn enforce_retention_below(
        &self,
        now_micros: u64,
        max_bytes: Option<u64>,
        max_age: Option<Duration>,
        floor: u64,
    ) -> Result<usize, StorageError> {
        let mut doomed = Vec::new();
        let cuts;
        {
            let mut st = self.shared.state.borrow_mut();
            if st.closing || st.closed {
                // Its files may be another owner's now (a shard re-pinned to another
                // core opens them once this log closed).
                return Err(StorageError::Closed);
            }
            if st.exclusive {
                return Err(StorageError::Busy);
            }
            let n = retention_doomed(&st, now_micros, max_bytes, max_age, floor);
            for _ in 0..n {
                let s = st.segments.pop_front().expect("doomed segments exist");
                st.retired_bytes += s.data_len;
                doomed.push(s);
            }
            cuts = st.cuts;
        }
        // Removals yield (they run on the core's blocking thread), and a shard moved to
        // another core opens these files once this log closed: a close waits until the
        // pass stops, and the pass stops at the next segment once a close began (the
        // next owner finds the rest and removes them itself). Otherwise the next owner
        // could list a segment this loop was still removing, and fail to open it.
        let _removing = Removing::start(self);
        let mut removed = 0;
        let mut failed = None;
        for s in &doomed {
            if self.shared.state.borrow().closing {
                break;
            }
            let name = segment_name(s.base);
            match self.shared.backend.remove(&name).await {
                // Gone already: removed all the same (put back, it would stop
                // retention on this log for good).
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    failed = Some(StorageError::io("retention remove", &name, e));
                    break;
                }
            }
            let _ = self.shared.backend.remove(&index_name(s.base)).await;
            removed += 1;
        }
        if removed < doomed.len() {
            // The segments not removed are still this log's, at its head: memory keeps
            // matching the files (the base moved back at the next open before). Unless
            // a cut or reset took the log meanwhile: its plan was made without them,
            // and putting them back under it would cut or keep the wrong segments
            // (left, the files are found again at the next open, as before).
            let mut st = self.shared.state.borrow_mut();
            if st.cuts == cuts && !st.exclusive && !st.closing && !st.closed {
                for s in doomed.drain(removed..).rev() {
                    st.retired_bytes -= s.data_len;
                    st.segments.push_front(s);
                }
            }
        }
        if removed > 0 {
            self.shared
                .backend
                .sync_dir()
                .await
                .map_err(|e| StorageError::io("retention sync_dir", "log directory", e))?;
            // Space freed: an earlier life's mark this one could not remove at its open.
            if self.shared.mark_left.get()
                && !self.shared.state.borrow().closing
                && mark_life(&self.shared.backend, false).await.is_ok()
            {
                self.shared.mark_left.set(false);
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(removed),
        }
    }

    /// [`SegmentLog::enforce_retention_below`] for a log whose newer records supersede
    /// older ones (cache values, stream state, a compaction's copies): everything
    /// appended is made durable first. Under `fsync: none` and `periodic` an append is
    /// answered before its write, and removing superseded records while what supersedes
    /// them is not on disk lets a crash take back both: a value written long ago would
    /// vanish instead of reverting to it. A sync that fails removes nothing.
    pub async fn remove_superseded_below(
        &self,
        now_micros: u64,
        max_bytes: Option<u64>,
        max_age: Option<Duration>,
        floor: u64,
    ) -> Result<usize, StorageError> {
        self.sync().await?;
        self.enforce_retention_below(now_micros, max_bytes, max_age, floor)
            .await
    }

    /// What [`SegmentLog::enforce_retention_below`] would remove now: the base the log
    /// would have after it, and the kinds of batch the removed segments may hold.
    pub fn retention_cut(
        &self,
        now_micros: u64,
        max_bytes: Option<u64>,
        max_age: Option<Duration>,
        floor: u64,
    ) -> (u64, KindSet) {
        let st = self.shared.state.borrow();
        let n = retention_doomed(&st, now_micros, max_bytes, max_age, floor);
        let kinds = st
            .segments
            .iter()
            .take(n)
            .fold(KindSet::default(), |k, s| k.union(s.kinds));
        let base = st.segments.get(n).map_or(st.next_offset, |s| s.base);
        (base, kinds)
    }

    /// Writes everything staged, fsyncs, writes the newest segment's index and stops
    /// the flusher. Later appends fail with `Closed`.
    pub async fn close(&self) -> Result<(), StorageError> {
        if self.shared.config.read_only {
            return Ok(());
        }
        {
            let mut st = self.shared.state.borrow_mut();
            st.closing = true;
            st.sync_requested = true;
            wake_flusher_now(&mut st);
        }
        // A metadata write in progress lands before the close returns (the next owner
        // reads it); later ones are refused (`write_meta`).
        drop(self.meta_turn().await);
        // A retention pass removing files stops at its next segment.
        self.no_removals().await;
        let tasks: Vec<_> = self.tasks.borrow_mut().drain(..).collect();
        for t in tasks {
            t.await;
        }
        let poisoned = self.shared.state.borrow().poisoned.clone();
        if let Some((op, detail)) = poisoned {
            return Err(StorageError::Poisoned { op, detail });
        }
        if self.shared.config.fsync != FsyncMode::OnCommit || self.shared.mark_left.get() {
            // Closing synced everything: the next open's recovery is strict again.
            // Best effort (a mark left behind only makes that recovery lenient).
            let _ = mark_life(&self.shared.backend, false).await;
        }
        let (base, bytes) = {
            let st = self.shared.state.borrow();
            let last = st.segments.back().expect("at least one segment");
            (
                last.base,
                last.index
                    .encode(last.base, last.kinds, Some(last.max_timestamp_micros)),
            )
        };
        // Past what a read takes back it is not written: rebuilt at each open.
        if bytes.len() as u64 <= crate::io::SMALL_FILE_MAX_BYTES {
            let _ = self
                .shared
                .backend
                .write_small(&index_name(base), &bytes)
                .await;
        }
        Ok(())
    }

    /// After [`SegmentLog::close`]: seals the newest segment (its index written) and
    /// starts an empty one, so the next open loads that index instead of scanning and
    /// checksumming the whole segment. Used when another core takes the shard over at
    /// once (a live re-pin). Nothing when the newest segment holds fewer than
    /// `min_bytes` (or no batch at all: creating a segment costs a few syncs, more than
    /// scanning a small one), or when the log is still open (sealing only speeds up the
    /// next open).
    pub async fn seal_active(&self, min_bytes: u64) -> Result<(), StorageError> {
        let (closed, next, written) = {
            let st = self.shared.state.borrow();
            let newest = st.segments.back().expect("at least one segment");
            (
                st.closed,
                st.next_offset,
                newest.end_offset > newest.base && st.append_pos >= min_bytes,
            )
        };
        if self.shared.config.read_only || !written || !closed {
            return Ok(());
        }
        roll(&self.shared, next).await.map_err(|f| match f {
            Failure::NoSpace(op, e) | Failure::Poison(op, e) => {
                StorageError::io(op, &segment_name(next), e)
            }
        })
    }
}

/// Why a waiter can stop waiting for progress: the log is poisoned or closed.
fn stopped<F>(st: &State<F>) -> Option<StorageError> {
    if let Some((op, detail)) = &st.poisoned {
        return Some(StorageError::Poisoned {
            op,
            detail: detail.clone(),
        });
    }
    st.closed.then_some(StorageError::Closed)
}

fn ack_end<F>(st: &State<F>, mode: FsyncMode) -> u64 {
    match mode {
        FsyncMode::OnCommit => st.durable_end,
        // Sequenced is acknowledged (step 4), within the staging bound.
        FsyncMode::None | FsyncMode::Periodic(_) => st.early_end.max(st.written_end),
    }
}

/// Has `waker` woken once the acknowledged end reaches `end`: once per task, however
/// often its future is polled meanwhile. Each poll added a clone: a task polled often
/// while a slow flush ran (a `zip` or `select` beside a busy branch) piled up clones
/// until glommio's count of its waker overflowed, a panic of the core.
fn wait_ack<F>(st: &mut State<F>, end: u64, waker: &Waker) {
    let waiting = st.ack_waiters.entry(end).or_default();
    if !waiting.iter().any(|w| w.will_wake(waker)) {
        waiting.push(waker.clone());
    }
}

fn wake_acked<F>(st: &mut State<F>, mode: FsyncMode) {
    let acked = ack_end(st, mode).max(st.durable_end);
    let later = st.ack_waiters.split_off(&(acked + 1));
    let ready = std::mem::replace(&mut st.ack_waiters, later);
    for w in ready.into_values().flatten() {
        w.wake();
    }
}

fn wake_all<F>(st: &mut State<F>) {
    for w in std::mem::take(&mut st.ack_waiters).into_values().flatten() {
        w.wake();
    }
    for w in std::mem::take(&mut st.sequencer.waiters).into_values() {
        w.wake();
    }
    if let Some(w) = st.idle_waiter.take() {
        w.wake();
    }
}

/// Refuses a new batch while the log cannot take one.
fn admit<F>(st: &State<F>) -> Result<(), StorageError> {
    if let Some(e) = poison_error(st) {
        return Err(e);
    }
    if st.closing || st.closed {
        return Err(StorageError::Closed);
    }
    if st.exclusive {
        return Err(StorageError::Busy);
    }
    Ok(())
}

fn poison_error<F>(st: &State<F>) -> Option<StorageError> {
    st.poisoned
        .as_ref()
        .map(|(op, detail)| StorageError::Poisoned {
            op,
            detail: detail.clone(),
        })
}

/// The last batch written to `segments`, newest segment first.
fn written_last_batch<F>(segments: &VecDeque<Segment<F>>) -> Option<(u64, BatchKind)> {
    segments.iter().rev().find_map(|s| s.last_batch)
}

async fn periodic_sync<B: Backend>(shared: std::rc::Weak<Shared<B>>, interval: Duration) {
    loop {
        glommio::timer::sleep(interval).await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let mut st = shared.state.borrow_mut();
        if st.closing || st.closed || st.poisoned.is_some() {
            return;
        }
        if st.written_end > st.durable_end {
            st.sync_requested = true;
            wake_flusher_now(&mut st);
        }
    }
}

/// Wakes the flusher, ending a write linger at once (a sync or a close asks for it).
fn wake_flusher_now<F>(st: &mut State<F>) {
    if let Some(w) = st.flusher.take() {
        w.wake();
    }
    if let Some((_, w)) = st.linger_kick.take() {
        w.wake();
    }
}

/// The flusher task: steps 2, 3 and 5 of the durability protocol.
async fn flusher<B: Backend>(shared: Rc<Shared<B>>) {
    let mut buf: Vec<u8> = Vec::new();
    loop {
        let holds_much = idle_buffer_bytes(&shared.state.borrow()) > IDLE_BUFFERS_KEEP;
        let go = if holds_much {
            let work = async { Some(next_work(&shared).await) };
            let idle = async {
                glommio::timer::sleep(IDLE_BUFFERS_RELEASE).await;
                None
            };
            match futures_lite::future::or(work, idle).await {
                Some(go) => go,
                None => {
                    buf = Vec::new();
                    let_go_buffers(&mut shared.state.borrow_mut());
                    next_work(&shared).await
                }
            }
        } else {
            next_work(&shared).await
        };
        if !go {
            let mut st = shared.state.borrow_mut();
            let_go_buffers(&mut st);
            st.closed = st.closing;
            wake_all(&mut st);
            return;
        }
        let linger = shared.config.write_linger;
        if shared.config.fsync.acks_before_write() && !linger.is_zero() && {
            let st = shared.state.borrow();
            !st.closing
                && !st.sync_requested
                && !st.exclusive
                && st.staged.iter().map(|c| c.bytes.len()).sum::<usize>() < LINGER_BYTES_MAX
                // Nobody waits for a write of what is appended (a reader of a record
                // not written yet): the linger saves device writes, it never delays
                // a reader. One who starts waiting during the linger ends it.
                && st
                    .ack_waiters
                    .first_key_value()
                    .is_none_or(|(&end, _)| end > st.next_offset)
        } {
            // The appends are acknowledged already (step 4): let more gather so one
            // write carries them. An append made after half the linger ends it, so a
            // steady one-at-a-time producer starts each write from its own wake-up
            // rather than the core waking once more for a timer; the timer is for the
            // last append before a pause.
            let from = Instant::now() + linger / 2;
            let mut armed = false;
            futures_lite::future::or(glommio::timer::sleep(linger), async {
                poll_fn(|cx| {
                    let mut st = shared.state.borrow_mut();
                    if armed && st.linger_kick.is_none() {
                        return Poll::Ready(());
                    }
                    armed = true;
                    st.linger_kick = Some((from, cx.waker().clone()));
                    Poll::Pending
                })
                .await;
            })
            .await;
            shared.state.borrow_mut().linger_kick = None;
        }
        let result = flush_round(&shared, &mut buf).await;
        let mut st = shared.state.borrow_mut();
        st.flushing = false;
        st.write_buf_bytes = buf.capacity();
        if let Some(w) = st.idle_waiter.take() {
            w.wake();
        }
        if let Err((op, e)) = result {
            let_go_buffers(&mut st);
            st.poisoned = Some((op, e.to_string()));
            wake_all(&mut st);
            st.closed = st.closing;
            return;
        }
        if st.closing && st.staged.is_empty() && !st.sync_requested {
            let_go_buffers(&mut st);
            st.closed = true;
            wake_all(&mut st);
            return;
        }
    }
}

/// The spare chunk buffers go, and the write buffer is counted gone (the flusher drops
/// its own): the log is idle, closed or poisoned.
fn let_go_buffers<F>(st: &mut State<F>) {
    st.spare = Vec::new();
    st.write_buf_bytes = 0;
}

/// Waits until the flusher has a round to write (`true`), or must stop (`false`).
async fn next_work<B: Backend>(shared: &Shared<B>) -> bool {
    poll_fn(|cx| {
        let mut st = shared.state.borrow_mut();
        if st.poisoned.is_some() {
            // Poisoned by a truncation (step 6b): nothing more is written.
            return Poll::Ready(false);
        }
        // A truncation or reset parks the flusher once what it staged is written.
        let parked = st.exclusive && st.staged.is_empty();
        if !parked && (!st.staged.is_empty() || st.sync_requested || st.closing) {
            st.flushing = true;
            Poll::Ready(true)
        } else {
            st.flusher = Some(cx.waker().clone());
            Poll::Pending
        }
    })
    .await
}

/// Why a flusher step failed, which decides what the log does about it.
enum Failure {
    /// Out of space or quota: roll back (step 5).
    NoSpace(&'static str, io::Error),
    /// Anything else: poison.
    Poison(&'static str, io::Error),
}

impl Failure {
    fn of(op: &'static str, e: io::Error) -> Failure {
        if is_no_space(&e) {
            Failure::NoSpace(op, e)
        } else {
            Failure::Poison(op, e)
        }
    }
}

/// ENOSPC or EDQUOT: the device or the quota is full, and freeing space will cure it.
fn is_no_space(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
}

/// How long a roll waits, in all, for a descriptor to create its next segment with,
/// before it poisons the log as any other failed step does.
const ROLL_DESCRIPTOR_WAIT: Duration = Duration::from_secs(10);
/// How often it tries again meanwhile.
const ROLL_DESCRIPTOR_RETRY: Duration = Duration::from_millis(10);

/// One round of steps 2 and 3. `Err` poisons the log; a full disk is handled here.
async fn flush_round<B: Backend>(
    shared: &Rc<Shared<B>>,
    buf: &mut Vec<u8>,
) -> Result<(), (&'static str, io::Error)> {
    let cfg = &shared.config;
    let (chunks, sync_requested) = {
        let mut st = shared.state.borrow_mut();
        st.stats.flush_rounds += 1;
        let chunks = take_round(&mut st.staged);
        let round_bytes: usize = chunks.iter().map(|c| c.bytes.len()).sum();
        st.stats.largest_round_bytes = st.stats.largest_round_bytes.max(round_bytes as u64);
        // Close asks for a sync of everything, which may take several rounds.
        let sync_requested = std::mem::take(&mut st.sync_requested) || st.closing;
        (chunks, sync_requested)
    };
    let mut batches_written = 0u64;
    let mut rolled_back = false;
    let writing = std::time::Instant::now();
    let mut chunks = chunks.into_iter();
    while let Some(chunk) = chunks.next() {
        let result = write_chunk(shared, buf, &chunk).await;
        let mut st = shared.state.borrow_mut();
        recycle(&mut st, chunk);
        match result {
            Ok(batches) => batches_written += batches,
            Err(Failure::Poison(op, e)) => return Err((op, e)),
            // Everything staged was acknowledged when it was sequenced (step 4): giving
            // its offsets back would let other records take offsets readers have seen.
            Err(Failure::NoSpace(op, e)) if cfg.fsync.acks_before_write() => {
                return Err((op, e));
            }
            Err(Failure::NoSpace(op, e)) => {
                for rest in chunks.by_ref() {
                    recycle(&mut st, rest);
                }
                roll_back(&mut st, op, &e);
                rolled_back = true;
            }
        }
    }
    let (need_sync, file, target) = {
        let mut st = shared.state.borrow_mut();
        if batches_written > 0 {
            st.device_latency.write.observe(writing.elapsed());
        }
        let want = cfg.fsync == FsyncMode::OnCommit || sync_requested;
        let last = st.segments.back().expect("at least one segment");
        (
            want && st.written_end > st.durable_end,
            last.file.clone(),
            st.written_end,
        )
    };
    if need_sync {
        // The mutant skips the group commit's fdatasync; one asked for still runs.
        let skip = cfg.unsafe_skip_fdatasync && !sync_requested;
        let syncing = std::time::Instant::now();
        if !skip {
            file.sync_data().await.map_err(|e| ("fsync", e))?;
        }
        let mut st = shared.state.borrow_mut();
        if !skip {
            st.device_latency.sync.observe(syncing.elapsed());
            st.dsync_ready =
                cfg.dsync_writes && cfg.fsync == FsyncMode::OnCommit && !cfg.unsafe_skip_fdatasync;
        }
        st.durable_end = target;
        st.stats.syncs += u64::from(!skip);
        st.stats.synced_batches += batches_written;
        wake_acked(&mut st, cfg.fsync);
    } else if sync_requested {
        let mut st = shared.state.borrow_mut();
        wake_acked(&mut st, cfg.fsync);
    }
    // Not after a rollback: the space just freed is for the data retried next.
    if !rolled_back {
        zero_ahead(shared).await?;
    }
    Ok(())
}

/// Zeros one call writes at most: an append staged meanwhile waits for them.
const ZERO_AHEAD_CHUNK: u64 = 64 * 1024;

/// Where one step of zeros ahead that starts at `from` ends: [`ZERO_AHEAD_CHUNK`] at
/// most (less when the setting is smaller), block-aligned, within the segment's size.
fn zeros_to<B: Backend>(shared: &Shared<B>, from: u64) -> u64 {
    let step = shared.config.zero_ahead_bytes.min(ZERO_AHEAD_CHUNK);
    format::align_down(from + step).min(format::align_up(shared.config.segment_bytes_max))
}

/// Writes zeros past the newest segment's data, [`ZERO_AHEAD_CHUNK`] at most, when less
/// than half of [`LogConfig::zero_ahead_bytes`] is left (see there), and only when
/// nothing is staged: a write of data never waits for zeros it does not need yet. They
/// are written inside a flush round (`flushing` set), which a truncation or reset waits
/// out, and at or past the block after the data, which only the flusher extends: zeros
/// never land on data. A full disk is not the log's failure here (the zeros carry
/// nothing): the segment grows as it would without them, and no more are written to it
/// (counted). Any other failed write poisons, as a failed write of data does: the
/// device is failing, and a fault injected for a write must not be spent silently.
async fn zero_ahead<B: Backend>(shared: &Rc<Shared<B>>) -> Result<(), (&'static str, io::Error)> {
    let step = shared.config.zero_ahead_bytes;
    if step == 0 {
        return Ok(());
    }
    let (file, from, to) = {
        let st = shared.state.borrow();
        if st.closing || st.exclusive || st.poisoned.is_some() || !st.staged.is_empty() {
            return Ok(());
        }
        let seg = st.segments.back().expect("at least one segment");
        let data_end = format::align_up(seg.data_len);
        let from = seg.zeroed_to.max(data_end);
        let cap = format::align_up(shared.config.segment_bytes_max);
        if from - data_end >= step / 2 || from >= cap {
            return Ok(());
        }
        let to = zeros_to(shared, from).max(from + BLOCK_BYTES as u64);
        (seg.file.clone(), from, to)
    };
    let zeros = vec![0u8; (to - from) as usize];
    let written = file.write_at(&zeros, from).await;
    let mut st = shared.state.borrow_mut();
    let Some(seg) = st
        .segments
        .back_mut()
        .filter(|s| Rc::ptr_eq(&s.file, &file))
    else {
        return Ok(());
    };
    match written {
        Ok(()) => {
            seg.zeroed_to = seg.zeroed_to.max(to);
            st.stats.zero_ahead_bytes += to - from;
            Ok(())
        }
        Err(e) if is_no_space(&e) => {
            seg.zeroed_to = u64::MAX;
            st.stats.zero_ahead_failures += 1;
            Ok(())
        }
        Err(e) => Err(("write zeros ahead", e)),
    }
}

/// Step 2: takes the chunks of one round from the front of `staged`, the first always and
/// each next one while the round stays within [`format::ROUND_BYTES_MAX`].
fn take_round(staged: &mut VecDeque<Chunk>) -> VecDeque<Chunk> {
    let mut bytes = 0;
    let n = staged
        .iter()
        .enumerate()
        .take_while(|(i, c)| {
            bytes += c.bytes.len();
            *i == 0 || bytes <= format::ROUND_BYTES_MAX
        })
        .count();
    let rest = staged.split_off(n);
    std::mem::replace(staged, rest)
}

/// Step 2 for one chunk: rolls if it opens a segment, then writes it. Returns the
/// batches written.
async fn write_chunk<B: Backend>(
    shared: &Rc<Shared<B>>,
    buf: &mut Vec<u8>,
    chunk: &Chunk,
) -> Result<u64, Failure> {
    if chunk.opens_segment {
        roll(shared, chunk.segment_base).await?;
    }
    // Rewrite the last partial block with the new bytes behind it.
    let (file, write_pos, valid_len, zeroed_to, durable) = {
        let st = shared.state.borrow();
        let seg = st.segments.back().expect("at least one segment");
        debug_assert_eq!(seg.base, chunk.segment_base);
        buf.clear();
        // Grown to what this write needs, not doubled past it (the buffer stays).
        let need = format::align_up((seg.tail_block.len() + chunk.bytes.len()) as u64) as usize;
        buf.reserve_exact(need);
        buf.extend_from_slice(&seg.tail_block);
        (
            seg.file.clone(),
            format::align_down(seg.data_len),
            seg.data_len,
            seg.zeroed_to,
            st.dsync_ready,
        )
    };
    buf.extend_from_slice(&chunk.bytes);
    let data_end = buf.len();
    buf.resize(format::align_up(data_end as u64) as usize, 0);
    let data_blocks = buf.len();
    // A write that grows the file past the zeros written ahead takes the next zeros
    // with it: under a load that always has appends staged, `zero_ahead` never gets a
    // turn, and every round would grow the file. The zeros follow the data in the same
    // write, at the block after it, where `zero_ahead` would put them.
    let data_to = write_pos + data_blocks as u64;
    if shared.config.zero_ahead_bytes > 0 && zeroed_to != u64::MAX && data_to > zeroed_to {
        let to = zeros_to(shared, data_to);
        if to > data_to {
            buf.reserve_exact((to - write_pos) as usize - buf.len());
            buf.resize((to - write_pos) as usize, 0);
        }
    }
    let mut written = write_data(&*file, buf, write_pos, durable).await;
    if buf.len() > data_blocks && written.as_ref().is_err_and(is_no_space) {
        // No room for the zeros: none more for this segment, and the data is written
        // alone (whatever of the longer write landed was these same bytes and zeros).
        buf.truncate(data_blocks);
        {
            let mut st = shared.state.borrow_mut();
            st.stats.zero_ahead_failures += 1;
            if let Some(seg) = st.segments.back_mut() {
                seg.zeroed_to = u64::MAX;
            }
        }
        written = write_data(&*file, buf, write_pos, durable).await;
    }
    if let Err(e) = written {
        // A durable write that fails is classified as a write: out of space (whether
        // the allocation or the sync at its end refused, and whatever of it landed),
        // the rollback below cuts the file back, restores the block holding the valid
        // end and fdatasyncs that, so nothing refused stays; any other errno poisons,
        // as a failed fdatasync does.
        if !is_no_space(&e) {
            return Err(Failure::Poison(
                if durable { "durable write" } else { "write" },
                e,
            ));
        }
        if shared.config.fsync.acks_before_write() {
            // The log poisons (step 5 does not apply): what landed was acknowledged, and
            // recovery keeps whatever of it is whole, as after a crash.
            return Err(Failure::NoSpace("write", e));
        }
        // Step 5a: blocks that landed past the valid end would sit behind the shorter
        // batch that reuses these offsets, and recovery would call that interior damage.
        cut_back(&*file, valid_len)
            .await
            .map_err(|e| Failure::Poison("truncate after a no-space write", e))?;
        // Zeros written ahead went with the cut; a segment that found no room for
        // zeros gets none again.
        if let Some(seg) = shared.state.borrow_mut().segments.back_mut()
            && seg.zeroed_to != u64::MAX
        {
            seg.zeroed_to = 0;
        }
        // A short write (the kernel wrote the first blocks, the retry of the rest found
        // no space) may have landed the block holding the valid end with whole batches
        // of this chunk in it: they are refused, so they must not come back after a
        // crash. That block is allocated already, so putting it back as it was needs no
        // space; the sync makes the put-back and the cut outlast a power cut too.
        let tail = (valid_len - write_pos) as usize;
        if tail > 0 {
            buf.truncate(tail);
            buf.resize(format::align_up(tail as u64) as usize, 0);
            file.overwrite_at(buf, write_pos)
                .await
                .map_err(|e| Failure::Poison("restore after a no-space write", e))?;
        }
        file.sync_data()
            .await
            .map_err(|e| Failure::Poison("fsync after a no-space write", e))?;
        return Err(Failure::NoSpace("write", e));
    }
    let mut st = shared.state.borrow_mut();
    let seg = st.segments.back_mut().expect("at least one segment");
    seg.data_len = write_pos + data_end as u64;
    seg.end_offset = chunk.end_offset;
    seg.last_batch = chunk.last_batch.or(seg.last_batch);
    seg.kinds = seg.kinds.union(chunk.kinds);
    seg.max_timestamp_micros = seg.max_timestamp_micros.max(chunk.max_timestamp_micros);
    for &(o, p) in &chunk.index {
        seg.index.observe(o, p, 0);
    }
    let tail_start = format::align_down(data_end as u64) as usize;
    seg.tail_block.clear();
    seg.tail_block.extend_from_slice(&buf[tail_start..data_end]);
    let zeros = (buf.len() - data_blocks) as u64;
    if zeros > 0 {
        seg.zeroed_to = seg.zeroed_to.max(write_pos + buf.len() as u64);
    }
    if durable && st.durable_end == st.written_end {
        // Everything below was durable, and the write made its own bytes so (step 3).
        st.durable_end = chunk.end_offset;
        st.stats.syncs += 1;
        st.stats.dsync_writes += 1;
        st.stats.synced_batches += chunk.batches;
    }
    st.written_end = chunk.end_offset;
    st.stats.bytes_written += data_blocks as u64;
    st.stats.zero_ahead_bytes += zeros;
    wake_acked(&mut st, shared.config.fsync);
    Ok(chunk.batches)
}

/// Writes a round's data: durably (step 3, [`LogConfig::dsync_writes`]) or not.
async fn write_data<F: SegmentFile>(
    file: &F,
    data: &[u8],
    pos: u64,
    durable: bool,
) -> io::Result<()> {
    if durable {
        file.write_durable_at(data, pos).await
    } else {
        file.write_at(data, pos).await
    }
}

/// Keeps a chunk's buffer for reuse by `begin_append`, within [`SPARE_BYTES_MAX`].
fn recycle<F>(st: &mut State<F>, mut chunk: Chunk) {
    let kept = st.spare.iter().map(Vec::capacity).sum::<usize>();
    if st.spare.len() < 4 && kept + chunk.bytes.capacity() <= SPARE_BYTES_MAX {
        chunk.bytes.clear();
        st.spare.push(chunk.bytes);
    }
}

/// Buffer capacity held for the next appends and writes, not in use.
fn idle_buffer_bytes<F>(st: &State<F>) -> usize {
    st.spare.iter().map(Vec::capacity).sum::<usize>() + st.write_buf_bytes
}

/// Cuts a file whose write failed back to the block holding its valid end, if the write
/// grew it (step 5a).
async fn cut_back<F: SegmentFile>(file: &F, valid_len: u64) -> io::Result<()> {
    let keep = format::align_up(valid_len);
    if file.size().await? > keep {
        file.truncate(keep).await?;
    }
    Ok(())
}

/// Steps 5b to 5d, after cleanup: fails every batch not yet written, gives their offsets
/// back and ends the era.
fn roll_back<F>(st: &mut State<F>, op: &'static str, e: &io::Error) {
    let point = st.written_end;
    let (base, data_len, last_indexed) = {
        let seg = st.segments.back().expect("at least one segment");
        debug_assert_eq!(seg.end_offset, point, "writing ends in the newest segment");
        (seg.base, seg.data_len, seg.index.last().map(|(_, p)| p))
    };
    for chunk in std::mem::take(&mut st.staged) {
        recycle(st, chunk);
    }
    st.next_offset = point;
    st.append_base = base;
    st.append_pos = data_len;
    st.append_last_indexed = last_indexed;
    st.last_batch = written_last_batch(&st.segments);
    st.stats.no_space_rollbacks += 1;
    let cause = RollbackCause::NoSpace {
        op,
        detail: e.to_string(),
    };
    end_era(st, point, cause);
}

/// How many of the oldest segments retention removes: whole sealed segments ending at or
/// below `floor`, while the log is over `max_bytes` or the segment's newest record is
/// older than `max_age`.
fn retention_doomed<F>(
    st: &State<F>,
    now_micros: u64,
    max_bytes: Option<u64>,
    max_age: Option<Duration>,
    floor: u64,
) -> usize {
    let mut total: u64 = st.segments.iter().map(|s| s.data_len).sum();
    let mut n = 0;
    while st.segments.len() > n + 1 {
        let front = &st.segments[n];
        if front.end_offset > floor {
            break;
        }
        let too_big = max_bytes.is_some_and(|max| total > max);
        let too_old = max_age.is_some_and(|age| {
            front
                .max_timestamp_micros
                .saturating_add(age.as_micros().min(u128::from(u64::MAX)) as u64)
                < now_micros
        });
        if !(too_big || too_old) {
            break;
        }
        total -= front.data_len;
        n += 1;
    }
    n
}

/// Ends the era at `point` (steps 5d and 6c): batches at or past it were given back.
fn end_era<F>(st: &mut State<F>, point: u64, cause: RollbackCause) {
    let next_era = Rc::new(Era {
        number: st.era.number + 1,
        ended: OnceCell::new(),
    });
    let ended = std::mem::replace(&mut st.era, next_era.clone());
    ended
        .ended
        .set(Rollback {
            point,
            cause,
            next: next_era,
        })
        .expect("an era ends once: the current era has not ended");
    // Turns at or past the point were taken by batches that no longer exist; the next
    // era's batches take them again.
    drop(st.sequencer.resolved.split_off(&point));
    st.sequencer.next = st.sequencer.next.min(point);
    st.early_end = st.early_end.min(point);
    wake_all(st);
}

/// Seals the newest segment (fdatasync, index file) and creates the next one with a
/// durable header and directory entry before anything is written into it. Out of space
/// while creating it, the half-made file is removed (step 5a).
async fn roll<B: Backend>(shared: &Rc<Shared<B>>, new_base: u64) -> Result<(), Failure> {
    let (old_file, old_base, old_index, old_end, data_end) = {
        let st = shared.state.borrow();
        let s = st.segments.back().expect("at least one segment");
        let data_end = format::align_up(s.data_len);
        (
            s.file.clone(),
            s.base,
            s.index
                .encode(s.base, s.kinds, Some(s.max_timestamp_micros)),
            s.end_offset,
            data_end,
        )
    };
    // A sealed segment ends with its data: zeros written ahead of it (this life or one
    // before a restart) are cut off, before the fdatasync below, and the rest of its
    // reservation goes with them (a truncation to the size it has gives back blocks
    // reserved past it: skipped when no zeros lengthened the file, a segment sealed
    // early kept its whole reservation until retention removed it, until 2026-12-08).
    // Best effort: a segment with zeros after its data is valid (recovery reads them as
    // its end), only longer.
    if (shared.config.zero_ahead_bytes > 0 || shared.config.preallocate)
        && old_file.size().await.is_ok_and(|size| size >= data_end)
        && old_file.truncate(data_end).await.is_ok()
        && let Some(seg) = shared.state.borrow_mut().segments.back_mut()
    {
        seg.zeroed_to = 0;
    }
    // It covers written data: a failure poisons, whatever the errno.
    old_file
        .sync_data()
        .await
        .map_err(|e| Failure::Poison("fsync", e))?;
    old_file.sealed();
    {
        let mut st = shared.state.borrow_mut();
        st.durable_end = st.durable_end.max(old_end);
        st.stats.syncs += 1;
        // What the sealed segment holds is acknowledged now, not after the new segment
        // exists (which may wait for a descriptor, below).
        wake_acked(&mut st, shared.config.fsync);
    }
    // Derived: a lost or torn index is rebuilt at open, so it is not fsynced (nor
    // written past what a read takes back).
    if old_index.len() as u64 <= crate::io::SMALL_FILE_MAX_BYTES {
        let _ = shared
            .backend
            .write_small(&index_name(old_base), &old_index)
            .await;
    }
    let give_up = Instant::now() + ROLL_DESCRIPTOR_WAIT;
    let segment = match loop {
        match create_segment(&shared.backend, &shared.config, new_base).await {
            // Out of descriptors: a shortage that passes (another shard closing, a
            // client going away). The log's writes wait for one, up to a bound, rather
            // than poison it; creating the segment again starts it over (the file is
            // opened with create and truncated).
            Err((_, e)) if is_out_of_descriptors(&e) && Instant::now() < give_up => {
                glommio::timer::sleep(ROLL_DESCRIPTOR_RETRY).await;
                shared.state.borrow_mut().stats.roll_descriptor_waits += 1;
            }
            other => break other,
        }
    } {
        Ok(segment) => segment,
        Err((op, e)) => {
            let failure = Failure::of(op, e);
            if matches!(failure, Failure::NoSpace(..)) {
                // Left behind, a segment with a header would break the offset chain
                // once the old segment grows past its base.
                discard_segment(&shared.backend, new_base)
                    .await
                    .map_err(|e| Failure::Poison("remove a half-made segment", e))?;
            }
            return Err(failure);
        }
    };
    let mut st = shared.state.borrow_mut();
    st.segments.push_back(segment);
    st.stats.rolls += 1;
    Ok(())
}

/// Removes the segment file at `base`, if there is one, durably.
async fn discard_segment<B: Backend>(backend: &B, base: u64) -> io::Result<()> {
    match backend.remove(&segment_name(base)).await {
        Ok(()) => backend.sync_dir().await,
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Creates the segment at `base`: an empty file, its space reserved, a durable header
/// and a durable directory entry. `Err` names the step that failed.
async fn create_segment<B: Backend>(
    backend: &B,
    config: &LogConfig,
    base: u64,
) -> Result<Segment<B::File>, (&'static str, io::Error)> {
    let name = segment_name(base);
    let step = |op| move |e| (op, e);
    let file = backend
        .open(&name, true)
        .await
        .map_err(step("create segment"))?;
    file.truncate(0)
        .await
        .map_err(step("truncate new segment"))?;
    if config.preallocate {
        file.allocate(config.segment_bytes_max)
            .await
            .map_err(step("fallocate new segment"))?;
    }
    let header = SegmentHeader {
        base_offset: base,
        created_at_micros: now_micros(),
    }
    .encode();
    file.write_at(&header, 0)
        .await
        .map_err(step("write segment header"))?;
    file.sync_data()
        .await
        .map_err(step("fsync segment header"))?;
    backend.sync_dir().await.map_err(step("fsync directory"))?;
    Ok(Segment {
        name,
        base,
        end_offset: base,
        data_len: SEGMENT_HEADER_BYTES as u64,
        file: Rc::new(file),
        index: SparseIndex::default(),
        max_timestamp_micros: 0,
        tail_block: Vec::new(),
        last_batch: None,
        kinds: KindSet::default(),
        zeroed_to: 0,
    })
}

const _: () = assert!(SEGMENT_HEADER_BYTES.is_multiple_of(BLOCK_BYTES));
