//! Percentiles and medians for benchmark output.

/// The `p` quantile (0..=1) of `v` (sorted in place). 0 for an empty slice.
pub fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN latencies"));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// The median of `v`.
pub fn median(mut v: Vec<f64>) -> f64 {
    percentile(&mut v, 0.5)
}
