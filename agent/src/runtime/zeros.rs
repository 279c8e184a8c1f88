//! Strict mode's zeros the NRI plugin gave: which containers got `<kind> 0`, in which namespace, so
//! that the zero can be lifted (`<kind> max`) when the namespace is labelled exempt later, and
//! forgotten when the runtime removes the container.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Container ID → (its pod's namespace, the value lifting its zero). Shared by the plugin's session
/// and its answering tasks.
#[derive(Debug, Default)]
pub struct Zeros {
    /// Strict mode is on (off, nothing is remembered: no zero is ever lifted, and no removal is
    /// followed that would forget it).
    strict: bool,
    zeroed: Mutex<HashMap<String, (String, String)>>,
}

impl Zeros {
    /// The zeros of a plugin in strict mode (`strict`), or none.
    pub fn new(strict: bool) -> Zeros {
        Zeros {
            strict,
            zeroed: Mutex::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, (String, String)>> {
        self.zeroed.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Container `id` of `namespace` was answered `value`: remembered when that is strict mode's zero.
    pub fn note(&self, id: &str, namespace: &str, value: Option<&str>) {
        if !self.strict {
            return;
        }
        if let Some(lift) = value.and_then(lifting) {
            self.lock()
                .insert(id.to_string(), (namespace.to_string(), lift));
        }
    }

    /// The runtime removed container `id`.
    pub fn forget(&self, id: &str) {
        self.lock().remove(id);
    }

    /// The zeroed containers whose namespace is `exempt` now, forgotten here: `(ID, the value lifting
    /// the zero)`.
    pub fn lift(&self, exempt: impl Fn(&str) -> bool) -> Vec<(String, String)> {
        self.lock()
            .extract_if(|_, (namespace, _)| exempt(namespace))
            .map(|(id, (_, value))| (id, value))
            .collect()
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

    #[test]
    fn zeros_are_lifted_once_by_namespace_and_removed_containers_never() {
        let off = Zeros::new(false);
        off.note("a", "late", Some("tdx 0"));
        assert!(
            off.lift(|_| true).is_empty(),
            "nothing remembered out of strict mode"
        );
        let z = Zeros::new(true);
        z.note("a", "late", Some("tdx 0"));
        z.note("b", "late", Some("tdx 0"));
        z.note("c", "default", Some("tdx 0"));
        z.note("d", "late", Some("tdx 1"));
        z.note("e", "late", None);
        z.forget("b");
        assert_eq!(
            z.lift(|ns| ns == "late"),
            [("a".to_string(), "tdx max".to_string())]
        );
        assert!(z.lift(|ns| ns == "late").is_empty(), "lifted once");
        assert_eq!(
            z.lift(|_| true).len(),
            1,
            "c, whose namespace was not exempt"
        );
    }
}
