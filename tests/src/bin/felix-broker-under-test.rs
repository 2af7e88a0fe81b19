//! The broker binary the harness spawns. It is this package's own target, so
//! `cargo test -p felix-cluster` always rebuilds it from the current broker code (a
//! prebuilt `felix-broker` could be stale and make "revert the fix, watch the test
//! fail" silently test the old code).

fn main() -> anyhow::Result<()> {
    felix_broker::cli::main()
}
