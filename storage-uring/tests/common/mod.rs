//! Fixtures that let one test body run on both backends.

#![allow(dead_code)]

use std::future::Future;
use std::path::PathBuf;

use felix_storage_uring::io::Backend;
use felix_storage_uring::{DmaBackend, MemBackend};

/// Runs `f` on a fresh glommio executor (the log spawns its flusher there).
pub fn run<F, Fut>(f: F) -> Fut::Output
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future + 'static,
    Fut::Output: Send + 'static,
{
    glommio::LocalExecutorBuilder::default()
        .io_memory(2 << 20)
        .spawn(f)
        .expect("executor starts")
        .join()
        .expect("executor finishes")
}

/// A place a log lives, plus the ways a test can damage it.
#[allow(async_fn_in_trait)]
pub trait Fixture: 'static {
    type B: Backend;
    async fn backend(&self) -> Self::B;
    /// Overwrites bytes of a file, durably.
    fn corrupt(&self, name: &str, pos: u64, bytes: &[u8]);
    /// Cuts or zero-extends a file.
    fn set_len(&self, name: &str, len: u64);
    fn remove(&self, name: &str);
    fn len(&self, name: &str) -> u64;
    fn names(&self) -> Vec<String>;
    fn write(&self, name: &str, data: &[u8]);
}

pub struct Mem(pub MemBackend);

impl Fixture for Mem {
    type B = MemBackend;
    async fn backend(&self) -> MemBackend {
        self.0.clone()
    }
    fn corrupt(&self, name: &str, pos: u64, bytes: &[u8]) {
        self.0.corrupt(name, pos as usize, bytes)
    }
    fn set_len(&self, name: &str, len: u64) {
        self.0.set_len(name, len as usize)
    }
    fn remove(&self, name: &str) {
        self.0.delete(name)
    }
    fn len(&self, name: &str) -> u64 {
        self.0.contents(name).map_or(0, |c| c.len() as u64)
    }
    fn names(&self) -> Vec<String> {
        let mut v = Vec::new();
        v.extend(futures_lite::future::block_on(self.0.list()).unwrap());
        v
    }
    fn write(&self, name: &str, data: &[u8]) {
        self.0.put_file(name, data)
    }
}

pub struct Disk(pub PathBuf, pub tempfile::TempDir);

impl Disk {
    pub fn new() -> Disk {
        let t = tempfile::Builder::new()
            .prefix("felix-log-test")
            .tempdir_in(std::env::var("FELIX_TEST_DIR").unwrap_or_else(|_| "/var/tmp".into()))
            .unwrap();
        Disk(t.path().join("log"), t)
    }
}

impl Fixture for Disk {
    type B = DmaBackend;
    async fn backend(&self) -> DmaBackend {
        DmaBackend::open_dir(&self.0).await.unwrap()
    }
    fn corrupt(&self, name: &str, pos: u64, bytes: &[u8]) {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(self.0.join(name))
            .unwrap();
        f.write_all_at(bytes, pos).unwrap();
        f.sync_all().unwrap();
    }
    fn set_len(&self, name: &str, len: u64) {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(self.0.join(name))
            .unwrap();
        f.set_len(len).unwrap();
        f.sync_all().unwrap();
    }
    fn remove(&self, name: &str) {
        std::fs::remove_file(self.0.join(name)).unwrap()
    }
    fn len(&self, name: &str) -> u64 {
        std::fs::metadata(self.0.join(name)).map_or(0, |m| m.len())
    }
    fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| !n.starts_with('.'))
            .collect();
        v.sort();
        v
    }
    fn write(&self, name: &str, data: &[u8]) {
        std::fs::write(self.0.join(name), data).unwrap()
    }
}

/// The payload of record `offset` in tests: self-describing, so a read can check it.
pub fn payload(offset: u64, len: usize) -> Vec<u8> {
    let mut v = offset.to_be_bytes().to_vec();
    v.resize(len.max(8), (offset % 251) as u8);
    v
}
