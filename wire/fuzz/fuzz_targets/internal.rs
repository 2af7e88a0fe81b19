#![no_main]
//! Fuzz target: see `felix_wire::fuzzing::internal` for the invariants checked.

libfuzzer_sys::fuzz_target!(|data: &[u8]| felix_wire::fuzzing::internal(data));
