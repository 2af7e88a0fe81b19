//! A latency histogram one core writes and `/metrics` reads: fixed buckets of relaxed
//! atomic counters, so recording is a few uncontended increments on the core's own
//! cache lines and reading never stops the core.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the buckets, in microseconds (a last one, `+Inf`, is implied): the
/// storage log's, so its device times add straight in.
pub use felix_storage_uring::LATENCY_BOUNDS_US as BOUNDS_US;

/// Counts of observations per bucket, their sum and count.
#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; BOUNDS_US.len() + 1],
    sum_us: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&self, d: Duration) {
        let us = d.as_micros().min(u128::from(u64::MAX)) as u64;
        let i = BOUNDS_US.partition_point(|b| *b < us);
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// Adds observations counted elsewhere (a log's device times) in the same buckets.
    pub fn add(&self, b: &felix_storage_uring::LatencyBuckets) {
        let mut n = 0;
        for (bucket, c) in self.buckets.iter().zip(b.counts) {
            if c > 0 {
                bucket.fetch_add(c, Ordering::Relaxed);
                n += c;
            }
        }
        self.sum_us.fetch_add(b.sum_us, Ordering::Relaxed);
        self.count.fetch_add(n, Ordering::Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Counts per bucket (not cumulative), in [`BOUNDS_US`] order and `+Inf` last.
    pub fn buckets(&self) -> Vec<u64> {
        self.buckets
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .collect()
    }

    /// Sum of observations, seconds.
    pub fn sum_seconds(&self) -> f64 {
        self.sum_us.load(Ordering::Relaxed) as f64 / 1e6
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observations_land_in_their_buckets_with_sum_and_count() {
        let h = Histogram::default();
        h.observe(Duration::from_micros(20));
        h.observe(Duration::from_micros(25));
        h.observe(Duration::from_micros(400));
        h.observe(Duration::from_secs(5));
        let b = h.buckets();
        assert_eq!(b.len(), BOUNDS_US.len() + 1);
        assert_eq!(b[0], 2, "25 µs is in the 25 µs bucket: {b:?}");
        assert_eq!(b[5], 1, "400 µs is in the 500 µs bucket: {b:?}");
        assert_eq!(b[BOUNDS_US.len()], 1, "5 s is past the last bound: {b:?}");
        assert_eq!(b.iter().sum::<u64>(), 4);
        assert_eq!(h.count(), 4);
        assert!((h.sum_seconds() - 5.000445).abs() < 1e-9);
        let mut more = felix_storage_uring::LatencyBuckets::default();
        more.observe(Duration::from_micros(30));
        more.observe(Duration::from_secs(2));
        h.add(&more);
        let b = h.buckets();
        assert_eq!((b[1], b[BOUNDS_US.len()], h.count()), (1, 2, 6));
    }
}
