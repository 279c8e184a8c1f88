//! Waiting in tests for what happens in the background: [`eventually`] polls a check until it holds
//! and panics naming what it awaited when a generous deadline passes; [`until`] is the same loop with
//! the caller's deadline and an error instead of the panic.
//!
//! A check is an async closure returning `bool` (the condition holds) or `Option<T>` (the value,
//! once there is one): `eventually("the VMI cached", async || cache.len() == 1).await`.

use std::time::Duration;

use tokio::time::Instant;

use crate::{Error, Result};

/// How long [`eventually`] waits: generous, so that a loaded machine (two cores running several test
/// binaries at once) is not taken for a bug. A check that holds returns at once anyway.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// The pause after the first check that does not hold; it doubles after each further one, up to
/// [`LONGEST_PAUSE`]: quick answers are seen quickly, long waits poll lightly.
const FIRST_PAUSE: Duration = Duration::from_millis(10);
/// The longest pause between two checks.
const LONGEST_PAUSE: Duration = Duration::from_millis(100);

/// What a check returns: `true` or `Some(value)` once what it awaits holds.
pub trait Outcome {
    /// What the wait gives back: `()` for a `bool` check, the value for an `Option` one.
    type Value;
    /// The value, once the check holds.
    fn holds(self) -> Option<Self::Value>;
}

impl Outcome for bool {
    type Value = ();

    fn holds(self) -> Option<()> {
        self.then_some(())
    }
}

impl<T> Outcome for Option<T> {
    type Value = T;

    fn holds(self) -> Option<T> {
        self
    }
}

/// Poll `check` until it holds and return its value; panic naming `what` after [`PATIENCE`].
pub async fn eventually<O: Outcome>(what: &str, check: impl AsyncFnMut() -> O) -> O::Value {
    match until(what, PATIENCE, check).await {
        Ok(value) => value,
        Err(e) => panic!("{e}"),
    }
}

/// Poll `check` until it holds and return its value, or [`Error::Timeout`] once `timeout` has passed (the
/// check runs at least once, and once more at the deadline).
pub async fn until<O: Outcome>(
    what: &str,
    timeout: Duration,
    mut check: impl AsyncFnMut() -> O,
) -> Result<O::Value> {
    let deadline = Instant::now() + timeout;
    let mut pause = FIRST_PAUSE;
    loop {
        if let Some(value) = check().await.holds() {
            return Ok(value);
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::Timeout {
                what: what.to_string(),
                after: timeout,
                log: None,
            });
        }
        tokio::time::sleep(pause.min(deadline - now)).await;
        pause = (pause * 2).min(LONGEST_PAUSE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_check_that_holds_late_is_waited_for_and_one_that_never_holds_times_out() {
        let mut calls = 0;
        let value = eventually("the third call", async || {
            calls += 1;
            (calls == 3).then_some(calls)
        })
        .await;
        assert_eq!(value, 3);

        let timeout = Duration::from_millis(200);
        let started = Instant::now();
        let err = until("nothing", timeout, async || false)
            .await
            .expect_err("never holds");
        assert_eq!(err.to_string(), "timed out after 200ms waiting for nothing");
        let took = started.elapsed();
        assert!(took >= timeout, "gave up early: {took:?}");
        assert!(
            took < timeout * 5,
            "waited well past the deadline: {took:?}"
        );
    }
}
