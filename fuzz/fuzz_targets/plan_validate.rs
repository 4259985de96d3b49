//! `plan_validate`: the input type, the body and its invariants are
//! `stowage_fuzz_checks::plan_validate` (also run over the committed corpus
//! by the test suite).

#![no_main]

use stowage_fuzz_checks::plan_validate::{Input, check_input};

libfuzzer_sys::fuzz_target!(|input: Input| check_input(input));
