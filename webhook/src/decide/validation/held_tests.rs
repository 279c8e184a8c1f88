//! Keys a node's report shows free that a pod still cannot have: reserved by other pods, and kept
//! for VMIs that waited longer than the pod's own.

use super::tests::{STALE, kind, now, report, tdx};
use super::*;

#[test]
fn keys_kept_for_vmis_waiting_longer_are_not_free_for_the_pod_and_the_message_says_so() {
    let two = report(Some(kind(31, 2, 0)), 5);
    let held = |reserved: &KeyRequests, queued: &KeyRequests| {
        let held = Held { reserved, queued };
        NodeAssessment::new("q", &tdx(1), Some(&two), held, now(), STALE)
    };
    let a = held(&tdx(1), &tdx(1));
    assert_eq!(a.fit(), Fit::Short);
    assert_eq!(
        a.describe(),
        "q 0/31 free (1 just admitted, not in the report yet, 1 kept for VMs waiting longer)"
    );
    assert_eq!(held(&tdx(0), &tdx(1)).fit(), Fit::Fits, "one left");
    assert_eq!(
        held(&tdx(0), &tdx(3)).describe(),
        "q 0/31 free (2 kept for VMs waiting longer)",
        "no more kept than there are keys left"
    );
}
