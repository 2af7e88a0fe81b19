//! A fault seam for the real backend: errors armed from any thread (an admin endpoint, a
//! test) and raised by [`super::dma::DmaBackend`] before it touches a segment file, so a
//! running broker can be shown a full disk or a failing fdatasync without a full disk.
//!
//! What must stay true: an unarmed [`StorageFaults`] never fails anything, and a `Once`
//! fault fails exactly one operation even when several cores race for it (arming and
//! taking are single atomic operations). Only atomics: checking costs one load when
//! nothing is armed.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// How many operations an armed fault fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultTimes {
    /// The next one, then the fault disarms itself.
    Once,
    /// Every one until [`StorageFaults::clear`].
    Always,
}

/// Set when a slot is armed; the errno lives in the low 32 bits.
const ARMED: u64 = 1 << 32;
/// Set for [`FaultTimes::Always`].
const ALWAYS: u64 = 1 << 33;

/// One armed-or-not fault: errno and times packed in one word, so arming is one store and
/// taking a `Once` fault is one compare-exchange.
#[derive(Debug, Default)]
struct Slot(AtomicU64);

impl Slot {
    fn arm(&self, errno: i32, times: FaultTimes) {
        assert!(
            errno > 0,
            "an injected errno is a positive OS error code: {errno}"
        );
        let always = if times == FaultTimes::Always {
            ALWAYS
        } else {
            0
        };
        self.0
            .store(ARMED | always | u64::from(errno as u32), Ordering::Release);
    }

    /// The errno to fail with, taking a `Once` fault.
    fn take(&self) -> Option<i32> {
        let mut s = self.0.load(Ordering::Acquire);
        loop {
            if s & ARMED == 0 {
                return None;
            }
            let errno = (s & u64::from(u32::MAX)) as i32;
            if s & ALWAYS != 0 {
                return Some(errno);
            }
            match self
                .0
                .compare_exchange(s, 0, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Some(errno),
                // Taken by another core, or re-armed: look again.
                Err(now) => s = now,
            }
        }
    }
}

/// Faults to inject into segment-file I/O. Share one as `Arc<StorageFaults>` between the
/// backends of every core and whoever arms it.
#[derive(Debug, Default)]
pub struct StorageFaults {
    /// Data writes and fallocate.
    writes: Slot,
    /// fdatasync.
    syncs: Slot,
    /// Opening a log's directory.
    opens: Slot,
    injected: AtomicU64,
}

impl StorageFaults {
    /// Nothing armed.
    pub fn new() -> Arc<StorageFaults> {
        Arc::new(StorageFaults::default())
    }

    /// Data writes and fallocate of segment files fail with `errno` (e.g. `libc::ENOSPC`).
    /// Replaces any write fault already armed.
    pub fn fail_writes(&self, errno: i32, times: FaultTimes) {
        self.writes.arm(errno, times);
    }

    /// fdatasync of segment files fails with `errno` (e.g. `libc::EIO`). Replaces any sync
    /// fault already armed.
    pub fn fail_syncs(&self, errno: i32, times: FaultTimes) {
        self.syncs.arm(errno, times);
    }

    /// Opening a log's directory ([`super::dma::DmaBackend::open_dir_with_faults`]) fails
    /// with `errno` (e.g. `libc::EMFILE`, as when the process is out of descriptors).
    /// Replaces any open fault already armed.
    pub fn fail_opens(&self, errno: i32, times: FaultTimes) {
        self.opens.arm(errno, times);
    }

    /// Disarms every fault.
    pub fn clear(&self) {
        self.writes.0.store(0, Ordering::Release);
        self.syncs.0.store(0, Ordering::Release);
        self.opens.0.store(0, Ordering::Release);
    }

    /// Operations failed by injection so far.
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::Relaxed)
    }

    /// Before a data write or fallocate.
    pub(crate) fn check_write(&self) -> io::Result<()> {
        self.check(&self.writes)
    }

    /// Before an fdatasync.
    pub(crate) fn check_sync(&self) -> io::Result<()> {
        self.check(&self.syncs)
    }

    /// Before opening a log's directory.
    pub(crate) fn check_open(&self) -> io::Result<()> {
        self.check(&self.opens)
    }

    fn check(&self, slot: &Slot) -> io::Result<()> {
        match slot.take() {
            None => Ok(()),
            Some(errno) => {
                self.injected.fetch_add(1, Ordering::Relaxed);
                Err(io::Error::from_raw_os_error(errno))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unarmed_seam_fails_nothing() {
        let f = StorageFaults::new();
        for _ in 0..3 {
            f.check_write().unwrap();
            f.check_sync().unwrap();
            f.check_open().unwrap();
        }
        assert_eq!(f.injected(), 0);
    }

    #[test]
    fn once_fails_exactly_one_operation_with_the_armed_errno() {
        let f = StorageFaults::new();
        f.fail_writes(libc::ENOSPC, FaultTimes::Once);
        let e = f.check_write().unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
        f.check_write().unwrap();
        f.check_sync().unwrap();
        assert_eq!(f.injected(), 1);
    }

    #[test]
    fn always_fails_until_cleared() {
        let f = StorageFaults::new();
        f.fail_syncs(libc::EIO, FaultTimes::Always);
        for _ in 0..3 {
            assert_eq!(f.check_sync().unwrap_err().raw_os_error(), Some(libc::EIO));
        }
        f.check_write().unwrap();
        f.fail_opens(libc::EMFILE, FaultTimes::Always);
        assert_eq!(
            f.check_open().unwrap_err().raw_os_error(),
            Some(libc::EMFILE)
        );
        f.clear();
        f.check_sync().unwrap();
        f.check_open().unwrap();
        assert_eq!(f.injected(), 4);
    }

    #[test]
    fn a_once_fault_raced_by_many_threads_fires_once() {
        for _ in 0..50 {
            let f = StorageFaults::new();
            f.fail_writes(libc::EDQUOT, FaultTimes::Once);
            let failures: usize = std::thread::scope(|s| {
                let handles: Vec<_> = (0..4)
                    .map(|_| {
                        let f = &f;
                        s.spawn(move || (0..100).filter(|_| f.check_write().is_err()).count())
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).sum()
            });
            assert_eq!(failures, 1);
            assert_eq!(f.injected(), 1);
        }
    }
}
