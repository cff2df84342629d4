#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Small traces whose every number is worked out by hand in the comments.

use kici_simulate::{parse_trace, simulate, SimOptions};
use std::sync::Arc;

fn config(warm: &str) -> Arc<kici_model::Config> {
    let yaml = format!(
        r#"
version: 1
scalers:
  - name: c
    type: container
    maxAgents: 2
{warm}    labelSets:
      - labels: [linux]
        image: agent:1
"#
    );
    Arc::new(
        kici_config::load_documents(&[("scalers.yaml", &yaml)])
            .unwrap()
            .config,
    )
}

fn line(at: u32, duration: u32) -> String {
    format!("{{\"at\": {at}, \"labels\": [\"linux\"], \"durationSeconds\": {duration}}}\n")
}

#[test]
fn without_a_warm_pool_every_job_waits_for_its_spawn_and_the_cap() {
    // Containers register 5 s after their spawn (the default).
    // j1, j2 at 0: spawned at once, ready at 5 (wait 5 each), done at 15.
    // j3 at 1: maxAgents 2 is full, it waits (one refusal) until j1's and
    //   j2's agents are gone at 15, is spawned then, ready at 20: wait 19.
    // j4 at 100: spawned, ready at 105: wait 5; done at 110.
    let trace = [line(0, 10), line(0, 10), line(1, 10), line(100, 5)].concat();
    let trace = parse_trace("t.jsonl", &trace).unwrap();
    let r = simulate(config(""), &trace, &SimOptions::default());
    let c = &r.scalers["c"];
    assert_eq!(c.jobs, 4);
    assert_eq!(c.zero_wait, 0);
    // Waits 5, 5, 5, 19 (nearest rank).
    assert_eq!(
        (c.wait.p50, c.wait.p90, c.wait.p99, c.wait.max),
        (5.0, 19.0, 19.0, 19.0)
    );
    assert_eq!(c.idle_agent_seconds, 0.0);
    assert_eq!(c.peak_agents, 2);
    assert_eq!(c.refusals.values().sum::<u64>(), 1);
    assert_eq!(r.overall, *c);
    assert_eq!(r.simulated_seconds, 110.0);
}

#[test]
fn a_warm_pool_serves_at_once_and_costs_its_idle_time() {
    // warmPool size 1; containers register 5 s after their spawn.
    // 0: W1 spawned, idle from 5.
    // A at 10 takes W1 (wait 0; W1 idle 5 s); W2 spawned, idle from 15.
    //   A done at 20.
    // B at 30 takes W2 (wait 0; W2 idle 15 s); W3 spawned at 30.
    // C at 31: W3 is not up yet and maxAgents 2 is full (W2, W3): it waits
    //   (one refusal); B ends at 40, W2 goes, C's agent is spawned, ready at
    //   45: wait 14. C done at 55: the end.
    // W3 idle from 35 to 55: 20 s. Idle in all: 5 + 15 + 20 = 40.
    let trace = [line(10, 10), line(30, 10), line(31, 10)].concat();
    let trace = parse_trace("t.jsonl", &trace).unwrap();
    let r = simulate(
        config("    warmPool: {enabled: true, size: 1}\n"),
        &trace,
        &SimOptions::default(),
    );
    let c = &r.scalers["c"];
    assert_eq!(c.jobs, 3);
    assert_eq!(c.zero_wait, 2);
    assert_eq!((c.wait.p50, c.wait.p90, c.wait.max), (0.0, 14.0, 14.0));
    assert_eq!(c.idle_agent_seconds, 40.0);
    assert_eq!(c.peak_agents, 2);
    assert_eq!(c.refusals.values().sum::<u64>(), 1);
    assert_eq!(r.simulated_seconds, 55.0);
}
