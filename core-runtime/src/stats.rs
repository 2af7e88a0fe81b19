//! Per-core statistics, written by the owning core and read by the metrics exporter.
//!
//! Counters are relaxed atomics on the owning core's own struct (no contention: one
//! writer). Latency histograms are recorded into a core-local HDR histogram and merged
//! into the shared one at most once per `flush_interval`, so the hot path never takes a
//! lock.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

/// Counters and histograms of one core.
#[derive(Debug)]
pub struct CoreStats {
    /// Driver/inbox loop iterations.
    pub loops: AtomicU64,
    /// Iterations that took longer than 10 ms (a stalled loop).
    pub stalls: AtomicU64,
    /// Tasks spawned.
    pub tasks: AtomicU64,
    /// Messages sent to other cores.
    pub mesh_sent: AtomicU64,
    /// Messages received from other cores.
    pub mesh_received: AtomicU64,
    /// Messages waiting in this core's inbox (sampled).
    pub inbox_depth: AtomicU64,
    /// Nanoseconds the executor spent running tasks (sampled from glommio).
    pub busy_ns: AtomicU64,
    latency: Mutex<Histogram<u64>>,
}

impl Default for CoreStats {
    fn default() -> Self {
        Self {
            loops: AtomicU64::new(0),
            stalls: AtomicU64::new(0),
            tasks: AtomicU64::new(0),
            mesh_sent: AtomicU64::new(0),
            mesh_received: AtomicU64::new(0),
            inbox_depth: AtomicU64::new(0),
            busy_ns: AtomicU64::new(0),
            latency: Mutex::new(
                Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid bounds"),
            ),
        }
    }
}

/// A latency snapshot, microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LatencySummary {
    /// Samples.
    pub count: u64,
    /// Median.
    pub p50: u64,
    /// 99th percentile.
    pub p99: u64,
    /// 99.9th percentile.
    pub p999: u64,
    /// Maximum.
    pub max: u64,
}

impl CoreStats {
    /// Adds one to a counter.
    pub fn incr(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Current value of a counter.
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }

    /// The merged latency histogram's summary.
    pub fn latency(&self) -> LatencySummary {
        let h = self
            .latency
            .lock()
            .expect("stats lock is never poisoned by a panic-free merge");
        LatencySummary {
            count: h.len(),
            p50: h.value_at_quantile(0.5),
            p99: h.value_at_quantile(0.99),
            p999: h.value_at_quantile(0.999),
            max: h.max(),
        }
    }

    fn merge(&self, local: &Histogram<u64>) {
        if let Ok(mut h) = self.latency.lock() {
            let _ = h.add(local);
        }
    }
}

/// A core-local latency recorder that merges into [`CoreStats`] periodically.
#[derive(Debug)]
pub struct LatencyRecorder {
    local: Histogram<u64>,
    last_flush: Instant,
    flush_interval: Duration,
}

impl Default for LatencyRecorder {
    fn default() -> Self {
        Self {
            local: Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid bounds"),
            last_flush: Instant::now(),
            flush_interval: Duration::from_secs(1),
        }
    }
}

impl LatencyRecorder {
    /// Records one latency, merging into `stats` if the interval passed.
    pub fn record(&mut self, stats: &CoreStats, latency: Duration) {
        let _ = self
            .local
            .record((latency.as_micros() as u64).clamp(1, 60_000_000));
        if self.last_flush.elapsed() >= self.flush_interval {
            self.flush(stats);
        }
    }

    /// Merges now.
    pub fn flush(&mut self, stats: &CoreStats) {
        stats.merge(&self.local);
        self.local.reset();
        self.last_flush = Instant::now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latencies_reach_the_shared_histogram_only_on_flush() {
        let stats = CoreStats::default();
        let mut r = LatencyRecorder::default();
        for us in [100u64, 200, 300] {
            r.record(&stats, Duration::from_micros(us));
        }
        assert_eq!(stats.latency().count, 0, "not yet merged");
        r.flush(&stats);
        let l = stats.latency();
        assert_eq!(l.count, 3);
        assert!((199..=201).contains(&l.p50), "{l:?}");
    }
}
