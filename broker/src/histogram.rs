//! A latency histogram one core writes and `/metrics` reads: fixed buckets of relaxed
//! atomic counters, so recording is a few uncontended increments on the core's own
//! cache lines and reading never stops the core.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the buckets, in microseconds (a last one, `+Inf`, is implied).
pub const BOUNDS_US: [u64; 14] = [
    25, 50, 100, 200, 300, 500, 1_000, 2_000, 5_000, 10_000, 50_000, 100_000, 500_000, 1_000_000,
];

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

    /// Appends this histogram's Prometheus lines (`_bucket` cumulative with `le` in
    /// seconds, `_sum`, `_count`) for series `name` with `labels` (`core="0"`).
    pub fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0u64;
        for (i, b) in self.buckets.iter().enumerate() {
            cumulative += b.load(Ordering::Relaxed);
            let le = match BOUNDS_US.get(i) {
                Some(us) => format!("{}", *us as f64 / 1e6),
                None => "+Inf".to_owned(),
            };
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le}\"}} {cumulative}");
        }
        let _ = writeln!(
            out,
            "{name}_sum{{{labels}}} {}",
            self.sum_us.load(Ordering::Relaxed) as f64 / 1e6
        );
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observations_land_in_cumulative_buckets_with_sum_and_count() {
        let h = Histogram::default();
        h.observe(Duration::from_micros(20));
        h.observe(Duration::from_micros(25));
        h.observe(Duration::from_micros(400));
        h.observe(Duration::from_secs(5));
        let mut out = String::new();
        h.render(&mut out, "x_seconds", "core=\"0\"");
        let line = |le: &str| {
            out.lines()
                .find(|l| l.starts_with(&format!("x_seconds_bucket{{core=\"0\",le=\"{le}\"}}")))
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|v| v.parse::<u64>().ok())
        };
        assert_eq!(line("0.000025"), Some(2), "{out}");
        assert_eq!(line("0.0003"), Some(2), "{out}");
        assert_eq!(line("0.0005"), Some(3), "{out}");
        assert_eq!(line("1"), Some(3), "{out}");
        assert_eq!(line("+Inf"), Some(4), "{out}");
        assert!(out.contains("x_seconds_count{core=\"0\"} 4"), "{out}");
        assert!(out.contains("x_seconds_sum{core=\"0\"} 5.000445"), "{out}");
    }
}
