//! An in-memory backend with fault injection, for tests that must see what the disk does
//! wrong: fail the next write or fsync, tear a write (a prefix reaches the "platter",
//! then the write fails), or crash (every file reverts to what was last fsynced, and
//! the directory to what the last directory sync saw: a file created, removed or renamed
//! since then is back where it was). Faults can carry an errno
//! ([`MemBackend::fail_with`]) so the log's handling of a full disk (ENOSPC, EDQUOT) is
//! tested here, step by step, as well as on the real backend. A write yields to the
//! executor once before it lands, as a real one waits for the device, so appenders
//! interleave with the flusher here as they do on disk.
//!
//! Files are inodes shared by the directory and by open handles, as on Linux: a handle
//! keeps working on a file that was removed or renamed after it was opened.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::io;
use std::rc::Rc;

use bytes::Bytes;

use super::faults::FaultTimes;
use super::{Backend, SegmentFile};
use crate::format::BLOCK_BYTES;

#[derive(Debug, Default, Clone)]
struct MemFile {
    /// What reads see.
    data: Vec<u8>,
    /// What survives a crash.
    durable: Vec<u8>,
}

type Inode = Rc<RefCell<MemFile>>;

fn inode(data: &[u8], durable: &[u8]) -> Inode {
    Rc::new(RefCell::new(MemFile {
        data: data.to_vec(),
        durable: durable.to_vec(),
    }))
}

/// An operation of the memory backend that a fault can be aimed at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemOp {
    /// `SegmentFile::write_at`.
    Write,
    /// `SegmentFile::sync_data`.
    Sync,
    /// `SegmentFile::allocate`.
    Allocate,
    /// `SegmentFile::truncate`.
    Truncate,
    /// `Backend::sync_dir`.
    SyncDir,
    /// `Backend::rename`.
    Rename,
}

const MEM_OPS: usize = 6;

#[derive(Debug, Clone, Copy)]
struct Armed {
    errno: i32,
    /// Operations of its kind still let through before it fires.
    skip: u64,
    times: FaultTimes,
}

#[derive(Debug, Default)]
struct Faults {
    fail_next_write: bool,
    fail_next_sync: bool,
    /// Bytes that land, and the errno the write then fails with (`None`: a plain error).
    tear_next_write: Option<(usize, Option<i32>)>,
    armed: [Option<Armed>; MEM_OPS],
    /// Count of writes/syncs, for tests that aim a fault at the n-th operation.
    writes: u64,
    syncs: u64,
}

impl Faults {
    /// Fails `op` now if a fault aimed at it is due.
    fn check(&mut self, op: MemOp) -> io::Result<()> {
        let slot = &mut self.armed[op as usize];
        let Some(armed) = slot else {
            return Ok(());
        };
        if armed.skip > 0 {
            armed.skip -= 1;
            return Ok(());
        }
        let errno = armed.errno;
        if armed.times == FaultTimes::Once {
            *slot = None;
        }
        Err(io::Error::from_raw_os_error(errno))
    }
}

#[derive(Debug, Default)]
struct MemFs {
    /// The directory as operations left it.
    files: BTreeMap<String, Inode>,
    /// The directory as the last `sync_dir` saw it: what a crash leaves.
    synced: BTreeMap<String, Inode>,
    faults: Faults,
}

impl MemFs {
    fn file(&self, name: &str) -> Option<Inode> {
        self.files.get(name).cloned()
    }
}

/// An in-memory directory. Clones share the same files.
#[derive(Debug, Clone, Default)]
pub struct MemBackend {
    fs: Rc<RefCell<MemFs>>,
}

/// A file of a [`MemBackend`].
pub struct MemFileHandle {
    fs: Rc<RefCell<MemFs>>,
    file: Inode,
}

impl std::fmt::Debug for MemFileHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemFileHandle")
            .field("len", &self.file.borrow().data.len())
            .finish()
    }
}

fn injected(what: &str) -> io::Error {
    io::Error::other(format!("injected {what} failure"))
}

impl MemBackend {
    /// An empty directory.
    pub fn new() -> Self {
        Self::default()
    }

    /// The next write fails with EIO and changes nothing.
    pub fn fail_next_write(&self) {
        self.fs.borrow_mut().faults.fail_next_write = true;
    }

    /// The next fsync fails with EIO.
    pub fn fail_next_sync(&self) {
        self.fs.borrow_mut().faults.fail_next_sync = true;
    }

    /// The next write lands only its first `keep` bytes, durably (as a power cut mid-
    /// write would leave them), and then fails.
    pub fn tear_next_write(&self, keep: usize) {
        self.fs.borrow_mut().faults.tear_next_write = Some((keep, None));
    }

    /// As [`MemBackend::tear_next_write`], failing with `errno` (a write that ran out of
    /// space part way).
    pub fn tear_next_write_with(&self, keep: usize, errno: i32) {
        self.fs.borrow_mut().faults.tear_next_write = Some((keep, Some(errno)));
    }

    /// The next write fails with `errno` (e.g. `libc::ENOSPC`) and changes nothing.
    pub fn fail_next_write_with(&self, errno: i32) {
        self.fail_with(MemOp::Write, errno, 0, FaultTimes::Once);
    }

    /// After letting `skip` more `op`s through, `op` fails with `errno` and changes
    /// nothing: once, or every time until [`MemBackend::clear_faults`]. Replaces any
    /// fault already aimed at `op`.
    pub fn fail_with(&self, op: MemOp, errno: i32, skip: u64, times: FaultTimes) {
        self.fs.borrow_mut().faults.armed[op as usize] = Some(Armed { errno, skip, times });
    }

    /// Disarms every fault ("space was freed").
    pub fn clear_faults(&self) {
        let mut fs = self.fs.borrow_mut();
        let (writes, syncs) = (fs.faults.writes, fs.faults.syncs);
        fs.faults = Faults {
            writes,
            syncs,
            ..Faults::default()
        };
    }

    /// A new backend holding what survives a crash now: the directory as the last
    /// directory sync saw it, each file with its last fsynced contents.
    pub fn crash(&self) -> MemBackend {
        let fs = self.fs.borrow();
        let files: BTreeMap<String, Inode> = fs
            .synced
            .iter()
            .map(|(name, f)| {
                let durable = &f.borrow().durable;
                (name.clone(), inode(durable, durable))
            })
            .collect();
        MemBackend {
            fs: Rc::new(RefCell::new(MemFs {
                synced: files.clone(),
                files,
                faults: Faults::default(),
            })),
        }
    }

    /// Overwrites bytes of a file, durably (bit rot, a stray writer).
    pub fn corrupt(&self, name: &str, pos: usize, bytes: &[u8]) {
        let f = self.fs.borrow().file(name).expect("corrupt: no such file");
        let mut f = f.borrow_mut();
        let f = &mut *f;
        for (i, b) in bytes.iter().enumerate() {
            for v in [&mut f.data, &mut f.durable] {
                if pos + i >= v.len() {
                    v.resize(pos + i + 1, 0);
                }
                v[pos + i] = *b;
            }
        }
    }

    /// Sets a file's durable length (truncating or zero-extending it).
    pub fn set_len(&self, name: &str, len: usize) {
        let f = self.fs.borrow().file(name).expect("set_len: no such file");
        let mut f = f.borrow_mut();
        f.data.resize(len, 0);
        f.durable.resize(len, 0);
    }

    /// A file's current contents.
    pub fn contents(&self, name: &str) -> Option<Vec<u8>> {
        self.fs.borrow().file(name).map(|f| f.borrow().data.clone())
    }

    /// Places a whole file, durably (a foreign file in the data directory).
    pub fn put_file(&self, name: &str, data: &[u8]) {
        let mut fs = self.fs.borrow_mut();
        let f = inode(data, data);
        fs.files.insert(name.to_owned(), f.clone());
        fs.synced.insert(name.to_owned(), f);
    }

    /// Removes a file, durably.
    pub fn delete(&self, name: &str) {
        let mut fs = self.fs.borrow_mut();
        fs.files.remove(name);
        fs.synced.remove(name);
    }

    /// Writes and fsyncs performed so far.
    pub fn op_counts(&self) -> (u64, u64) {
        let fs = self.fs.borrow();
        (fs.faults.writes, fs.faults.syncs)
    }
}

impl Backend for MemBackend {
    type File = MemFileHandle;

    async fn open(&self, name: &str, create: bool) -> io::Result<MemFileHandle> {
        let mut fs = self.fs.borrow_mut();
        let file = match fs.file(name) {
            Some(f) => f,
            None if create => {
                let f = Inode::default();
                fs.files.insert(name.to_owned(), f.clone());
                f
            }
            None => return Err(io::Error::from(io::ErrorKind::NotFound)),
        };
        Ok(MemFileHandle {
            fs: self.fs.clone(),
            file,
        })
    }

    async fn list(&self) -> io::Result<Vec<String>> {
        Ok(self.fs.borrow().files.keys().cloned().collect())
    }

    async fn remove(&self, name: &str) -> io::Result<()> {
        self.fs
            .borrow_mut()
            .files
            .remove(name)
            .map(|_| ())
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))
    }

    async fn sync_dir(&self) -> io::Result<()> {
        let mut fs = self.fs.borrow_mut();
        fs.faults.check(MemOp::SyncDir)?;
        fs.synced = fs.files.clone();
        Ok(())
    }

    async fn write_small(&self, name: &str, data: &[u8]) -> io::Result<()> {
        let mut fs = self.fs.borrow_mut();
        let f = fs.files.entry(name.to_owned()).or_default();
        f.borrow_mut().data = data.to_vec();
        Ok(())
    }

    async fn read_small(&self, name: &str) -> io::Result<Option<Vec<u8>>> {
        Ok(self.contents(name))
    }

    async fn write_synced(&self, name: &str, data: &[u8]) -> io::Result<()> {
        futures_lite::future::yield_now().await;
        let mut fs = self.fs.borrow_mut();
        fs.faults.writes += 1;
        fs.faults.check(MemOp::Write)?;
        let f = fs.files.entry(name.to_owned()).or_default().clone();
        f.borrow_mut().data = data.to_vec();
        fs.faults.syncs += 1;
        fs.faults.check(MemOp::Sync)?;
        let mut f = f.borrow_mut();
        f.durable = f.data.clone();
        Ok(())
    }

    async fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        let mut fs = self.fs.borrow_mut();
        fs.faults.check(MemOp::Rename)?;
        let f = fs
            .files
            .remove(from)
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        fs.files.insert(to.to_owned(), f);
        Ok(())
    }
}

impl MemFileHandle {
    fn with<T>(&self, f: impl FnOnce(&mut MemFile) -> T) -> io::Result<T> {
        Ok(f(&mut self.file.borrow_mut()))
    }
}

impl SegmentFile for MemFileHandle {
    async fn write_at(&self, data: &[u8], pos: u64) -> io::Result<()> {
        assert!(
            (pos as usize).is_multiple_of(BLOCK_BYTES) && data.len().is_multiple_of(BLOCK_BYTES),
            "O_DIRECT writes are block-aligned: pos {pos}, len {}",
            data.len()
        );
        // A real write waits for the device: other tasks (appenders) run meanwhile.
        futures_lite::future::yield_now().await;
        let (fail, tear) = {
            let mut fs = self.fs.borrow_mut();
            fs.faults.writes += 1;
            let fail = std::mem::take(&mut fs.faults.fail_next_write);
            if !fail {
                fs.faults.check(MemOp::Write)?;
            }
            (fail, fs.faults.tear_next_write.take())
        };
        if fail {
            return Err(injected("write"));
        }
        let pos = pos as usize;
        let keep = tear.map_or(data.len(), |(k, _)| k.min(data.len()));
        self.with(|f| {
            for v in [Some(&mut f.data), tear.map(|_| &mut f.durable)]
                .into_iter()
                .flatten()
            {
                if v.len() < pos + keep {
                    v.resize(pos + keep, 0);
                }
                v[pos..pos + keep].copy_from_slice(&data[..keep]);
            }
        })?;
        match tear {
            Some((_, Some(errno))) => return Err(io::Error::from_raw_os_error(errno)),
            Some((_, None)) => return Err(injected("torn write")),
            None => {}
        }
        Ok(())
    }

    async fn read_at(&self, pos: u64, len: usize) -> io::Result<Bytes> {
        self.with(|f| {
            let start = (pos as usize).min(f.data.len());
            let end = start.saturating_add(len).min(f.data.len());
            Bytes::copy_from_slice(&f.data[start..end])
        })
    }

    async fn sync_data(&self) -> io::Result<()> {
        let fail = {
            let mut fs = self.fs.borrow_mut();
            fs.faults.syncs += 1;
            let fail = std::mem::take(&mut fs.faults.fail_next_sync);
            if !fail {
                fs.faults.check(MemOp::Sync)?;
            }
            fail
        };
        if fail {
            // As on Linux after a failed fsync: the dirty data may be dropped, so what
            // survives a crash is unknowable. Keep the old durable contents.
            return Err(injected("fsync"));
        }
        self.with(|f| f.durable = f.data.clone())
    }

    async fn size(&self) -> io::Result<u64> {
        self.with(|f| f.data.len() as u64)
    }

    async fn allocate(&self, _len: u64) -> io::Result<()> {
        self.fs.borrow_mut().faults.check(MemOp::Allocate)
    }

    async fn truncate(&self, len: u64) -> io::Result<()> {
        self.fs.borrow_mut().faults.check(MemOp::Truncate)?;
        self.with(|f| f.data.resize(len as usize, 0))
    }
}
