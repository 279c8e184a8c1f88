//! The step table the standalone prints: fixed-width columns, the last one (what happened and why)
//! wrapped at word boundaries so every line fits a terminal of [`TABLE_WIDTH`] columns.

/// Widest line the table prints.
pub const TABLE_WIDTH: usize = 100;

/// One row: a step of the scenario.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Row {
    /// Step number (empty on follow-up rows of the same step).
    pub step: String,
    /// What the step is about (`vm-1 pod`, `vm-1 binding`, `legacy-db`).
    pub object: String,
    /// Who acted: a webhook endpoint (`/mutate`, `/validate`) or a simulated actor (`scheduler`,
    /// `kubelet`, `host`, `KubeVirt`).
    pub who: String,
    /// The outcome (`patched`, `allowed`, `denied`, `started`, ...).
    pub decision: String,
    /// Free keys on the TEE node after the step, as its agent reported them.
    pub free: String,
    /// What happened and why: the webhook's message, the patch, the event.
    pub message: String,
}

const HEADERS: [&str; 6] = [
    "#",
    "OBJECT",
    "WHO",
    "DECISION",
    "FREE",
    "WHAT HAPPENED / WHY",
];
const WIDTHS: [usize; 5] = [3, 16, 9, 8, 4];
const GAP: usize = 2;

/// Renders rows one at a time with a fixed layout.
#[derive(Clone, Copy, Debug)]
pub struct StepTable {
    message_width: usize,
}

impl Default for StepTable {
    fn default() -> Self {
        StepTable::new(TABLE_WIDTH)
    }
}

impl StepTable {
    /// A table whose lines are at most `width` characters (at least 30 are left for the message).
    pub fn new(width: usize) -> Self {
        let fixed: usize = WIDTHS.iter().sum::<usize>() + GAP * WIDTHS.len();
        StepTable {
            message_width: width.saturating_sub(fixed).max(30),
        }
    }

    /// The header line and a rule under it.
    pub fn header(&self) -> String {
        let cells: Vec<String> = HEADERS.iter().map(|h| (*h).to_string()).collect();
        let head = self.line(&cells[..5], &cells[5]);
        let rule = "-".repeat(head.chars().count());
        format!("{head}\n{rule}\n")
    }

    /// One row, possibly over several lines (the message wraps; other cells are cut with `~`).
    pub fn row(&self, row: &Row) -> String {
        let fixed =
            [&row.step, &row.object, &row.who, &row.decision, &row.free].map(|s| s.to_string());
        let mut lines = wrap(&row.message, self.message_width).into_iter();
        let first = lines.next().unwrap_or_default();
        let mut out = self.line(&fixed, &first);
        out.push('\n');
        let blank: [String; 5] = Default::default();
        for l in lines {
            out.push_str(&self.line(&blank, &l));
            out.push('\n');
        }
        out
    }

    fn line(&self, fixed: &[String], message: &str) -> String {
        let mut out = String::new();
        for (cell, width) in fixed.iter().zip(WIDTHS) {
            out.push_str(&fit(cell, width));
            out.push_str(&" ".repeat(GAP));
        }
        out.push_str(message);
        out.trim_end().to_string()
    }
}

/// `s` padded or cut (ending in `~`) to exactly `width` characters.
fn fit(s: &str, width: usize) -> String {
    let n = s.chars().count();
    if n <= width {
        format!("{s}{}", " ".repeat(width - n))
    } else {
        let mut cut: String = s.chars().take(width.saturating_sub(1)).collect();
        cut.push('~');
        cut
    }
}

/// Greedy word wrap to `width` characters; words longer than a line are split.
pub fn wrap(text: &str, width: usize) -> Vec<String> {
    let width = width.max(1);
    let mut lines = Vec::new();
    let mut cur = String::new();
    for word in text.split_whitespace() {
        let mut word: Vec<char> = word.chars().collect();
        loop {
            let cur_len = cur.chars().count();
            let need = if cur.is_empty() {
                word.len()
            } else {
                cur_len + 1 + word.len()
            };
            if need <= width {
                if !cur.is_empty() {
                    cur.push(' ');
                }
                cur.extend(word.iter());
                break;
            }
            if cur.is_empty() {
                // A word longer than a whole line: split it.
                let rest = word.split_off(width);
                lines.push(word.iter().collect());
                word = rest;
                continue;
            }
            lines.push(std::mem::take(&mut cur));
        }
    }
    if !cur.is_empty() || lines.is_empty() {
        lines.push(cur);
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_line_fits_and_the_message_wraps() {
        let t = StepTable::default();
        let row = Row {
            step: "12".into(),
            object: "virt-launcher-vm-123-abcde".into(),
            who: "/validate".into(),
            decision: "denied".into(),
            free: "0".into(),
            message: "no node can host this TDX VM: node-a has 0 of 8 TDX keys free (6 held by \
                      pods, 2 outside Kubernetes); free a key or add a TDX host: a-very-long-word-\
                      that-does-not-fit-on-one-line-of-the-message-column-at-all"
                .into(),
        };
        let text = format!("{}{}", t.header(), t.row(&row));
        for line in text.lines() {
            assert!(line.chars().count() <= TABLE_WIDTH, "{line:?}");
        }
        assert!(text.lines().count() >= 5, "{text}");
        assert!(text.contains("virt-launcher-v~"), "{text}");
        let joined: String = text
            .lines()
            .skip(2)
            .map(|l| l.chars().skip(50).collect::<String>() + " ")
            .collect();
        assert!(joined.contains("node-a has 0 of 8"), "{joined}");
    }

    #[test]
    fn wrap_edge_cases() {
        assert_eq!(wrap("", 10), vec![String::new()]);
        assert_eq!(wrap("a b c", 3), vec!["a b", "c"]);
        assert_eq!(wrap("abcdefgh", 3), vec!["abc", "def", "gh"]);
    }
}
