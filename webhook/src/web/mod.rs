//! The webhook's HTTPS side: [`server`] (rustls, HTTP/1.1 + HTTP/2, graceful drain) with its
//! [`stall`] guard, [`tls`] (certificate loading, hot-swappable resolver, directory watching),
//! [`admission`] (the AdmissionReview envelope: parse once, respond with a base64 patch),
//! [`admitted`] (the review's object decoded into the pod types), [`state`] (what every request
//! shares) and [`handlers`] (`POST /mutate`, `POST /validate`).

pub mod admission;
pub mod admitted;
pub mod forward;
pub mod handlers;
pub mod server;
pub mod stall;
pub mod state;
pub mod tls;
