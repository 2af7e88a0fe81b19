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
//!
//! Two models of losing power. [`MemBackend::crash`] is the kind one: every file holds
//! exactly what it held at its last fsync. [`MemBackend::power_loss`] is what a disk with
//! a volatile write cache may do: it may have persisted any subset of the sectors written
//! since the last fsync, in any order. The directory is as in a crash; then each file is
//! compared, 512-byte sector by sector, between what reads see and what was last synced,
//! and every sector that differs is kept in its new or its old version by a seeded coin:
//! - inside the synced length, the old version is the synced bytes;
//! - past it (the file grew), the old version is zeros: a dropped sector reads as zeros
//!   and the file keeps the length reads see, as an allocated but unwritten extent does
//!   (preallocated space, a size update that reached the disk before the data did);
//! - a file shortened since its last sync keeps the new or the old length (one coin: the
//!   size is one field), and past the new length holds its synced bytes.
//!
//! So a power loss never invents bytes nobody wrote, but may leave holes before data that
//! did land. An fsync makes every sector of the file durable at once; a durable write
//! (`write_durable_at`, O_DSYNC) only the sectors it wrote.

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
    /// `SegmentFile::sync_data`, and the sync that ends `SegmentFile::write_durable_at`.
    Sync,
    /// `SegmentFile::allocate`.
    Allocate,
    /// `SegmentFile::truncate`.
    Truncate,
    /// `Backend::sync_dir`.
    SyncDir,
    /// `Backend::rename`.
    Rename,
    /// `Backend::remove`.
    Remove,
}

const MEM_OPS: usize = 7;

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

    /// Counts a sync (an fdatasync, or the one ending a durable write) and fails it,
    /// as `what`, if a fault is aimed at it.
    fn sync(&mut self, what: &str) -> io::Result<()> {
        self.syncs += 1;
        if std::mem::take(&mut self.fail_next_sync) {
            return Err(injected(what));
        }
        self.check(MemOp::Sync)
    }
}

#[derive(Debug, Default)]
struct MemFs {
    /// The directory as operations left it.
    files: BTreeMap<String, Inode>,
    /// The directory as the last `sync_dir` saw it: what a crash leaves.
    synced: BTreeMap<String, Inode>,
    faults: Faults,
    /// Bytes returned by reads so far.
    read_bytes: u64,
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
                read_bytes: 0,
            })),
        }
    }

    /// A new backend holding what may survive a power cut now: as [`MemBackend::crash`],
    /// but every 512-byte sector written since the file's last fsync is independently
    /// kept or lost, chosen by a generator seeded with `seed` (the module docs give the
    /// model). The same state and seed give the same result.
    pub fn power_loss(&self, seed: u64) -> MemBackend {
        let mut coin = SplitMix64(seed);
        let fs = self.fs.borrow();
        let files: BTreeMap<String, Inode> = fs
            .synced
            .iter()
            .map(|(name, f)| {
                let f = f.borrow();
                let survived = sectors_after_power_loss(&f.data, &f.durable, &mut coin);
                (name.clone(), inode(&survived, &survived))
            })
            .collect();
        MemBackend {
            fs: Rc::new(RefCell::new(MemFs {
                synced: files.clone(),
                files,
                faults: Faults::default(),
                read_bytes: 0,
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

    /// Bytes read from files so far.
    pub fn bytes_read(&self) -> u64 {
        self.fs.borrow().read_bytes
    }

    /// Writes and fsyncs performed so far.
    pub fn op_counts(&self) -> (u64, u64) {
        let fs = self.fs.borrow();
        (fs.faults.writes, fs.faults.syncs)
    }
}

/// The unit a disk persists atomically in the power-loss model.
pub const SECTOR_BYTES: usize = 512;

/// What a file holds after a power cut: `data` as reads see it, `durable` as last
/// synced; each differing sector is the new or the old one, by `coin`.
fn sectors_after_power_loss(data: &[u8], durable: &[u8], coin: &mut SplitMix64) -> Vec<u8> {
    let len = if data.len() < durable.len() && coin.flip() {
        durable.len()
    } else {
        data.len()
    };
    // Past either length a version reads as zeros: never-written space, or bytes a
    // truncation removed.
    let byte = |v: &[u8], i: usize| v.get(i).copied().unwrap_or(0);
    let mut out = vec![0u8; len];
    for start in (0..len).step_by(SECTOR_BYTES) {
        let end = (start + SECTOR_BYTES).min(len);
        let differs = (start..end).any(|i| byte(data, i) != byte(durable, i));
        let from = if start >= data.len() || (differs && coin.flip()) {
            durable
        } else {
            data
        };
        for (i, b) in out[start..end].iter_mut().enumerate() {
            *b = byte(from, start + i);
        }
    }
    out
}

/// A tiny seeded generator (splitmix64): the library does not depend on `rand`.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn flip(&mut self) -> bool {
        self.next() & 1 == 1
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
        let mut fs = self.fs.borrow_mut();
        fs.faults.check(MemOp::Remove)?;
        fs.files
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
        match self.contents(name) {
            Some(c) if c.len() as u64 > super::SMALL_FILE_MAX_BYTES => {
                Err(super::too_large(name, c.len() as u64))
            }
            c => Ok(c),
        }
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

    async fn write_durable_at(&self, data: &[u8], pos: u64) -> io::Result<()> {
        self.write_at(data, pos).await?;
        // The sync the write ends with: a fault aimed at syncs fails it, the bytes
        // written but not durable, as after a failed fdatasync.
        self.fs.borrow_mut().faults.sync("O_DSYNC write")?;
        // Only this range (and the length reaching it) becomes durable.
        let (pos, end) = (pos as usize, pos as usize + data.len());
        self.with(|f| {
            if f.durable.len() < end {
                f.durable.resize(end, 0);
            }
            f.durable[pos..end].copy_from_slice(data);
        })
    }

    async fn overwrite_at(&self, data: &[u8], pos: u64) -> io::Result<()> {
        assert!(
            (pos as usize).is_multiple_of(BLOCK_BYTES) && data.len().is_multiple_of(BLOCK_BYTES),
            "O_DIRECT writes are block-aligned: pos {pos}, len {}",
            data.len()
        );
        futures_lite::future::yield_now().await;
        // No fault: an overwrite allocates nothing.
        let pos = pos as usize;
        self.with(|f| {
            if f.data.len() < pos + data.len() {
                f.data.resize(pos + data.len(), 0);
            }
            f.data[pos..pos + data.len()].copy_from_slice(data);
        })
    }

    async fn read_at(&self, pos: u64, len: usize) -> io::Result<Bytes> {
        let read = self.with(|f| {
            let start = (pos as usize).min(f.data.len());
            let end = start.saturating_add(len).min(f.data.len());
            Bytes::copy_from_slice(&f.data[start..end])
        })?;
        self.fs.borrow_mut().read_bytes += read.len() as u64;
        Ok(read)
    }

    async fn sync_data(&self) -> io::Result<()> {
        // As on Linux after a failed fsync: the dirty data may be dropped, so what
        // survives a crash is unknowable. Keep the old durable contents.
        self.fs.borrow_mut().faults.sync("fsync")?;
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

#[cfg(test)]
mod tests {
    use futures_lite::future::block_on;

    use super::*;

    const BLOCK: usize = BLOCK_BYTES;

    /// A directory with `a` synced as `old`, then `new` written over it without a sync.
    fn written_after_sync(old: &[u8], new: &[u8]) -> MemBackend {
        let mem = MemBackend::new();
        block_on(async {
            let f = mem.open("a", true).await.unwrap();
            f.write_at(old, 0).await.unwrap();
            f.sync_data().await.unwrap();
            mem.sync_dir().await.unwrap();
            f.write_at(new, 0).await.unwrap();
        });
        mem
    }

    fn sectors(bytes: &[u8]) -> Vec<&[u8]> {
        bytes.chunks(SECTOR_BYTES).collect()
    }

    #[test]
    fn power_loss_keeps_each_unsynced_sector_old_or_new_and_both_happen() {
        let old = vec![1u8; BLOCK];
        let new = vec![2u8; BLOCK];
        let mem = written_after_sync(&old, &new);
        let (mut kept_new, mut kept_old) = (0, 0);
        for seed in 0..32 {
            let after = mem.power_loss(seed).contents("a").unwrap();
            assert_eq!(after.len(), BLOCK);
            for s in sectors(&after) {
                // A sector is all of one version: the disk writes sectors whole.
                assert!(s == &old[..SECTOR_BYTES] || s == &new[..SECTOR_BYTES]);
                kept_new += usize::from(s[0] == 2);
                kept_old += usize::from(s[0] == 1);
            }
            assert_eq!(mem.power_loss(seed).contents("a"), Some(after), "seeded");
        }
        assert!(
            kept_new > 0 && kept_old > 0,
            "{kept_new} new, {kept_old} old"
        );
        // A crash is the case where every sector kept its old version.
        assert_eq!(mem.crash().contents("a"), Some(old));
    }

    #[test]
    fn power_loss_past_the_synced_length_keeps_the_length_and_drops_to_zeros() {
        let old = vec![1u8; BLOCK];
        let mut new = old.clone();
        new.extend(vec![3u8; 2 * BLOCK]);
        let mem = written_after_sync(&old, &new);
        let mut dropped = 0;
        for seed in 0..16 {
            let after = mem.power_loss(seed).contents("a").unwrap();
            assert_eq!(
                after.len(),
                new.len(),
                "the file keeps the length reads saw"
            );
            assert_eq!(after[..BLOCK], old[..], "synced sectors are untouched");
            for s in sectors(&after[BLOCK..]) {
                assert!(s.iter().all(|b| *b == 3) || s.iter().all(|b| *b == 0));
                dropped += usize::from(s[0] == 0);
            }
        }
        assert!(dropped > 0);
    }

    #[test]
    fn power_loss_leaves_synced_files_alone_and_forgets_unsynced_names() {
        let mem = MemBackend::new();
        block_on(async {
            let f = mem.open("synced", true).await.unwrap();
            f.write_at(&[7u8; BLOCK], 0).await.unwrap();
            f.sync_data().await.unwrap();
            mem.sync_dir().await.unwrap();
            let g = mem.open("unlisted", true).await.unwrap();
            g.write_at(&[8u8; BLOCK], 0).await.unwrap();
            g.sync_data().await.unwrap();
        });
        for seed in 0..8 {
            let after = mem.power_loss(seed);
            assert_eq!(after.contents("synced"), Some(vec![7u8; BLOCK]));
            assert_eq!(
                after.contents("unlisted"),
                None,
                "its name was never synced"
            );
        }
    }

    #[test]
    fn power_loss_after_an_unsynced_truncate_keeps_one_length_or_the_other() {
        let mem = written_after_sync(&[5u8; 2 * BLOCK], &[5u8; 2 * BLOCK]);
        block_on(async {
            let f = mem.open("a", false).await.unwrap();
            f.truncate(BLOCK as u64).await.unwrap();
        });
        let lens: std::collections::BTreeSet<usize> = (0..16)
            .map(|seed| mem.power_loss(seed).contents("a").unwrap())
            .inspect(|c| assert!(c.iter().all(|b| *b == 5), "old bytes or none"))
            .map(|c| c.len())
            .collect();
        assert_eq!(lens, [BLOCK, 2 * BLOCK].into());
    }
}
