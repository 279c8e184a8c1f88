//! Deterministic input mutation for bounded fuzzing on stable Rust (the `robust_fuzz` test) and a
//! corpus of realistic seeds.
//!
//! [`Mutator`] is a seeded generator (`fastrand`) with byte-level mutations (flips, truncation, splicing,
//! insertion of interesting tokens) and JSON-structure mutations (values replaced by other types, keys
//! deleted, deep nesting, huge numbers, odd unicode). Same seed, same sequence: a failure is reproduced
//! by its seed and iteration number.

use std::path::PathBuf;

use serde_json::{Map, Value, json};

/// One element of a non-empty slice.
fn pick<'a, T>(rng: &mut fastrand::Rng, items: &'a [T]) -> &'a T {
    &items[rng.usize(..items.len())]
}

/// Tokens that tend to reach parser corner cases.
const TOKENS: &[&str] = &[
    "null",
    "true",
    "false",
    "0",
    "-1",
    "18446744073709551616",
    "1e999",
    "-0.0",
    "\"\"",
    "{}",
    "[]",
    "\"\\u0000\"",
    "\"\\ud800\"",
    "\"\u{202e}\u{feff}\"",
    "\"CREATE\"",
    "\"DELETE\"",
    "\"admission.k8s.io/v1\"",
    "\"AdmissionReview\"",
    "\"kubevirt.io\"",
    "\"virt-launcher\"",
    "\"compute\"",
    "\"tdx.intel.com/keys\"",
    "\"1\"",
    "\"1.5\"",
    "\"1k\"",
    ",",
    ":",
    "\"",
    "\\",
    "{",
    "}",
    "[",
    "]",
    "\n",
    "\t",
    " max",
    "tdx",
    "sev",
    "sev_es",
    "tdx.max",
    ".max",
];

/// Mutates byte strings and JSON documents deterministically.
#[derive(Clone, Debug)]
pub struct Mutator {
    rng: fastrand::Rng,
}

impl Mutator {
    /// A mutator from `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            rng: fastrand::Rng::with_seed(seed),
        }
    }

    /// The random source (for callers choosing their own variations).
    pub fn rng(&mut self) -> &mut fastrand::Rng {
        &mut self.rng
    }

    /// Apply 1-4 random byte-level mutations; `other` is a second input for splicing.
    pub fn mutate_bytes(&mut self, input: &[u8], other: &[u8]) -> Vec<u8> {
        let mut out = input.to_vec();
        let rounds = 1 + self.rng.usize(..4);
        for _ in 0..rounds {
            self.mutate_bytes_once(&mut out, other);
        }
        out
    }

    fn mutate_bytes_once(&mut self, out: &mut Vec<u8>, other: &[u8]) {
        let len = out.len();
        match self.rng.usize(..9) {
            // Flip a bit.
            0 if len > 0 => {
                let i = self.rng.usize(..len);
                out[i] ^= 1 << self.rng.usize(..8);
            }
            // Replace a byte with an interesting one.
            1 if len > 0 => {
                let i = self.rng.usize(..len);
                out[i] = *pick(
                    &mut self.rng,
                    &[
                        0u8, b'"', b'\\', b'{', b'}', b'[', b']', b':', b',', 0xff, 0xc3, b'\n',
                    ],
                );
            }
            // Truncate.
            2 if len > 0 => {
                let at = self.rng.usize(..len);
                out.truncate(at);
            }
            // Delete a range.
            3 if len > 1 => {
                let a = self.rng.usize(..len);
                let b = (a + 1 + self.rng.usize(..64)).min(len);
                out.drain(a..b);
            }
            // Duplicate a range.
            4 if len > 1 => {
                let a = self.rng.usize(..len);
                let b = (a + 1 + self.rng.usize(..256)).min(len);
                let chunk = out[a..b].to_vec();
                let at = self.rng.usize(..len);
                out.splice(at..at, chunk);
            }
            // Insert a token.
            5 => {
                let at = self.rng.usize(..len + 1);
                let tok = pick(&mut self.rng, TOKENS).as_bytes().to_vec();
                out.splice(at..at, tok);
            }
            // Splice: our head + the other input's tail.
            6 if !other.is_empty() => {
                let at = self.rng.usize(..len + 1);
                let from = self.rng.usize(..other.len());
                out.truncate(at);
                out.extend_from_slice(&other[from..]);
            }
            // Overwrite a digit with a huge or odd number.
            7 if len > 0 => {
                let start = self.rng.usize(..len);
                if let Some(i) = (0..len)
                    .map(|k| (start + k) % len)
                    .find(|&i| out[i].is_ascii_digit())
                {
                    let tok = *pick(
                        &mut self.rng,
                        &["99999999999999999999999", "-1", "1e308", "0.5"],
                    );
                    out.splice(i..i + 1, tok.bytes());
                }
            }
            // Invalid UTF-8 sequence.
            _ => {
                let at = self.rng.usize(..len + 1);
                const SEQS: [&[u8]; 4] = [
                    &[0xff],
                    &[0xc3, 0x28],
                    &[0xed, 0xa0, 0x80],
                    &[0xf4, 0x90, 0x80, 0x80],
                ];
                let seq = *pick(&mut self.rng, &SEQS);
                out.splice(at..at, seq.iter().copied());
            }
        }
    }

    /// Apply 1-3 random structural mutations to a JSON document.
    pub fn mutate_json(&mut self, doc: &Value) -> Value {
        let mut out = doc.clone();
        let rounds = 1 + self.rng.usize(..3);
        for _ in 0..rounds {
            let paths = collect_paths(&out);
            let path = pick(&mut self.rng, &paths).clone();
            self.mutate_at(&mut out, &path);
        }
        out
    }

    fn mutate_at(&mut self, doc: &mut Value, path: &[Step]) {
        let choice = self.rng.usize(..8);
        // Deleting a key needs the parent.
        if choice == 0 && !path.is_empty() {
            let Some((last, parent)) = path.split_last() else {
                return;
            };
            if let Some(p) = get_mut(doc, parent) {
                match (p, last) {
                    (Value::Object(m), Step::Key(k)) => {
                        m.remove(k);
                    }
                    (Value::Array(a), Step::Index(i)) if *i < a.len() => {
                        a.remove(*i);
                    }
                    _ => {}
                }
            }
            return;
        }
        let replacement = self.replacement(choice);
        if let Some(slot) = get_mut(doc, path) {
            match replacement {
                Some(v) => *slot = v,
                None => {
                    // Wrap in deep nesting.
                    let depth = 1 + self.rng.usize(..200);
                    let mut v = std::mem::take(slot);
                    for _ in 0..depth {
                        v = if self.rng.bool() {
                            Value::Array(vec![v])
                        } else {
                            json!({ "x": v })
                        };
                    }
                    *slot = v;
                }
            }
        }
    }

    /// A value of a random type, or `None` for "nest the current value deeply".
    fn replacement(&mut self, choice: usize) -> Option<Value> {
        let r = &mut self.rng;
        Some(match choice {
            1 => Value::Null,
            2 => json!(r.bool()),
            3 => {
                let numbers = [
                    json!(0),
                    json!(-1),
                    json!(u64::MAX),
                    json!(i64::MIN),
                    json!(1.5e300),
                    json!(-0.0),
                    json!(4_294_967_296u64),
                ];
                pick(r, &numbers).clone()
            }
            4 => {
                let s = *pick(
                    r,
                    &[
                        "",
                        "CREATE",
                        "UPDATE",
                        "pods",
                        "binding",
                        "compute",
                        "virt-launcher",
                        "true",
                        "1",
                        "-1",
                        "1.5",
                        "999999999999999999999",
                        "tdx 1",
                        "\u{0}",
                        "\u{202e}evil",
                        "ユニコード",
                        "a/b~c",
                        "kubevirt.io/v1",
                        "VirtualMachineInstance",
                    ],
                );
                if r.usize(..8) == 0 {
                    Value::String(s.repeat(10_000))
                } else {
                    Value::String(s.to_owned())
                }
            }
            5 => Value::Array(vec![Value::Null, json!(1), json!("x")]),
            6 => Value::Object(Map::new()),
            _ => return None,
        })
    }
}

#[derive(Clone, Debug)]
enum Step {
    Key(String),
    Index(usize),
}

fn collect_paths(doc: &Value) -> Vec<Vec<Step>> {
    let mut out = vec![Vec::new()];
    let mut stack: Vec<(Vec<Step>, &Value)> = vec![(Vec::new(), doc)];
    while let Some((path, v)) = stack.pop() {
        match v {
            Value::Object(m) => {
                for (k, child) in m {
                    let mut p = path.clone();
                    p.push(Step::Key(k.clone()));
                    out.push(p.clone());
                    stack.push((p, child));
                }
            }
            Value::Array(a) => {
                for (i, child) in a.iter().enumerate() {
                    let mut p = path.clone();
                    p.push(Step::Index(i));
                    out.push(p.clone());
                    stack.push((p, child));
                }
            }
            _ => {}
        }
    }
    out
}

fn get_mut<'a>(doc: &'a mut Value, path: &[Step]) -> Option<&'a mut Value> {
    let mut cur = doc;
    for step in path {
        cur = match (cur, step) {
            (Value::Object(m), Step::Key(k)) => m.get_mut(k)?,
            (Value::Array(a), Step::Index(i)) => a.get_mut(*i)?,
            _ => return None,
        };
    }
    Some(cur)
}

/// The directory of committed sample files (`tests/fixtures`).
pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

/// Every committed AdmissionReview sample (`tests/fixtures/admission/*.json`), sorted by file name.
pub fn admission_corpus() -> std::io::Result<Vec<(String, Vec<u8>)>> {
    let dir = fixtures_dir().join("admission");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "json") {
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            out.push((name, std::fs::read(&path)?));
        }
    }
    out.sort();
    Ok(out)
}

/// Realistic misc cgroup file contents (as seen on hosts, including the odd ones the kernel or a
/// half-written file produce), for seeding the misc-file parsers.
pub fn misc_corpus() -> Vec<&'static str> {
    vec![
        "tdx 31\n",
        "sev 99\nsev_es 410\n",
        "tdx 0\nsev 0\nsev_es 0\n",
        "tdx 31 \n\n",
        "res_a 3\ntdx 16\nunknown_thing 7\n",
        "tdx max\nsev 4\n",
        "sev_es max\n",
        "tdx.max 0\nsev.max 2\nsev_es.max 18446744073709551615\n",
        "tdx.max 3\n",
        "",
        "\n",
        "tdx",
        "tdx 1 2\n",
        "tdx -1\n",
        "tdx 18446744073709551616\n",
        ".max 1\n",
    ]
}
