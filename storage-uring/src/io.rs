//! All file I/O goes through [`Backend`] and [`SegmentFile`], so the same log and the
//! same tests run on the io_uring O_DIRECT backend ([`dma::DmaBackend`]) and on an
//! in-memory backend that can be told to fail, tear or lose writes
//! ([`memory::MemBackend`]). The real backend can be handed a [`faults::StorageFaults`]
//! seam so that a running process can be shown a full disk or a failing fdatasync.
//!
//! Writes are whole blocks: `pos` and `data.len()` are multiples of
//! [`crate::format::BLOCK_BYTES`], as O_DIRECT requires; the memory backend checks this
//! so a misaligned write is caught in tests, not on a customer's disk. Backends are
//! single-core (`!Send`): one log lives on one executor.

use std::io;

use bytes::Bytes;

pub mod dma;
pub mod faults;
pub mod memory;

/// EMFILE or ENFILE: the process or the system is out of file descriptors — a shortage
/// that passes, which says nothing about the disk.
pub fn is_out_of_descriptors(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// The largest small file (index, metadata, snapshot, intent) read whole. Above any
/// the log writes (an index of a 256 MiB segment is about 1 MiB, of the broker's
/// largest, 64 GiB, about 256 MiB; the log writes no index past this bound, and the
/// broker's snapshots are bounded at a few hundred KiB), far below a size that takes
/// the process down: a file larger is damage. Its size was allocated before reading,
/// so a sparse terabyte-long index (filesystem damage, a stray writer) aborted the
/// broker at every open of its shard (until 2026-12-08).
pub const SMALL_FILE_MAX_BYTES: u64 = 1 << 30;

/// The refusal of a small file larger than [`SMALL_FILE_MAX_BYTES`].
pub(crate) fn too_large(name: &str, size: u64) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("{name}: {size} bytes, more than a small file's {SMALL_FILE_MAX_BYTES}"),
    )
}

/// A directory holding one log's files.
#[allow(async_fn_in_trait)]
pub trait Backend: Clone + 'static {
    /// An open file.
    type File: SegmentFile;

    /// Opens `name`, creating it (empty) when `create` is set and it does not exist.
    async fn open(&self, name: &str, create: bool) -> io::Result<Self::File>;
    /// File names in the directory.
    async fn list(&self) -> io::Result<Vec<String>>;
    /// Removes a file.
    async fn remove(&self, name: &str) -> io::Result<()>;
    /// Makes creations and removals in the directory durable.
    async fn sync_dir(&self) -> io::Result<()>;
    /// Writes a small whole file with ordinary buffered I/O (indexes: derived, never
    /// fsynced).
    async fn write_small(&self, name: &str, data: &[u8]) -> io::Result<()>;
    /// Reads a small whole file; `Ok(None)` when it does not exist. One larger than
    /// [`SMALL_FILE_MAX_BYTES`] is refused (`InvalidData`), not read.
    async fn read_small(&self, name: &str) -> io::Result<Option<Vec<u8>>>;
    /// Creates or empties `name`, writes exactly `data` with ordinary buffered I/O and
    /// fdatasyncs it (metadata and intent files). Its directory entry is durable only
    /// after [`Backend::sync_dir`].
    async fn write_synced(&self, name: &str, data: &[u8]) -> io::Result<()>;
    /// Atomically replaces `to` with `from` (rename(2)): a reader sees the old `to` or
    /// the new one. Durable only after [`Backend::sync_dir`].
    async fn rename(&self, from: &str, to: &str) -> io::Result<()>;
}

/// One open file.
#[allow(async_fn_in_trait)]
pub trait SegmentFile: 'static {
    /// Writes all of `data` at `pos`. Both are block-aligned.
    async fn write_at(&self, data: &[u8], pos: u64) -> io::Result<()>;
    /// Writes all of `data` at `pos` and returns once those bytes are durable, as a
    /// write followed by [`SegmentFile::sync_data`] would, in one request (O_DSYNC):
    /// the range written and the size needed to read it, nothing else.
    /// Writes this one did not make are not promised durable by it. Block-aligned.
    async fn write_durable_at(&self, data: &[u8], pos: u64) -> io::Result<()>;
    /// Writes all of `data` at `pos` over blocks the file already holds: nothing is
    /// allocated, so a full disk cannot refuse it, and fault seams that model a full
    /// disk let it through. Both are block-aligned.
    async fn overwrite_at(&self, data: &[u8], pos: u64) -> io::Result<()>;
    /// Reads up to `len` bytes at `pos` (fewer at end of file). Any alignment.
    async fn read_at(&self, pos: u64, len: usize) -> io::Result<Bytes>;
    /// Makes every completed write durable (fdatasync).
    async fn sync_data(&self) -> io::Result<()>;
    /// The log sealed this file: it is not written again unless that roll fails, so a
    /// backend may let go of what it keeps for writes (and take it again if needed).
    fn sealed(&self) {}
    /// Current size.
    async fn size(&self) -> io::Result<u64>;
    /// Reserves space up to `len` without changing the size (fallocate KEEP_SIZE).
    async fn allocate(&self, len: u64) -> io::Result<()>;
    /// Sets the size.
    async fn truncate(&self, len: u64) -> io::Result<()>;
}
