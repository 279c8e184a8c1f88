//! `admission.decider: leader`: where a review that takes a key is decided (here, at the decider it
//! is forwarded to, or refused while nobody decides), and the forward itself.

use crate::cluster::index::KeyIndex;
use crate::cluster::lead::Leadership;
use crate::decide::lead::Route as LeadRoute;
use crate::decide::queue;
use crate::decide::validation::reason;
use crate::error::Result;
use crate::web::forward::Forwarder;
use crate::web::handlers::Reviewed;

use super::{Answer, ValidationContext, respond};

/// Where reviews that take a key are decided (`admission.decider: leader`).
#[derive(Clone, Copy, Debug)]
pub struct Decider<'a> {
    /// The election.
    pub leadership: &'a Leadership,
    /// The connection to the deciding replica.
    pub forwarder: &'a Forwarder,
    /// This review was forwarded by another replica: decide it or refuse it, never forward it again.
    pub forwarded: bool,
}

/// What a review that takes a key does on this replica.
pub(super) enum Route {
    /// Decide it here.
    Here,
    /// Send it to the deciding replica at this address.
    Forward(String),
    /// Refuse it: nobody decides now (why).
    Refuse(String),
}

/// Where the check of a review that takes a key is made (see [`Decider`]): a binding (`create`
/// false) is decided by a decider that has just taken over too (it holds the pod's keys on the
/// scheduler's node, what the pod's lost hold held); a CREATE waits for the orphans.
pub(super) fn route(ctx: &ValidationContext<'_>, index: &KeyIndex, create: bool) -> Route {
    let Some(d) = ctx.decider else {
        return Route::Here;
    };
    let route = if create {
        match d.leadership.route_create(index) {
            Ok(r) => r,
            Err(n) => {
                return Route::Refuse(format!(
                    "teeguard's deciding replica has just taken over and waits for {n} launcher \
                     pod(s) admitted before it to be bound or gone"
                ));
            }
        }
    } else {
        d.leadership.route()
    };
    match route {
        LeadRoute::Here => Route::Here,
        LeadRoute::Forward(address) if !d.forwarded => Route::Forward(address),
        LeadRoute::Forward(address) => Route::Refuse(format!(
            "teeguard's replicas disagree on which decides (this one was sent the review, the Lease \
             names {address})"
        )),
        LeadRoute::Nobody => {
            Route::Refuse("no teeguard replica decides right now (an election)".into())
        }
    }
}

/// A review that takes a key, not decided here: forwarded, or refused.
pub(super) fn not_here(request: &'static str, kind: &'static str, route: Route) -> Option<Verdict> {
    match route {
        Route::Here => None,
        Route::Forward(address) => Some(Verdict::Forward(address)),
        Route::Refuse(why) => Some(Verdict::Answer(Answer::deny(
            request,
            kind,
            reason::NO_DECIDER,
            format!("{why}; {}", crate::decide::validation::HINT),
        ))),
    }
}

/// A review decided (or refused) here, or to forward.
pub(super) enum Verdict {
    Answer(Answer),
    Forward(String),
}

/// Send the review to the deciding replica; its answer is this one's. A forward that fails is a
/// refusal the new decider's planner ends (the VMI waits its turn like any refused for keys).
pub(super) async fn forward(
    body: &[u8],
    address: &str,
    ctx: &ValidationContext<'_>,
    uid: String,
) -> Result<Reviewed> {
    let sent = match ctx.decider {
        Some(d) => {
            d.forwarder
                .forward(address, axum::body::Bytes::copy_from_slice(body))
                .await
        }
        None => Err("this replica has no connection to a decider".to_string()),
    };
    match sent {
        Ok(answer) => Ok(Reviewed::forwarded(answer)),
        Err(why) => {
            tracing::warn!(
                decider = address,
                error = why,
                "cannot forward a review to the deciding replica; refused"
            );
            let mut msg = format!("{why}; {}", crate::decide::validation::HINT);
            queue::note_refusal(reason::NO_DECIDER, Some(&mut msg));
            let a = Answer::deny("forward", "none", reason::NO_DECIDER, msg);
            if let Some(m) = ctx.metrics {
                m.validation(a.request, a.kind, a.outcome);
            }
            Ok(respond(uid, a))
        }
    }
}
