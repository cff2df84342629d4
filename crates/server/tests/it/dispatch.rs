//! Scale requests that nobody dispatches: the agent registers with the
//! gateway, waits `pendingDispatchTimeoutSeconds` for a job that never
//! comes, and leaves. Its request ends there — the job id never gets a
//! second agent — and a cancel of a bound request whose agent is waiting
//! destroys it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::daemon::{agent_lite_dir, wait_until, Daemon, Dir};
use serde_json::Value;
use std::time::Duration;

fn config() -> String {
    format!(
        "version: 1\nscalers:\n  - name: local\n    type: bare-metal\n    maxAgents: 4\n    x-kici-scaler:\n      pendingDispatchTimeoutSeconds: 1\n    labelSets:\n      - labels: [local]\n        binaryPath: {}\n",
        agent_lite_dir().join("kici-agent-lite").display()
    )
}

/// Every agent the daemon made (gone ones too), with its state and failure.
fn all_agents(d: &Daemon) -> Vec<Value> {
    let (status, body) = d.http("GET", "/v1/agents?all=true", None);
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    v["agents"].as_array().unwrap().clone()
}

#[test]
fn an_undispatched_scale_request_ends_at_the_timeout_and_gets_no_second_agent() {
    let dir = Dir::with_config(&config());
    let d = Daemon::start(&dir, &["--listen", "127.0.0.1:0"], &[]);
    let (status, answer) = d.scale("never-dispatched", &["local"]);
    assert_eq!(status, 202, "{answer}");
    let first = answer["agentId"].as_str().unwrap().to_owned();
    wait_until("the agent leaves at the pending-dispatch timeout", || {
        all_agents(&d).iter().any(|a| {
            a["agentId"] == first.as_str() && a["failureReason"] == "pending-dispatch-timeout"
        })
    });
    // Five more timeouts' worth of time: no new agent for the job.
    std::thread::sleep(Duration::from_secs(5));
    let agents = all_agents(&d);
    assert_eq!(agents.len(), 1, "one agent in all: {agents:?}");
    // A cancel now finds nothing to cancel; a new request is a new one.
    let (status, answer) = d.scale("never-dispatched", &["local"]);
    assert_eq!(status, 202, "{answer}");
    assert_ne!(answer["agentId"].as_str().unwrap(), first);
}

#[test]
fn a_cancel_of_a_bound_request_whose_agent_waits_destroys_it_and_nothing_comes_back() {
    let dir = Dir::with_config(&config().replace(
        "pendingDispatchTimeoutSeconds: 1",
        "pendingDispatchTimeoutSeconds: 60",
    ));
    let d = Daemon::start(&dir, &["--listen", "127.0.0.1:0"], &[]);
    let (status, answer) = d.scale("to-cancel", &["local"]);
    assert_eq!(status, 202, "{answer}");
    let agent = answer["agentId"].as_str().unwrap().to_owned();
    d.wait_state(&agent, "registered");
    let (status, body) = d.http("DELETE", "/v1/scale/to-cancel", None);
    assert_eq!(status, 204, "{body}");
    wait_until("the waiting agent is destroyed", || {
        all_agents(&d)
            .iter()
            .any(|a| a["agentId"] == agent.as_str() && a["state"] == "gone")
    });
    std::thread::sleep(Duration::from_secs(3));
    let agents = all_agents(&d);
    assert_eq!(agents.len(), 1, "nothing came back: {agents:?}");
}
