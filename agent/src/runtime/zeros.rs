//! Strict mode's keyless containers: which containers get `<kind> 0` unless their namespace is
//! labelled exempt, in which namespace, and whether they have that zero now, so that the plugin gives
//! or lifts it (`<kind> max`) as the label comes and goes, as the cgroup writer does for pod cgroups.
//! A container is forgotten when the runtime removes it.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// One keyless container of strict mode.
#[derive(Debug)]
struct Keyless {
    /// Its pod's namespace.
    namespace: String,
    /// The zero it gets unless the namespace is exempt (`tdx 0`).
    zero: String,
    /// It has the zero now (else no limit, or the zero lifted).
    zeroed: bool,
}

/// Container ID → what strict mode gives it. Shared by the plugin's session and its answering tasks.
#[derive(Debug, Default)]
pub struct Zeros {
    keyless: Mutex<HashMap<String, Keyless>>,
}

impl Zeros {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Keyless>> {
        self.keyless.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Container `id` of `namespace` gets `zero` unless the namespace is exempt (`None`: it is not one
    /// of strict mode's keyless containers, nothing to remember), and has `now` (`None`: no limit).
    pub fn note(&self, id: &str, namespace: &str, zero: Option<&str>, now: Option<&str>) {
        let Some(zero) = zero else {
            return;
        };
        let keyless = Keyless {
            namespace: namespace.to_string(),
            zero: zero.to_string(),
            zeroed: now == Some(zero),
        };
        self.lock().insert(id.to_string(), keyless);
    }

    /// The runtime removed container `id`.
    pub fn forget(&self, id: &str) {
        self.lock().remove(id);
    }

    /// The containers whose limit no longer fits their namespace's label (`exempt`), taken as set
    /// from now on: `(ID, misc.max)`, the zero lifted (`tdx max`) where the namespace is labelled
    /// exempt now, given again (`tdx 0`) where the label was removed.
    pub fn follow(&self, exempt: impl Fn(&str) -> bool) -> Vec<(String, String)> {
        let mut changed = Vec::new();
        for (id, k) in self.lock().iter_mut() {
            let zeroed = !exempt(&k.namespace);
            if zeroed == k.zeroed {
                continue;
            }
            let value = if zeroed {
                Some(k.zero.clone())
            } else {
                lifting(&k.zero)
            };
            if let Some(value) = value {
                k.zeroed = zeroed;
                changed.push((id.clone(), value));
            }
        }
        changed
    }
}

/// The value that lifts strict mode's zero `value` (`tdx 0` → `tdx max`); `None` when `value` is not
/// zeros only.
fn lifting(value: &str) -> Option<String> {
    let kinds = value
        .lines()
        .map(|line| match line.split_once(' ') {
            Some((kind, "0")) => Some(kind),
            _ => None,
        })
        .collect::<Option<Vec<_>>>()?;
    (!kinds.is_empty()).then(|| {
        kinds
            .iter()
            .map(|k| format!("{k} max"))
            .collect::<Vec<_>>()
            .join("\n")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_zero_of_every_line_is_lifted_and_to_max() {
        assert_eq!(lifting("tdx 0").as_deref(), Some("tdx max"));
        assert_eq!(
            lifting("sev 0\nsev_es 0").as_deref(),
            Some("sev max\nsev_es max")
        );
        for kept in ["tdx 1", "sev 0\nsev_es 2", "", "tdx", "tdx max"] {
            assert_eq!(lifting(kept), None, "{kept:?}");
        }
    }

    fn sorted(mut v: Vec<(String, String)>) -> Vec<(String, String)> {
        v.sort();
        v
    }

    fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
        v.iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    #[test]
    fn zeros_follow_the_namespace_label_both_ways_once_and_removed_containers_never() {
        let z = Zeros::default();
        z.note("a", "late", Some("tdx 0"), Some("tdx 0"));
        z.note("b", "late", Some("tdx 0"), Some("tdx 0"));
        z.note("c", "default", Some("tdx 0"), Some("tdx 0"));
        z.note("d", "late", None, Some("tdx 1"));
        z.note("e", "open", Some("tdx 0"), None);
        z.forget("b");
        let exempt = |ns: &str| ns == "late" || ns == "open";
        assert_eq!(z.follow(exempt), pairs(&[("a", "tdx max")]));
        assert!(z.follow(exempt).is_empty(), "each change once");
        // The label moves from `late` and `open` to `default`.
        assert_eq!(
            sorted(z.follow(|ns| ns == "default")),
            pairs(&[("a", "tdx 0"), ("c", "tdx max"), ("e", "tdx 0")])
        );
    }
}
