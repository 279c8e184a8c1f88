//! Deterministic input mutation for bounded fuzzing on stable Rust (the `robust_fuzz` test) and a
//! corpus of realistic seeds.
//!
//! [`Mutator`] is a seeded xorshift generator with byte-level mutations (flips, truncation, splicing,
//! insertion of interesting tokens) and JSON-structure mutations (values replaced by other types, keys
//! deleted, deep nesting, huge numbers, odd unicode). Same seed, same sequence: a failure is reproduced
//! by its seed and iteration number.

use std::path::PathBuf;

use serde_json::{Map, Value, json};

/// xorshift64* generator: fast, deterministic, good enough to pick mutations.
#[derive(Clone, Debug)]
pub struct XorShift {
    state: u64,
}

impl XorShift {
    /// A generator from `seed` (0 is replaced by a fixed non-zero constant).
    pub fn new(seed: u64) -> Self {
        Self {
            state: if seed == 0 {
                0x9E37_79B9_7F4A_7C15
            } else {
                seed
            },
        }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.state;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.state = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform-ish in `0..n` (`0` when `n == 0`).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }

    /// True with probability `1 / n`.
    pub fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }

    /// One element of a non-empty slice.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
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
    rng: XorShift,
}

impl Mutator {
    /// A mutator from `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            rng: XorShift::new(seed),
        }
    }

    /// The random source (for callers choosing their own variations).
    pub fn rng(&mut self) -> &mut XorShift {
        &mut self.rng
    }

    /// Apply 1-4 random byte-level mutations; `other` is a second input for splicing.
    pub fn mutate_bytes(&mut self, input: &[u8], other: &[u8]) -> Vec<u8> {
        let mut out = input.to_vec();
        let rounds = 1 + self.rng.below(4);
        for _ in 0..rounds {
            self.mutate_bytes_once(&mut out, other);
        }
        out
    }

    fn mutate_bytes_once(&mut self, out: &mut Vec<u8>, other: &[u8]) {
        let len = out.len();
        match self.rng.below(9) {
            // Flip a bit.
            0 if len > 0 => {
                let i = self.rng.below(len);
                out[i] ^= 1 << self.rng.below(8);
            }
            // Replace a byte with an interesting one.
            1 if len > 0 => {
                let i = self.rng.below(len);
                out[i] = *self.rng.pick(&[
                    0u8, b'"', b'\\', b'{', b'}', b'[', b']', b':', b',', 0xff, 0xc3, b'\n',
                ]);
            }
            // Truncate.
            2 if len > 0 => {
                let at = self.rng.below(len);
                out.truncate(at);
            }
            // Delete a range.
            3 if len > 1 => {
                let a = self.rng.below(len);
                let b = (a + 1 + self.rng.below(64)).min(len);
                out.drain(a..b);
            }
            // Duplicate a range.
            4 if len > 1 => {
                let a = self.rng.below(len);
                let b = (a + 1 + self.rng.below(256)).min(len);
                let chunk = out[a..b].to_vec();
                let at = self.rng.below(len);
                out.splice(at..at, chunk);
            }
            // Insert a token.
            5 => {
                let at = self.rng.below(len + 1);
                let tok = self.rng.pick(TOKENS).as_bytes().to_vec();
                out.splice(at..at, tok);
            }
            // Splice: our head + the other input's tail.
            6 if !other.is_empty() => {
                let at = self.rng.below(len + 1);
                let from = self.rng.below(other.len());
                out.truncate(at);
                out.extend_from_slice(&other[from..]);
            }
            // Overwrite a digit with a huge or odd number.
            7 if len > 0 => {
                let start = self.rng.below(len);
                if let Some(i) = (0..len)
                    .map(|k| (start + k) % len)
                    .find(|&i| out[i].is_ascii_digit())
                {
                    let tok = *self
                        .rng
                        .pick(&["99999999999999999999999", "-1", "1e308", "0.5"]);
                    out.splice(i..i + 1, tok.bytes());
                }
            }
            // Invalid UTF-8 sequence.
            _ => {
                let at = self.rng.below(len + 1);
                const SEQS: [&[u8]; 4] = [
                    &[0xff],
                    &[0xc3, 0x28],
                    &[0xed, 0xa0, 0x80],
                    &[0xf4, 0x90, 0x80, 0x80],
                ];
                let seq = *self.rng.pick(&SEQS);
                out.splice(at..at, seq.iter().copied());
            }
        }
    }

    /// Apply 1-3 random structural mutations to a JSON document.
    pub fn mutate_json(&mut self, doc: &Value) -> Value {
        let mut out = doc.clone();
        let rounds = 1 + self.rng.below(3);
        for _ in 0..rounds {
            let paths = collect_paths(&out);
            let path = self.rng.pick(&paths).clone();
            self.mutate_at(&mut out, &path);
        }
        out
    }

    fn mutate_at(&mut self, doc: &mut Value, path: &[Step]) {
        let choice = self.rng.below(8);
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
                    let depth = 1 + self.rng.below(200);
                    let mut v = std::mem::take(slot);
                    for _ in 0..depth {
                        v = if self.rng.one_in(2) {
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
            2 => json!(*r.pick(&[true, false])),
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
                r.pick(&numbers).clone()
            }
            4 => {
                let s = *r.pick(&[
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
                ]);
                if r.one_in(8) {
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
