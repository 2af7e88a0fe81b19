//! The locked-memory limit io_uring buffer registration needs.
//!
//! glommio registers its I/O buffers with the kernel, which counts them against
//! `RLIMIT_MEMLOCK` unless the process has `CAP_IPC_LOCK`. [`ensure`] raises the soft
//! limit when the hard limit allows, and otherwise explains exactly what to run.

use crate::error::StorageError;

/// What [`ensure`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemlockStatus {
    /// The limit was already high enough.
    Sufficient,
    /// The soft limit was raised to the needed size.
    Raised,
    /// The limit is low but the process may lock memory anyway (CAP_IPC_LOCK).
    Privileged,
}

fn has_cap_ipc_lock() -> bool {
    // CapEff in /proc/self/status is a hex mask; CAP_IPC_LOCK is bit 14.
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|caps| caps & (1 << 14) != 0)
}

/// Makes sure `needed` bytes can be locked, raising the soft limit if allowed.
pub fn ensure(needed: u64) -> Result<MemlockStatus, StorageError> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) } != 0 {
        return Err(StorageError::Config(
            "getrlimit(RLIMIT_MEMLOCK) failed".into(),
        ));
    }
    if lim.rlim_cur == libc::RLIM_INFINITY || lim.rlim_cur >= needed {
        return Ok(MemlockStatus::Sufficient);
    }
    if lim.rlim_max == libc::RLIM_INFINITY || lim.rlim_max >= needed {
        let raised = libc::rlimit {
            rlim_cur: needed,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: setrlimit reads the struct we own.
        if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &raised) } == 0 {
            return Ok(MemlockStatus::Raised);
        }
    }
    if has_cap_ipc_lock() {
        return Ok(MemlockStatus::Privileged);
    }
    Err(StorageError::Memlock {
        current: lim.rlim_cur,
        needed,
        needed_kib: needed.div_ceil(1024),
    })
}
