//! Replays the committed fuzz corpus (`wire/fuzz/corpus/<target>/`) through the same
//! entry points the `cargo fuzz` targets call, so every CI run re-checks every input a
//! fuzzer ever kept, without a fuzzing toolchain.

fn replay(target: &str, run: fn(&[u8])) {
    let dir = manifest_dir().join("fuzz/corpus").join(target);
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let data = std::fs::read(entry.unwrap().path()).unwrap();
        run(&data);
        // Every prefix too: truncation is the commonest corruption.
        for cut in 0..data.len().min(256) {
            run(&data[..cut]);
        }
        n += 1;
    }
    assert!(n > 0, "{target}: corpus is empty");
}

#[test]
fn frames_corpus_replays_clean() {
    replay("frames", felix_wire::fuzzing::frames);
}

#[test]
fn json_message_corpus_replays_clean() {
    replay("json_message", felix_wire::fuzzing::json_message);
}

#[test]
fn publish_batch_corpus_replays_clean() {
    replay("publish_batch", felix_wire::fuzzing::publish_batch);
}

#[test]
fn publish_ack_corpus_replays_clean() {
    replay("publish_ack", felix_wire::fuzzing::publish_ack);
}

#[test]
fn event_batch_corpus_replays_clean() {
    replay("event_batch", felix_wire::fuzzing::event_batch);
}

#[test]
fn internal_corpus_replays_clean() {
    replay("internal", felix_wire::fuzzing::internal);
}

/// This package's directory: cargo's value at run time (a build reused from another
/// checkout must not read that checkout's files), the compile-time one otherwise.
fn manifest_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(
        || env!("CARGO_MANIFEST_DIR").into(),
        std::path::PathBuf::from,
    )
}
