//! The misc cgroup file parsers (`parse_values`, `parse_max`, `parse_events`) on arbitrary bytes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    teeguard_fuzz::misc(data);
});
