//! The engine's port to durable state, and the single writer that feeds it.
//!
//! The engine produces [`JournalEntry`]s in order — agents and pending
//! scale requests, one durability path for both; `JournalWriter` applies
//! them one at a time, so a store always sees a subject's writes in the
//! order they happened (writes of one agent or request that queued up
//! together collapse into the newest: each entry is its whole state). The write that recovery depends on — the record made
//! before a backend is asked to create anything — is awaited by the spawn
//! (it carries an acknowledgement); the others are not, and a failed one is
//! kept (the newest per agent) and retried until the store answers again,
//! so a store outage delays writes but loses none.

use crate::engine::{JournalEntry, JournalKey};
use async_trait::async_trait;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::sync::{mpsc, oneshot};

/// Where journal entries go (the daemon's state store).
#[async_trait]
pub trait Journal: Send + Sync {
    /// Applies one entry; `at` is the wall-clock time of the snapshot (an
    /// agent's creation time is `at - age`).
    async fn write(&self, entry: &JournalEntry, at: SystemTime) -> Result<(), JournalError>;
}

/// A journal write that did not happen: what kind of failure (to match
/// on) and the store's own error (the `source()` chain).
#[derive(Debug, Clone, thiserror::Error)]
#[error("state store: {kind}")]
pub struct JournalError {
    pub kind: JournalErrorKind,
    #[source]
    source: Option<Arc<dyn std::error::Error + Send + Sync>>,
}

/// What kind of failure a [`JournalError`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum JournalErrorKind {
    /// The store did not answer (down, unreachable, timed out): the write
    /// is retried until it answers.
    #[error("unavailable")]
    Unavailable,
    /// The store answered and refused the write (a constraint, a record
    /// it cannot take): a retry fails the same way.
    #[error("write refused")]
    Refused,
    /// The journal's writer stopped (the runtime is shutting down).
    #[error("the writer stopped")]
    Stopped,
}

impl JournalError {
    /// A failure of `kind`, caused by `source`.
    pub fn new(
        kind: JournalErrorKind,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self {
            kind,
            source: Some(Arc::new(source)),
        }
    }

    /// The writer stopped before the write was attempted.
    pub fn stopped() -> Self {
        Self {
            kind: JournalErrorKind::Stopped,
            source: None,
        }
    }

    pub fn kind(&self) -> JournalErrorKind {
        self.kind
    }
}

impl PartialEq for JournalError {
    fn eq(&self, other: &Self) -> bool {
        self.kind == other.kind && self.to_string() == other.to_string()
    }
}

/// How often failed writes are retried.
const RETRY_EVERY: Duration = Duration::from_secs(1);

pub(crate) enum JournalOp {
    Write {
        entry: JournalEntry,
        at: SystemTime,
        ack: Option<oneshot::Sender<Result<(), JournalError>>>,
    },
    /// Answered once every earlier write was attempted and none is waiting
    /// for a retry.
    Flush(oneshot::Sender<bool>),
}

/// At most this many queued operations are taken in one round, so a flood
/// of writes cannot starve a waiting flush for long.
const MAX_BATCH: usize = 256;

/// One agent's writes within a round, collapsed into its last.
struct Coalesced {
    entry: JournalEntry,
    at: SystemTime,
    acks: Vec<oneshot::Sender<Result<(), JournalError>>>,
}

pub(crate) struct JournalWriter {
    journal: Arc<dyn Journal>,
    /// The newest failed entry per subject, waiting for a retry.
    failed: BTreeMap<JournalKey, (JournalEntry, SystemTime)>,
}

impl JournalWriter {
    pub(crate) fn spawn(journal: Arc<dyn Journal>) -> mpsc::UnboundedSender<JournalOp> {
        let (tx, rx) = mpsc::unbounded_channel();
        let writer = Self {
            journal,
            failed: BTreeMap::new(),
        };
        tokio::spawn(writer.run(rx));
        tx
    }

    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<JournalOp>) {
        let mut retry = tokio::time::interval(RETRY_EVERY);
        retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                op = rx.recv() => match op {
                    Some(op) => {
                        // Whatever queued up behind it goes in the same round:
                        // under load, one store round trip per agent instead of
                        // one per queued write.
                        let mut batch = vec![op];
                        while batch.len() < MAX_BATCH {
                            match rx.try_recv() {
                                Ok(op) => batch.push(op),
                                Err(_) => break,
                            }
                        }
                        self.apply(batch).await;
                    }
                    // Every sender is gone: the runtime stopped.
                    None => {
                        self.retry_failed().await;
                        break;
                    }
                },
                _ = retry.tick(), if !self.failed.is_empty() => self.retry_failed().await,
            }
        }
    }

    /// Applies queued operations in order. Writes of one agent between two
    /// flushes collapse into its last one (each entry is the agent's whole
    /// state); every acknowledgement gets that write's result.
    async fn apply(&mut self, batch: Vec<JournalOp>) {
        let mut writes: Vec<Coalesced> = Vec::new();
        for op in batch {
            match op {
                JournalOp::Write { entry, at, ack } => {
                    let key = entry.key();
                    match writes.iter_mut().find(|w| w.entry.key() == key) {
                        Some(w) => {
                            w.entry = entry;
                            w.at = at;
                            w.acks.extend(ack);
                        }
                        None => writes.push(Coalesced {
                            entry,
                            at,
                            acks: ack.into_iter().collect(),
                        }),
                    }
                }
                JournalOp::Flush(done) => {
                    self.write_all(std::mem::take(&mut writes)).await;
                    self.retry_failed().await;
                    let _ = done.send(self.failed.is_empty());
                }
            }
        }
        self.write_all(writes).await;
    }

    async fn write_all(&mut self, writes: Vec<Coalesced>) {
        for w in writes {
            let result = self.write(w.entry, w.at).await;
            for ack in w.acks {
                let _ = ack.send(result.clone());
            }
        }
    }

    async fn write(&mut self, entry: JournalEntry, at: SystemTime) -> Result<(), JournalError> {
        // A newer entry supersedes a failed older one of the same subject.
        let key = entry.key();
        self.failed.remove(&key);
        let result = self.journal.write(&entry, at).await;
        if let Err(e) = &result {
            tracing::warn!(subject = %key, error = %e, "state write failed; retrying until the store answers");
            self.failed.insert(key, (entry, at));
        }
        result
    }

    async fn retry_failed(&mut self) {
        let pending = std::mem::take(&mut self.failed);
        let mut down = false;
        for (key, (entry, at)) in pending {
            // One failure says the store is still down: keep the rest as they are.
            if down {
                self.failed.insert(key, (entry, at));
                continue;
            }
            if self.journal.write(&entry, at).await.is_err() {
                down = true;
                self.failed.insert(key, (entry, at));
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use kici_model::{AgentId, ScalerType};
    use parking_lot::Mutex;

    /// Records the agents written, in order; writes wait for permits of the
    /// gate, so operations queue up behind the first one.
    struct Recording {
        writes: Mutex<Vec<AgentId>>,
        gate: tokio::sync::Semaphore,
    }

    #[async_trait]
    impl Journal for Recording {
        async fn write(&self, entry: &JournalEntry, _at: SystemTime) -> Result<(), JournalError> {
            self.gate.acquire().await.unwrap().forget();
            self.writes.lock().push(entry.agent().unwrap());
            Ok(())
        }
    }

    #[tokio::test]
    async fn queued_writes_of_one_agent_collapse_and_every_ack_is_answered() {
        let journal = Arc::new(Recording {
            writes: Mutex::default(),
            gate: tokio::sync::Semaphore::new(0),
        });
        let tx = JournalWriter::spawn(journal.clone());
        let a = AgentId::new(ScalerType::Container, [0, 0, 0, 1]);
        let b = AgentId::new(ScalerType::Container, [0, 0, 0, 2]);
        let write = |agent: AgentId, ack: bool| {
            let (ack_tx, ack_rx) = oneshot::channel();
            tx.send(JournalOp::Write {
                entry: JournalEntry::Forget(agent),
                at: SystemTime::now(),
                ack: ack.then_some(ack_tx),
            })
            .unwrap();
            ack_rx
        };
        // The first write is taken alone and held at the gate; the rest queue.
        let first = write(a, true);
        tokio::task::yield_now().await;
        let acks = [write(a, true), write(b, false), write(a, true)];
        let (flush_tx, flush_rx) = oneshot::channel();
        tx.send(JournalOp::Flush(flush_tx)).unwrap();
        journal.gate.add_permits(16);
        first.await.unwrap().unwrap();
        let [a2, _unacked, a3] = acks;
        a2.await.unwrap().unwrap();
        a3.await.unwrap().unwrap();
        assert!(flush_rx.await.unwrap());
        assert_eq!(
            *journal.writes.lock(),
            [a, a, b],
            "a's two queued writes became one"
        );
    }
}
