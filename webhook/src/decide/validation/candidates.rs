//! The scan over the candidate nodes of a pod not bound yet ([`CandidateScan`]): stops at the first
//! node that fits, otherwise keeps what a refusal lists, allocating only for the few nodes it may list.

use std::ops::ControlFlow;
use std::time::Duration;

use jiff::Timestamp;
use teeguard_shared::config::StalePolicy;
use teeguard_shared::pod::KeyRequests;

use super::*;

/// The candidate nodes of a pod not bound yet, folded one at a time in any order.
///
/// [`CandidateScan::offer`] says [`ControlFlow::Break`] at the first node that fits (the verdict is then
/// an admission and the rest need not be looked at). Until then the scan keeps only counts, the best
/// [`MAX_LISTED_NODES`] nodes for the refusal message (most available keys, then name) and the first
/// [`MAX_LISTED_NODES`] names (by name) of nodes with unknown reports, so a scan over thousands of nodes
/// allocates only for the few it may list. The verdict is the same whatever the order of the offers.
#[derive(Clone, Debug)]
pub struct CandidateScan<'r> {
    requests: &'r KeyRequests,
    /// A node that fits is a DRA node (the scheduler decides there).
    dra: bool,
    total: usize,
    unknown: usize,
    fits: bool,
    /// Sorted best first: rank descending, then name.
    pub(super) best: Vec<(u64, NodeAssessment)>,
    /// Sorted by name.
    pub(super) unknown_names: Vec<String>,
}

impl<'r> CandidateScan<'r> {
    /// An empty scan for a pod requesting `requests`.
    pub fn new(requests: &'r KeyRequests) -> Self {
        CandidateScan {
            requests,
            dra: false,
            total: 0,
            unknown: 0,
            fits: false,
            best: Vec::new(),
            unknown_names: Vec::new(),
        }
    }

    /// Offer the candidate `node` with its report (`None`: no report) and the keys `held` there for
    /// other pods and VMIs (see [`NodeAssessment::new`]). Allocates only when the node joins the listed
    /// few.
    pub fn offer<'a, 'h>(
        &mut self,
        node: &str,
        report: impl Into<Report<'a>>,
        held: impl Into<Held<'h>>,
        now: Timestamp,
        stale_after: Duration,
    ) -> ControlFlow<()> {
        let given = report.into();
        let held = held.into();
        let report = current_report(given, now, stale_after);
        let requests = self.requests;
        let (fit, rank) = if scheduler_allocates(requests, &report) {
            // DRA mode: the scheduler allocates this node's keys; the pod may wait there (Pending).
            self.dra = true;
            (Fit::Fits, u64::MAX)
        } else {
            let figures = requests
                .iter()
                .map(|(kind, n)| (*n, kind_figures(*kind, &report, held)));
            fit_and_rank(figures)
        };
        self.add(fit, rank, node, || {
            NodeAssessment::new(node, requests, given, held, now, stale_after)
        })
    }

    /// Offer an already assessed candidate (for `requests` of this scan).
    #[cfg(test)]
    pub(crate) fn offer_assessed(&mut self, a: NodeAssessment) -> ControlFlow<()> {
        if a.scheduler_allocates {
            self.dra = true;
            let node = a.node.clone();
            return self.add(Fit::Fits, u64::MAX, &node, || a);
        }
        let (fit, rank) = fit_and_rank(a.kinds.iter().map(|(_, want, f)| (*want, f.clone())));
        let node = a.node.clone();
        self.add(fit, rank, &node, || a)
    }

    fn add(
        &mut self,
        fit: Fit,
        rank: u64,
        node: &str,
        assess: impl FnOnce() -> NodeAssessment,
    ) -> ControlFlow<()> {
        self.total += 1;
        match fit {
            Fit::Fits => {
                self.fits = true;
                return ControlFlow::Break(());
            }
            Fit::Unknown => {
                self.unknown += 1;
                let at = self.unknown_names.partition_point(|n| n.as_str() < node);
                if at < MAX_LISTED_NODES {
                    self.unknown_names.insert(at, node.to_string());
                    self.unknown_names.truncate(MAX_LISTED_NODES);
                }
            }
            Fit::Short => {}
        }
        // Best first: higher rank, then smaller name.
        let at = self
            .best
            .partition_point(|(r, a)| *r > rank || (*r == rank && a.node.as_str() < node));
        if at < MAX_LISTED_NODES {
            self.best.insert(at, (rank, assess()));
            self.best.truncate(MAX_LISTED_NODES);
        }
        ControlFlow::Continue(())
    }

    /// Candidates offered so far.
    #[cfg(test)]
    pub(crate) fn offered(&self) -> usize {
        self.total
    }

    /// Whether some offered candidate fits.
    #[cfg(test)]
    pub(crate) fn fits(&self) -> bool {
        self.fits
    }

    /// The verdict over every candidate offered (or up to the first that fits).
    pub fn verdict(self, policy: StalePolicy) -> Verdict {
        let requests = self.requests;
        if self.fits {
            return Verdict::Admit {
                reason: if self.dra {
                    reason::SCHEDULER_ALLOCATED
                } else {
                    reason::ENOUGH_KEYS
                },
                warnings: Vec::new(),
            };
        }
        let vm = vm_label(requests);
        if self.total == 0 {
            return Verdict::Refuse {
                reason: reason::NO_CANDIDATE_NODES,
                message: format!(
                    "no node can host {vm}: no node matches the pod's nodeSelector and required node affinity; \
                     check the VirtualMachineInstance's nodeSelector/affinity and the nodes' labels"
                ),
            };
        }
        if self.unknown > 0 && policy == StalePolicy::Allow {
            let shown = list_more(self.unknown_names.join(", "), self.unknown);
            return Verdict::Admit {
                reason: reason::REPORT_UNKNOWN,
                warnings: vec![format!(
                    "teeguard could not check free {} keys: no node with a current report has enough, and the report of {shown} is missing or stale; allowed by {}",
                    kinds_label(requests),
                    Trigger::PodCreate.policy_field()
                )],
            };
        }
        let listed: Vec<String> = self.best.iter().map(|(_, a)| a.describe()).collect();
        let list = list_more(listed.join(", "), self.total);
        let hint = if self.unknown == 0 {
            HINT.to_string()
        } else {
            format!("{HINT}; {AGENT_HINT}")
        };
        Verdict::Refuse {
            reason: if self.unknown == self.total {
                reason::REPORT_UNKNOWN
            } else {
                reason::INSUFFICIENT_KEYS
            },
            message: format!("no node can host {vm}: {list}; {hint}"),
        }
    }
}

/// `list`, followed by ` and N more` when `total` exceeds [`MAX_LISTED_NODES`].
fn list_more(mut list: String, total: usize) -> String {
    if total > MAX_LISTED_NODES {
        list.push_str(&format!(" and {} more", total - MAX_LISTED_NODES));
    }
    list
}
