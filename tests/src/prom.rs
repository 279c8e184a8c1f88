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
        self.get(name, filter).unwrap_or(0.0)
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

/// The mean of histogram `name`'s observations between two scrapes (`_sum` over `_count`), with the
/// count; `None` when nothing was observed.
pub fn mean_delta(
    before: &Scrape,
    after: &Scrape,
    name: &str,
    filter: &[(&str, &str)],
) -> Option<(std::time::Duration, f64)> {
    let between = after
        .histogram(name, filter)?
        .minus(&before.histogram(name, filter).unwrap_or_default());
    Some((between.mean()?, between.count))
}

/// A histogram read from a scrape ([`Scrape::histogram`]): cumulative bucket counts by upper bound
/// (`+Inf` last), summed over the label sets asked for.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Histogram {
    /// `(upper bound in seconds, cumulative count)`, ascending; the last bound is `+Inf`.
    pub buckets: Vec<(f64, f64)>,
    /// The sum of the observations.
    pub sum: f64,
    /// The number of observations.
    pub count: f64,
}

impl Histogram {
    /// What was observed between `before` and `self`. A bound missing from `before` takes the count
    /// of its nearest bound below (the counts are cumulative), or 0 (an empty `before`).
    pub fn minus(&self, before: &Histogram) -> Histogram {
        let was = |le: f64| {
            before
                .buckets
                .iter()
                .take_while(|(b, _)| *b <= le)
                .last()
                .map_or(0.0, |(_, n)| *n)
        };
        Histogram {
            buckets: self
                .buckets
                .iter()
                .map(|&(le, n)| (le, n - was(le)))
                .collect(),
            sum: self.sum - before.sum,
            count: self.count - before.count,
        }
    }

    /// The mean observation; `None` when nothing was observed.
    pub fn mean(&self) -> Option<std::time::Duration> {
        (self.count > 0.0)
            .then(|| std::time::Duration::from_secs_f64((self.sum / self.count).max(0.0)))
    }

    /// Quantile `q` (0..=1), linearly interpolated inside the bucket that holds it, with that
    /// bucket's upper bound (what the estimate is sure of). In the `+Inf` bucket the estimate is the
    /// highest finite bound, as Prometheus' `histogram_quantile` does. `None` when nothing was
    /// observed.
    pub fn quantile(&self, q: f64) -> Option<(std::time::Duration, std::time::Duration)> {
        let total = self.buckets.last()?.1;
        if total <= 0.0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * total;
        let (mut lower, mut below) = (0.0, 0.0);
        for &(le, n) in &self.buckets {
            if n >= rank && n > below {
                let secs = |s: f64| std::time::Duration::from_secs_f64(s.max(0.0));
                if le.is_infinite() {
                    return Some((secs(lower), secs(lower)));
                }
                let estimate = lower + (le - lower) * (rank - below) / (n - below);
                return Some((secs(estimate), secs(le)));
            }
            (lower, below) = (le, n);
        }
        None
    }
}

impl Scrape {
    /// Histogram `name` (its `_bucket`, `_sum` and `_count` series) summed over the samples whose
    /// labels include every `(key, value)` of `filter`; `None` when it is not exported.
    pub fn histogram(&self, name: &str, filter: &[(&str, &str)]) -> Option<Histogram> {
        let bucket = format!("{name}_bucket");
        let mut by_le: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
        for s in self.matching(&bucket, filter) {
            let Some(le) = s.labels.get("le").and_then(|le| parse_le(le)) else {
                continue;
            };
            // Ordered by the bound's bits: for non-negative floats they sort as the numbers do.
            by_le.entry(le.to_bits()).or_insert((le, 0.0)).1 += s.value;
        }
        let count = self.get(&format!("{name}_count"), filter);
        if by_le.is_empty() && count.is_none() {
            return None;
        }
        Some(Histogram {
            buckets: by_le.into_values().collect(),
            sum: self.sum(&format!("{name}_sum"), filter),
            count: count.unwrap_or(0.0),
        })
    }

    /// [`Scrape::histogram`] for each value of label `by`.
    pub fn histograms_by(
        &self,
        name: &str,
        by: &str,
        filter: &[(&str, &str)],
    ) -> BTreeMap<String, Histogram> {
        self.by(&format!("{name}_count"), by, filter)
            .into_keys()
            .filter_map(|value| {
                let mut f = filter.to_vec();
                f.push((by, value.as_str()));
                Some((value.clone(), self.histogram(name, &f)?))
            })
            .collect()
    }
}

/// A bucket's `le`: a number or `+Inf`.
fn parse_le(le: &str) -> Option<f64> {
    match le {
        "+Inf" => Some(f64::INFINITY),
        n => n.parse().ok().filter(|v: &f64| *v >= 0.0),
    }
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

    const HIST: &str = "# TYPE d histogram\n\
        d_bucket{e=\"a\",le=\"0.1\"} 2\nd_bucket{e=\"a\",le=\"1.0\"} 8\nd_bucket{e=\"a\",le=\"+Inf\"} 10\n\
        d_sum{e=\"a\"} 6.5\nd_count{e=\"a\"} 10\n\
        d_bucket{e=\"b\",le=\"0.1\"} 1\nd_bucket{e=\"b\",le=\"1.0\"} 1\nd_bucket{e=\"b\",le=\"+Inf\"} 1\n\
        d_sum{e=\"b\"} 0.05\nd_count{e=\"b\"} 1\n";

    #[test]
    fn a_histogram_sums_the_label_sets_asked_for_and_orders_its_buckets() {
        let s = Scrape::parse(HIST);
        let a = s.histogram("d", &[("e", "a")]).expect("exported");
        assert_eq!(
            a.buckets,
            vec![(0.1, 2.0), (1.0, 8.0), (f64::INFINITY, 10.0)]
        );
        assert_eq!((a.sum, a.count), (6.5, 10.0));
        let all = s.histogram("d", &[]).expect("exported");
        assert_eq!(
            all.buckets,
            vec![(0.1, 3.0), (1.0, 9.0), (f64::INFINITY, 11.0)]
        );
        assert_eq!(s.histograms_by("d", "e", &[]).len(), 2);
        assert_eq!(s.histogram("absent", &[]), None);
    }

    #[test]
    fn a_quantile_interpolates_in_its_bucket_and_stops_at_the_last_finite_bound() {
        let a = Scrape::parse(HIST)
            .histogram("d", &[("e", "a")])
            .expect("a");
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1000.0;
        // p50: rank 5 of 10, the (0.1, 1.0] bucket holds ranks 3..=8: 0.1 + 0.9 * 3/6.
        let (p50, le) = a.quantile(0.5).expect("observed");
        assert!((ms(p50) - 550.0).abs() < 1e-6, "{p50:?}");
        assert_eq!(le, std::time::Duration::from_secs(1));
        // p99 falls in +Inf: the highest finite bound, as histogram_quantile says.
        assert_eq!(
            a.quantile(0.99).expect("observed").0,
            std::time::Duration::from_secs(1)
        );
        assert_eq!(a.mean(), Some(std::time::Duration::from_millis(650)));
        // Nothing observed between two equal scrapes.
        assert_eq!(a.minus(&a).quantile(0.5), None);
        assert_eq!(a.minus(&a).mean(), None);
        let earlier = Scrape::parse(
            "d_bucket{e=\"a\",le=\"0.1\"} 2\nd_bucket{e=\"a\",le=\"+Inf\"} 2\nd_sum{e=\"a\"} 0.1\nd_count{e=\"a\"} 2\n",
        )
        .histogram("d", &[])
        .expect("earlier");
        let between = a.minus(&earlier);
        assert_eq!(
            between.buckets,
            vec![(0.1, 0.0), (1.0, 6.0), (f64::INFINITY, 8.0)]
        );
        assert_eq!(between.count, 8.0);
    }
}
