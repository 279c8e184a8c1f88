//! `/validate` (`review_validation`, with its index of holds) on arbitrary bytes. Seeds: `tests/fixtures/admission/*.json`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    teeguard_fuzz::validate(data);
});
