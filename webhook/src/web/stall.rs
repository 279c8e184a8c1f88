//! A per-connection guard against clients that stop reading.
//!
//! hyper's header-read timeout only runs while it waits for a request head, and the request timeout
//! covers reading the body and deciding. Neither applies while the server is blocked *writing* a response
//! to a client that never reads (for example one that pipelines requests and ignores the answers): the
//! connection would hold its slot forever. [`WriteStallGuard`] fails a write, flush or shutdown that has
//! made no progress for the configured time, which makes hyper close the connection.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// Wraps a stream; a write-side operation pending for longer than `limit` without progress fails with
/// [`io::ErrorKind::TimedOut`]. Reads pass through untouched.
#[derive(Debug)]
pub struct WriteStallGuard<S> {
    inner: S,
    limit: Duration,
    stalled_since: Option<Pin<Box<Sleep>>>,
}

impl<S> WriteStallGuard<S> {
    /// Guard `inner` with the given stall limit.
    pub fn new(inner: S, limit: Duration) -> Self {
        WriteStallGuard {
            inner,
            limit,
            stalled_since: None,
        }
    }

    /// Track one poll of a write-side operation: progress resets the timer, `Pending` arms it, and an
    /// expired timer turns the `Pending` into a time-out error.
    fn track<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        match polled {
            Poll::Ready(r) => {
                self.stalled_since = None;
                Poll::Ready(r)
            }
            Poll::Pending => {
                let limit = self.limit;
                let timer = self
                    .stalled_since
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
                match timer.as_mut().poll(cx) {
                    Poll::Pending => Poll::Pending,
                    Poll::Ready(()) => {
                        self.stalled_since = None;
                        Poll::Ready(Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            format!(
                                "the client read nothing for {limit:?} while a response was being \
                                 written; closing the connection"
                            ),
                        )))
                    }
                }
            }
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteStallGuard<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteStallGuard<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.track(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.track(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_flush(cx);
        this.track(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_shutdown(cx);
        this.track(cx, polled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn a_reader_that_stops_fails_the_write_after_the_limit() {
        // A 64-byte pipe whose far end never reads: the second write blocks.
        let (near, _far) = tokio::io::duplex(64);
        let mut guarded = WriteStallGuard::new(near, Duration::from_millis(100));
        guarded.write_all(&[0; 64]).await.expect("fits the buffer");
        let started = std::time::Instant::now();
        let err = tokio::time::timeout(Duration::from_secs(5), guarded.write_all(&[0; 64]))
            .await
            .expect("the guard ends the write, not the test's timeout")
            .expect_err("stalled write");
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= Duration::from_millis(100));
    }

    #[tokio::test]
    async fn a_slow_but_steady_reader_is_fine() {
        let (near, mut far) = tokio::io::duplex(16);
        let mut guarded = WriteStallGuard::new(near, Duration::from_millis(200));
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            let mut buf = [0u8; 16];
            while got.len() < 256 {
                tokio::time::sleep(Duration::from_millis(20)).await;
                let n = far.read(&mut buf).await.expect("read");
                got.extend_from_slice(&buf[..n]);
            }
            got.len()
        });
        // 256 bytes through a 16-byte pipe takes ~16 × 20 ms, longer than the limit, but every write
        // makes progress within it.
        guarded.write_all(&[7; 256]).await.expect("steady progress");
        assert_eq!(reader.await.expect("join"), 256);
    }
}
