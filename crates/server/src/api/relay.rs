//! Server-Sent Event streams fed by a task: what a fleet host relays (a
//! job's output from the host running it, the fleet's events) is pushed
//! into a bounded channel that the response streams. Every wait of the
//! feeding task ends as soon as the reader leaves — not at the next event,
//! which may not come for hours (a silent job, a quiet fleet).

use axum::response::sse::Event;
use futures_util::stream::{self, Stream, StreamExt};
use std::convert::Infallible;
use std::future::Future;
use std::time::Duration;
use tokio::sync::mpsc;

/// The feeding side of a relayed SSE stream. Cheap to clone.
#[derive(Clone)]
pub struct Relay(mpsc::Sender<Result<Event, Infallible>>);

/// A relay and the stream its reader gets; events it sends beyond
/// `capacity` unread wait for the reader.
pub fn relay(capacity: usize) -> (Relay, impl Stream<Item = Result<Event, Infallible>> + Send) {
    let (tx, rx) = mpsc::channel(capacity);
    let events = stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (e, rx)) });
    (Relay(tx), events)
}

impl Relay {
    /// Sends `event`; `false` when the reader left.
    pub async fn send(&self, event: Event) -> bool {
        self.0.send(Ok(event)).await.is_ok()
    }

    /// `work`'s output, or `None` as soon as the reader left.
    pub async fn unless_left<F: Future>(&self, work: F) -> Option<F::Output> {
        tokio::select! {
            out = work => Some(out),
            _ = self.0.closed() => None,
        }
    }

    /// Waits `pause`; `false` if the reader left meanwhile.
    pub async fn pause(&self, pause: Duration) -> bool {
        self.unless_left(tokio::time::sleep(pause)).await.is_some()
    }

    /// Sends every event of `events` until it ends (`true`) or the reader
    /// leaves (`false`).
    pub async fn pipe(&self, events: impl Stream<Item = Result<Event, Infallible>>) -> bool {
        let mut events = std::pin::pin!(events);
        loop {
            match self.unless_left(events.next()).await {
                None => return false,
                Some(None) => return true,
                Some(Some(event)) => {
                    if self.0.send(event).await.is_err() {
                        return false;
                    }
                }
            }
        }
    }
}
