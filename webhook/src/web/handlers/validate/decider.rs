//! Where a review that takes a key is decided (here, at the decider it is forwarded to, or refused
//! while nobody decides), and the forward itself.

use crate::cluster::index::KeyIndex;
use crate::cluster::lead::Leadership;
use crate::decide::lead::Route as LeadRoute;
use crate::decide::queue;
use crate::decide::validation::reason;
use crate::web::forward::Forwarder;
use crate::web::handlers::Reviewed;

use super::{Answer, ValidationContext, respond};

/// Where reviews that take a key are decided.
#[derive(Clone, Copy, Debug)]
pub struct Decider<'a> {
    /// The election.
    pub leadership: &'a Leadership,
    /// The connection to the deciding replica.
    pub forwarder: &'a Forwarder,
    /// This review was forwarded by another replica: decide it or refuse it, never forward it again.
    pub forwarded: bool,
}

/// Where the check of a review that takes a key is made (see [`Decider`]): `None` here, else the
/// verdict that forwards, declines or refuses it (`refused` makes the refusal the handler answers
/// with: its mode, its note). A binding (`create` false) is decided by a decider that has just taken
/// over too (it holds the pod's keys on the scheduler's node, what the pod's lost hold held); a CREATE
/// waits for the orphans.
pub(super) fn elsewhere(
    ctx: &ValidationContext<'_>,
    index: &KeyIndex,
    create: bool,
    (request, kind): (&'static str, &'static str),
    refused: impl FnOnce(Answer) -> Answer,
) -> Option<Verdict> {
    let d = ctx.decider?;
    // Nobody decides now (or this replica decides but may not admit a CREATE yet): wait a moment for
    // a decider (one may be taking the Lease over, or reading the holds of the one that gave it up),
    // then refuse.
    let nobody = |why: String| Verdict::Nobody {
        refusal: refused(Answer::deny(
            request,
            kind,
            reason::NO_DECIDER,
            format!("{why}; {}", crate::decide::validation::HINT),
        )),
        create,
    };
    let route = if create {
        match d.leadership.route_create(index) {
            Ok(r) => r,
            Err(n) => {
                return Some(nobody(format!(
                    "teeguard's deciding replica has just taken over and waits for {n} launcher \
                     pod(s) admitted before it to be bound or gone"
                )));
            }
        }
    } else {
        d.leadership.route()
    };
    // Forwarded here by a replica while this one does not decide: that replica asks the Lease again.
    match route {
        LeadRoute::Here => None,
        LeadRoute::Forward(address) if !d.forwarded => Some(Verdict::Forward(address)),
        LeadRoute::Forward(address) => Some(Verdict::Decline(format!("the Lease names {address}"))),
        LeadRoute::Nobody if d.forwarded => Some(Verdict::Decline("nobody holds the Lease".into())),
        LeadRoute::Nobody => Some(nobody(
            "no teeguard replica decides right now (an election, or the deciding replica \
             cannot reach the API server to renew its Lease)"
                .into(),
        )),
    }
}

/// A review decided (or refused) here, or to send elsewhere.
pub(super) enum Verdict {
    Answer(Answer),
    Forward(String),
    /// Nobody decides (`create`: a CREATE the decider may not admit yet): wait a moment for a
    /// decider and review again, else this refusal.
    Nobody {
        refusal: Answer,
        create: bool,
    },
    /// Forwarded here, not deciding (why): HTTP 503 to the forwarding replica.
    Decline(String),
}

/// Wait, at most one Lease retry period, for a replica that decides (other than a decider at
/// `failed`, which could not be reached; with `create`, one that may admit a CREATE): true once there
/// is one and the review should be routed again. A decider that stopped cleanly wrote its holds and
/// gave the Lease up, so the wait ends at the next read and once those holds are in the index.
pub(super) async fn await_decider(
    ctx: &ValidationContext<'_>,
    index: &KeyIndex,
    failed: Option<&str>,
    create: bool,
) -> bool {
    match ctx.decider {
        Some(d) if !d.forwarded => {
            let index = create.then_some(index);
            d.leadership.await_decider(failed, index).await
        }
        _ => false,
    }
}

/// Send the review to the deciding replica; its answer is this one's (`Err`: why it could not be
/// sent or answered).
pub(super) async fn forward(
    body: &[u8],
    address: &str,
    ctx: &ValidationContext<'_>,
) -> crate::error::Result<Reviewed> {
    let sent = match ctx.decider {
        Some(d) => {
            d.forwarder
                .forward(address, axum::body::Bytes::copy_from_slice(body))
                .await
        }
        None => Err(crate::error::Error::Forward {
            address: address.to_string(),
            reason: "this replica has no connection to a decider".into(),
        }),
    };
    sent.map(Reviewed::forwarded)
}

/// A forward that failed: a refusal the new decider's planner ends (the VMI waits its turn like any
/// refused for keys).
pub(super) fn unforwarded(
    address: &str,
    why: crate::error::Error,
    ctx: &ValidationContext<'_>,
    uid: String,
) -> Reviewed {
    tracing::warn!(
        decider = address,
        error = %why,
        "cannot forward a review to the deciding replica; refused"
    );
    let mut msg = format!("{why}; {}", crate::decide::validation::HINT);
    queue::note_refusal(reason::NO_DECIDER, Some(&mut msg));
    let a = Answer::deny("forward", "none", reason::NO_DECIDER, msg);
    if let Some(m) = ctx.metrics {
        m.validation(a.request, a.kind, a.outcome);
    }
    respond(uid, a)
}
