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
