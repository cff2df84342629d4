//! A long pending queue over a cap of one agent: what one release/admit
//! cycle costs, and what it reports.
//!
//! Each cycle, the running agent comes up, runs its job and is destroyed;
//! its release admits the oldest waiting request; one new request arrives
//! (so the queue keeps its length) and the engine's next deadline is asked
//! for, as the runtime does after every call. The cost and the number of
//! events (each is one SSE event, one log line and, for a refusal, one
//! metric increment in the daemon) must not grow with the queue.
//!
//! - `release_admit_cycle/fresh/{100,1000,10000}`: the waiting requests are
//!   younger than the starvation threshold.
//! - `release_admit_cycle/starved/{…}`: they are older, so they hold
//!   capacity against younger ones.
//!
//! Before the criterion groups, 1,000 cycles per case (after 100 untimed
//! ones) are run and timed once, and their events per cycle printed:
//!
//! ```text
//! cargo bench -p kici-engine --bench pending -- --measurement-time 2
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kici_admission::Admission;
use kici_engine::{
    Effect, Engine, EngineEvent, EngineSettings, Mode, ResourceHandle, ScaleOutcome, ScaleRequest,
};
use kici_model::{AgentId, LabelSet};
use kici_routing::HostPlatform;
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

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

const SIZES: [usize; 3] = [100, 1_000, 10_000];
const CYCLES: usize = 1_000;
const WARM_UP: usize = 100;

struct Queue {
    engine: Engine,
    now: Instant,
    running: AgentId,
    next_job: usize,
}

fn request(job: usize) -> ScaleRequest {
    ScaleRequest {
        job: format!("job-{job}").parse().unwrap(),
        run_id: None,
        labels: LabelSet::parse(["one"]).unwrap(),
        exclude: LabelSet::default(),
        resources: None,
        mode: Mode::Standalone,
    }
}

fn spawned(e: &mut Engine) -> AgentId {
    e.take_effects()
        .into_iter()
        .find_map(|f| match f {
            Effect::Spawn(o) => Some(o.agent),
            _ => None,
        })
        .expect("a release over a cap of one admits one request")
}

impl Queue {
    /// One running agent and `pending` requests waiting behind it; with
    /// `starved`, the clock then moves past the starvation threshold.
    fn new(pending: usize, starved: bool) -> Self {
        let loaded = kici_config::load_documents(&[("scalers.yaml", CAP_ONE)]).unwrap();
        let config = Arc::new(loaded.config);
        let admission = Admission::new(&config, None).unwrap();
        let settings = EngineSettings {
            max_pending: pending * 2,
            ..EngineSettings::default()
        };
        let mut engine = Engine::new(
            config,
            admission,
            HostPlatform::new("linux", "x86_64"),
            settings,
        );
        let now = Instant::now();
        let first = engine.request_scale(request(0), now).unwrap();
        assert!(matches!(first, ScaleOutcome::Spawning { .. }));
        let running = spawned(&mut engine);
        // Starved requests arrived longer than the threshold ago.
        let waited = if starved {
            engine.settings().starvation + Duration::from_secs(1)
        } else {
            Duration::ZERO
        };
        for job in 1..=pending {
            engine.restore_pending(request(job), waited, now).unwrap();
        }
        assert_eq!(engine.pending_len(), pending);
        engine.take_events();
        Self {
            engine,
            now,
            running,
            next_job: pending + 1,
        }
    }

    /// One cycle; returns the events it recorded.
    fn cycle(&mut self) -> Vec<EngineEvent> {
        self.now += Duration::from_millis(1);
        let (e, now, a) = (&mut self.engine, self.now, self.running);
        e.spawn_succeeded(
            a,
            ResourceHandle {
                id: a.to_string(),
                ..Default::default()
            },
            now,
        );
        let job = e.agent_registered(a, now).unwrap().bound_job_id.unwrap();
        e.job_started(a, job.clone(), now).unwrap();
        e.job_completed(a, &job, Some(0), now).unwrap();
        e.destroy_finished(a, now);
        self.running = spawned(e);
        e.request_scale(request(self.next_job), now).unwrap();
        self.next_job += 1;
        black_box(e.next_deadline(now));
        e.take_events()
    }
}

/// 1,000 timed cycles per case, with what they reported. Each cycle's
/// arrival is refused once (it waits); a request refused again for the
/// same reason would show as more than one refusal per cycle.
fn report() {
    println!(
        "{:<8} {:>8} {:>14} {:>18} {:>16}",
        "queue", "pending", "time/cycle", "refusals/cycle", "events/cycle"
    );
    for starved in [false, true] {
        let mut base = None;
        for n in SIZES {
            let mut q = Queue::new(n, starved);
            // Out of the timing: the first cycles after filling the queue
            // run on cold caches.
            for _ in 0..WARM_UP {
                q.cycle();
            }
            let (mut events, mut refusals) = (0usize, 0usize);
            let t = Instant::now();
            for _ in 0..CYCLES {
                let ev = q.cycle();
                refusals += ev
                    .iter()
                    .filter(|e| matches!(e, EngineEvent::Refused { .. }))
                    .count();
                events += ev.len();
            }
            let per = t.elapsed() / CYCLES as u32;
            assert_eq!(q.engine.pending_len(), n);
            let ratio = per.as_secs_f64() / *base.get_or_insert(per.as_secs_f64());
            println!(
                "{:<8} {n:>8} {:>11.2} µs {:>18.3} {:>16.3}   ({ratio:.2}× the {} case)",
                if starved { "starved" } else { "fresh" },
                per.as_secs_f64() * 1e6,
                refusals as f64 / CYCLES as f64,
                events as f64 / CYCLES as f64,
                SIZES[0],
            );
        }
    }
}

fn cycles(c: &mut Criterion) {
    report();
    let mut g = c.benchmark_group("release_admit_cycle");
    for starved in [false, true] {
        let name = if starved { "starved" } else { "fresh" };
        for n in SIZES {
            let mut q = Queue::new(n, starved);
            g.bench_with_input(BenchmarkId::new(name, n), &n, |b, _| {
                b.iter(|| black_box(q.cycle()))
            });
        }
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = cycles
}
criterion_main!(benches);
