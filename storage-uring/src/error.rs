//! Storage errors. Corruption names the broken invariant and where it was found.

use std::io;

use crate::format::FormatError;

/// What is wrong with a segment.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CorruptionKind {
    /// A header or batch does not decode.
    #[error(transparent)]
    Format(#[from] FormatError),
    /// A batch does not start where the previous one ended.
    #[error("offset gap: expected offset {expected}, found {found}")]
    OffsetGap {
        /// What contiguity requires.
        expected: u64,
        /// What is there.
        found: u64,
    },
    /// The header's base offset disagrees with the file name.
    #[error("segment header says base offset {header}, file name says {name}")]
    BaseMismatch {
        /// From the file name.
        name: u64,
        /// From the header.
        header: u64,
    },
    /// Damage followed by more data: not a torn tail, so it cannot be repaired.
    #[error("damaged data is followed by non-zero bytes at byte {next_data}: interior damage")]
    Interior {
        /// Where the later data is.
        next_data: u64,
        /// The damage itself.
        cause: FormatError,
    },
    /// The intent file of an interrupted truncation or reset does not decode, or names
    /// an offset the log cannot be cut at.
    #[error("log intent file is unusable: {reason}")]
    Intent {
        /// What is wrong with it.
        reason: &'static str,
    },
}

/// Where corruption was found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("corrupt segment {segment} at byte {position}{}: {kind}", offset.map(|o| format!(" (offset {o})")).unwrap_or_default())]
pub struct Corruption {
    /// Segment file name.
    pub segment: String,
    /// Byte position in the file.
    pub position: u64,
    /// The log offset expected there, when known.
    pub offset: Option<u64>,
    /// What is wrong.
    pub kind: CorruptionKind,
}

/// Everything the log can refuse or fail with.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// An I/O call failed.
    #[error("I/O error during {op} on {file}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file.
        file: String,
        /// The OS error.
        source: io::Error,
    },
    /// An earlier write or fsync failed; nothing is acknowledged until restart and
    /// recovery.
    #[error("log is poisoned by a failed {op} ({detail}); restart to recover")]
    Poisoned {
        /// write or fsync.
        op: &'static str,
        /// The original error.
        detail: String,
    },
    /// The device ran out of space (ENOSPC) or quota (EDQUOT) before this batch was
    /// written. The batch is not acknowledged and its offsets are reused; the log takes
    /// writes again once space is freed.
    #[error("no space left on device during {op}: {detail}")]
    NoSpace {
        /// The step that failed: a data write or a step of creating a segment.
        op: &'static str,
        /// The original error.
        detail: String,
    },
    /// The data directory is damaged where repair would lose acknowledged records.
    #[error(transparent)]
    Corrupt(#[from] Corruption),
    /// A file in the data directory that this log did not write.
    #[error("foreign file {name} in the log directory: {reason}")]
    ForeignFile {
        /// Its name.
        name: String,
        /// Why it is not ours.
        reason: &'static str,
    },
    /// Read below the oldest retained offset.
    #[error("offset {requested} was removed by retention; the oldest retained offset is {oldest}")]
    Trimmed {
        /// What was asked.
        requested: u64,
        /// Oldest retained.
        oldest: u64,
    },
    /// An append with no records.
    #[error("an append needs at least one record")]
    EmptyBatch,
    /// An append larger than one batch may be.
    #[error("batch body of {bytes} bytes exceeds the {max}-byte limit")]
    BatchTooLarge {
        /// Size.
        bytes: usize,
        /// Limit.
        max: usize,
    },
    /// The log was closed.
    #[error("log is closed")]
    Closed,
    /// `begin_append_at` named an offset other than the next one.
    #[error("append at offset {found} refused: the log's next offset is {expected}")]
    NotAtTail {
        /// The log's next offset.
        expected: u64,
        /// The offset asked for.
        found: u64,
    },
    /// An offset outside what the operation accepts.
    #[error("offset {offset} is outside [{low}, {high}]")]
    OutOfRange {
        /// The offset asked for.
        offset: u64,
        /// Lowest accepted.
        low: u64,
        /// Highest accepted.
        high: u64,
    },
    /// A truncation point inside a batch: batches are cut whole or not at all.
    #[error("offset {offset} is not the first offset of a batch")]
    NotBatchBoundary {
        /// The offset asked for.
        offset: u64,
    },
    /// A truncation or reset holds the log: appends, retention and other truncations
    /// are refused until it returns.
    #[error("a truncation or reset of the log is in progress")]
    Busy,
    /// `reset_empty_at` on a log that holds records.
    #[error("the log holds records [{base_offset}, {next_offset}): only an empty log is reset")]
    NotEmpty {
        /// Oldest retained offset.
        base_offset: u64,
        /// Next offset.
        next_offset: u64,
    },
    /// A truncation removed this batch's records before its commit was awaited.
    #[error("the batch was removed by a truncation from offset {from}")]
    RemovedByTruncation {
        /// Where the truncation cut.
        from: u64,
    },
    /// A batch whose shape its kind forbids.
    #[error("invalid batch: {0}")]
    InvalidBatch(&'static str),
    /// A metadata file name the log refuses.
    #[error("metadata file name {name:?} refused: {reason}")]
    BadMetaName {
        /// The name.
        name: String,
        /// Why.
        reason: &'static str,
    },
    /// Configuration that cannot work.
    #[error("invalid log configuration: {0}")]
    Config(String),
    /// Locked-memory limit too low for io_uring buffers.
    #[error(
        "locked-memory limit is {current} bytes but {needed} are needed for io_uring buffers, \
         and it cannot be raised here: run `ulimit -l {needed_kib}` (KiB) or higher, or grant CAP_IPC_LOCK"
    )]
    Memlock {
        /// Current soft limit.
        current: u64,
        /// Needed.
        needed: u64,
        /// Needed, in KiB as `ulimit -l` takes it.
        needed_kib: u64,
    },
}

impl StorageError {
    pub(crate) fn io(op: &'static str, file: &str, source: io::Error) -> StorageError {
        StorageError::Io {
            op,
            file: file.to_owned(),
            source,
        }
    }
}
