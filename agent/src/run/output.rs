//! [`Output`]: one thing the agent keeps written to the API server (the report, the Node's extended
//! resources, the DRA ResourceSlices), and when it may be written again after a failure.

use std::fmt::Display;
use std::time::{Duration, Instant};

use crate::cluster::watch::Backoff;

/// An output the agent keeps written: after a failed write the next one waits out a growing backoff
/// (reset by a success), and the last error is kept for the report's conditions.
#[derive(Debug)]
pub(super) struct Output {
    backoff: Backoff,
    retry_at: Option<Instant>,
    error: Option<String>,
}

impl Output {
    pub(super) fn new(backoff: Backoff) -> Output {
        Output {
            backoff,
            retry_at: None,
            error: None,
        }
    }

    /// A write may go now (none failed, or the backoff after the failure has passed).
    pub(super) fn due(&self) -> bool {
        self.retry_at.is_none_or(|t| Instant::now() >= t)
    }

    /// When the write that failed may be tried again.
    pub(super) fn retry_at(&self) -> Option<Instant> {
        self.retry_at
    }

    /// Why the last write failed (`None` after a success).
    pub(super) fn error(&self) -> Option<&str> {
        self.error.as_deref()
    }

    /// The write went through.
    pub(super) fn written(&mut self) {
        self.backoff.reset();
        self.retry_at = None;
        self.error = None;
    }

    /// The write failed with `error`; how long until it may be tried again.
    pub(super) fn failed(&mut self, error: &impl Display) -> Duration {
        let delay = self.backoff.next_delay();
        self.retry_at = Some(Instant::now() + delay);
        self.error = Some(error.to_string());
        delay
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_write_waits_out_its_backoff_and_a_success_clears_it() {
        let mut out = Output::new(Backoff::new(
            Duration::from_secs(60),
            Duration::from_secs(60),
        ));
        assert!(out.due() && out.error().is_none());
        let delay = out.failed(&"403 forbidden");
        assert!(delay >= Duration::from_secs(40), "{delay:?}");
        assert!(!out.due(), "not before the backoff has passed");
        assert_eq!(out.error(), Some("403 forbidden"));
        assert!(out.retry_at().is_some_and(|t| t > Instant::now()));
        out.written();
        assert!(out.due() && out.error().is_none() && out.retry_at().is_none());
    }
}
