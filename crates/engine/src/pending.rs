//! Scale requests that could not be admitted yet.
//!
//! A scale request has its own small state machine (docs/ARCHITECTURE.md,
//! *The agent lifecycle*): `pending → admitted | cancelled | expired | no-backend`
//! (plus `too-large` when a reload shrinks a cap below it). While pending it
//! waits here, FIFO by arrival; the engine serves the queue oldest first
//! among those that fit, with starved requests holding capacity.
//!
//! # Why the queue is kept by shape
//!
//! Requests of one *shape* — same scaler, same label set, same `requests` —
//! are interchangeable for admission: they meet the same caps, the same
//! breaker and the same switches, so when the oldest of them does not fit,
//! none of the younger ones can (usage and held capacity only grow during an
//! admission pass). An admission pass (`PendingQueue::plan`) therefore
//! tries the oldest waiting request of each shape, moves on to the next of
//! that shape only after one is admitted, and stops trying a shape at its
//! first refusal. A release over a long queue costs a few attempts per shape,
//! not one per request.
//!
//! The starvation holds of the requests it does not visit are counted, not
//! visited: the starved members of a refused shape are a prefix of that
//! shape's arrival order, so how many of them are older than the request
//! being tried is one binary search.
//!
//! A request is reported refused once per reason (scaler and cap) it waits
//! for: the pass reports a refusal only when it differs from the last one
//! reported for that request, and a request that waits behind an identical
//! refused one is reported with that request's reason, once.

use crate::lifecycle::Mode;
use kici_admission::{Cap, Holds, Refusal};
use kici_model::{EffectiveResources, JobId, LabelSet, ResourceRequest, Resources, ScalerName};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
    /// The scaler and cap this request was last reported refused for; a
    /// refusal for the same pair is not reported again. `None` until its
    /// first refusal (a new or re-queued request).
    pub refused_for: Option<(ScalerName, Cap)>,
}

/// Arrival order: arrival time, then insertion order among equal times (a
/// re-queued request keeps its original arrival time and so its place).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct Arrival {
    at: Instant,
    seq: u64,
}

/// What admission cannot tell apart (see the module documentation).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Shape {
    scaler_index: usize,
    label_set: usize,
    requests: Resources,
}

impl Shape {
    fn of(entry: &PendingEntry) -> Self {
        Self {
            scaler_index: entry.scaler_index,
            label_set: entry.label_set,
            requests: entry.resources.requests,
        }
    }
}

#[derive(Debug)]
struct Slot {
    entry: PendingEntry,
    arrival: Arrival,
}

/// The waiting requests of one shape.
#[derive(Debug, Default)]
struct Members {
    /// Arrival order.
    order: VecDeque<(Arrival, JobId)>,
    /// Members never reported refused (`refused_for` is `None`): when the
    /// shape is refused, these — and only these — are reported with it,
    /// without a walk over the whole shape.
    unreported: HashSet<JobId>,
}

impl Members {
    fn index_of(&self, arrival: Arrival) -> Option<usize> {
        self.order.binary_search_by(|(a, _)| a.cmp(&arrival)).ok()
    }

    /// How many members arrived before `bound`.
    fn before(&self, bound: Arrival) -> usize {
        self.order.partition_point(|(a, _)| *a < bound)
    }
}

/// The pending requests: by job, by shape in arrival order, by expiry.
#[derive(Debug, Default)]
pub struct PendingQueue {
    slots: HashMap<JobId, Slot>,
    shapes: HashMap<Shape, Members>,
    expiries: BTreeMap<(Instant, Arrival), JobId>,
    per_scaler: HashMap<ScalerName, usize>,
    next_seq: u64,
}

/// One admission attempt for a waiting request (see [`PendingQueue::plan`]).
pub(crate) enum Attempt<A> {
    /// Reserved: the request leaves the queue.
    Admitted(A),
    /// Not now; the request keeps waiting.
    Refused(Refusal),
    /// Never, under the current configuration (its whole shape).
    TooLarge(String),
    /// Not tried in this pass (cordoned or draining scaler, open breaker,
    /// no fresh agent id): nor is the rest of its shape, and it holds
    /// nothing.
    Skip,
    /// Admission failed; the pass ends here.
    Stop(kici_admission::AdmitError),
}

/// What the engine decides for each shape's candidate during a pass.
pub(crate) trait Admitter {
    type Admitted;
    /// The request's machine pool (for the capacity its starvation holds).
    fn pool(&self, entry: &PendingEntry) -> Option<&str>;
    /// Tries to reserve for `entry` against what is free after `holds`.
    fn attempt(&mut self, entry: &PendingEntry, holds: &Holds) -> Attempt<Self::Admitted>;
}

/// The outcome of one admission pass; nothing in the queue changed yet.
pub(crate) struct Plan<A> {
    /// In admission order.
    pub admitted: Vec<(JobId, A)>,
    /// Per refused shape, the request that was tried and why it was refused.
    pub refused: Vec<(Shape, JobId, Refusal)>,
    pub too_large: Vec<(Shape, String)>,
    pub error: Option<kici_admission::AdmitError>,
}

impl PendingQueue {
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn contains(&self, job: &JobId) -> bool {
        self.slots.contains_key(job)
    }

    /// Inserts keeping arrival order (after every request that arrived at
    /// the same instant or before). A job already queued is replaced.
    pub fn insert(&mut self, entry: PendingEntry) {
        let job = entry.request.job.clone();
        self.remove(&job);
        let arrival = Arrival {
            at: entry.enqueued,
            seq: self.next_seq,
        };
        self.next_seq += 1;
        let members = self.shapes.entry(Shape::of(&entry)).or_default();
        // Nearly always the youngest of its shape: a push at the back.
        let at = members.before(arrival);
        members.order.insert(at, (arrival, job.clone()));
        // A request re-routed by a reload keeps what it was refused for
        // under its old scaler; under its new one it is not reported yet.
        if entry.refused_for.as_ref().map(|(s, _)| s) != Some(&entry.scaler) {
            members.unreported.insert(job.clone());
        }
        self.expiries.insert((entry.expires, arrival), job.clone());
        *self.per_scaler.entry(entry.scaler.clone()).or_default() += 1;
        self.slots.insert(job, Slot { entry, arrival });
    }

    /// 1-based position of a job in the queue (arrival order).
    pub fn position(&self, job: &JobId) -> Option<usize> {
        let arrival = self.slots.get(job)?.arrival;
        let older: usize = self.shapes.values().map(|m| m.before(arrival)).sum();
        Some(older + 1)
    }

    pub fn get(&self, job: &JobId) -> Option<&PendingEntry> {
        self.slots.get(job).map(|s| &s.entry)
    }

    pub fn remove(&mut self, job: &JobId) -> Option<PendingEntry> {
        let Slot { entry, arrival } = self.slots.remove(job)?;
        let shape = Shape::of(&entry);
        if let Some(members) = self.shapes.get_mut(&shape) {
            if let Some(i) = members.index_of(arrival) {
                members.order.remove(i);
            }
            members.unreported.remove(job);
            if members.order.is_empty() {
                self.shapes.remove(&shape);
            }
        }
        self.expiries.remove(&(entry.expires, arrival));
        if let Some(n) = self.per_scaler.get_mut(&entry.scaler) {
            *n -= 1;
            if *n == 0 {
                self.per_scaler.remove(&entry.scaler);
            }
        }
        Some(entry)
    }

    /// Every entry, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = &PendingEntry> {
        self.slots.values().map(|s| &s.entry)
    }

    /// Removes and returns every entry `pred` selects, in arrival order.
    /// Visits the whole queue: for rare operations (reload, drain,
    /// shutdown), never per release.
    pub fn take_where(&mut self, mut pred: impl FnMut(&PendingEntry) -> bool) -> Vec<PendingEntry> {
        let mut taken: Vec<(Arrival, JobId)> = self
            .slots
            .iter()
            .filter(|(_, s)| pred(&s.entry))
            .map(|(job, s)| (s.arrival, job.clone()))
            .collect();
        taken.sort_unstable();
        if taken.len() == self.slots.len() {
            let mut all = std::mem::take(&mut self.slots);
            self.shapes.clear();
            self.expiries.clear();
            self.per_scaler.clear();
            return taken
                .into_iter()
                .filter_map(|(_, job)| all.remove(&job).map(|s| s.entry))
                .collect();
        }
        taken
            .into_iter()
            .filter_map(|(_, job)| self.remove(&job))
            .collect()
    }

    /// Removes and returns every entry whose TTL ran out, in arrival order.
    pub fn take_expired(&mut self, now: Instant) -> Vec<PendingEntry> {
        let mut due: Vec<(Arrival, JobId)> = Vec::new();
        for ((expires, arrival), job) in &self.expiries {
            if *expires > now {
                break;
            }
            due.push((*arrival, job.clone()));
        }
        due.sort_unstable();
        due.into_iter()
            .filter_map(|(_, job)| self.remove(&job))
            .collect()
    }

    /// Removes and returns every entry of one shape, in arrival order.
    pub(crate) fn take_shape(&mut self, shape: &Shape) -> Vec<PendingEntry> {
        let Some(members) = self.shapes.get(shape) else {
            return Vec::new();
        };
        let jobs: Vec<JobId> = members.order.iter().map(|(_, j)| j.clone()).collect();
        jobs.iter().filter_map(|job| self.remove(job)).collect()
    }

    /// When the oldest waiting request of each scaler arrived. Reads the
    /// front of each shape's arrival order, so it costs one step per shape,
    /// not per request.
    pub fn oldest_per_scaler(&self) -> HashMap<&ScalerName, Instant> {
        let mut oldest: HashMap<&ScalerName, Instant> = HashMap::new();
        for members in self.shapes.values() {
            let Some((arrival, job)) = members.order.front() else {
                continue;
            };
            let Some(slot) = self.slots.get(job) else {
                continue;
            };
            oldest
                .entry(&slot.entry.scaler)
                .and_modify(|at| *at = (*at).min(arrival.at))
                .or_insert(arrival.at);
        }
        oldest
    }

    pub fn count_for(&self, scaler: &str) -> usize {
        self.per_scaler.get(scaler).copied().unwrap_or(0)
    }

    pub fn next_expiry(&self) -> Option<Instant> {
        self.expiries.keys().next().map(|(at, _)| *at)
    }

    /// One admission pass, oldest first among those that fit: the oldest
    /// waiting request of each shape is tried in arrival order; an admitted
    /// one makes way for the next of its shape, a refused one ends its
    /// shape's turn. A request tried while older starved requests (waiting
    /// at least `starvation`) of refused shapes wait is checked against
    /// what is free after their needs.
    ///
    /// Costs one attempt per shape plus one per admission, each after a
    /// binary search per refused shape — not a visit of every request.
    pub(crate) fn plan<D: Admitter>(
        &self,
        now: Instant,
        starvation: Duration,
        admitter: &mut D,
    ) -> Plan<D::Admitted> {
        let mut plan = Plan {
            admitted: Vec::new(),
            refused: Vec::new(),
            too_large: Vec::new(),
            error: None,
        };
        // Starved: arrived at or before `now - starvation`. No real entry
        // has the sequence number `u64::MAX`, so "arrived before `cutoff`"
        // is exactly "starved".
        let cutoff = now
            .checked_sub(starvation)
            .map(|at| Arrival { at, seq: u64::MAX });
        let shapes: Vec<(&Shape, &Members)> = self.shapes.iter().collect();
        let mut turn: BinaryHeap<Reverse<(Arrival, usize, usize)>> = shapes
            .iter()
            .enumerate()
            .filter_map(|(si, (_, m))| m.order.front().map(|(a, _)| Reverse((*a, si, 0))))
            .collect();
        // Refused shapes: (shape, index of its refused request, an entry of
        // it for the scaler and requests its starved members hold).
        let mut refused: Vec<(usize, usize, &PendingEntry)> = Vec::new();
        while let Some(Reverse((arrival, si, at))) = turn.pop() {
            let (shape, members) = shapes[si];
            let Some(job) = members.order.get(at).map(|(_, j)| j) else {
                continue;
            };
            let Some(slot) = self.slots.get(job) else {
                continue;
            };
            let mut holds = Holds::none();
            if let Some(cutoff) = cutoff {
                let bound = arrival.min(cutoff);
                for (ri, first_refused, entry) in &refused {
                    // Every member of a refused shape from its refused
                    // request on waits (an identical one did not fit); the
                    // starved ones older than this request hold.
                    let waiting_older = shapes[*ri].1.before(bound).saturating_sub(*first_refused);
                    holds.add_many(
                        &entry.scaler,
                        entry.resources.requests,
                        admitter.pool(entry),
                        waiting_older as u64,
                    );
                }
            }
            match admitter.attempt(&slot.entry, &holds) {
                Attempt::Admitted(a) => {
                    plan.admitted.push((job.clone(), a));
                    if let Some((next, _)) = members.order.get(at + 1) {
                        turn.push(Reverse((*next, si, at + 1)));
                    }
                }
                Attempt::Refused(r) => {
                    refused.push((si, at, &slot.entry));
                    plan.refused.push((shape.clone(), job.clone(), r));
                }
                Attempt::TooLarge(detail) => plan.too_large.push((shape.clone(), detail)),
                Attempt::Skip => {}
                Attempt::Stop(e) => {
                    plan.error = Some(e);
                    break;
                }
            }
        }
        plan
    }

    /// Records the refusals of a pass and returns those to report: the
    /// request tried, when its scaler or cap changed since its last report,
    /// and the never-reported requests waiting behind it in its shape,
    /// which wait for the same reason. Call before the pass's admissions
    /// leave the queue or after, but before anything else is inserted.
    pub(crate) fn record_refusals(
        &mut self,
        refused: &[(Shape, JobId, Refusal)],
    ) -> Vec<(JobId, ScalerName, Refusal)> {
        let mut report = Vec::new();
        for (shape, job, refusal) in refused {
            let Some(slot) = self.slots.get_mut(job) else {
                continue;
            };
            let tried_at = slot.arrival;
            let reason = (slot.entry.scaler.clone(), refusal.cap);
            if slot.entry.refused_for.as_ref() != Some(&reason) {
                slot.entry.refused_for = Some(reason.clone());
                report.push((job.clone(), reason.0.clone(), *refusal));
            }
            let Some(members) = self.shapes.get_mut(shape) else {
                continue;
            };
            members.unreported.remove(job);
            if members.unreported.is_empty() {
                continue;
            }
            let mut behind: Vec<(Arrival, JobId)> = Vec::new();
            members.unreported.retain(|j| match self.slots.get(j) {
                Some(s) if s.arrival > tried_at => {
                    behind.push((s.arrival, j.clone()));
                    false
                }
                // Ahead of the refused request: admitted in this very pass.
                Some(_) => true,
                None => false,
            });
            behind.sort_unstable();
            for (_, j) in behind {
                if let Some(s) = self.slots.get_mut(&j) {
                    if s.entry.refused_for.as_ref() != Some(&reason) {
                        s.entry.refused_for = Some(reason.clone());
                        report.push((j, reason.0.clone(), *refusal));
                    }
                }
            }
        }
        report
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    //! [`PendingQueue::plan`] against the plain definition it replaces:
    //! every waiting request tried in arrival order, each starved refused
    //! one adding its needs to the holds of every younger one. Both run on
    //! their own admission controller with the same prior reservations;
    //! they must admit the same requests in the same order, and each
    //! refusal the plan reports must be exactly the one the definition
    //! computes for that request (cap, usage, held amount).

    use super::*;
    use kici_admission::{Admission, AdmitError, Demand, Reservation};
    use kici_model::{AgentId, Config, MemoryBytes, MilliCpu, ScalerType};
    use proptest::prelude::*;
    use std::collections::HashSet;
    use std::sync::Arc;

    const CONFIG: &str = r#"
version: 1
globalMaxAgents: 7
globalResourceCap: { maxCpu: 8, maxMemory: 10g }
machinePools:
  - name: shared
    cap: { maxCpu: 5, maxMemory: 6g }
scalers:
  - name: a
    type: bare-metal
    maxAgents: 4
    resourceCap: { maxCpu: 4 }
    machinePool: shared
    labelSets:
      - labels: [a, one]
        binaryPath: /bin/agent
      - labels: [a, two]
        binaryPath: /bin/agent
  - name: b
    type: bare-metal
    maxAgents: 5
    resourceCap: { maxMemory: 6g }
    labelSets:
      - labels: [b]
        binaryPath: /bin/agent
  - name: c
    type: bare-metal
    maxAgents: 50
    labelSets:
      - labels: [c]
        binaryPath: /bin/agent
"#;

    const STARVATION: Duration = Duration::from_secs(300);

    fn config() -> Arc<Config> {
        match kici_config::load_documents(&[("scalers.yaml", CONFIG)]) {
            Ok(l) => Arc::new(l.config),
            Err(e) => panic!("test config invalid:\n{e}"),
        }
    }

    /// (scaler index, label set, cpus, GiB)
    type Spec = (usize, usize, u64, u64);

    fn requests(cpus: u64, gib: u64) -> Resources {
        Resources::new(
            MilliCpu::from_millis(cpus * 1000),
            MemoryBytes::from_bytes(gib << 30),
        )
    }

    fn demand(config: &Config, spec: Spec) -> Demand {
        let scaler = &config.scalers[spec.0];
        Demand {
            agent: AgentId::random(ScalerType::BareMetal),
            scaler: scaler.name.clone(),
            requests: requests(spec.2, spec.3),
            pool: scaler.machine_pool.clone(),
        }
    }

    /// An admission controller with `prior` reserved (what fits of it).
    fn admission(config: &Config, prior: &[Spec]) -> (Admission, Vec<Reservation>) {
        let admission = Admission::new(config, None).unwrap();
        let held = prior
            .iter()
            .filter_map(|s| {
                admission
                    .try_reserve(demand(config, *s), &Holds::none())
                    .ok()
            })
            .collect();
        (admission, held)
    }

    struct TestAdmitter<'a> {
        config: &'a Config,
        admission: &'a Admission,
        skipped: &'a HashSet<(usize, usize)>,
    }

    impl TestAdmitter<'_> {
        fn skips(&self, e: &PendingEntry) -> bool {
            self.skipped.contains(&(e.scaler_index, e.label_set))
        }

        fn demand(&self, e: &PendingEntry) -> Demand {
            let scaler = &self.config.scalers[e.scaler_index];
            Demand {
                agent: AgentId::random(ScalerType::BareMetal),
                scaler: scaler.name.clone(),
                requests: e.resources.requests,
                pool: scaler.machine_pool.clone(),
            }
        }
    }

    impl Admitter for TestAdmitter<'_> {
        type Admitted = Reservation;

        fn pool(&self, e: &PendingEntry) -> Option<&str> {
            self.config.scalers[e.scaler_index].machine_pool.as_deref()
        }

        fn attempt(&mut self, e: &PendingEntry, holds: &Holds) -> Attempt<Reservation> {
            if self.skips(e) {
                return Attempt::Skip;
            }
            match self.admission.try_reserve(self.demand(e), holds) {
                Ok(r) => Attempt::Admitted(r),
                Err(AdmitError::Refused(r)) => Attempt::Refused(r),
                Err(AdmitError::TooLarge(t)) => Attempt::TooLarge(t.detail),
                Err(e) => Attempt::Stop(e),
            }
        }
    }

    fn entry(config: &Config, i: usize, spec: Spec, enqueued: Instant) -> PendingEntry {
        let scaler = &config.scalers[spec.0];
        let labels = scaler.label_sets[spec.1].labels.clone();
        PendingEntry {
            request: ScaleRequest {
                job: format!("j{i}").parse().unwrap(),
                run_id: None,
                labels,
                exclude: LabelSet::default(),
                resources: None,
                mode: Mode::Orchestrator,
            },
            scaler: scaler.name.clone(),
            scaler_index: spec.0,
            label_set: spec.1,
            resources: EffectiveResources {
                requests: requests(spec.2, spec.3),
                limits: Resources::default(),
            },
            enqueued,
            expires: enqueued + Duration::from_secs(3600),
            refused_for: None,
        }
    }

    /// What the definition decides for each request, by job.
    #[derive(Debug, Default)]
    struct Reference {
        admitted: Vec<JobId>,
        refused: HashMap<JobId, Refusal>,
        too_large: HashSet<JobId>,
    }

    fn reference(
        admitter: &TestAdmitter<'_>,
        in_order: &[PendingEntry],
        now: Instant,
        kept: &mut Vec<Reservation>,
    ) -> Reference {
        let mut out = Reference::default();
        let mut holds = Holds::none();
        for e in in_order {
            if admitter.skips(e) {
                continue;
            }
            match admitter.admission.try_reserve(admitter.demand(e), &holds) {
                Ok(r) => {
                    kept.push(r);
                    out.admitted.push(e.request.job.clone());
                }
                Err(AdmitError::Refused(r)) => {
                    if now.saturating_duration_since(e.enqueued) >= STARVATION {
                        holds.add(&e.scaler, e.resources.requests, admitter.pool(e));
                    }
                    out.refused.insert(e.request.job.clone(), r);
                }
                Err(AdmitError::TooLarge(_)) => {
                    out.too_large.insert(e.request.job.clone());
                }
                Err(e) => panic!("{e}"),
            }
        }
        out
    }

    fn spec() -> impl Strategy<Value = Spec> {
        prop_oneof![
            (Just(0usize), 0usize..2, 1u64..3, 0u64..3),
            (Just(1usize), Just(0usize), 0u64..2, 1u64..4),
            (Just(2usize), Just(0usize), 1u64..2, 0u64..2),
            // Never fits: more than `a`'s cpu cap.
            (Just(0usize), Just(0usize), Just(5u64), Just(0u64)),
        ]
    }

    fn check(prior: Vec<Spec>, queue: Vec<(Spec, u64)>, skipped: HashSet<(usize, usize)>) {
        let config = config();
        let now = Instant::now() + Duration::from_secs(1000);
        let entries: Vec<PendingEntry> = queue
            .iter()
            .enumerate()
            .map(|(i, (s, age))| entry(&config, i, *s, now - Duration::from_secs(*age)))
            .collect();
        let mut q = PendingQueue::default();
        for e in &entries {
            q.insert(e.clone());
        }
        // The definition's order: arrival time, then insertion order.
        let mut in_order = entries.clone();
        in_order.sort_by_key(|e| e.enqueued);

        let (new_adm, _new_prior) = admission(&config, &prior);
        let mut admitter = TestAdmitter {
            config: &config,
            admission: &new_adm,
            skipped: &skipped,
        };
        let plan = q.plan(now, STARVATION, &mut admitter);
        assert!(plan.error.is_none());

        let (ref_adm, _ref_prior) = admission(&config, &prior);
        let ref_admitter = TestAdmitter {
            config: &config,
            admission: &ref_adm,
            skipped: &skipped,
        };
        let mut kept = Vec::new();
        let want = reference(&ref_admitter, &in_order, now, &mut kept);

        let admitted: Vec<JobId> = plan.admitted.iter().map(|(j, _)| j.clone()).collect();
        assert_eq!(admitted, want.admitted, "admissions and their order");
        assert_eq!(new_adm.usage(), ref_adm.usage());
        for (_, job, refusal) in &plan.refused {
            assert_eq!(Some(refusal), want.refused.get(job), "refusal of {job}");
        }
        let too_large: HashSet<JobId> = plan
            .too_large
            .iter()
            .flat_map(|(shape, _)| q.shapes[shape].order.iter().map(|(_, j)| j.clone()))
            .collect();
        assert_eq!(too_large, want.too_large);
        // Whatever the plan leaves waiting, the definition refused too or
        // skipped, and the other way round.
        let waiting: HashSet<&JobId> = q
            .slots
            .keys()
            .filter(|j| !admitted.contains(j) && !too_large.contains(j))
            .collect();
        let want_waiting: HashSet<&JobId> = in_order
            .iter()
            .map(|e| &e.request.job)
            .filter(|j| !want.admitted.contains(j) && !want.too_large.contains(j))
            .collect();
        assert_eq!(waiting, want_waiting);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]
        #[test]
        fn plan_admits_exactly_what_a_full_scan_admits(
            prior in prop::collection::vec(spec(), 0..8),
            // Ages in seconds: some starved (>= 300), many sharing an instant.
            queue in prop::collection::vec((spec(), prop_oneof![Just(0u64), 0u64..600]), 0..40),
            skipped in prop::collection::hash_set((0usize..3, 0usize..2), 0..2),
        ) {
            check(prior, queue, skipped);
        }
    }

    #[test]
    fn record_refusals_reports_a_reason_once_and_the_requests_behind_it() {
        let config = config();
        let now = Instant::now();
        let mut q = PendingQueue::default();
        for i in 0..3 {
            q.insert(entry(&config, i, (1, 0, 1, 1), now));
        }
        let shape = Shape::of(q.get(&"j0".parse().unwrap()).unwrap());
        let refusal = |cap| Refusal {
            cap,
            requested: 1,
            used: 1,
            held: 0,
            limit: 1,
        };
        let tried = |cap| vec![(shape.clone(), "j0".parse().unwrap(), refusal(cap))];
        let reported = |r: Vec<(JobId, ScalerName, Refusal)>| -> Vec<String> {
            r.into_iter()
                .map(|(j, _, r)| format!("{j}:{}", r.cap))
                .collect()
        };
        assert_eq!(
            reported(q.record_refusals(&tried(Cap::GlobalCount))),
            ["j0:global-count", "j1:global-count", "j2:global-count"]
        );
        assert!(q.record_refusals(&tried(Cap::GlobalCount)).is_empty());
        // The tried request changes reason; the ones behind it are not
        // tried and keep theirs.
        assert_eq!(
            reported(q.record_refusals(&tried(Cap::ScalerMemory))),
            ["j0:scaler-memory"]
        );
        // A newcomer behind is reported with the shape's current reason.
        q.insert(entry(&config, 3, (1, 0, 1, 1), now));
        assert_eq!(
            reported(q.record_refusals(&tried(Cap::ScalerMemory))),
            ["j3:scaler-memory"]
        );
        // Re-queued (its reason forgotten): reported again.
        let mut j1 = q.remove(&"j1".parse().unwrap()).unwrap();
        j1.refused_for = None;
        q.insert(j1);
        assert_eq!(
            reported(q.record_refusals(&tried(Cap::ScalerMemory))),
            ["j1:scaler-memory"]
        );
    }

    #[test]
    fn indexes_follow_inserts_and_removals() {
        let config = config();
        let t0 = Instant::now();
        let mut q = PendingQueue::default();
        let at = |s: u64| t0 + Duration::from_secs(s);
        // Inserted out of arrival order, two shapes, equal instants.
        q.insert(entry(&config, 0, (1, 0, 1, 1), at(5)));
        q.insert(entry(&config, 1, (2, 0, 1, 1), at(1)));
        q.insert(entry(&config, 2, (1, 0, 1, 1), at(5)));
        q.insert(entry(&config, 3, (1, 0, 1, 1), at(3)));
        let pos = |q: &PendingQueue, j: &str| q.position(&j.parse().unwrap());
        assert_eq!(
            ["j1", "j3", "j0", "j2"].map(|j| pos(&q, j)),
            [Some(1), Some(2), Some(3), Some(4)]
        );
        assert_eq!(q.count_for("b"), 3);
        assert_eq!(q.count_for("c"), 1);
        assert_eq!(q.next_expiry(), Some(at(1) + Duration::from_secs(3600)));
        assert!(q.remove(&"j3".parse().unwrap()).is_some());
        assert_eq!(pos(&q, "j2"), Some(3));
        assert_eq!(q.count_for("b"), 2);
        let expired = q.take_expired(at(5) + Duration::from_secs(3600));
        let jobs: Vec<String> = expired.iter().map(|e| e.request.job.to_string()).collect();
        assert_eq!(jobs, ["j1", "j0", "j2"]);
        assert!(q.is_empty() && q.shapes.is_empty() && q.expiries.is_empty());
        assert_eq!(q.count_for("b"), 0);
    }
}
