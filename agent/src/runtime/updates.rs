//! The plugin's own `UpdateContainers` calls (a container created before the plugin registered and
//! started after, strict mode's zeros given or lifted): each answer is logged, and so is a call the
//! runtime leaves unanswered for [`UPDATE_ANSWER_WAIT`] (CRI-O was seen once never to answer one; the
//! container then keeps its limit until the runtime applies it or the next `Synchronize`).

use std::time::{Duration, Instant};

use super::transport as t;
use super::wire;

/// How long the runtime may leave an `UpdateContainers` unanswered before the plugin says so (twice
/// the timeout the call carries, the plugin's `REGISTER_TIMEOUT`).
pub const UPDATE_ANSWER_WAIT: Duration = Duration::from_secs(10);

/// The calls not answered yet, oldest first: stream, container ID, `misc.max`, when sent.
#[derive(Debug, Default)]
pub struct Unanswered {
    calls: Vec<(u32, String, String, Instant)>,
}

impl Unanswered {
    /// The call on `stream` asking for `misc.max` `value` for container `id` was sent now.
    pub fn sent(&mut self, stream: u32, id: &str, value: &str) {
        let call = (stream, id.to_string(), value.to_string(), Instant::now());
        self.calls.push(call);
    }

    /// The runtime answered the call on `stream` with `payload`: log what it says.
    pub fn answered(&mut self, stream: u32, payload: &[u8]) {
        self.calls.retain(|(s, ..)| *s != stream);
        let failed = t::decode_response(payload)
            .map_err(|e| e.to_string())
            .and_then(|r| match r.code() {
                0 => wire::failed_updates(&r.payload).map_err(|e| e.to_string()),
                code => Err(format!("code {code}: {}", r.message())),
            });
        match failed {
            Ok(failed) if failed.is_empty() => tracing::debug!("the runtime applied the update"),
            Ok(failed) => {
                tracing::warn!(containers = ?failed, "the runtime could not apply misc.max to these containers; they run without a limit")
            }
            Err(e) => {
                tracing::warn!(error = %e, "UpdateContainers failed; the container runs without a limit")
            }
        }
    }

    /// When the oldest call not answered is overdue (`None`: none waits).
    pub fn deadline(&self) -> Option<Instant> {
        self.calls.first().map(|c| c.3 + UPDATE_ANSWER_WAIT)
    }

    /// Log each call unanswered for [`UPDATE_ANSWER_WAIT`], once, and stop following it.
    pub fn note_overdue(&mut self) {
        let now = Instant::now();
        self.calls.retain(|(_, id, value, sent)| {
            let waiting = now.duration_since(*sent) < UPDATE_ANSWER_WAIT;
            if !waiting {
                tracing::warn!(container = %id, misc_max = %value, waited = ?UPDATE_ANSWER_WAIT, "the runtime has not answered UpdateContainers: the container keeps its current misc.max until the runtime applies it or the plugin synchronizes again (an agent or runtime restart)");
            }
            waiting
        });
    }
}
