#![no_main]
//! Fuzz target: see `felix_broker::session::testing::fuzz_session` for what is checked.

libfuzzer_sys::fuzz_target!(|data: &[u8]| felix_broker::session::testing::fuzz_session(data));
