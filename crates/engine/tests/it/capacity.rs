#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Warm pools by schedule and by forecast, through the engine with an
//! explicit monotonic clock and wall clock.

use crate::common;

use common::*;
use kici_engine::{AgentState, Effect, Engine, ResourceHandle, WarmSource};
use kici_model::AgentId;
use std::time::Instant;

fn wall(text: &str) -> jiff::Timestamp {
    text.parse().unwrap()
}

fn target(e: &Engine, now: Instant) -> (u32, WarmSource) {
    let s = &e.status(now).scalers[0];
    (s.warm_target, s.warm_source.clone())
}

fn up(e: &mut Engine, a: AgentId, now: Instant) {
    e.spawn_succeeded(a, ResourceHandle::default(), now);
    e.agent_registered(a, now).unwrap();
}

fn destroys(e: &mut Engine) -> Vec<AgentId> {
    e.take_effects()
        .into_iter()
        .filter_map(|f| match f {
            Effect::Destroy(o) => Some(o.agent),
            _ => None,
        })
        .collect()
}

fn schedule_config(size: u32) -> String {
    format!(
        r#"
version: 1
scalers:
  - name: c
    type: container
    maxAgents: 5
    warmPool: {{enabled: true, size: 1, idleTimeoutSeconds: 86400}}
    x-kici-scaler:
      maxLifetimeSeconds: 172800
      warmPool:
        schedule:
          - {{days: [mon, tue, wed, thu, fri], from: "08:00", to: "18:00", timezone: Europe/Paris, size: {size}}}
    labelSets:
      - labels: [linux]
        image: agent:1
"#
    )
}

#[test]
fn a_schedule_period_sets_the_warm_pool_and_upstreams_size_applies_outside() {
    let mut clock = Clock::new();
    let mut e = engine(&schedule_config(3));
    // Monday 07:59:30 in Paris (UTC+1 in January): before the period.
    e.set_wall_clock(clock.now(), wall("2026-01-05T06:59:30Z"));
    e.tick(clock.now());
    assert_eq!(target(&e, clock.now()), (1, WarmSource::Static));
    let first = spawn_orders(&mut e);
    assert_eq!(first.len(), 1);
    // The next plan is due on the timer.
    assert_eq!(
        e.next_deadline(clock.now()),
        Some(clock.now() + std::time::Duration::from_secs(30))
    );
    let now = clock.advance(30);
    e.tick(now);
    let period = WarmSource::Period {
        index: 0,
        description: "mon,tue,wed,thu,fri 08:00-18:00 Europe/Paris".into(),
    };
    assert_eq!(target(&e, now), (3, period.clone()));
    let more = spawn_orders(&mut e);
    assert_eq!(more.len(), 2);
    for a in first.iter().chain(&more) {
        up(&mut e, *a, now);
    }
    // A reload applies a new size at once.
    let bigger = config(&schedule_config(4));
    e.reload(bigger, now).unwrap();
    assert_eq!(target(&e, now).0, 4);
    assert_eq!(spawn_orders(&mut e).len(), 1);
    e.reload(config(&schedule_config(3)), now).unwrap();
    let shrunk = destroys(&mut e);
    assert_eq!(shrunk.len(), 1, "the newest warm agent leaves");
    for a in &shrunk {
        e.destroy_finished(*a, now);
    }
    // 18:00 in Paris: back to upstream's size; the newest idle agents leave.
    let now = clock.advance(10 * 3600);
    e.tick(now);
    assert_eq!(target(&e, now), (1, WarmSource::Static));
    let mut gone = destroys(&mut e);
    gone.sort();
    let mut newest = more.clone();
    newest.sort();
    assert_eq!(gone, newest);
    assert_eq!(e.agent(first[0], now).unwrap().state, AgentState::Idle);
    // Saturday at 10:00: not in the period.
    let mut e = engine(&schedule_config(3));
    e.set_wall_clock(clock.now(), wall("2026-01-10T09:00:00Z"));
    e.tick(clock.now());
    assert_eq!(target(&e, clock.now()), (1, WarmSource::Static));
}

const FORECAST: &str = r#"
version: 1
globalMaxAgents: 4
scalers:
  - name: f
    type: container
    maxAgents: 10
    x-kici-scaler:
      warmPool:
        forecast: {minSize: 1, maxSize: 6}
    labelSets:
      - labels: [linux]
        image: agent:1
"#;

/// Drives one engine through a fixed history; returns the target after
/// each step.
fn forecast_history() -> Vec<(u64, u32)> {
    let mut clock = Clock::new();
    let start = clock.now();
    let mut e = engine(
        FORECAST
            .replace("globalMaxAgents: 4", "globalMaxAgents: 20")
            .as_str(),
    );
    let mut seen = Vec::new();
    let mut step = |e: &mut Engine, now: Instant| {
        e.tick(now);
        let t = target(e, now);
        assert_eq!(t.1, WarmSource::Forecast);
        seen.push((now.duration_since(start).as_secs(), t.0));
        // Every spawn takes 10 s to register; destroys finish at once.
        for f in e.take_effects() {
            match f {
                Effect::Spawn(o) => {
                    e.spawn_succeeded(o.agent, ResourceHandle::default(), now);
                    e.agent_registered(o.agent, now + std::time::Duration::from_secs(10))
                        .unwrap();
                }
                Effect::Destroy(o) => e.destroy_finished(o.agent, now),
                _ => {}
            }
        }
    };
    step(&mut e, clock.now());
    // A fan-out of 5 jobs at 60 s.
    let now = clock.advance(60);
    for i in 0..5 {
        e.request_scale(request(&format!("j{i}"), &["linux"]), now)
            .unwrap();
    }
    step(&mut e, now);
    for _ in 0..90 {
        let now = clock.advance(30);
        step(&mut e, now);
    }
    seen
}

#[test]
fn the_forecast_follows_bursts_holds_them_then_falls_and_is_deterministic() {
    let seen = forecast_history();
    let at = |secs: u64| seen.iter().find(|(t, _)| *t >= secs).unwrap().1;
    // No history: minSize.
    assert_eq!(seen[0], (0, 1));
    // The burst of 5 within one spawn time (10 s, learned from the first
    // registration) raises the target at the next plan.
    assert_eq!(at(90), 5);
    // The burst stays in the 30-minute window, and the target is held 10
    // minutes more before it falls back to minSize.
    assert_eq!(at(60 + 1800 + 30), 5);
    assert_eq!(at(60 + 1800 + 540), 5);
    assert_eq!(at(60 + 1800 + 600), 1);
    // The target never flaps: it only rises once and falls once.
    let changes = seen.windows(2).filter(|w| w[0].1 != w[1].1).count();
    assert_eq!(changes, 2, "{seen:?}");
    // Same history, same clock offsets: same targets.
    assert_eq!(forecast_history(), seen);
}

#[test]
fn the_forecast_never_exceeds_max_size_or_the_caps() {
    let mut clock = Clock::new();
    // globalMaxAgents 4 is below maxSize 6.
    let mut e = engine(FORECAST);
    e.tick(clock.now());
    let now = clock.advance(1);
    for i in 0..30 {
        let _ = e.request_scale(request(&format!("j{i}"), &["linux"]), now);
    }
    let now = clock.advance(30);
    e.tick(now);
    assert_eq!(target(&e, now).0, 4);
    let mut e = engine(&FORECAST.replace("globalMaxAgents: 4", "globalMaxAgents: 50"));
    e.tick(clock.now());
    for i in 0..30 {
        let _ = e.request_scale(request(&format!("j{i}"), &["linux"]), clock.now());
    }
    let now = clock.advance(30);
    e.tick(now);
    assert_eq!(target(&e, now).0, 6);
}

/// Drives one engine (minSize 0, maxSize 6, spawns registering after 10 s)
/// with one job at each of `jobs` (seconds from the start), ticking every
/// 5 s until `until`; returns the target after each tick.
fn forecast_run(jobs: &[u64], until: u64) -> Vec<(u64, u32)> {
    let mut clock = Clock::new();
    let start = clock.now();
    let mut e = engine(
        &FORECAST
            .replace("globalMaxAgents: 4", "globalMaxAgents: 20")
            .replace("minSize: 1", "minSize: 0"),
    );
    let mut seen = Vec::new();
    let mut next = 0;
    let mut secs = 0;
    while secs <= until {
        let now = clock.now();
        while next < jobs.len() && jobs[next] <= secs {
            let _ = e.request_scale(request(&format!("j{next}"), &["linux"]), now);
            next += 1;
        }
        e.tick(now);
        for f in e.take_effects() {
            match f {
                Effect::Spawn(o) => {
                    e.spawn_succeeded(o.agent, ResourceHandle::default(), now);
                    e.agent_registered(o.agent, now + std::time::Duration::from_secs(10))
                        .unwrap();
                }
                Effect::Destroy(o) => e.destroy_finished(o.agent, now),
                _ => {}
            }
        }
        seen.push((now.duration_since(start).as_secs(), target(&e, now).0));
        clock.advance(5);
        secs += 5;
    }
    seen
}

#[test]
fn a_steady_stream_gets_the_pool_its_rate_is_worth_and_it_falls_soon_after_the_stream_ends() {
    // One job every 5 s for 20 minutes: 2 expected per 10 s spawn time.
    let jobs: Vec<u64> = (0..240).map(|i| i * 5).collect();
    let seen = forecast_run(&jobs, 3600);
    let at = |secs: u64| seen.iter().find(|(t, _)| *t >= secs).unwrap().1;
    // About two arrivals per spawn time (a little more: the replay's
    // agents queue behind the caps, so the learned spawn time exceeds
    // 10 s): a pool a few agents above the mean, and steady — two jobs 5 s
    // apart are the stream, not a fan-out, so nothing clumps it upwards.
    let plateau: Vec<u32> = seen
        .iter()
        .filter(|(t, _)| (900..=1195).contains(t))
        .map(|(_, v)| *v)
        .collect();
    assert!(plateau.iter().all(|v| (4..=6).contains(v)), "{seen:?}");
    assert!(plateau.windows(2).all(|w| w[0] == w[1]), "{seen:?}");
    // Once the rate window has emptied (15 minutes after the last job) the
    // target falls within a minute, not after the fan-out's 10-minute hold.
    let last = 239 * 5;
    assert_eq!(at(last + 900 + 60 + 30), 0, "{seen:?}");
    assert_eq!(forecast_run(&jobs, 3600), seen);
}

#[test]
fn a_trickle_of_jobs_keeps_no_agent_warm_but_a_fan_out_does() {
    // One job every 3 minutes: a warm agent would idle 18 spawn times per
    // wait it saves.
    let trickle: Vec<u64> = (0..20).map(|i| i * 180).collect();
    let seen = forecast_run(&trickle, 3600);
    assert!(seen.iter().all(|(_, v)| *v == 0), "{seen:?}");
    // The same trickle with 4 jobs within 2 s at 30 minutes: a fan-out.
    let mut jobs = trickle.clone();
    jobs.extend([1800, 1800, 1801, 1801]);
    jobs.sort_unstable();
    let seen = forecast_run(&jobs, 3600);
    let at = |secs: u64| seen.iter().find(|(t, _)| *t >= secs).unwrap().1;
    assert_eq!(at(1800 + 30), 5);
}
