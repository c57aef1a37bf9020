//! A request body that must deliver each gRPC message whole within a
//! deadline of its start (the first message from the RPC's headers): an RPC
//! whose client sent its headers and part of a message, then stalled, is
//! cancelled with `DEADLINE_EXCEEDED` instead of holding its connection
//! busy (and so out of the idle limits) for ever. Between messages of a
//! stream nothing is due: a session waiting for its node's next report is
//! not stalled.
//!
//! A [`Watch`] is told while a message is due from the client, so the
//! listener can tell a connection waiting on its client (a stall, when it
//! lasts) from one whose requests have arrived and are being served.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

/// gRPC's length prefix: a compression flag and a big-endian length.
const PREFIX: usize = 5;

/// Where a request's gRPC framing stands.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Framing {
    prefix: [u8; PREFIX],
    prefix_len: usize,
    /// Bytes of the current message still to come.
    remaining: usize,
}

impl Framing {
    /// Takes `data`; whether a message is under way (started, not whole)
    /// afterwards.
    pub(crate) fn take(&mut self, mut data: &[u8]) -> bool {
        while !data.is_empty() {
            if self.remaining > 0 {
                let n = self.remaining.min(data.len());
                self.remaining -= n;
                data = &data[n..];
            } else {
                let n = (PREFIX - self.prefix_len).min(data.len());
                self.prefix[self.prefix_len..self.prefix_len + n].copy_from_slice(&data[..n]);
                self.prefix_len += n;
                data = &data[n..];
                if self.prefix_len == PREFIX {
                    let len = u32::from_be_bytes([
                        self.prefix[1],
                        self.prefix[2],
                        self.prefix[3],
                        self.prefix[4],
                    ]);
                    self.remaining = len as usize;
                    self.prefix_len = 0;
                }
            }
        }
        self.under_way()
    }

    fn under_way(&self) -> bool {
        self.prefix_len > 0 || self.remaining > 0
    }
}

/// Told what a [`Deadlined`] body waits for.
pub(crate) trait Watch: Send + Sync {
    /// A message is due from the client (`true`), or no longer (`false`:
    /// it came whole, the body ended, the RPC was cut or dropped). Calls
    /// alternate, starting with `true`.
    fn due(&self, due: bool);
    /// The RPC was cancelled: a message did not come whole in time.
    fn cut(&self);
}

/// The request body of one RPC, held to the deadline.
pub(crate) struct Deadlined {
    body: tonic::body::Body,
    deadline: Duration,
    framing: Framing,
    /// Armed while a message is due; `None` between messages.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    watch: Arc<dyn Watch>,
}

impl Deadlined {
    /// `body`, its first message due within `deadline` from now; `watch`
    /// is told while a message is due and of an RPC cancelled.
    pub(crate) fn new(body: tonic::body::Body, deadline: Duration, watch: Arc<dyn Watch>) -> Self {
        watch.due(true);
        Deadlined {
            body,
            deadline,
            framing: Framing::default(),
            timer: Some(Box::pin(tokio::time::sleep(deadline))),
            watch,
        }
    }

    fn arm(&mut self) {
        if self.timer.is_none() {
            self.timer = Some(Box::pin(tokio::time::sleep(self.deadline)));
            self.watch.due(true);
        }
    }

    fn disarm(&mut self) {
        if self.timer.take().is_some() {
            self.watch.due(false);
        }
    }
}

impl Drop for Deadlined {
    fn drop(&mut self) {
        self.disarm();
    }
}

impl http_body::Body for Deadlined {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, tonic::Status>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.body).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    let was = this.framing.under_way();
                    let now = this.framing.take(data);
                    if !now {
                        // A message is whole: nothing is due until the next.
                        this.disarm();
                    } else if !was {
                        this.arm();
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                this.disarm();
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e))),
            Poll::Pending => {
                if let Some(timer) = this.timer.as_mut() {
                    if timer.as_mut().poll(cx).is_ready() {
                        this.disarm();
                        this.watch.cut();
                        return Poll::Ready(Some(Err(tonic::Status::deadline_exceeded(format!(
                            "the request was not received whole within {:?}; the RPC is cancelled",
                            this.deadline
                        )))));
                    }
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_is_under_way_until_its_announced_length_has_come() {
        let mut f = Framing::default();
        assert!(f.take(&[0, 0, 0]), "part of a prefix");
        assert!(f.take(&[0, 3, b'a']), "prefix whole, 2 bytes to come");
        assert!(!f.take(b"bc"), "whole");
        assert!(
            !f.take(&[0, 0, 0, 0, 0]),
            "an empty message is whole at once"
        );
        // Two messages in one frame, the second cut short.
        assert!(f.take(&[0, 0, 0, 0, 1, b'x', 0, 0, 0, 0, 2, b'y']));
        assert!(!f.take(b"z"));
    }
}
