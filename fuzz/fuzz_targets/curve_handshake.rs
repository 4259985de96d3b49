//! `curve_handshake`: the body and its invariants are `stowage_fuzz_checks::curve_handshake`
//! (also run over the committed corpus by the test suite).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| stowage_fuzz_checks::curve_handshake::check(data));
