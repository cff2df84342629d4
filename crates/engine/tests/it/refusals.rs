#![allow(clippy::unwrap_used, clippy::expect_used)]
//! A request waiting for capacity is refused — one `Refused` event, hence
//! one log line and one metric increment downstream — once per reason it
//! waits for, and again only when that reason changes. Releases that admit
//! the head of a long queue must not re-refuse everyone behind it: the
//! events of one release/admit cycle do not grow with the queue.

use crate::common;

use common::*;
use kici_admission::Cap;
use kici_engine::{Effect, Engine, EngineEvent, ResourceHandle, ScaleOutcome};
use kici_model::{AgentId, JobId, MemoryBytes, ResourceRequest, ResourceSpec, ScalerName};
use std::collections::HashMap;
use std::time::Instant;

/// One agent at a time, whatever the scaler allows.
const CAP_ONE: &str = r#"
version: 1
globalMaxAgents: 1
scalers:
  - name: one
    type: bare-metal
    maxAgents: 5
    labelSets:
      - labels: [one]
        binaryPath: /bin/agent
        resources: { cpus: 1, memory: 1g }
"#;

fn spawn_order(e: &mut Engine) -> Option<AgentId> {
    let mut spawned = None;
    for f in e.take_effects() {
        if let Effect::Spawn(o) = f {
            assert!(spawned.is_none(), "one spawn per release over a cap of 1");
            spawned = Some(o.agent);
        }
    }
    spawned
}

/// The agent comes up, runs its standalone job and is destroyed: its
/// release admits the next request.
fn run_to_gone(e: &mut Engine, a: AgentId, now: Instant) {
    e.spawn_succeeded(
        a,
        ResourceHandle {
            id: format!("h-{a}"),
            ..Default::default()
        },
        now,
    );
    let reg = e.agent_registered(a, now).unwrap();
    let job = reg.bound_job_id.unwrap();
    e.job_started(a, job.clone(), now).unwrap();
    e.job_completed(a, &job, Some(0), now).unwrap();
    e.destroy_finished(a, now);
}

fn refusals(events: &[EngineEvent]) -> Vec<(JobId, ScalerName, Cap)> {
    events
        .iter()
        .filter_map(|ev| match ev {
            EngineEvent::Refused {
                job_id,
                scaler,
                cap,
                ..
            } => Some((job_id.clone(), scaler.clone(), *cap)),
            _ => None,
        })
        .collect()
}

struct Cycles {
    /// Every refusal ever reported, per job.
    per_job: HashMap<JobId, Vec<Cap>>,
    /// Events recorded by each release/admit cycle.
    events_per_cycle: Vec<usize>,
    refusals_per_cycle: Vec<usize>,
}

/// `n` requests wait over a cap of one; then `k` cycles each finish the
/// running agent, which admits the oldest waiting request. Half-way the
/// clock jumps past the starvation threshold, so the second half runs with
/// starved requests holding capacity.
fn cycles(n: usize, k: usize) -> Cycles {
    let mut clock = Clock::new();
    let mut e = engine(CAP_ONE);
    let mut per_job: HashMap<JobId, Vec<Cap>> = HashMap::new();
    let mut note = |events: &[EngineEvent]| {
        let found = refusals(events);
        for (job, _, cap) in &found {
            per_job.entry(job.clone()).or_default().push(*cap);
        }
        found.len()
    };
    let first = e
        .request_scale(request("run-0", &["one"]), clock.now())
        .unwrap();
    let mut running = spawned(&first);
    for i in 1..=n {
        let out = e
            .request_scale(request(&format!("wait-{i}"), &["one"]), clock.now())
            .unwrap();
        assert_eq!(out, ScaleOutcome::Pending { position: i });
    }
    e.take_effects();
    let arrivals = note(&e.take_events());
    assert_eq!(arrivals, n, "every waiting request is refused on arrival");
    let mut events_per_cycle = Vec::new();
    let mut refusals_per_cycle = Vec::new();
    for cycle in 0..k {
        let now = if cycle == k / 2 {
            clock.advance(400)
        } else {
            clock.advance(1)
        };
        run_to_gone(&mut e, running, now);
        // The runtime recomputes its timer after every call: a tick at the
        // same instant is a second admission pass with nothing released.
        e.tick(now);
        running = spawn_order(&mut e).expect("the release admits the next request");
        let events = e.take_events();
        refusals_per_cycle.push(note(&events));
        events_per_cycle.push(events.len());
    }
    assert_eq!(e.pending_len(), n - k);
    Cycles {
        per_job,
        events_per_cycle,
        refusals_per_cycle,
    }
}

#[test]
fn a_waiting_request_is_refused_once_across_release_admit_cycles() {
    let (n, k) = (60, 20);
    let c = cycles(n, k);
    assert_eq!(c.per_job.len(), n);
    for (job, caps) in &c.per_job {
        assert_eq!(caps, &[Cap::GlobalCount], "{job} refused {caps:?}");
    }
    assert!(
        c.refusals_per_cycle.iter().all(|r| *r == 0),
        "releases re-refused waiting requests: {:?}",
        c.refusals_per_cycle
    );
}

#[test]
fn events_per_cycle_do_not_grow_with_the_queue() {
    let short = cycles(10, 8);
    let long = cycles(400, 8);
    assert_eq!(short.events_per_cycle, long.events_per_cycle);
    // The finished agent's transitions, the admitted request leaving the
    // queue and the new agent's first transition: a handful, never a
    // multiple of the queue.
    assert!(
        long.events_per_cycle.iter().all(|n| *n <= 10),
        "{:?}",
        long.events_per_cycle
    );
}

/// `a` and `b` share a global cap of 2; `b` alone has 2g of memory.
const TWO_REASONS: &str = r#"
version: 1
globalMaxAgents: 2
scalers:
  - name: a
    type: bare-metal
    maxAgents: 5
    labelSets:
      - labels: [a]
        binaryPath: /bin/agent
        resources: { cpus: 1, memory: 1g }
  - name: b
    type: bare-metal
    maxAgents: 5
    resourceCap: { maxMemory: 2g }
    labelSets:
      - labels: [b]
        binaryPath: /bin/agent
        resources: { cpus: 1, memory: 1g }
"#;

#[test]
fn a_change_of_reason_yields_exactly_one_new_refusal() {
    let mut clock = Clock::new();
    let mut e = engine(TWO_REASONS);
    let b = ScalerName::new("b");
    let mut b_full = request("b-full", &["b"]);
    b_full.resources = Some(ResourceRequest::flat(ResourceSpec {
        cpus: None,
        memory: Some("2g".parse::<MemoryBytes>().unwrap()),
    }));
    let b_agent = spawned(&e.request_scale(b_full, clock.now()).unwrap());
    e.take_effects();
    e.take_events();
    // Passes that change nothing (timer ticks) report nothing.
    let quiet = |e: &mut Engine, clock: &mut Clock| {
        for _ in 0..3 {
            let now = clock.advance(1);
            e.tick(now);
            assert_eq!(refusals(&e.take_events()), []);
        }
    };

    // A global slot is free, but `b` has no memory left.
    let waiting = job("b-wait");
    let out = e
        .request_scale(request("b-wait", &["b"]), clock.now())
        .unwrap();
    assert_eq!(out, ScaleOutcome::Pending { position: 1 });
    assert_eq!(
        refusals(&e.take_events()),
        [(waiting.clone(), b.clone(), Cap::ScalerMemory)]
    );
    quiet(&mut e, &mut clock);

    // An `a` request fits the free global slot and passes it. From the
    // next pass on the waiting request is refused for global-count first:
    // one new refusal, then silence.
    let now = clock.advance(1);
    let a1 = spawned(&e.request_scale(request("a-1", &["a"]), now).unwrap());
    e.tick(now);
    assert_eq!(
        refusals(&e.take_events()),
        [(waiting.clone(), b.clone(), Cap::GlobalCount)]
    );
    quiet(&mut e, &mut clock);

    // `a-1` leaves: the global slot is free again, the memory is not.
    let now = clock.advance(1);
    e.take_effects();
    run_to_gone(&mut e, a1, now);
    e.tick(now);
    assert_eq!(
        refusals(&e.take_events()),
        [(waiting.clone(), b.clone(), Cap::ScalerMemory)]
    );
    assert_eq!(spawn_order(&mut e), None);
    quiet(&mut e, &mut clock);

    // `b-full` leaves: the request fits and is admitted, refused no more.
    let now = clock.advance(1);
    run_to_gone(&mut e, b_agent, now);
    assert!(spawn_order(&mut e).is_some());
    assert!(!e.is_pending(&waiting));
    assert_eq!(refusals(&e.take_events()), []);
}

#[test]
fn a_request_behind_an_identical_waiting_one_is_refused_for_the_same_cap() {
    let clock = Clock::new();
    let mut e = engine(CAP_ONE);
    spawned(
        &e.request_scale(request("run", &["one"]), clock.now())
            .unwrap(),
    );
    for j in ["w1", "w2", "w3"] {
        e.request_scale(request(j, &["one"]), clock.now()).unwrap();
    }
    let caps: Vec<(String, Cap)> = refusals(&e.take_events())
        .into_iter()
        .map(|(j, _, c)| (j.to_string(), c))
        .collect();
    assert_eq!(
        caps,
        [
            ("w1".to_owned(), Cap::GlobalCount),
            ("w2".to_owned(), Cap::GlobalCount),
            ("w3".to_owned(), Cap::GlobalCount),
        ]
    );
}
