//! The documentation cannot rot unnoticed (issue 32):
//!
//! - `README.md` stays an operator's first day: at most 12 KB;
//! - every relative link in `README.md`, `docs/*.md`, `docs/records/*.md` and `charts/teeguard/README.md` points at a file
//!   that exists and, with `#anchor`, at a heading that exists (GitHub's anchors);
//! - the configuration tables of the README and the chart README name exactly the fields of the
//!   configuration file. The fields come from the code: the loader (`teeguard_shared::Config`) rejects
//!   an unknown key with the list of keys it accepts at that place, so asking it with a made-up key at
//!   every level finds them all, and a new field without a row fails here;
//! - `docs/cli.md` names every flag of `teeguard-webhook` and `teeguard-agent` (their clap definitions);
//! - the README's Development section names the test command;
//! - the source files the docs, the crates' module docs and the chart's comments name exist.

use std::collections::BTreeSet;
use std::path::{Component, Path, PathBuf};

use clap::CommandFactory;
use teeguard_shared::{Config, Error};

/// The most the README may weigh.
const README_MAX_BYTES: u64 = 12_000;

/// The repository's root (this crate lives in `tests/`).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("read {rel}: {e}"))
}

/// The Markdown files whose links must resolve, relative to the root: `README.md`, `docs/*.md`, the
/// lab records `docs/records/*.md` and the chart's README.
fn markdown_files() -> Vec<String> {
    let mut files = vec!["README.md".to_string()];
    for dir in ["docs", "docs/records"] {
        let mut docs: Vec<String> = std::fs::read_dir(root().join(dir))
            .unwrap_or_else(|e| panic!("read {dir}/: {e}"))
            .map(|entry| entry.expect("directory entry").file_name())
            .map(|name| name.to_string_lossy().into_owned())
            .filter(|name| name.ends_with(".md"))
            .map(|name| format!("{dir}/{name}"))
            .collect();
        docs.sort();
        files.extend(docs);
    }
    files.push("charts/teeguard/README.md".to_string());
    files
}

// ---- Markdown, as much of it as the checks need ----

/// The lines outside fenced code blocks, with their 1-based numbers.
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut in_fence = false;
    let mut lines = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            in_fence = !in_fence;
            continue;
        }
        if !in_fence {
            lines.push((i + 1, line));
        }
    }
    lines
}

/// `line` without its inline code spans (`` `like this` ``), where a `](` is not a link.
fn without_code_spans(line: &str) -> String {
    line.split('`').step_by(2).collect::<Vec<_>>().join(" ")
}

/// The targets of the inline links `[text](target)` and images on a line, code spans left out.
fn link_targets(line: &str) -> Vec<String> {
    let text = without_code_spans(line);
    let mut targets = Vec::new();
    let mut rest = text.as_str();
    while let Some(at) = rest.find("](") {
        rest = &rest[at + 2..];
        let end = rest.find(')').unwrap_or(rest.len());
        // `[text](<path> "title")`: the path is the first word, angle brackets dropped.
        let target = rest[..end].split_whitespace().next().unwrap_or("");
        targets.push(
            target
                .trim_start_matches('<')
                .trim_end_matches('>')
                .to_string(),
        );
        rest = &rest[end..];
    }
    targets
}

/// The anchor GitHub gives a heading: its text lowercased, every character but letters, digits, `-`,
/// `_` and spaces dropped, spaces turned into `-`.
fn github_anchor(heading: &str) -> String {
    heading
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// A heading's text as GitHub renders it: `[text](target)` becomes `text`.
fn heading_text(raw: &str) -> String {
    let mut out = String::new();
    let mut rest = raw.trim().trim_end_matches('#').trim();
    while let Some(open) = rest.find('[') {
        let Some(mid) = rest[open..].find("](").map(|m| open + m) else {
            break;
        };
        let Some(close) = rest[mid..].find(')').map(|c| mid + c) else {
            break;
        };
        out.push_str(&rest[..open]);
        out.push_str(&rest[open + 1..mid]);
        rest = &rest[close + 1..];
    }
    out.push_str(rest);
    out
}

/// The headings of a Markdown text (outside code blocks): (level, text).
fn headings(text: &str) -> Vec<(usize, String)> {
    prose_lines(text)
        .into_iter()
        .filter_map(|(_, line)| {
            let level = line.chars().take_while(|c| *c == '#').count();
            let rest = &line[level..];
            ((1..=6).contains(&level) && rest.starts_with(' ')).then(|| (level, heading_text(rest)))
        })
        .collect()
}

/// Every anchor a Markdown text has: one per heading, repeated headings numbered `-1`, `-2`, ... as
/// GitHub does.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for (_, heading) in headings(text) {
        let base = github_anchor(&heading);
        let mut anchor = base.clone();
        let mut n = 0;
        while found.contains(&anchor) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
        found.insert(anchor);
    }
    found
}

/// The lines of the section under the heading `heading` (exactly, e.g. `## Development`), up to the
/// next heading of the same or a higher level; code blocks are left out.
fn section<'a>(text: &'a str, heading: &str) -> Vec<&'a str> {
    let level = heading.chars().take_while(|c| *c == '#').count();
    let mut lines = prose_lines(text)
        .into_iter()
        .map(|(_, line)| line)
        .skip_while(|line| line.trim_end() != heading);
    assert!(lines.next().is_some(), "no heading `{heading}`");
    lines
        .take_while(|line| {
            let l = line.chars().take_while(|c| *c == '#').count();
            !((1..=level).contains(&l) && line[l..].starts_with(' '))
        })
        .collect()
}

/// `docs/../README.md` as `README.md`, for messages that name the file a link points at.
fn without_dot_dot(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::ParentDir if out.file_name().is_some() => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

// ---- the README's size ----

#[test]
fn readme_stays_under_12_kib() {
    let bytes = std::fs::metadata(root().join("README.md"))
        .expect("README.md")
        .len();
    assert!(
        bytes <= README_MAX_BYTES,
        "README.md is {bytes} bytes, over the {README_MAX_BYTES} (12 KB) an operator's first day gets: \
         move the detail into docs/ (operating.md, enforcement.md, internals.md, performance.md, ...) \
         and link it from where a reader would look"
    );
}

#[test]
fn readme_development_section_names_the_test_command() {
    let development = section(&read("README.md"), "## Development").join("\n");
    assert!(
        development.contains("`scripts/test.sh`"),
        "README.md's Development section must name the test command `scripts/test.sh` (CI's .ci/run \
         runs it); it says:\n{development}"
    );
}

// ---- links ----

#[test]
fn github_anchors_are_computed_like_github() {
    for (heading, anchor) in [
        ("Troubleshooting denials", "troubleshooting-denials"),
        ("API load (5 000 nodes)", "api-load-5-000-nodes"),
        ("Configuration file (`config`)", "configuration-file-config"),
        (
            "Mutation: what the webhook writes",
            "mutation-what-the-webhook-writes",
        ),
        (
            "Shared between replicas: the `TeeReservation`",
            "shared-between-replicas-the-teereservation",
        ),
        (
            "GitOps caveat: `lookup` needs a cluster",
            "gitops-caveat-lookup-needs-a-cluster",
        ),
    ] {
        assert_eq!(github_anchor(heading), anchor, "{heading}");
    }
    assert_eq!(
        heading_text("See [the chart](chart.md) now"),
        "See the chart now"
    );
    let repeated = anchors("# A\n## Notes\n```\n# not a heading\n```\n## Notes\n");
    assert_eq!(
        repeated,
        BTreeSet::from(["a".to_string(), "notes".to_string(), "notes-1".to_string()])
    );
}

#[test]
fn relative_links_in_the_docs_point_at_existing_files_and_headings() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in markdown_files() {
        let text = read(&file);
        let dir = Path::new(&file).parent().unwrap_or(Path::new(""));
        for (line_no, line) in prose_lines(&text) {
            for target in link_targets(line) {
                if target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                checked += 1;
                let (path, anchor) = match target.split_once('#') {
                    Some((path, anchor)) => (path, Some(anchor)),
                    None => (target.as_str(), None),
                };
                let target_rel = if path.is_empty() {
                    PathBuf::from(&file)
                } else {
                    without_dot_dot(&dir.join(path))
                };
                let target_abs = root().join(&target_rel);
                if !target_abs.exists() {
                    broken.push(format!(
                        "{file}:{line_no}: link `{target}`: {} does not exist; fix the path or \
                         restore the file",
                        target_rel.display()
                    ));
                    continue;
                }
                let Some(anchor) = anchor else { continue };
                if target_abs.extension().is_some_and(|e| e == "md") {
                    let text = std::fs::read_to_string(&target_abs).expect("linked Markdown file");
                    if !anchors(&text).contains(anchor) {
                        broken.push(format!(
                            "{file}:{line_no}: link `{target}`: {} has no heading with the anchor \
                             `#{anchor}`; point the link at an existing heading or rename the heading \
                             back",
                            target_rel.display()
                        ));
                    }
                }
            }
        }
    }
    assert!(
        checked > 20,
        "only {checked} relative links found: is link_targets broken?"
    );
    assert!(
        broken.is_empty(),
        "{} broken links:\n{}",
        broken.len(),
        broken.join("\n")
    );
}

// ---- source files named in the docs ----

/// Every file of the repository (relative, `/`-separated), build output and installed tools left out.
fn repository_files() -> Vec<String> {
    fn walk(dir: &Path, rel: &str, out: &mut Vec<String>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if rel.is_empty() && matches!(name.as_str(), "target" | ".tools" | ".git") {
                continue;
            }
            let path = if rel.is_empty() {
                name.clone()
            } else {
                format!("{rel}/{name}")
            };
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                walk(&entry.path(), &path, out);
            } else {
                out.push(path);
            }
        }
    }
    let mut out = Vec::new();
    walk(&root(), "", &mut out);
    out
}

/// The source file names (`holds.rs`, `cluster/retry.rs`, `scripts/test.sh`) in the inline code spans
/// of `text`'s lines: the words of a span that end in `.rs` or `.sh` (a `:line` suffix dropped).
fn named_source_files(lines: &[(usize, &str)]) -> Vec<(usize, String)> {
    let mut names = Vec::new();
    for (line_no, line) in lines {
        for span in line.split('`').skip(1).step_by(2) {
            for word in span.split(|c: char| c.is_whitespace() || matches!(c, ',' | '(' | ')')) {
                let word = word
                    .split(':')
                    .next()
                    .unwrap_or("")
                    .trim_start_matches("./");
                let is_file = word.ends_with(".rs") || word.ends_with(".sh");
                let plain = word
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '/'));
                if is_file && plain && !word.contains('*') && word.len() > 3 {
                    names.push((*line_no, word.to_string()));
                }
            }
        }
    }
    names
}

/// The lines of the module docs (`//!`) of every crate's sources and of the chart's template comments,
/// with the file each comes from.
fn module_doc_lines() -> Vec<(String, usize, String)> {
    let mut out = Vec::new();
    for file in repository_files() {
        let rust = file.ends_with(".rs")
            && ["shared/", "webhook/", "agent/", "certs/", "tests/"]
                .iter()
                .any(|c| file.starts_with(c));
        let chart = file.starts_with("charts/") && file.ends_with(".yaml");
        if !rust && !chart {
            continue;
        }
        let text = read(&file);
        for (i, line) in text.lines().enumerate() {
            let trimmed = line.trim_start();
            let doc = if rust {
                trimmed.strip_prefix("//!")
            } else {
                trimmed.strip_prefix('#')
            };
            if let Some(doc) = doc {
                out.push((file.clone(), i + 1, doc.to_string()));
            }
        }
    }
    out
}

/// Whether `name` is a file of the repository (a path ending in it, at a `/`) or of the reference
/// material beside it (`../shared/`: the kits' scripts such as tee-vm's `run.sh`), or names a file
/// inside a guest (an absolute path such as `/host/cmd.sh`, or `cmd.sh`, the session script the test kit
/// writes there).
fn is_known_file(files: &[String], reference: &[String], name: &str) -> bool {
    if name.starts_with('/') || name == "cmd.sh" {
        return true;
    }
    if let Some(rel) = name.strip_prefix("../shared/") {
        return reference.iter().any(|f| f == rel);
    }
    let suffix = format!("/{name}");
    files
        .iter()
        .chain(reference)
        .any(|f| f == name || f.ends_with(&suffix))
}

/// The files of `../shared/` (relative to it), or none where it is not beside the repository.
fn reference_files() -> Vec<String> {
    let dir = root().join("../shared");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            for inner in std::fs::read_dir(entry.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                out.push(format!("{name}/{}", inner.file_name().to_string_lossy()));
            }
        } else {
            out.push(name);
        }
    }
    out
}

#[test]
fn source_files_named_in_the_docs_and_module_docs_exist() {
    let files = repository_files();
    let reference = reference_files();
    let mut missing = Vec::new();
    let mut checked = 0;
    for file in markdown_files() {
        let text = read(&file);
        for (line_no, name) in named_source_files(&prose_lines(&text)) {
            checked += 1;
            if !is_known_file(&files, &reference, &name) {
                missing.push(format!("{file}:{line_no}: `{name}`"));
            }
        }
    }
    for (file, line_no, doc) in module_doc_lines() {
        // A chart comment names files as plain words (`# webhook/src/cluster/holds.rs: ...`).
        let line = if file.starts_with("charts/") {
            doc.split_whitespace()
                .filter(|w| w.contains("src/"))
                .map(|w| format!("`{}`", w.trim_end_matches([':', ',', '.'])))
                .collect::<Vec<_>>()
                .join(" ")
        } else {
            doc
        };
        for (_, name) in named_source_files(&[(line_no, line.as_str())]) {
            checked += 1;
            if !is_known_file(&files, &reference, &name) {
                missing.push(format!("{file}:{line_no}: `{name}`"));
            }
        }
    }
    assert!(
        checked > 50,
        "only {checked} file names found in the docs: is named_source_files broken?"
    );
    assert!(
        missing.is_empty(),
        "{} file names in the docs name no file of the repository (renamed or removed?): fix the \
         name or the doc:\n{}",
        missing.len(),
        missing.join("\n")
    );
}

// ---- the configuration tables ----

/// The keys the configuration loader accepts in the mapping at `path` (`["admission"]`), asked of the
/// loader itself with a key it cannot know; `None` when `path` holds a value, not a mapping of keys.
fn config_keys_under(path: &[String]) -> Option<Vec<String>> {
    const PROBE: &str = "teeguardDocsTestProbe";
    let mut yaml = format!("{{{PROBE}: 1}}");
    for key in path.iter().rev() {
        yaml = format!("{{{key}: {yaml}}}");
    }
    // A mapping of fields rejects the probe with serde's "unknown field `PROBE`, expected one of `a`,
    // `b`" ("expected `a` or `b`", "expected `a`"). Anything else (a type error, an unknown enum
    // variant, a map that takes any key) means `path` is a field with a value.
    let Err(Error::Config { reason, .. }) = Config::from_yaml(&yaml) else {
        return None;
    };
    let expected = reason
        .split_once(&format!("unknown field `{PROBE}`, expected "))?
        .1;
    Some(
        expected
            .split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect(),
    )
}

/// Every key of the configuration file as a dotted path (`admission.staleReportPolicy.podCreate`).
fn config_file_fields() -> BTreeSet<String> {
    fn walk(path: Vec<String>, fields: &mut BTreeSet<String>) {
        match config_keys_under(&path) {
            Some(keys) => {
                for key in keys {
                    let mut child = path.clone();
                    child.push(key);
                    walk(child, fields);
                }
            }
            None => {
                fields.insert(path.join("."));
            }
        }
    }
    let mut fields = BTreeSet::new();
    walk(Vec::new(), &mut fields);
    fields
}

#[test]
fn config_file_fields_are_found_in_the_loader() {
    let fields = config_file_fields();
    for known in [
        "resources.tdx.resourceName",
        "resources.sevEs.keysPerVm",
        "enforcement.nriPluginIndex",
        "admission.staleReportPolicy.podCreate",
        "admission.ledgerTtl",
        "agent.heartbeatInterval",
    ] {
        assert!(
            fields.contains(known),
            "asking the configuration loader for its keys did not find `{known}` (found {fields:?}): \
             has the loader's error for an unknown key changed? See config_keys_under"
        );
    }
}

/// The first cell of each row of the first table in the section under `heading`, backticks dropped,
/// with `prefix` (`config.`) taken off.
fn table_keys(file: &str, heading: &str, prefix: &str) -> Vec<String> {
    let text = read(file);
    let rows: Vec<&str> = section(&text, heading)
        .into_iter()
        .skip_while(|line| !line.starts_with('|'))
        .take_while(|line| line.starts_with('|'))
        .skip(2) // the header and the |---| line
        .collect();
    assert!(!rows.is_empty(), "{file}: no table under `{heading}`");
    rows.iter()
        .map(|row| {
            let cell = row.split('|').nth(1).unwrap_or("").trim().trim_matches('`');
            cell.strip_prefix(prefix).unwrap_or(cell).to_string()
        })
        .collect()
}

/// Whether a table's key names the field: equal, segment by segment, where a `<placeholder>`
/// segment (`resources.<kind>.keysPerVm`) stands for any one.
fn row_names_field(row: &str, field: &str) -> bool {
    let (row, field): (Vec<&str>, Vec<&str>) =
        (row.split('.').collect(), field.split('.').collect());
    row.len() == field.len()
        && row
            .iter()
            .zip(&field)
            .all(|(r, f)| r == f || (r.starts_with('<') && r.ends_with('>')))
}

/// The configuration table of `file` names every field of the configuration file, and nothing else.
fn assert_table_matches_config(file: &str, heading: &str, prefix: &str) {
    let rows = table_keys(file, heading, prefix);
    let fields = config_file_fields();
    let mut problems = Vec::new();
    for field in &fields {
        if !rows.iter().any(|row| row_names_field(row, field)) {
            problems.push(format!(
                "`{prefix}{field}` is a field of the configuration file (shared/src/config.rs) but \
                 {file}'s table under `{heading}` has no row for it: add the row \
                 | `{prefix}{field}` | <default> | <meaning> |"
            ));
        }
    }
    for row in &rows {
        if !fields.iter().any(|field| row_names_field(row, field)) {
            problems.push(format!(
                "{file}'s table under `{heading}` has a row `{prefix}{row}`, which is no field of the \
                 configuration file (shared/src/config.rs): remove the row or fix its name"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn readme_configuration_table_names_exactly_the_config_file_fields() {
    assert_table_matches_config("README.md", "## Configuration", "");
}

#[test]
fn chart_readme_configuration_table_names_exactly_the_config_file_fields() {
    assert_table_matches_config(
        "charts/teeguard/README.md",
        "### Configuration file (`config`)",
        "config.",
    );
}

// ---- the command-line reference ----

/// Whether `text` mentions `flag` (`--node`) as a whole flag, not as the start of a longer one
/// (`--node-name`).
fn mentions_flag(text: &str, flag: &str) -> bool {
    text.match_indices(flag).any(|(at, _)| {
        !text[at + flag.len()..]
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '-')
    })
}

/// The long flags of `command` (without `--help` and `--version`), each with its short form if any.
fn flags(command: &clap::Command) -> Vec<(String, Option<String>)> {
    command
        .get_arguments()
        .filter_map(|arg| {
            let long = arg.get_long()?;
            (long != "help" && long != "version").then(|| {
                (
                    format!("--{long}"),
                    arg.get_short().map(|s| format!("-{s}")),
                )
            })
        })
        .collect()
}

/// What docs/cli.md lacks for `command` (`name`: `teeguard-agent scan`, `teeguard-certs`): a row of
/// the table starting with its name, and each of its flags in that row.
fn missing_from_row(cli_md: &str, name: &str, command: &clap::Command) -> Vec<String> {
    let start = format!("| `{name}");
    let Some(row) = cli_md.lines().find(|line| {
        line.strip_prefix(&start)
            .is_some_and(|rest| rest.starts_with([' ', '`']))
    }) else {
        return vec![format!(
            "{name}: docs/cli.md has no row starting with `{start}`"
        )];
    };
    flags(command)
        .into_iter()
        .filter(|(long, short)| {
            !mentions_flag(row, long) && !short.as_ref().is_some_and(|s| mentions_flag(row, s))
        })
        .map(|(long, _)| {
            format!(
                "{name} {long}: missing from its row in docs/cli.md; add it with its default and \
                 what it does"
            )
        })
        .collect()
}

#[test]
fn cli_reference_lists_every_flag_of_every_binary() {
    let cli_md = read("docs/cli.md");
    let mut missing = Vec::new();
    for (binary, command) in [
        ("teeguard-webhook", teeguard_webhook::cli::Cli::command()),
        ("teeguard-agent", teeguard_agent::cli::Cli::command()),
        ("teeguard-certs", teeguard_certs::cli::Cli::command()),
    ] {
        if !command.has_subcommands() {
            missing.extend(missing_from_row(&cli_md, binary, &command));
            continue;
        }
        // Flags of the binary itself (`--log-format` before the subcommand): anywhere in the file.
        for (long, _) in flags(&command) {
            if !mentions_flag(&cli_md, &long) {
                missing.push(format!(
                    "{binary} {long}: not mentioned anywhere in docs/cli.md"
                ));
            }
        }
        // A subcommand's flags: in its row of the table.
        for sub in command.get_subcommands() {
            let name = format!("{binary} {}", sub.get_name());
            missing.extend(missing_from_row(&cli_md, &name, sub));
        }
    }
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}
