//! The one clock seam. Stateful logic never reads a clock: its driver calls [`now`] once
//! per event and passes the [`Now`] in, so tests hand in virtual time instead.
//!
//! A `Now` carries both clocks because they answer different questions: the monotonic
//! instant drives timers and deadlines (it never steps), the wall clock stamps records
//! and checks token expiry (it is what other machines agree on).

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// A moment, on both clocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Now {
    /// Monotonic time, for timers.
    pub instant: Instant,
    /// Wall-clock microseconds since the Unix epoch, for records and expiry.
    pub wall_micros: u64,
}

impl Now {
    /// A moment given explicitly (virtual time in tests).
    pub fn at(instant: Instant, wall_micros: u64) -> Now {
        Now {
            instant,
            wall_micros,
        }
    }

    /// Wall-clock seconds since the epoch.
    pub fn wall_secs(&self) -> u64 {
        self.wall_micros / 1_000_000
    }

    /// Wall-clock milliseconds since the epoch.
    pub fn wall_ms(&self) -> u64 {
        self.wall_micros / 1_000
    }

    /// This moment moved `d` later on both clocks.
    pub fn after(&self, d: Duration) -> Now {
        Now {
            instant: self.instant + d,
            wall_micros: self.wall_micros + d.as_micros() as u64,
        }
    }
}

/// Reads both clocks.
pub fn now() -> Now {
    Now {
        instant: Instant::now(),
        wall_micros: wall_micros(),
    }
}

/// Wall-clock microseconds since the Unix epoch (0 before it).
pub fn wall_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// A moment on `CLOCK_BOOTTIME`, in nanoseconds since boot: monotonic like [`Instant`]
/// (`CLOCK_MONOTONIC`), but it also counts the time the host spent suspended. A lease
/// must: the control plane's clock runs on through a suspend, and a broker whose
/// monotonic clock stood still would wake believing it still held a lease the control
/// plane had let lapse, and gave away.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BootTime(u64);

impl BootTime {
    /// Now.
    pub fn now() -> BootTime {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid timespec to write; CLOCK_BOOTTIME exists on every
        // Linux this runs on (since 2.6.39), so the call cannot fail.
        unsafe {
            libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts);
        }
        BootTime(ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
    }

    /// The moment `nanos` after boot (virtual time in tests).
    pub fn from_nanos(nanos: u64) -> BootTime {
        BootTime(nanos)
    }

    /// Nanoseconds since boot.
    pub fn nanos(self) -> u64 {
        self.0
    }

    /// This moment moved `d` later.
    pub fn after(self, d: Duration) -> BootTime {
        BootTime(
            self.0
                .saturating_add(d.as_nanos().min(u128::from(u64::MAX)) as u64),
        )
    }
}
