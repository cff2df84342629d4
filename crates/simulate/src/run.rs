//! The replay loop: a virtual clock that jumps to the next thing that
//! happens (an arrival, a simulated backend event, an engine deadline),
//! the engine's effects served by a simulated backend.

use crate::report::{Report, Stats, WaitStats};
use crate::trace::Trace;
use kici_admission::Admission;
use kici_engine::{
    AgentState, Effect, Engine, EngineEvent, EngineSettings, JobEffect, Mode, ResourceHandle,
    ScaleOutcome, ScaleRequest,
};
use kici_model::{AgentId, Config, JobId, LabelSet, ScalerType};
use kici_routing::HostPlatform;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Spawn → registered, per backend type.
#[derive(Debug, Clone, PartialEq)]
pub struct SpawnTimes(BTreeMap<ScalerType, Duration>);

impl Default for SpawnTimes {
    /// A warm host's typical times: a process starts in about a second, a
    /// container (image present) in a few, a microVM boots in a few, an
    /// external cloud instance in about a minute.
    fn default() -> Self {
        Self(BTreeMap::from([
            (ScalerType::BareMetal, Duration::from_secs(1)),
            (ScalerType::Container, Duration::from_secs(5)),
            (ScalerType::Firecracker, Duration::from_secs(3)),
            (ScalerType::Event, Duration::from_secs(60)),
        ]))
    }
}

impl SpawnTimes {
    pub fn set(&mut self, kind: ScalerType, took: Duration) {
        self.0.insert(kind, took);
    }

    pub fn get(&self, kind: ScalerType) -> Duration {
        self.0.get(&kind).copied().unwrap_or(Duration::from_secs(5))
    }
}

/// How to replay.
#[derive(Debug, Clone)]
pub struct SimOptions {
    pub spawn: SpawnTimes,
    /// The wall-clock time of the trace's start when the trace has none
    /// (warm pool schedules read it).
    pub start: jiff::Timestamp,
    /// Routing as on a host of this platform.
    pub host: HostPlatform,
}

impl Default for SimOptions {
    fn default() -> Self {
        Self {
            spawn: SpawnTimes::default(),
            // A Monday, 00:00 UTC.
            start: jiff::Timestamp::from_second(1_704_067_200)
                .unwrap_or(jiff::Timestamp::UNIX_EPOCH),
            host: HostPlatform::new("linux", "x86_64"),
        }
    }
}

/// What the simulated backend and agents do next.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Step {
    Registered(AgentId),
    JobDone(AgentId, JobId),
    DestroyDone(AgentId),
}

/// A job of the trace as the replay follows it.
struct JobState {
    arrived: Duration,
    duration: Duration,
    scaler: Option<String>,
}

#[derive(Default)]
struct Acc {
    jobs: u64,
    zero_wait: u64,
    waits: Vec<f64>,
    idle: f64,
    live: u64,
    peak: u64,
    refusals: BTreeMap<String, u64>,
    lost: BTreeMap<String, u64>,
}

impl Acc {
    fn stats(mut self) -> Stats {
        Stats {
            jobs: self.jobs,
            zero_wait: self.zero_wait,
            wait: WaitStats::of(&mut self.waits),
            // Milliseconds are the clock's resolution; sums of f64 seconds
            // carry noise below it.
            idle_agent_seconds: (self.idle * 1000.0).round() / 1000.0,
            peak_agents: self.peak,
            refusals: self.refusals,
            lost: self.lost,
        }
    }
}

/// The engine's settings for a replay: as the daemon's, with a short
/// history of gone agents (nobody lists them).
fn settings() -> EngineSettings {
    EngineSettings {
        gone_history: 16,
        max_pending: usize::MAX,
        ..EngineSettings::default()
    }
}

struct Sim {
    engine: Engine,
    origin: Instant,
    t: Duration,
    start: jiff::Timestamp,
    spawn: SpawnTimes,
    queue: BinaryHeap<Reverse<(Duration, u64, Step)>>,
    seq: u64,
    jobs: HashMap<JobId, JobState>,
    alive: HashSet<AgentId>,
    /// Agents alive now and at most, over every scaler.
    live: u64,
    peak: u64,
    acc: BTreeMap<String, Acc>,
    open: usize,
}

impl Sim {
    fn now(&self) -> Instant {
        self.origin + self.t
    }

    fn at(&mut self, after: Duration, step: Step) {
        self.seq += 1;
        self.queue.push(Reverse((self.t + after, self.seq, step)));
    }

    fn acc(&mut self, scaler: &str) -> &mut Acc {
        self.acc.entry(scaler.to_owned()).or_default()
    }

    /// A job's agent is ready for it now: its wait ends, its run starts.
    fn ready(&mut self, agent: AgentId, job: JobId) {
        let Some(state) = self.jobs.get(&job) else {
            return;
        };
        let wait = self.t.saturating_sub(state.arrived).as_secs_f64();
        let (duration, scaler) = (state.duration, state.scaler.clone());
        if let Some(name) = scaler {
            let acc = self.acc(&name);
            acc.jobs += 1;
            acc.waits.push(wait);
            if wait == 0.0 {
                acc.zero_wait += 1;
            }
        }
        self.at(duration, Step::JobDone(agent, job));
    }

    fn lose(&mut self, job: &JobId, why: &str) {
        if let Some(state) = self.jobs.remove(job) {
            self.open -= 1;
            let name = state.scaler.unwrap_or_else(|| "(none)".to_owned());
            *self.acc(&name).lost.entry(why.to_owned()).or_default() += 1;
        }
    }

    /// Serves what the engine asked for and records what it reported.
    fn drain(&mut self) {
        loop {
            let effects = self.engine.take_effects();
            let events = self.engine.take_events();
            // The replay keeps nothing durable.
            let _ = self.engine.take_journal();
            if effects.is_empty() && events.is_empty() {
                return;
            }
            for event in events {
                self.observe(event);
            }
            for effect in effects {
                match effect {
                    Effect::Spawn(order) => {
                        let kind = order.scaler().kind;
                        let took = self.spawn.get(kind);
                        self.at(took, Step::Registered(order.agent));
                    }
                    Effect::Destroy(order) => {
                        self.at(Duration::ZERO, Step::DestroyDone(order.agent))
                    }
                    Effect::Revoke(_) | Effect::Ended(_) => {}
                    // Its agent's registration names the job.
                    Effect::Job(JobEffect::Bound { .. }) => {}
                    Effect::Job(JobEffect::Dispatch { job, agent }) => self.ready(agent, job),
                    Effect::Job(JobEffect::Ended { job, lost }) => {
                        let why = format!("{lost:?}");
                        let why = why
                            .split([' ', '(', '{'])
                            .next()
                            .unwrap_or("lost")
                            .to_owned();
                        self.lose(&job, &why);
                    }
                }
            }
        }
    }

    fn observe(&mut self, event: EngineEvent) {
        match event {
            EngineEvent::AgentTransition {
                agent_id,
                scaler,
                from,
                to,
                seconds_in_state,
                ..
            } => {
                let name = scaler.as_str().to_owned();
                if matches!(from, AgentState::Registered | AgentState::Idle) {
                    self.acc(&name).idle += seconds_in_state;
                }
                if to == AgentState::Gone {
                    if self.alive.remove(&agent_id) {
                        self.acc(&name).live -= 1;
                        self.live -= 1;
                    }
                } else if self.alive.insert(agent_id) {
                    self.live += 1;
                    self.peak = self.peak.max(self.live);
                    let acc = self.acc(&name);
                    acc.live += 1;
                    acc.peak = acc.peak.max(acc.live);
                }
            }
            EngineEvent::Refused { scaler, cap, .. } => {
                *self
                    .acc(scaler.as_str())
                    .refusals
                    .entry(cap.to_string())
                    .or_default() += 1;
            }
            _ => {}
        }
    }

    fn step(&mut self, step: Step) {
        let now = self.now();
        match step {
            Step::Registered(agent) => {
                self.engine
                    .spawn_succeeded(agent, ResourceHandle::default(), now);
                // An agent stopped while it booted is gone already.
                if let Ok(reg) = self.engine.agent_registered(agent, now) {
                    if let Some(job) = reg.bound_job_id {
                        if self.engine.job_started(agent, job.clone(), now).is_ok() {
                            self.drain();
                            self.ready(agent, job);
                        }
                    }
                }
            }
            Step::JobDone(agent, job) => {
                if self.jobs.remove(&job).is_some() {
                    self.open -= 1;
                }
                let _ = self.engine.job_completed(agent, &job, Some(0), now);
            }
            Step::DestroyDone(agent) => self.engine.destroy_finished(agent, now),
        }
        self.drain();
    }
}

/// Replays `trace` under `config` and measures it.
pub fn simulate(config: Arc<Config>, trace: &Trace, options: &SimOptions) -> Report {
    let admission = match Admission::new(&config, None) {
        Ok(a) => a,
        // A validated configuration always builds its admission; if it did
        // not, nothing could be replayed.
        Err(_) => return Report::default(),
    };
    let engine = Engine::new(config, admission, options.host.clone(), settings());
    let mut sim = Sim {
        engine,
        origin: Instant::now(),
        t: Duration::ZERO,
        start: trace.start.unwrap_or(options.start),
        spawn: options.spawn.clone(),
        queue: BinaryHeap::new(),
        seq: 0,
        jobs: HashMap::new(),
        alive: HashSet::new(),
        live: 0,
        peak: 0,
        acc: BTreeMap::new(),
        open: 0,
    };
    // The daemon runs before the trace's first job: warm pools start
    // filling at the trace's start.
    let wall = sim.start;
    sim.engine.set_wall_clock(sim.origin, wall);
    sim.engine.tick(sim.origin);
    sim.drain();
    let mut next = 0usize;
    let mut wall_set_at = None;
    loop {
        let now = sim.now();
        // Before any timer, the engine learns the wall clock (schedules).
        if wall_set_at != Some(sim.t) {
            let wall = sim
                .start
                .checked_add(jiff::SignedDuration::try_from(sim.t).unwrap_or_default())
                .unwrap_or(sim.start);
            sim.engine.set_wall_clock(now, wall);
            wall_set_at = Some(sim.t);
        }
        // Everything due now: arrivals first (they were recorded first),
        // then the backend's and agents' reports, then the engine's timers.
        while let Some(job) = trace.jobs.get(next).filter(|j| j.at <= sim.t) {
            next += 1;
            let id: JobId = match format!("job-{next}").parse() {
                Ok(id) => id,
                Err(_) => continue,
            };
            let request = ScaleRequest {
                job: id.clone(),
                run_id: None,
                labels: job.labels.clone(),
                exclude: LabelSet::default(),
                resources: job.resources,
                mode: Mode::Standalone,
            };
            let scaler = sim
                .engine
                .classify(&request)
                .ok()
                .map(|(s, _)| s.as_str().to_owned());
            sim.jobs.insert(
                id.clone(),
                JobState {
                    arrived: sim.t,
                    duration: job.duration,
                    scaler,
                },
            );
            sim.open += 1;
            match sim.engine.request_scale(request, now) {
                Ok(ScaleOutcome::NoBackend { .. }) => sim.lose(&id, "NoBackend"),
                Ok(ScaleOutcome::TooLarge { .. }) => sim.lose(&id, "TooLarge"),
                Ok(_) => {}
                Err(_) => sim.lose(&id, "Refused"),
            }
            sim.drain();
        }
        while let Some(Reverse((at, _, _))) = sim.queue.peek() {
            if *at > sim.t {
                break;
            }
            if let Some(Reverse((_, _, step))) = sim.queue.pop() {
                sim.step(step);
            }
        }
        if sim.engine.next_deadline(now).is_some_and(|d| d <= now) {
            sim.engine.tick(now);
            sim.drain();
        }
        if next >= trace.jobs.len() && sim.open == 0 {
            break;
        }
        // The clock jumps to the next thing that happens.
        let arrival = trace.jobs.get(next).map(|j| j.at);
        let queued = sim.queue.peek().map(|Reverse((at, _, _))| *at);
        let deadline = sim
            .engine
            .next_deadline(now)
            .map(|d| d.saturating_duration_since(sim.origin));
        let Some(t) = [arrival, queued, deadline].into_iter().flatten().min() else {
            break;
        };
        // A deadline that is not later (the engine had nothing to do at
        // it) must not stall the clock.
        sim.t = if t > sim.t {
            t
        } else {
            sim.t + Duration::from_millis(1)
        };
    }
    // Agents still up at the end count as idle until then.
    let end = sim.now();
    for view in sim.engine.agents(false, end) {
        if matches!(view.state, AgentState::Registered | AgentState::Idle) {
            sim.acc(view.scaler.as_str()).idle += view.state_seconds;
        }
    }
    let mut overall = Acc {
        peak: sim.peak,
        ..Acc::default()
    };
    let mut scalers = BTreeMap::new();
    for (name, acc) in std::mem::take(&mut sim.acc) {
        overall.jobs += acc.jobs;
        overall.zero_wait += acc.zero_wait;
        overall.waits.extend_from_slice(&acc.waits);
        overall.idle += acc.idle;
        for (k, v) in &acc.refusals {
            *overall.refusals.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &acc.lost {
            *overall.lost.entry(k.clone()).or_default() += v;
        }
        if name != "(none)" {
            scalers.insert(name, acc.stats());
        }
    }
    Report {
        overall: overall.stats(),
        scalers,
        simulated_seconds: sim.t.as_secs_f64(),
    }
}
