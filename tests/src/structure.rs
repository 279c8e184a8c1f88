//! The shape of a crate's `src`, checked so that it lasts: layers that import only downwards, a pure
//! core, no import circles, short files that say what they hold. The webhook's and the agent's
//! `tests/structure.rs` describe their layers with a [`Layers`] and assert that [`problems`] finds
//! nothing.
//!
//! The checks read the source as text: [`references`] understands `crate::a::b`, `crate::{a, b::c}`
//! and `super::` paths, and paths that start with the crate's own name (`teeguard_agent::a`, as its
//! binary's `main.rs` spells them); comments are skipped.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Longest a file may be (the goal is "under about 600 lines").
pub const MAX_LINES: usize = 650;

/// One layer: top-level modules of one rank.
#[derive(Clone, Copy, Debug)]
pub struct Layer {
    /// The top-level modules (`"decide"` for `decide.rs` or `decide/`; `"lib"`, `"main"` for the roots).
    pub modules: &'static [&'static str],
    /// The modules of this layer may import each other (the wiring on top). When false, each talks to
    /// something else and imports only its own module and the layers below.
    pub siblings_share: bool,
}

/// A crate's layers and its pure core.
#[derive(Clone, Copy, Debug)]
pub struct Layers {
    /// For messages: `webhook/src`.
    pub name: &'static str,
    /// The crate's name as paths spell it (`teeguard_webhook`): a path starting with it (in
    /// `main.rs`, a binary that uses the library) is read like one starting with `crate::`.
    pub crate_name: &'static str,
    /// Bottom to top; a module may import its own layer (see [`Layer::siblings_share`]) and those below.
    pub layers: &'static [Layer],
    /// The pure core's top-level module.
    pub core: &'static str,
    /// What the core may import of the crate besides itself.
    pub core_may_import: &'static [&'static str],
    /// Paths the core may not use (`tokio`, `std::fs`): a line holding `<path>::` is flagged.
    pub impure: &'static [&'static str],
}

impl Layers {
    /// The rank of a top-level module, if it is in a layer.
    fn rank(&self, top: &str) -> Option<usize> {
        self.layers.iter().position(|l| l.modules.contains(&top))
    }
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
        for entry in std::fs::read_dir(&dir).expect("read the source tree") {
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
/// `["decide", "ledger", "Ledger"]`; `super::x` resolved against `module`; `<crate_name>::x` read as
/// `crate::x`). Comments are skipped.
pub fn references(text: &str, module: &[String], crate_name: &str) -> BTreeSet<Vec<String>> {
    let by_name = format!("{crate_name}::");
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("");
        for (prefix, base) in [
            ("crate::", Vec::new()),
            (by_name.as_str(), Vec::new()),
            ("super::", module[..module.len().saturating_sub(1)].to_vec()),
        ] {
            let mut rest = code;
            while let Some(at) = rest.find(prefix) {
                // `super::` inside `crate::...::super::` does not occur; a `self::super::` neither.
                let after = &rest[at + prefix.len()..];
                // Only the whole name: `teeguard_agent::` is not the end of `my_teeguard_agent::`.
                let starts_a_word =
                    !rest[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_');
                rest = after;
                if !starts_a_word {
                    continue;
                }
                for path in expand(after) {
                    let mut full = base.clone();
                    full.extend(path);
                    if !full.is_empty() {
                        out.insert(full);
                    }
                }
            }
        }
    }
    out
}

/// The paths starting at `s`: `a::b::C` -> [[a, b, C]]; `{a, b::c}` -> [[a], [b, c]]; nested groups
/// are read one level deep (enough for `use` lines, which rustfmt keeps on one line when short).
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

/// Everything wrong with the tree under `root` (a crate's `src`), one line each.
pub fn problems(root: &Path, layers: &Layers) -> Vec<String> {
    let files = sources(root);
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| f.module.clone()).collect();
    let core = layers.core;
    let mut out = Vec::new();
    let mut graph: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for f in &files {
        let name = f.module.join("::");
        let top = f.module.first().map(String::as_str).unwrap_or("");
        let Some(own) = layers.rank(top) else {
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
        for r in references(&f.text, &f.module, layers.crate_name) {
            let target_top = r[0].as_str();
            let Some(theirs) = layers.rank(target_top) else {
                continue; // a re-export or item of lib.rs, or a local path
            };
            if theirs > own {
                out.push(format!(
                    "{name}: imports {} from a layer above it",
                    r.join("::")
                ));
            } else if theirs == own && target_top != top && !layers.layers[own].siblings_share {
                out.push(format!(
                    "{name}: imports {} from another module of its layer (each talks to something \
                     else; what both need goes below them)",
                    r.join("::")
                ));
            }
            if top == core && target_top != core && !layers.core_may_import.contains(&target_top) {
                out.push(format!(
                    "{name}: the pure core imports {} (only {core} and {} are allowed)",
                    r.join("::"),
                    layers.core_may_import.join(", ")
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
        if top == core {
            for path in layers.impure {
                let used = f.text.lines().any(|l| {
                    let code = l.split("//").next().unwrap_or("");
                    code.contains(&format!("{path}::"))
                        && !code.contains(&format!("_{path}::"))
                        && !code.contains(&format!("crate::{path}"))
                });
                if used {
                    out.push(format!("{name}: the pure core uses {path}"));
                }
            }
        }
    }
    out.extend(cycles(&graph));
    out
}

/// Import circles between file modules (each reported once, from its smallest member). A module's
/// references to its own submodules count when spelled with `crate::` or `super::`: a parent that
/// imports a child that imports the parent is a circle too, unless the parent is a crate root.
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

/// Assert that the crate whose `CARGO_MANIFEST_DIR` is `manifest_dir` keeps to `layers`.
pub fn assert_layered(manifest_dir: &str, layers: &Layers) {
    let root = Path::new(manifest_dir).join("src");
    let problems = problems(&root, layers);
    assert!(
        problems.is_empty(),
        "{} breaks its layering:\n  {}",
        layers.name,
        problems.join("\n  ")
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    const LAYERS: Layers = Layers {
        name: "example/src",
        crate_name: "example",
        layers: &[
            Layer {
                modules: &["decide"],
                siblings_share: false,
            },
            Layer {
                modules: &["cluster", "kernel"],
                siblings_share: false,
            },
            Layer {
                modules: &["web"],
                siblings_share: false,
            },
            Layer {
                modules: &["lib", "cli"],
                siblings_share: true,
            },
        ],
        core: "decide",
        core_may_import: &[],
        impure: &["tokio", "std::fs"],
    };

    /// The checker catches what it is for (so a green run means something).
    #[test]
    fn the_checker_reports_upward_and_sideways_imports_impure_cores_circles_and_long_files() {
        let dir = tempfile::tempdir().expect("tmp");
        let write = |rel: &str, body: &str| {
            let p = dir.path().join(rel);
            std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
            std::fs::write(p, body).expect("write");
        };
        write(
            "lib.rs",
            "//! root\npub mod decide;\npub mod web;\npub mod cluster;\nuse crate::cli::Cli;\n",
        );
        write("cli.rs", "//! cli\nuse crate::web::Server;\n");
        write(
            "decide/mod.rs",
            "//! core\nuse crate::web::envelope::Review;\nuse tokio::sync::Mutex;\n",
        );
        write(
            "decide/files.rs",
            "//! reads\nfn f() { let _ = std::fs::read(\"x\"); }\n",
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
        write(
            "kernel/mod.rs",
            "//! kernel\nuse crate::cluster::events::Sink;\n",
        );
        write("stray.rs", "fn f() {}\n");
        let got = problems(dir.path(), &LAYERS);
        let has = |needle: &str| got.iter().any(|p| p.contains(needle));
        for problem in [
            "decide: imports web::envelope::Review from a layer above it",
            "decide: the pure core imports web::envelope::Review",
            "decide: the pure core uses tokio",
            "decide::files: the pure core uses std::fs",
            "kernel: imports cluster::events::Sink from another module of its layer",
            "import circle: cluster::caches -> cluster::events",
            "cluster: 651 lines",
            "stray: module outside the layers",
        ] {
            assert!(has(problem), "{problem}: {got:#?}");
        }
        assert!(!has("web: imports"), "web may import cluster: {got:#?}");
        assert!(!has("lib: imports"), "lib and cli share a layer: {got:#?}");
    }

    /// A binary uses its library by the crate's name (`use example::web::Server`), not `crate::`:
    /// the checker reads those paths too, and only the whole name.
    #[test]
    fn the_checker_reads_paths_that_start_with_the_crate_name() {
        // A small binary meant to use nothing but the core, in the core's layer.
        const TOOL: Layers = Layers {
            name: "tool/src",
            crate_name: "tool",
            layers: &[
                Layer {
                    modules: &["decide", "main"],
                    siblings_share: true,
                },
                Layer {
                    modules: &["web", "lib"],
                    siblings_share: true,
                },
            ],
            core: "decide",
            core_may_import: &[],
            impure: &[],
        };
        let dir = tempfile::tempdir().expect("tmp");
        let write = |rel: &str, body: &str| {
            let p = dir.path().join(rel);
            std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
            std::fs::write(p, body).expect("write");
        };
        write("lib.rs", "//! root\npub mod decide;\npub mod web;\n");
        write("decide/mod.rs", "//! core\n");
        write("web/mod.rs", "//! web\n");
        write(
            "main.rs",
            "//! the binary\nuse tool::decide::Decision;\nuse tool::{web::Server};\n\
             use toolkit::web::Other;\nuse my_tool::web::Other;\n",
        );
        assert_eq!(
            problems(dir.path(), &TOOL),
            ["main: imports web::Server from a layer above it"]
        );
    }
}
