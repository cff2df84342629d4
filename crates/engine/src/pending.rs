//! Scale requests that could not be admitted yet.
//!
//! A scale request has its own small state machine (docs/ARCHITECTURE.md,
//! *The agent lifecycle*): `pending → admitted | cancelled | expired | no-backend`
//! (plus `too-large` when a reload shrinks a cap below it). While pending it
//! waits here, FIFO by arrival; the engine serves the queue oldest first
//! among those that fit, with starved requests holding capacity.

use crate::lifecycle::Mode;
use kici_model::{EffectiveResources, JobId, LabelSet, ResourceRequest, ScalerName};
use serde::Serialize;
use std::collections::VecDeque;
use std::time::Instant;

/// A scale request as the caller sent it. Two requests with the same job id
/// must be identical to be treated as a retry of one another.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScaleRequest {
    pub job: JobId,
    pub run_id: Option<String>,
    pub labels: LabelSet,
    pub exclude: LabelSet,
    pub resources: Option<ResourceRequest>,
    pub mode: Mode,
}

/// How a pending request left the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PendingEnd {
    Admitted,
    Cancelled,
    Expired,
    NoBackend,
    TooLarge,
}

impl PendingEnd {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Admitted => "admitted",
            Self::Cancelled => "cancelled",
            Self::Expired => "expired",
            Self::NoBackend => "no-backend",
            Self::TooLarge => "too-large",
        }
    }
}

/// One waiting request with what routing resolved for it.
#[derive(Debug, Clone)]
pub struct PendingEntry {
    pub request: ScaleRequest,
    pub scaler: ScalerName,
    pub scaler_index: usize,
    pub label_set: usize,
    pub resources: EffectiveResources,
    pub enqueued: Instant,
    pub expires: Instant,
}

/// FIFO of pending requests (arrival order; a re-queued request keeps its
/// original arrival time and so its place).
#[derive(Debug, Default)]
pub struct PendingQueue {
    entries: VecDeque<PendingEntry>,
}

impl PendingQueue {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Inserts keeping arrival order.
    pub fn insert(&mut self, entry: PendingEntry) {
        let at = self
            .entries
            .iter()
            .position(|e| e.enqueued > entry.enqueued)
            .unwrap_or(self.entries.len());
        self.entries.insert(at, entry);
    }

    /// 1-based position of a job in the queue.
    pub fn position(&self, job: &JobId) -> Option<usize> {
        self.entries
            .iter()
            .position(|e| &e.request.job == job)
            .map(|i| i + 1)
    }

    pub fn remove(&mut self, job: &JobId) -> Option<PendingEntry> {
        let i = self.entries.iter().position(|e| &e.request.job == job)?;
        self.entries.remove(i)
    }

    pub fn iter(&self) -> impl Iterator<Item = &PendingEntry> {
        self.entries.iter()
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut PendingEntry> {
        self.entries.iter_mut()
    }

    /// Removes and returns every entry `pred` selects, keeping order.
    pub fn take_where(&mut self, mut pred: impl FnMut(&PendingEntry) -> bool) -> Vec<PendingEntry> {
        let mut taken = Vec::new();
        let mut kept = VecDeque::with_capacity(self.entries.len());
        for e in self.entries.drain(..) {
            if pred(&e) {
                taken.push(e);
            } else {
                kept.push_back(e);
            }
        }
        self.entries = kept;
        taken
    }

    pub fn count_for(&self, scaler: &str) -> usize {
        self.entries
            .iter()
            .filter(|e| e.scaler.as_str() == scaler)
            .count()
    }

    pub fn next_expiry(&self) -> Option<Instant> {
        self.entries.iter().map(|e| e.expires).min()
    }
}
