//! The admission router and what every admission endpoint shares: body reading with a size limit,
//! a request timeout, JSON errors, metrics and logs.
//!
//! Adding an endpoint: write `handlers/<name>.rs` with an axum handler that calls [`serve_review`]
//! with its own review function, and add one `.route(...)` line in [`router`].

pub mod mutate;
pub mod validate;

use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http_body_util::BodyExt;

use crate::error::{Error, Result};
use crate::metrics::Outcome;
use crate::web::admission::ReviewResponse;
use crate::web::state::AppState;

/// The HTTPS router: `POST /mutate`, `POST /validate`. Unknown paths get a JSON 404.
///
/// The state is shared behind one `Arc`: axum clones the state for every request, and cloning
/// [`AppState`] itself would touch a dozen reference counts (caches, client, metrics, index, Event
/// sink) that every worker thread shares.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/mutate", post(mutate::handle))
        .route("/validate", post(validate::handle))
        .fallback(not_found)
        .with_state(Arc::new(state))
}

async fn not_found(req: Request) -> Response {
    let body = serde_json::json!({"error": format!("no endpoint {}: use POST /mutate or POST /validate", req.uri().path())});
    (
        axum::http::StatusCode::NOT_FOUND,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// A review's answer and how it ended, for metrics.
#[derive(Debug)]
pub struct Reviewed {
    /// The response to send.
    pub response: ReviewResponse,
    /// Allowed, patched or denied.
    pub outcome: Outcome,
}

impl Reviewed {
    /// The answer of the deciding replica to a forwarded review, sent as it is.
    pub fn forwarded(answer: Bytes) -> Reviewed {
        #[derive(serde::Deserialize)]
        struct Answer {
            response: Allowed,
        }
        #[derive(serde::Deserialize)]
        struct Allowed {
            allowed: bool,
        }
        let outcome = match serde_json::from_slice::<Answer>(&answer) {
            Ok(a) if a.response.allowed => Outcome::Allowed,
            Ok(_) => Outcome::Denied,
            Err(_) => Outcome::Error,
        };
        Reviewed {
            response: ReviewResponse {
                forwarded: Some(answer),
                ..ReviewResponse::default()
            },
            outcome,
        }
    }
}

/// Read the whole body, refusing more than `limit` bytes with [`Error::PayloadTooLarge`] (413).
///
/// A body that arrives as one frame (hyper hands over a body that is already in its read buffer in
/// one piece) is returned as that frame, without a copy; only a body in several frames is gathered
/// into one buffer.
///
/// An oversized body is read and discarded up to twice the limit before answering, so an HTTP/1.1
/// client that is still sending sees the 413 instead of a reset connection; beyond that the
/// connection is dropped. Nothing past the limit is buffered.
pub async fn read_body(mut body: Body, content_length: Option<u64>, limit: usize) -> Result<Bytes> {
    let drain_cap = limit.saturating_mul(2);
    let mut too_large = content_length.is_some_and(|len| len > limit as u64);
    if content_length.is_some_and(|len| len > drain_cap as u64) {
        return Err(Error::PayloadTooLarge { limit });
    }
    let capacity = content_length.map_or(0, |len| (len as usize).min(limit));
    // The first frame, kept as it is until a second one arrives; then everything goes to `joined`.
    let mut first: Option<Bytes> = None;
    let mut joined: Vec<u8> = Vec::new();
    let mut total = 0usize;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| Error::ReadBody(e.to_string()))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if data.is_empty() {
            continue;
        }
        total = total.saturating_add(data.len());
        if total > limit {
            too_large = true;
        }
        if too_large {
            if total > drain_cap {
                break;
            }
            continue;
        }
        if let Some(prev) = first.take() {
            joined.reserve(capacity.max(total));
            joined.extend_from_slice(&prev);
            joined.extend_from_slice(&data);
        } else if joined.is_empty() {
            first = Some(data);
        } else {
            joined.extend_from_slice(&data);
        }
    }
    if too_large {
        return Err(Error::PayloadTooLarge { limit });
    }
    Ok(first.unwrap_or_else(|| Bytes::from(joined)))
}

/// Run one admission endpoint: read the body (size limit), call `review` (all within the request
/// timeout), answer with the AdmissionReview JSON or a JSON error, and record metrics.
pub async fn serve_review<F, Fut>(
    state: &AppState,
    endpoint: &'static str,
    req: Request,
    review: F,
) -> Response
where
    F: FnOnce(Bytes) -> Fut,
    Fut: Future<Output = Result<Reviewed>>,
{
    let start = Instant::now();
    let content_length = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let limits = state.limits;
    let work = async {
        let body = read_body(req.into_body(), content_length, limits.max_body_bytes).await?;
        review(body).await
    };
    let result = match tokio::time::timeout(limits.request_timeout, work).await {
        Ok(r) => r,
        Err(_) => Err(Error::Timeout(limits.request_timeout)),
    };
    match result {
        Ok(reviewed) => {
            state
                .metrics
                .observe_request(endpoint, reviewed.outcome, start.elapsed());
            (
                [(header::CONTENT_TYPE, "application/json")],
                reviewed.response.to_json(),
            )
                .into_response()
        }
        Err(e) => {
            state
                .metrics
                .observe_request(endpoint, Outcome::Error, start.elapsed());
            if e.status().is_server_error() {
                tracing::warn!(endpoint, error = %e, "admission request failed");
            } else {
                tracing::info!(endpoint, error = %e, "admission request rejected");
            }
            e.into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(parts: &[&'static [u8]]) -> Body {
        let chunks: Vec<std::result::Result<Bytes, std::io::Error>> =
            parts.iter().map(|p| Ok(Bytes::from_static(p))).collect();
        Body::from_stream(futures::stream::iter(chunks))
    }

    fn run<T>(f: impl Future<Output = T>) -> T {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
            .block_on(f)
    }

    #[test]
    fn one_frame_is_returned_without_a_copy() {
        static BODY: &[u8] = b"{\"review\": 1}";
        let got = run(read_body(frames(&[BODY]), Some(BODY.len() as u64), 64)).expect("body");
        assert_eq!(got, BODY);
        assert_eq!(got.as_ptr(), BODY.as_ptr(), "the frame itself, not a copy");
    }

    #[test]
    fn several_frames_and_empty_frames_are_joined_in_order() {
        for (parts, want) in [
            (&[&b"ab"[..], b"cd", b"e"][..], &b"abcde"[..]),
            (&[&b""[..], b"ab", b"", b"cd"][..], b"abcd"),
            (&[&b"a"[..], b""][..], b"a"),
            (&[&b""[..]][..], b""),
            (&[][..], b""),
        ] {
            for length in [None, Some(want.len() as u64)] {
                let got = run(read_body(frames(parts), length, 64)).expect("body");
                assert_eq!(got, want, "{parts:?} with length {length:?}");
            }
        }
    }

    #[test]
    fn bodies_over_the_limit_are_refused_whatever_their_framing() {
        let too_large = |r: Result<Bytes>| matches!(r, Err(Error::PayloadTooLarge { limit: 4 }));
        // Announced too large, announced too large beyond the drain cap, or found too large.
        assert!(too_large(run(read_body(frames(&[b"abcde"]), Some(5), 4))));
        assert!(too_large(run(read_body(frames(&[b"abcde"]), Some(9), 4))));
        assert!(too_large(run(read_body(frames(&[b"ab", b"cde"]), None, 4))));
        assert!(too_large(run(read_body(frames(&[b"abcde"]), None, 4))));
        // Exactly the limit is fine, in one frame or several.
        assert_eq!(
            run(read_body(frames(&[b"ab", b"cd"]), None, 4)).expect("body"),
            &b"abcd"[..]
        );
    }
}
