//! The shape of `webhook/src`, checked so that it lasts: layers that import only downwards, a pure
//! decision core, no import circles, short files that say what they hold.
//!
//! Layers, bottom to top (a module may import its own layer and the layers below it):
//!
//! | rank | modules | what |
//! |---|---|---|
//! | 0 | `error` | the crate's error enum |
//! | 1 | `pods` | decoded pod types (what the decisions take as input) |
//! | 2 | `decide` | mutation, validation, node selection, the ledger: pure |
//! | 3 | `metrics` | Prometheus series; maps the decisions' outcomes to labels |
//! | 4 | `cluster` | what talks to the API server: caches (reflectors, lookups, cache-miss GETs), Events |
//! | 5 | `web` | server, TLS, stall guard, the AdmissionReview envelope, handlers |
//! | 6 | `app`, `cli`, `review`, `lib`, `main` | wiring, command line, the offline `review` |
//!
//! `decide/` may import nothing of the crate but itself and `pods`, and no runtime, client, server
//! or metrics crate. The checks read the source as text; [`references`] understands `crate::a::b`,
//! `crate::{a, b::c}` and `super::` paths.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Longest a file may be (the goal is "under about 600 lines").
const MAX_LINES: usize = 650;

/// Crates the decision core must not use.
const IMPURE_CRATES: [&str; 6] = [
    "tokio",
    "kube",
    "axum",
    "hyper",
    "prometheus_client",
    "tower",
];

fn rank(top: &str) -> Option<u8> {
    Some(match top {
        "error" => 0,
        "pods" => 1,
        "decide" => 2,
        "metrics" => 3,
        "cluster" => 4,
        "web" => 5,
        "app" | "cli" | "review" | "lib" | "main" => 6,
        _ => return None,
    })
}

/// A source file and its module path (`["decide", "validation", "limits"]`; `lib`/`main` for the
/// crate roots).
#[derive(Debug)]
struct Source {
    path: PathBuf,
    module: Vec<String>,
    text: String,
}

fn sources(root: &Path) -> Vec<Source> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read webhook/src") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(root).expect("under src");
            let mut module: Vec<String> = rel
                .with_extension("")
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if module.last().is_some_and(|m| m == "mod") {
                module.pop();
            }
            let text = std::fs::read_to_string(&path).expect("read source");
            out.push(Source { path, module, text });
        }
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    out
}

/// Every crate-internal path a file refers to, as module paths (`crate::decide::ledger::Ledger` ->
/// `["decide", "ledger", "Ledger"]`; `super::x` resolved against `module`). Comments are skipped.
fn references(text: &str, module: &[String]) -> BTreeSet<Vec<String>> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("");
        for (prefix, base) in [
            ("crate::", Vec::new()),
            ("super::", module[..module.len().saturating_sub(1)].to_vec()),
        ] {
            let mut rest = code;
            while let Some(at) = rest.find(prefix) {
                // `super::` inside `crate::...::super::` does not occur; a `self::super::` neither.
                let after = &rest[at + prefix.len()..];
                for path in expand(after) {
                    let mut full = base.clone();
                    full.extend(path);
                    if !full.is_empty() {
                        out.insert(full);
                    }
                }
                rest = after;
            }
        }
    }
    out
}

/// The paths starting at `s`: `a::b::C` -> [[a, b, C]]; `{a, b::c}` -> [[a], [b, c]]; nested groups
/// are read one level deep (enough for this crate's `use` lines, which rustfmt keeps on one line).
fn expand(s: &str) -> Vec<Vec<String>> {
    let ident = |s: &str| -> (String, usize) {
        let end = s
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(s.len());
        (s[..end].to_string(), end)
    };
    let mut path = Vec::new();
    let mut rest = s;
    loop {
        if let Some(group) = rest.strip_prefix('{') {
            let inner = group.split('}').next().unwrap_or("");
            return inner
                .split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty() && *p != "self")
                .map(|p| {
                    let mut full = path.clone();
                    full.extend(
                        p.split("::")
                            .map(|seg| ident(seg.trim()).0)
                            .filter(|seg| !seg.is_empty()),
                    );
                    full
                })
                .collect();
        }
        let (name, len) = ident(rest);
        if name.is_empty() {
            break;
        }
        path.push(name);
        rest = &rest[len..];
        match rest.strip_prefix("::") {
            Some(r) => rest = r,
            None => break,
        }
    }
    vec![path]
}

/// The file module a path refers to: the longest module path of a source that prefixes it.
fn resolve<'a>(path: &[String], modules: &'a BTreeSet<Vec<String>>) -> Option<&'a Vec<String>> {
    (1..=path.len())
        .rev()
        .find_map(|n| modules.get(&path[..n].to_vec()))
}

/// Everything wrong with the tree under `root`, one line each.
fn problems(root: &Path) -> Vec<String> {
    let files = sources(root);
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| f.module.clone()).collect();
    let mut out = Vec::new();
    let mut graph: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for f in &files {
        let name = f.module.join("::");
        let top = f.module.first().map(String::as_str).unwrap_or("");
        let Some(own) = rank(top) else {
            out.push(format!("{name}: module outside the layers (add it to one)"));
            continue;
        };
        let lines = f.text.lines().count();
        if lines > MAX_LINES {
            out.push(format!("{name}: {lines} lines (at most {MAX_LINES})"));
        }
        if !f.text.starts_with("//!") {
            out.push(format!(
                "{name}: no opening //! comment saying what it holds"
            ));
        }
        for r in references(&f.text, &f.module) {
            let target_top = r[0].as_str();
            let Some(theirs) = rank(target_top) else {
                continue; // a re-export or item of lib.rs, or a local path
            };
            if theirs > own {
                out.push(format!(
                    "{name}: imports {} from a layer above it",
                    r.join("::")
                ));
            }
            if top == "decide" && !matches!(target_top, "decide" | "pods") {
                out.push(format!(
                    "{name}: the decision core imports {} (only decide and pods are allowed)",
                    r.join("::")
                ));
            }
            if let Some(target) = resolve(&r, &modules)
                && target != &f.module
            {
                graph
                    .entry(f.module.clone())
                    .or_default()
                    .insert(target.clone());
            }
        }
        if top == "decide" {
            for krate in IMPURE_CRATES {
                let used = f.text.lines().any(|l| {
                    let code = l.split("//").next().unwrap_or("");
                    code.contains(&format!("{krate}::"))
                        && !code.contains(&format!("_{krate}::"))
                        && !code.contains(&format!("crate::{krate}"))
                });
                if used {
                    out.push(format!("{name}: the decision core uses the {krate} crate"));
                }
            }
        }
    }
    out.extend(cycles(&graph));
    out
}

/// Import circles between file modules (each reported once, from its smallest member). A module's
/// references to its own submodules (`mod x;` and their items) count: a parent that imports a child
/// that imports the parent is a circle too, unless the parent is a crate root.
fn cycles(graph: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Vec<String> {
    let mut found = BTreeSet::new();
    for start in graph.keys() {
        // Depth-first search for a path back to `start`.
        let mut stack = vec![(start.clone(), vec![start.clone()])];
        let mut seen = BTreeSet::new();
        while let Some((node, path)) = stack.pop() {
            for next in graph.get(&node).into_iter().flatten() {
                if next == start {
                    let mut circle: Vec<String> = path.iter().map(|m| m.join("::")).collect();
                    let min = circle.iter().min().cloned().unwrap_or_default();
                    let at = circle.iter().position(|m| *m == min).unwrap_or(0);
                    circle.rotate_left(at);
                    found.insert(circle.join(" -> "));
                } else if seen.insert(next.clone()) {
                    let mut p = path.clone();
                    p.push(next.clone());
                    stack.push((next.clone(), p));
                }
            }
        }
    }
    found
        .into_iter()
        .map(|c| format!("import circle: {c} -> (back)"))
        .collect()
}

#[test]
fn webhook_modules_import_only_downwards_and_the_decision_core_is_pure() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let problems = problems(&root);
    assert!(
        problems.is_empty(),
        "webhook/src breaks its layering:\n  {}",
        problems.join("\n  ")
    );
}

/// The checker itself catches what it is for (so a green run means something).
#[test]
fn the_checker_reports_upward_imports_impure_decisions_circles_and_long_files() {
    let dir = tempfile::tempdir().expect("tmp");
    let write = |rel: &str, body: &str| {
        let p = dir.path().join(rel);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(p, body).expect("write");
    };
    write(
        "lib.rs",
        "//! root\npub mod decide;\npub mod web;\npub mod cluster;\n",
    );
    write(
        "decide/mod.rs",
        "//! core\nuse crate::web::envelope::Review;\nuse tokio::sync::Mutex;\n",
    );
    write(
        "web/mod.rs",
        "//! web\nuse crate::cluster::{caches, events::Sink};\n",
    );
    write(
        "cluster/caches.rs",
        "//! caches\nuse crate::cluster::events::Sink;\n",
    );
    write(
        "cluster/events.rs",
        "//! events\nuse super::caches::Cache;\n",
    );
    write(
        "cluster/mod.rs",
        &format!("//! cluster\n{}", "// line\n".repeat(MAX_LINES)),
    );
    write("stray.rs", "fn f() {}\n");
    let got = problems(dir.path());
    let has = |needle: &str| got.iter().any(|p| p.contains(needle));
    assert!(
        has("decide: imports web::envelope::Review from a layer above it"),
        "{got:#?}"
    );
    assert!(
        has("decide: the decision core imports web::envelope::Review"),
        "{got:#?}"
    );
    assert!(
        has("decide: the decision core uses the tokio crate"),
        "{got:#?}"
    );
    assert!(
        has("import circle: cluster::caches -> cluster::events"),
        "{got:#?}"
    );
    assert!(has("cluster: 651 lines"), "{got:#?}");
    assert!(has("stray: module outside the layers"), "{got:#?}");
    assert!(!has("web: imports"), "web may import cluster: {got:#?}");
}
