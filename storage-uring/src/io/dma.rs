//! The io_uring O_DIRECT backend, on glommio's DMA files.
//!
//! Traps handled here (see `../shared/reference/platform-notes.md`):
//! - glommio probes the first DMA file it opens on a device for IOPOLL support by reading
//!   offset 0; an empty file makes it wrongly enable polling and every later O_DIRECT
//!   read fails. [`DmaBackend::open_dir`] therefore opens a non-empty probe file first.
//! - `DmaFile::create` opens write-only; we always open read-write.
//! - short writes are retried until the whole buffer is written.
//! - glommio wraps OS errors with context; `to_io` hands back the OS error itself so the
//!   log can tell a full disk (ENOSPC, EDQUOT) from a failing one by its errno.
//!
//! A backend opened with [`DmaBackend::open_dir_with_faults`] consults its
//! [`StorageFaults`] before every data write, fallocate and fdatasync of a segment file.
//!
//! Every write copies the caller's bytes into a buffer from glommio's registered
//! allocator (aligned, pooled by the executor) and moves it into the write.
//!
//! Durable writes ([`SegmentFile::write_durable_at`]) go through a second descriptor of
//! the same file opened with O_DSYNC on first use (glommio's writes take no per-call
//! RWF_DSYNC): the kernel ends each such write with the sync fdatasync would make, so
//! the completion means durable and the core is woken once, not twice. Both
//! descriptors are O_DIRECT, so neither has a page cache to get out of step with.

use std::cell::RefCell;
use std::io;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;

use bytes::Bytes;
use glommio::io::{BufferedFile, DmaFile, OpenOptions};

use super::faults::StorageFaults;
use super::{Backend, SegmentFile};
use crate::format::BLOCK_BYTES;

const PROBE_FILE: &str = ".felix-dma-probe";

/// A directory on a real file system, accessed with O_DIRECT through io_uring.
#[derive(Debug, Clone)]
pub struct DmaBackend {
    dir: Rc<PathBuf>,
    faults: Option<Arc<StorageFaults>>,
}

/// An open O_DIRECT file.
#[derive(Debug)]
pub struct DmaSegmentFile {
    file: DmaFile,
    path: PathBuf,
    /// The same file opened with O_DSYNC, for durable writes; opened on first use.
    dsync: RefCell<Option<Rc<DmaFile>>>,
    faults: Option<Arc<StorageFaults>>,
}

/// The OS error behind a glommio error, errno intact (the caller names the operation and
/// file); anything else as an `Other` error with glommio's description.
fn to_io(e: glommio::GlommioError<()>) -> io::Error {
    match e {
        glommio::GlommioError::IoError(e) => e,
        glommio::GlommioError::EnhancedIoError { source, .. } => source,
        other => io::Error::other(other.to_string()),
    }
}

impl DmaBackend {
    /// Opens (creating) a log directory. Must run on a glommio executor.
    pub async fn open_dir(dir: impl AsRef<Path>) -> io::Result<DmaBackend> {
        Self::open_dir_with_faults(dir, None).await
    }

    /// [`DmaBackend::open_dir`], with `faults` consulted before this open and every data
    /// write, fallocate and fdatasync of a segment file (`None`: no faults, as
    /// `open_dir`).
    pub async fn open_dir_with_faults(
        dir: impl AsRef<Path>,
        faults: Option<Arc<StorageFaults>>,
    ) -> io::Result<DmaBackend> {
        if let Some(f) = &faults {
            f.check_open()?;
        }
        // glommio opens directories by absolute path only (a relative one fails with
        // EBADF when the directory is synced).
        let dir = std::path::absolute(dir.as_ref())?;
        // Blocking calls (directories made and their parents fsynced): on the
        // executor's blocking thread, so a shard created at run time stalls no other.
        let probe = dir.join(PROBE_FILE);
        let made = dir.clone();
        let made_probe = probe.clone();
        glommio::executor()
            .spawn_blocking(move || -> io::Result<()> {
                create_dir_durably(&made)?;
                // Make sure glommio's first DMA open on this device sees a non-empty
                // file.
                let needs_probe =
                    std::fs::metadata(&made_probe).map(|m| m.len() < BLOCK_BYTES as u64);
                if needs_probe.unwrap_or(true) {
                    std::fs::write(&made_probe, vec![0xA5u8; BLOCK_BYTES])?;
                }
                Ok(())
            })
            .await?;
        let f = OpenOptions::new()
            .read(true)
            .dma_open(&probe)
            .await
            .map_err(to_io)?;
        let _ = f.read_at(0, BLOCK_BYTES).await.map_err(to_io)?;
        f.close().await.map_err(to_io)?;
        Ok(DmaBackend {
            dir: Rc::new(dir),
            faults,
        })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }
}

/// Creates `dir` and any missing parents, fsyncing the parent of each directory it
/// creates: the log fsyncs only its own directory, so without this a power cut could
/// lose the new directory's name, with every fdatasynced record inside it.
fn create_dir_durably(dir: &Path) -> io::Result<()> {
    let missing: Vec<&Path> = dir.ancestors().take_while(|d| !d.exists()).collect();
    std::fs::create_dir_all(dir)?;
    for created in missing.iter().rev() {
        if let Some(parent) = created.parent() {
            std::fs::File::open(parent)?.sync_all()?;
        }
    }
    Ok(())
}

impl Backend for DmaBackend {
    type File = DmaSegmentFile;

    async fn open(&self, name: &str, create: bool) -> io::Result<DmaSegmentFile> {
        let path = self.dir.join(name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .dma_open(&path)
            .await
            .map_err(to_io)?;
        Ok(DmaSegmentFile {
            file,
            path,
            dsync: RefCell::new(None),
            faults: self.faults.clone(),
        })
    }

    // Listing and unlinking are blocking calls with no io_uring op in glommio 0.9: they
    // run on the executor's blocking thread, so the core's other shards are served
    // meanwhile (an unlink of a large segment frees all its extents, milliseconds).
    async fn list(&self) -> io::Result<Vec<String>> {
        let dir = (*self.dir).clone();
        glommio::executor()
            .spawn_blocking(move || {
                let mut names = Vec::new();
                for entry in std::fs::read_dir(&dir)? {
                    let entry = entry?;
                    if entry.file_type()?.is_file()
                        && let Some(name) = entry.file_name().to_str()
                        && name != PROBE_FILE
                    {
                        names.push(name.to_owned());
                    }
                }
                Ok(names)
            })
            .await
    }

    async fn remove(&self, name: &str) -> io::Result<()> {
        glommio::io::remove(self.dir.join(name))
            .await
            .map_err(to_io)
    }

    async fn sync_dir(&self) -> io::Result<()> {
        let dir = glommio::io::Directory::open(&*self.dir)
            .await
            .map_err(to_io)?;
        dir.sync().await.map_err(to_io)?;
        dir.close().await.map_err(to_io)
    }

    async fn write_small(&self, name: &str, data: &[u8]) -> io::Result<()> {
        write_whole(&self.dir.join(name), data, false).await
    }

    async fn read_small(&self, name: &str) -> io::Result<Option<Vec<u8>>> {
        let file = match BufferedFile::open(self.dir.join(name)).await.map_err(to_io) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let read = async {
            let size = file.file_size().await.map_err(to_io)?;
            if size > super::SMALL_FILE_MAX_BYTES {
                return Err(super::too_large(name, size));
            }
            let mut out = Vec::with_capacity(size as usize);
            loop {
                let want = (size as usize).saturating_sub(out.len()).max(BLOCK_BYTES);
                let r = file.read_at(out.len() as u64, want).await.map_err(to_io)?;
                if r.is_empty() {
                    return Ok::<_, io::Error>(out);
                }
                out.extend_from_slice(&r);
                // Growing while read: the bound holds all the same.
                if out.len() as u64 > super::SMALL_FILE_MAX_BYTES {
                    return Err(super::too_large(name, out.len() as u64));
                }
            }
        }
        .await;
        let closed = file.close().await.map_err(to_io);
        let out = read?;
        closed?;
        Ok(Some(out))
    }

    async fn write_synced(&self, name: &str, data: &[u8]) -> io::Result<()> {
        write_whole(&self.dir.join(name), data, true).await
    }

    async fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        glommio::io::rename(self.dir.join(from), self.dir.join(to))
            .await
            .map_err(to_io)
    }
}

/// Creates or empties `path` and writes exactly `data` through the executor's ring (a
/// blocking write would stall every shard of the core: these files are indexes,
/// metadata and snapshots, megabytes at times), fdatasyncing it when `sync` is set.
async fn write_whole(path: &Path, data: &[u8], sync: bool) -> io::Result<()> {
    let file = BufferedFile::create(path).await.map_err(to_io)?;
    let written = async {
        let mut done = 0usize;
        while done < data.len() {
            let n = file
                .write_at(data[done..].to_vec(), done as u64)
                .await
                .map_err(to_io)?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "write wrote 0 bytes",
                ));
            }
            done += n;
        }
        if sync {
            file.fdatasync().await.map_err(to_io)?;
        }
        Ok::<_, io::Error>(())
    }
    .await;
    let closed = file.close().await.map_err(to_io);
    written?;
    closed
}

impl DmaSegmentFile {
    fn check_write(&self) -> io::Result<()> {
        self.faults.as_ref().map_or(Ok(()), |f| f.check_write())
    }

    fn check_sync(&self) -> io::Result<()> {
        self.faults.as_ref().map_or(Ok(()), |f| f.check_sync())
    }

    /// The O_DSYNC descriptor, opened on first use.
    async fn dsync_file(&self) -> io::Result<Rc<DmaFile>> {
        if let Some(f) = self.dsync.borrow().as_ref() {
            return Ok(f.clone());
        }
        let f = Rc::new(
            OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_DSYNC)
                .dma_open(&self.path)
                .await
                .map_err(to_io)?,
        );
        // Another write may have opened one meanwhile; either serves.
        Ok(self.dsync.borrow_mut().get_or_insert(f).clone())
    }

    /// Writes all of `data` at `pos` through `file`, resuming after short writes. Both
    /// are block-aligned, as O_DIRECT needs.
    async fn write_all_at(file: &DmaFile, data: &[u8], pos: u64) -> io::Result<()> {
        debug_assert!(
            (pos as usize).is_multiple_of(BLOCK_BYTES) && data.len().is_multiple_of(BLOCK_BYTES)
        );
        let mut done = 0usize;
        while done < data.len() {
            let mut buf = file.alloc_dma_buffer(data.len() - done);
            buf.as_bytes_mut().copy_from_slice(&data[done..]);
            let n = file.write_at(buf, pos + done as u64).await.map_err(to_io)?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "O_DIRECT write wrote 0 bytes",
                ));
            }
            // A short O_DIRECT write ends on a block boundary; resume there.
            done += n - n % BLOCK_BYTES;
            if n % BLOCK_BYTES != 0 && done < data.len() {
                continue;
            }
        }
        Ok(())
    }
}

impl SegmentFile for DmaSegmentFile {
    async fn write_at(&self, data: &[u8], pos: u64) -> io::Result<()> {
        self.check_write()?;
        Self::write_all_at(&self.file, data, pos).await
    }

    async fn write_durable_at(&self, data: &[u8], pos: u64) -> io::Result<()> {
        // A fault aimed at writes or at syncs fails it: it is both.
        self.check_write()?;
        self.check_sync()?;
        match self.dsync_file().await {
            Ok(file) => Self::write_all_at(&file, data, pos).await,
            // Out of descriptors (the process's or the system's), the O_DSYNC one cannot
            // be opened, which says nothing about the write: make it durable the other
            // way, through the descriptor the segment has, with one device round trip
            // more. Failing it would poison the log for a shortage that passes.
            Err(e) if super::is_out_of_descriptors(&e) => {
                Self::write_all_at(&self.file, data, pos).await?;
                self.file.fdatasync().await.map_err(to_io)
            }
            Err(e) => Err(e),
        }
    }

    async fn overwrite_at(&self, data: &[u8], pos: u64) -> io::Result<()> {
        Self::write_all_at(&self.file, data, pos).await
    }

    async fn read_at(&self, pos: u64, len: usize) -> io::Result<Bytes> {
        if len == 0 {
            return Ok(Bytes::new());
        }
        let r = self.file.read_at(pos, len).await.map_err(to_io)?;
        Ok(Bytes::copy_from_slice(&r))
    }

    async fn sync_data(&self) -> io::Result<()> {
        self.check_sync()?;
        self.file.fdatasync().await.map_err(to_io)
    }

    fn sealed(&self) {
        // Not one descriptor more per sealed segment for the rest of the process.
        self.dsync.borrow_mut().take();
    }

    async fn size(&self) -> io::Result<u64> {
        self.file.file_size().await.map_err(to_io)
    }

    async fn allocate(&self, len: u64) -> io::Result<()> {
        self.check_write()?;
        match self.file.pre_allocate(len, true).await.map_err(to_io) {
            // Not every file system can preallocate; it is an optimisation only.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::ENOSYS)) => Ok(()),
            other => other,
        }
    }

    async fn truncate(&self, len: u64) -> io::Result<()> {
        self.file.truncate(len).await.map_err(to_io)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glommio_errors_keep_their_errno() {
        // A full disk must read as ENOSPC, however glommio dressed the error up.
        let enhanced = glommio::GlommioError::<()>::EnhancedIoError {
            source: io::Error::from_raw_os_error(libc::ENOSPC),
            op: "Writing",
            path: Some(PathBuf::from("/x/00000000000000000000.seg")),
            fd: Some(7),
        };
        assert_eq!(to_io(enhanced).raw_os_error(), Some(libc::ENOSPC));
        let plain =
            glommio::GlommioError::<()>::IoError(io::Error::from_raw_os_error(libc::EDQUOT));
        assert_eq!(to_io(plain).raw_os_error(), Some(libc::EDQUOT));
    }

    /// Whole small files (indexes, metadata, snapshots) go through the ring: the core's
    /// other tasks run while one is read or written (a blocking call on the core's
    /// thread lets none run); a missing one reads as `None`, one of several megabytes
    /// and an odd length reads back exactly, and rewriting a file with less leaves only
    /// the new bytes.
    #[test]
    fn small_files_read_back_whole_through_the_ring() {
        in_a_directory(|path, backend| async move {
            let (ticks, ticker) = counting_turns();
            assert_eq!(backend.read_small("absent").await.unwrap(), None);
            let big: Vec<u8> = (0..(3 << 20) + 1234).map(|i| (i % 251) as u8).collect();
            let before = ticks.get();
            backend.write_small("big", &big).await.unwrap();
            assert!(
                ticks.get() > before,
                "the core ran nothing during the write"
            );
            let before = ticks.get();
            let read = backend.read_small("big").await.unwrap();
            assert!(ticks.get() > before, "the core ran nothing during the read");
            ticker.cancel();
            assert_eq!(read.as_ref(), Some(&big));
            backend.write_synced("big", b"short").await.unwrap();
            assert_eq!(
                backend.read_small("big").await.unwrap().as_deref(),
                Some(&b"short"[..])
            );
            backend.write_small("empty", b"").await.unwrap();
            assert_eq!(
                backend.read_small("empty").await.unwrap().as_deref(),
                Some(&b""[..])
            );
            assert_eq!(std::fs::read(path.join("big")).unwrap(), b"short");
            // One past the bound (sparse: nothing is written) is refused, not read.
            std::fs::File::create(path.join("huge"))
                .unwrap()
                .set_len(1 << 40)
                .unwrap();
            let refused = backend.read_small("huge").await.unwrap_err();
            assert_eq!(refused.kind(), std::io::ErrorKind::InvalidData, "{refused}");
        });
    }

    /// Listing the directory and removing a file run off the core's thread (its other
    /// tasks run meanwhile), list only segment-directory files (not the probe), and a
    /// missing file's removal still reads as not found (retention and cuts take that
    /// for done).
    #[test]
    fn listing_and_removing_let_the_core_run_other_tasks() {
        in_a_directory(|path, backend| async move {
            let (ticks, ticker) = counting_turns();
            backend.write_small("a", b"1").await.unwrap();
            backend.write_small("b", b"2").await.unwrap();
            std::fs::create_dir(path.join("sub")).unwrap();
            let before = ticks.get();
            let mut names = backend.list().await.unwrap();
            assert!(
                ticks.get() > before,
                "the core ran nothing during the listing"
            );
            names.sort();
            assert_eq!(names, ["a", "b"]);
            let before = ticks.get();
            backend.remove("a").await.unwrap();
            assert!(
                ticks.get() > before,
                "the core ran nothing during the removal"
            );
            ticker.cancel();
            assert!(!path.join("a").exists());
            let missing = backend.remove("a").await.unwrap_err();
            assert_eq!(missing.kind(), io::ErrorKind::NotFound, "{missing}");
        });
    }

    /// A task on the current executor that only counts its turns: a call during which
    /// the count moves let the core run its other tasks (a blocking call lets none).
    fn counting_turns() -> (
        std::rc::Rc<std::cell::Cell<u64>>,
        glommio::task::JoinHandle<()>,
    ) {
        let ticks = std::rc::Rc::new(std::cell::Cell::new(0u64));
        let ticker = glommio::spawn_local({
            let ticks = ticks.clone();
            async move {
                loop {
                    ticks.set(ticks.get() + 1);
                    futures_lite::future::yield_now().await;
                }
            }
        })
        .detach();
        (ticks, ticker)
    }

    /// Runs `test` on a glommio executor with a backend over a fresh directory.
    fn in_a_directory<F, Fut>(test: F)
    where
        F: FnOnce(PathBuf, DmaBackend) -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_path_buf();
        glommio::LocalExecutorBuilder::default()
            .make()
            .unwrap()
            .run(async move {
                let backend = DmaBackend::open_dir(&path).await.unwrap();
                test(path, backend).await;
            });
    }

    /// Durable writes go through a descriptor opened with O_DSYNC on first use, land
    /// where the plain descriptor reads them, and the descriptor goes at seal.
    #[test]
    fn durable_writes_go_through_an_o_dsync_descriptor_let_go_at_seal() {
        use std::os::fd::AsRawFd;
        in_a_directory(|_, backend| async move {
            let f = backend.open("a.seg", true).await.unwrap();
            let (a, b) = (vec![7u8; BLOCK_BYTES], vec![9u8; BLOCK_BYTES]);
            f.write_at(&a, 0).await.unwrap();
            assert!(f.dsync.borrow().is_none(), "a plain write opens nothing");
            f.write_durable_at(&b, BLOCK_BYTES as u64).await.unwrap();
            let fd = f
                .dsync
                .borrow()
                .as_ref()
                .expect("opened for the durable write")
                .as_raw_fd();
            // SAFETY: F_GETFL on a descriptor the file holds open.
            let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
            assert_ne!(flags & libc::O_DSYNC, 0, "flags {flags:#o}");
            let read = f.read_at(0, 2 * BLOCK_BYTES).await.unwrap();
            assert_eq!(read.to_vec(), [a, b].concat());
            f.sealed();
            assert!(f.dsync.borrow().is_none(), "let go at seal");
        });
    }
}
