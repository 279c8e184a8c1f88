//! Prometheus text exposition read back (a component's `/metrics`, e.g. the API server's): samples by
//! name and labels, summed over the labels not asked for, so two scrapes can be subtracted.

use std::collections::BTreeMap;

/// One scrape's samples.
#[derive(Clone, Debug, Default)]
pub struct Scrape(Vec<Sample>);

/// One sample line.
#[derive(Clone, Debug)]
pub struct Sample {
    /// The series name (`rest_client_requests_total`, `..._bucket`).
    pub name: String,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// Its value.
    pub value: f64,
}

impl Scrape {
    /// Parse the text format; lines that are not samples (comments, garbage) are skipped.
    pub fn parse(text: &str) -> Scrape {
        Scrape(text.lines().filter_map(sample).collect())
    }

    /// The sum of `name`'s samples whose labels include every `(key, value)` of `filter`.
    pub fn sum(&self, name: &str, filter: &[(&str, &str)]) -> f64 {
        self.matching(name, filter).map(|s| s.value).sum()
    }

    /// Like [`Scrape::sum`], but `None` when no sample matches (the series is not exported).
    pub fn get(&self, name: &str, filter: &[(&str, &str)]) -> Option<f64> {
        let mut found = None;
        for s in self.matching(name, filter) {
            *found.get_or_insert(0.0) += s.value;
        }
        found
    }

    /// [`Scrape::sum`] grouped by the value of label `by`.
    pub fn by(&self, name: &str, by: &str, filter: &[(&str, &str)]) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        for s in self.matching(name, filter) {
            let key = s.labels.get(by).cloned().unwrap_or_default();
            *out.entry(key).or_insert(0.0) += s.value;
        }
        out
    }

    fn matching<'a>(
        &'a self,
        name: &'a str,
        filter: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = &'a Sample> + 'a {
        self.0.iter().filter(move |s| {
            s.name == name
                && filter
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
    }
}

/// `after - before` of every group of [`Scrape::by`] (a group new in `after` counts from zero).
pub fn delta_by(
    before: &Scrape,
    after: &Scrape,
    name: &str,
    by: &str,
    filter: &[(&str, &str)],
) -> BTreeMap<String, f64> {
    let was = before.by(name, by, filter);
    after
        .by(name, by, filter)
        .into_iter()
        .map(|(k, v)| {
            let d = v - was.get(&k).copied().unwrap_or(0.0);
            (k, d)
        })
        .filter(|(_, d)| *d != 0.0)
        .collect()
}

/// `after - before` of [`Scrape::sum`].
pub fn delta(before: &Scrape, after: &Scrape, name: &str, filter: &[(&str, &str)]) -> f64 {
    after.sum(name, filter) - before.sum(name, filter)
}

/// The mean of histogram `name`'s observations between two scrapes (`_sum` over `_count`), with the
/// count; `None` when nothing was observed.
pub fn mean_delta(
    before: &Scrape,
    after: &Scrape,
    name: &str,
    filter: &[(&str, &str)],
) -> Option<(std::time::Duration, f64)> {
    let n = delta(before, after, &format!("{name}_count"), filter);
    let sum = delta(before, after, &format!("{name}_sum"), filter);
    (n > 0.0).then(|| (std::time::Duration::from_secs_f64((sum / n).max(0.0)), n))
}

/// `name{k="v",...} value [timestamp]`.
fn sample(line: &str) -> Option<Sample> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let (name, labels, rest) = match line.find('{') {
        Some(open) => {
            let (labels, rest) = label_set(&line[open + 1..])?;
            (&line[..open], labels, rest)
        }
        None => {
            let (name, rest) = line.split_once(' ')?;
            (name, BTreeMap::new(), rest)
        }
    };
    let value = rest.split_whitespace().next()?.parse().ok()?;
    Some(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

/// The labels after `{` up to the closing `}`, and what follows it.
fn label_set(mut s: &str) -> Option<(BTreeMap<String, String>, &str)> {
    let mut labels = BTreeMap::new();
    loop {
        s = s.trim_start_matches([',', ' ']);
        if let Some(rest) = s.strip_prefix('}') {
            return Some((labels, rest));
        }
        let (key, after) = s.split_once("=\"")?;
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next()? {
                (i, '"') => break i,
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                (_, c) => value.push(c),
            }
        };
        labels.insert(key.trim().to_string(), value);
        s = &after[end + 1..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_with_commas_and_escapes_are_read_whole() {
        let s = Scrape::parse(
            "# HELP x\nrest_client_requests_total{code=\"201\",host=\"127.0.0.1:6443\",method=\"POST\"} 7\n\
             rest_client_requests_total{code=\"200\",host=\"a,b\",method=\"GET\"} 3 1700000000\n\
             odd{msg=\"say \\\"hi\\\"\"} 1\nplain 2.5\n",
        );
        assert_eq!(s.sum("rest_client_requests_total", &[]), 10.0);
        assert_eq!(
            s.by("rest_client_requests_total", "method", &[])["POST"],
            7.0
        );
        assert_eq!(s.sum("odd", &[("msg", "say \"hi\"")]), 1.0);
        assert_eq!(s.sum("plain", &[]), 2.5);
        assert_eq!(s.get("plain", &[]), Some(2.5));
        assert_eq!(s.get("absent", &[]), None, "a series not exported is not 0");
        assert_eq!(
            s.get("rest_client_requests_total", &[("method", "PUT")]),
            None
        );
    }

    #[test]
    fn a_histograms_mean_between_two_scrapes_counts_only_what_was_observed_between_them() {
        let before = Scrape::parse("h_sum{p=\"a\"} 1.0\nh_count{p=\"a\"} 2\n");
        let after = Scrape::parse(
            "h_sum{p=\"a\"} 4.0\nh_count{p=\"a\"} 5\nh_sum{p=\"b\"} 9\nh_count{p=\"b\"} 1\n",
        );
        assert_eq!(
            mean_delta(&before, &after, "h", &[("p", "a")]),
            Some((std::time::Duration::from_secs(1), 3.0))
        );
        assert_eq!(mean_delta(&after, &after, "h", &[]), None);
    }
}
