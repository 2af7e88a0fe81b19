//! The seeded twin of the `recovery` fuzz target: thousands of random damage patterns
//! on every run, without a fuzzing toolchain.

use rand::{RngExt, SeedableRng};

#[test]
fn random_damage_never_panics_recovery_or_invents_records() {
    let seed = std::env::var("FELIX_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::rng().random::<u64>());
    eprintln!("FELIX_FUZZ_SEED={seed}");
    // The long form (docs/reliability.md row 9) asks for more: FELIX_FUZZ_PATTERNS=N.
    let patterns = std::env::var("FELIX_FUZZ_PATTERNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3000u64);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for _ in 0..patterns {
        let len = rng.random_range(0..64);
        let mut data: Vec<u8> = (0..len).map(|_| rng.random()).collect();
        if !data.is_empty() && rng.random_bool(0.8) {
            data[0] &= !1; // mostly damaged valid logs: they reach deeper
        }
        felix_storage_uring::fuzzing::recovery(&data);
    }
}
