//! `checkpoint_file`: the body and its invariants are
//! `stowage_fuzz_checks::checkpoint_file` (also run over the committed
//! corpus by the test suite).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| stowage_fuzz_checks::checkpoint_file::check(data));
