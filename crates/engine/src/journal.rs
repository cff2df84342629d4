//! The engine's port to durable state, and the single writer that feeds it.
//!
//! The engine produces [`JournalEntry`]s in order; [`JournalWriter`] applies
//! them one at a time, so a store always sees an agent's writes in the order
//! they happened. The write that recovery depends on — the record made
//! before a backend is asked to create anything — is awaited by the spawn
//! (it carries an acknowledgement); the others are not, and a failed one is
//! kept (the newest per agent) and retried until the store answers again,
//! so a store outage delays writes but loses none.

use crate::engine::JournalEntry;
use async_trait::async_trait;
use kici_model::AgentId;
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

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("state store: {0}")]
pub struct JournalError(pub String);

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

pub(crate) struct JournalWriter {
    journal: Arc<dyn Journal>,
    /// The newest failed entry per agent, waiting for a retry.
    failed: BTreeMap<AgentId, (JournalEntry, SystemTime)>,
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
                    Some(JournalOp::Write { entry, at, ack }) => {
                        let result = self.write(entry, at).await;
                        if let Some(ack) = ack {
                            let _ = ack.send(result);
                        }
                    }
                    Some(JournalOp::Flush(done)) => {
                        self.retry_failed().await;
                        let _ = done.send(self.failed.is_empty());
                    }
                    // Every sender (the runtime) is gone: a last attempt.
                    None => {
                        self.retry_failed().await;
                        break;
                    }
                },
                _ = retry.tick(), if !self.failed.is_empty() => self.retry_failed().await,
            }
        }
    }

    async fn write(&mut self, entry: JournalEntry, at: SystemTime) -> Result<(), JournalError> {
        // A newer entry supersedes a failed older one of the same agent.
        self.failed.remove(&entry.agent());
        let result = self.journal.write(&entry, at).await;
        if let Err(e) = &result {
            tracing::warn!(agent = %entry.agent(), error = %e, "state write failed; retrying until the store answers");
            self.failed.insert(entry.agent(), (entry, at));
        }
        result
    }

    async fn retry_failed(&mut self) {
        let pending = std::mem::take(&mut self.failed);
        let mut down = false;
        for (agent, (entry, at)) in pending {
            // One failure says the store is still down: keep the rest as they are.
            if down {
                self.failed.insert(agent, (entry, at));
                continue;
            }
            if self.journal.write(&entry, at).await.is_err() {
                down = true;
                self.failed.insert(agent, (entry, at));
            }
        }
    }
}
