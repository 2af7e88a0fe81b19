#![no_main]
//! Fuzz target: see `felix_storage_uring::fuzzing::recovery` for the invariants checked.

libfuzzer_sys::fuzz_target!(|data: &[u8]| felix_storage_uring::fuzzing::recovery(data));
