//! Bounded, deterministic fuzzing on stable Rust: a seeded mutator (`teeguard_tests::fuzzing`) over
//! the committed AdmissionReview samples and misc-file samples, run through the same bodies as the
//! cargo-fuzz targets (`tests/fuzz`). Properties checked for every input: no panic; `/mutate` answers
//! a well-formed AdmissionReview (uid echoed, patch base64 JSON Patch that applies to the object and
//! leaves a valid Pod) or a 4xx error; `/validate` answers a well-formed AdmissionReview without a
//! patch or a 4xx error; the misc parsers return a value that round-trips or a typed error naming
//! the file.
//!
//! A failure prints the seed, iteration and the input (also written to `target/robust-fuzz-failure-*`)
//! so it can be replayed; crashes found this way become named tests below with the input in
//! `tests/fuzz/regressions/`.

#[path = "../fuzz/src/lib.rs"]
mod bodies;

use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};

use bodies::Seen;
use serde_json::Value;
use teeguard_tests::fuzzing::{Mutator, admission_corpus, misc_corpus};

/// Iterations per target: a few seconds in a debug build on 2 cores.
const ADMISSION_ITERATIONS: usize = 1_000;
const MISC_ITERATIONS: usize = 10_000;
const SEED: u64 = 0x7ee9_0a2d_f022_2026;

fn save_failure(target: &str, iteration: usize, input: &[u8]) -> String {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    let path = dir.join(format!("robust-fuzz-failure-{target}-{iteration}"));
    match std::fs::write(&path, input) {
        Ok(()) => path.display().to_string(),
        Err(e) => format!("(could not save the input: {e})"),
    }
}

/// Run `body` on `input`; on panic fail with the seed, iteration and where the input was saved.
fn run_one(target: &str, iteration: usize, input: &[u8], body: fn(&[u8]) -> Seen) -> Seen {
    match catch_unwind(AssertUnwindSafe(|| body(input))) {
        Ok(seen) => seen,
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            let saved = save_failure(target, iteration, input);
            panic!(
                "{target}: property violated at seed {SEED:#x} iteration {iteration}: {msg}\ninput saved to {saved}\ninput (lossy): {}",
                String::from_utf8_lossy(&input[..input.len().min(2000)])
            );
        }
    }
}

#[test]
fn corpus_itself_passes() {
    let corpus = admission_corpus().expect("admission samples");
    assert!(
        corpus.len() >= 15,
        "expected the committed samples, found {}",
        corpus.len()
    );
    let mut seen = BTreeMap::new();
    for (name, bytes) in &corpus {
        let s = run_one(name, 0, bytes, bodies::mutate);
        *seen.entry(s).or_insert(0) += 1;
        run_one(name, 0, bytes, bodies::validate);
    }
    // The samples include TEE pods (patched), non-TEE and exempt pods (allowed) and a VMI with two
    // TEE kinds (denied): each body path is exercised before any mutation.
    for want in [Seen::Patched, Seen::Allowed] {
        assert!(seen.contains_key(&want), "no sample was {want:?}: {seen:?}");
    }
    for text in misc_corpus() {
        run_one("misc", 0, text.as_bytes(), bodies::misc);
    }
}

#[test]
fn admission_mutate_bounded() {
    admission_bounded("mutate", SEED, bodies::mutate);
}

#[test]
fn admission_validate_bounded() {
    admission_bounded("validate", SEED ^ 0xa11d, bodies::validate);
}

fn admission_bounded(target: &str, seed: u64, body: fn(&[u8]) -> Seen) {
    let corpus = admission_corpus().expect("admission samples");
    let docs: Vec<Value> = corpus
        .iter()
        .map(|(name, b)| serde_json::from_slice(b).unwrap_or_else(|e| panic!("{name}: {e}")))
        .collect();
    let mut m = Mutator::new(seed);
    let mut seen: BTreeMap<Seen, usize> = BTreeMap::new();
    for i in 0..ADMISSION_ITERATIONS {
        let a = m.rng().usize(..corpus.len());
        let b = m.rng().usize(..corpus.len());
        let input = if m.rng().bool() {
            m.mutate_bytes(&corpus[a].1, &corpus[b].1)
        } else {
            let doc = m.mutate_json(&docs[a]);
            serde_json::to_vec(&doc).expect("a Value serialises")
        };
        let s = run_one(target, i, &input, body);
        *seen.entry(s).or_insert(0) += 1;
    }
    println!("{target}: {seen:?}");
    // The mix must reach both the rejection path and the decision paths, or the mutator is useless:
    // more than this many of each outcome.
    let floors: &[(Seen, usize)] = if target == "validate" {
        &[
            (Seen::Rejected, ADMISSION_ITERATIONS / 10),
            (Seen::Allowed, ADMISSION_ITERATIONS / 20),
        ]
    } else {
        &[
            (Seen::Rejected, ADMISSION_ITERATIONS / 10),
            (Seen::Patched, ADMISSION_ITERATIONS / 20),
            (Seen::Allowed, 0),
        ]
    };
    for (outcome, floor) in floors {
        assert!(
            seen.get(outcome).copied().unwrap_or(0) > *floor,
            "{outcome:?}: {seen:?}"
        );
    }
}

#[test]
fn misc_parsers_bounded() {
    let corpus = misc_corpus();
    let mut m = Mutator::new(SEED ^ 0x5a5a);
    let mut seen: BTreeMap<Seen, usize> = BTreeMap::new();
    for i in 0..MISC_ITERATIONS {
        let a = corpus[m.rng().usize(..corpus.len())].as_bytes();
        let b = corpus[m.rng().usize(..corpus.len())].as_bytes();
        let input = m.mutate_bytes(a, b);
        let s = run_one("misc", i, &input, bodies::misc);
        *seen.entry(s).or_insert(0) += 1;
    }
    println!("misc: {seen:?}");
    assert!(
        seen.get(&Seen::Parsed).copied().unwrap_or(0) > MISC_ITERATIONS / 10,
        "{seen:?}"
    );
    assert!(
        seen.get(&Seen::Rejected).copied().unwrap_or(0) > MISC_ITERATIONS / 10,
        "{seen:?}"
    );
}

/// Huge and pathological inputs that random mutation rarely builds.
#[test]
fn pathological_inputs() {
    let deep_array = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let deep_object = format!(
        r#"{{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{{"uid":"u","operation":"CREATE","object":{}1{}}}}}"#,
        r#"{"a":"#.repeat(10_000),
        "}".repeat(10_000)
    );
    let many_containers = {
        let sample = admission_corpus()
            .expect("samples")
            .into_iter()
            .find(|(n, _)| n == "mutate-tdx-pod.json")
            .expect("tdx sample")
            .1;
        let mut v: Value = serde_json::from_slice(&sample).expect("json");
        let c = v["request"]["object"]["spec"]["containers"][0].clone();
        let list: Vec<Value> = (0..500)
            .map(|i| {
                let mut c = c.clone();
                if i > 0 {
                    c["name"] = Value::String(format!("c{i}"));
                }
                c
            })
            .collect();
        v["request"]["object"]["spec"]["containers"] = Value::Array(list);
        serde_json::to_vec(&v).expect("json")
    };
    let inputs: Vec<(&str, Vec<u8>)> = vec![
        ("empty", Vec::new()),
        ("nul bytes", vec![0; 4096]),
        ("deep array", deep_array.into_bytes()),
        ("deep object", deep_object.into_bytes()),
        ("500 containers", many_containers),
        ("huge number", br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":1e999999,"operation":"CREATE"}}"#.to_vec()),
        ("lone surrogate uid", br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"\ud800","operation":"CREATE"}}"#.to_vec()),
    ];
    for (name, input) in &inputs {
        run_one(name, 0, input, bodies::mutate);
        run_one(name, 0, input, bodies::validate);
    }
    let long_line = format!("tdx {}\n", "9".repeat(1_000_000));
    // parse_values is quadratic in the number of distinct names (MiscValues::set scans the list):
    // 20 000 lines take seconds in a debug build, so keep this at a size real files never reach.
    let many_lines: String = (0..2_000).map(|i| format!("r{i} {i}\n")).collect();
    for text in [long_line.as_str(), many_lines.as_str()] {
        run_one("misc", 0, text.as_bytes(), bodies::misc);
    }
}

/// Regression found by `cargo fuzz run misc` (input in `tests/fuzz/regressions/`): a misc-file parse
/// error quoted the resource name untruncated, so one garbage line yielded a multi-kilobyte log message.
#[test]
fn regression_misc_unbounded_error_message() {
    let input = std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fuzz/regressions/misc-unbounded-error-message"),
    )
    .expect("regression input");
    run_one("misc regression", 0, &input, bodies::misc);
}
