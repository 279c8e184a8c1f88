//! The committed sample files under `tests/fixtures/` (used by the README's curl example, the offline
//! CLI and docs) must equal what the builders produce. Regenerate with
//! `TEEGUARD_REGENERATE_FIXTURES=1 cargo test -p teeguard-tests --test fixtures_files`.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use serde_json::Value;
use teeguard_tests::fixtures::{Tee, regenerate, sample_files, vmi};

/// Directories whose every file is generated.
const MANAGED: [&str; 2] = ["admission", "vmis"];

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

fn first_difference(committed: &str, generated: &str) -> String {
    for (i, (a, b)) in committed.lines().zip(generated.lines()).enumerate() {
        if a != b {
            return format!("line {}: committed {a:?}, generated {b:?}", i + 1);
        }
    }
    format!(
        "committed has {} lines, generated {}",
        committed.lines().count(),
        generated.lines().count()
    )
}

#[test]
fn committed_samples_match_the_builders() {
    let dir = fixtures_dir();
    let files = sample_files();
    let mut problems = Vec::new();
    for (rel, content) in &files {
        let path = dir.join(rel);
        match fs::read_to_string(&path) {
            Ok(committed) if committed == *content => {}
            found => {
                if regenerate() {
                    fs::create_dir_all(path.parent().expect("parent"))
                        .expect("create fixtures dir");
                    fs::write(&path, content).expect("write fixture");
                } else {
                    let why = match found {
                        Ok(committed) => first_difference(&committed, content),
                        Err(e) => format!("cannot read: {e}"),
                    };
                    problems.push(format!("{rel}: {why}"));
                }
            }
        }
    }
    let expected: BTreeSet<&str> = files.iter().map(|(rel, _)| rel.as_str()).collect();
    for sub in MANAGED {
        let Ok(entries) = fs::read_dir(dir.join(sub)) else {
            continue;
        };
        for entry in entries {
            let entry = entry.expect("dir entry");
            let rel = format!("{sub}/{}", entry.file_name().to_string_lossy());
            if !expected.contains(rel.as_str()) {
                if regenerate() {
                    fs::remove_file(entry.path()).expect("remove stale fixture");
                } else {
                    problems.push(format!("{rel}: stale, no builder produces it"));
                }
            }
        }
    }
    assert!(
        problems.is_empty(),
        "sample files drifted from the builders:\n  {}\nrun: TEEGUARD_REGENERATE_FIXTURES=1 cargo test -p teeguard-tests --test fixtures_files",
        problems.join("\n  ")
    );
}

#[test]
fn samples_are_deterministic_and_parse_back() {
    let first = sample_files();
    assert_eq!(first, sample_files());
    let mut names = BTreeSet::new();
    for (rel, content) in &first {
        assert!(names.insert(rel.clone()), "duplicate {rel}");
        assert!(content.ends_with('\n'), "{rel} ends with a newline");
        if rel.ends_with(".json") {
            let _: Value = serde_json::from_str(content).unwrap_or_else(|e| panic!("{rel}: {e}"));
            assert!(
                content.starts_with("{\n  \"apiVersion\""),
                "{rel} is pretty-printed with sorted keys"
            );
        }
    }
    for tee in Tee::ALL {
        let rel = format!("vmis/{}.yaml", tee.slug());
        let (_, yaml) = first.iter().find(|(r, _)| *r == rel).expect("vmi sample");
        let parsed: Value = serde_yaml::from_str(yaml).unwrap_or_else(|e| panic!("{rel}: {e}"));
        assert_eq!(parsed, vmi(tee), "{rel} parses back to the builder's VMI");
    }
    for expected in [
        "admission/mutate-tdx-pod.json",
        "admission/validate-binding.json",
    ] {
        assert!(
            names.contains(expected),
            "{expected} is referenced by the README"
        );
    }
}
