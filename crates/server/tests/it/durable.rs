//! What the daemon keeps across a `kill -9` besides its agents: pending
//! scale requests (re-queued with their arrival time and TTL, dedupe by job
//! id intact; standalone jobs failed, not run), the SSE event ids
//! (numbering continues, `Last-Event-ID` replays across the restart,
//! retention bounded) and standalone jobs (a started one ends aborted, its
//! output readable, its agent destroyed). On SQLite and on PostgreSQL.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use common::daemon::{fresh_database, psql, rows, wait_until, Daemon, Dir, PATIENCE};
use common::{take_sse_events, SseEvent};
use serde_json::Value;
use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::path::Path;
use std::time::Duration;

/// The first `n` SSE events of `GET /v1/events` after `last_event_id`.
fn sse(d: &Daemon, last_event_id: u64, n: usize) -> Vec<SseEvent> {
    let mut s = std::net::TcpStream::connect(&d.addr).unwrap();
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    let req =
        format!(
        "GET /v1/events HTTP/1.0\r\nHost: x\r\nAuthorization: Bearer {}\r\nLast-Event-ID: {last_event_id}\r\n\r\n",
        crate::common::daemon::TEST_API_TOKEN
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut raw = String::new();
    let mut body_started = false;
    let mut events = Vec::new();
    let mut buf = [0u8; 8192];
    while events.len() < n {
        let k = s.read(&mut buf).unwrap();
        assert!(k > 0, "the stream ended after {events:?}");
        raw.push_str(&String::from_utf8_lossy(&buf[..k]));
        if !body_started {
            let Some(at) = raw.find("\r\n\r\n") else {
                continue;
            };
            assert!(
                raw.starts_with("HTTP/1.0 200") || raw.starts_with("HTTP/1.1 200"),
                "{raw}"
            );
            raw.drain(..at + 4);
            body_started = true;
        }
        events.extend(take_sse_events(&mut raw));
    }
    events.truncate(n);
    events
}

/// The instance's pending records: job id and arrival (ms), oldest first.
/// PostgreSQL is read with psql (the daemon holds the instance's lock).
fn pending_rows(url: &str, owner: &str) -> Vec<(String, i64)> {
    if url.starts_with("postgres") {
        psql(
            url,
            &format!(
                "SELECT job_id || ' ' || created_at FROM pending_requests WHERE owner = '{owner}' ORDER BY created_at, job_id"
            ),
        )
        .iter()
        .map(|l| {
            let (job, at) = l.split_once(' ').unwrap();
            (job.to_owned(), at.parse().unwrap())
        })
        .collect()
    } else {
        rows(url, owner)
            .pending
            .iter()
            .map(|p| (p.job_id.to_string(), p.created_at.0))
            .collect()
    }
}

fn pending_jobs(url: &str, owner: &str) -> BTreeSet<String> {
    pending_rows(url, owner)
        .into_iter()
        .map(|(j, _)| j)
        .collect()
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

/// The whole story on the store at `url` (`state` are the `--state` args).
fn pending_and_event_ids_survive_kill_9(dir: &Dir, state: &[&str], url: &str) {
    let args = |extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = ["--listen", "127.0.0.1:0", "--event-replay", "16"]
            .iter()
            .chain(state)
            .map(|s| (*s).to_owned())
            .collect();
        a.extend(extra.iter().map(|s| (*s).to_owned()));
        a
    };
    let start = |extra: &[&str]| {
        let a = args(extra);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        Daemon::start(dir, &a, &[])
    };

    // Run A: one agent fills the cap, two requests wait.
    let mut a = start(&[]);
    let owner = dir.instance();
    let (status, first) = a.scale("first", &["local"]);
    assert_eq!(status, 202, "{first}");
    let first = first["agentId"].as_str().unwrap().to_owned();
    a.wait_state(&first, "booted");
    for job in ["second", "third"] {
        let (status, answer) = a.scale(job, &["local"]);
        assert_eq!((status, answer["result"].as_str()), (200, Some("pending")));
    }
    // Acknowledged means recorded.
    assert_eq!(pending_jobs(url, &owner), set(&["second", "third"]));
    let recorded_at = pending_rows(url, &owner);
    let seen = sse(&a, 0, 3);
    a.kill9();
    let before = rows(url, &owner);
    let last = before.events.iter().map(|e| e.seq).max().unwrap();
    assert!(
        seen.iter().all(|e| e.id.unwrap() <= last),
        "every id a reader saw was recorded: {seen:?} vs {last}"
    );

    // Run B: both re-queued in order, with their records untouched.
    let mut b = start(&[]);
    assert_eq!(b.pending_restored["requeued"], 2, "{}", b.pending_restored);
    assert_eq!(pending_rows(url, &owner), recorded_at);
    let (status, answer) = b.scale("second", &["local"]);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["result"], "pending");
    assert_eq!(answer["position"], 1, "the retry keeps its place");
    let (status, answer) = b.scale("third", &["other-labels"]);
    assert_eq!(status, 409, "the same job id with another body: {answer}");
    // Ids continue: the two newest recorded events replay as they were,
    // then the new run's first event follows the last recorded id.
    let replay = sse(&b, last - 2, 3);
    let ids: Vec<u64> = replay.iter().map(|e| e.id.unwrap()).collect();
    assert_eq!(ids, [last - 1, last, last + 1], "{replay:?}");
    let kept: Vec<Value> = before
        .events
        .iter()
        .filter(|e| e.seq >= last - 1)
        .map(|e| serde_json::from_str(&e.body).unwrap())
        .collect();
    assert_eq!(replay[0].data, kept[0]);
    assert_eq!(replay[1].data, kept[1]);
    assert!(replay.iter().all(|e| e.event != "reset"), "{replay:?}");
    // Capacity frees: the oldest waiting request is admitted, its record
    // goes.
    let (status, body) = b.http("DELETE", &format!("/v1/agents/{first}"), None);
    assert_eq!(status, 202, "{body}");
    wait_until("second is admitted and its record deleted", || {
        pending_jobs(url, &owner) == set(&["third"])
    });
    let second_agent = b
        .agents()
        .into_iter()
        .find(|a| a != &first)
        .expect("an agent for second");
    b.wait_state(&second_agent, "booted");
    b.kill9();

    // Run C, with a pending TTL the remaining request has outlived since it
    // arrived (not since the restart): it expires at once.
    let third_arrived = kici_store::UnixMillis(pending_rows(url, &owner)[0].1).to_system_time();
    wait_until("third is older than 1 s", || {
        third_arrived.elapsed().unwrap_or_default() > Duration::from_millis(1100)
    });
    let mut c = start(&["--pending-ttl-seconds", "1"]);
    assert_eq!(c.pending_restored["expired"], 1, "{}", c.pending_restored);
    assert_eq!(c.pending_restored["requeued"], 0, "{}", c.pending_restored);
    assert_eq!(c.recovery["adopted"], 1, "{}", c.recovery);
    wait_until("third's record is gone", || {
        pending_jobs(url, &owner).is_empty()
    });

    // A standalone job that waits when the daemon dies is not run later:
    // it is shown failed, and its record goes.
    let (status, body) = c.http(
        "POST",
        "/v1/jobs",
        Some(
            r#"{"labels":["local"],"command":["sh","-c","echo never"],"env":{"SECRET":"s3cr3t"}}"#,
        ),
    );
    assert_eq!(status, 202, "{body}");
    let job: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(job["state"], "pending");
    let job_id = job["jobId"].as_str().unwrap().to_owned();
    c.kill9();
    let recorded = rows(url, &owner).pending;
    assert_eq!(recorded.len(), 1);
    assert!(
        !recorded[0].request.to_string().contains("s3cr3t"),
        "a job's environment is never stored: {:?}",
        recorded[0].request
    );
    let d = start(&[]);
    assert_eq!(
        d.pending_restored["standalone_failed"], 1,
        "{}",
        d.pending_restored
    );
    let (status, body) = d.http("GET", &format!("/v1/jobs/{job_id}"), None);
    assert_eq!(status, 200, "{body}");
    let view: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(view["state"], "failed", "{view}");
    assert_eq!(
        view["command"],
        serde_json::json!(["sh", "-c", "echo never"])
    );
    assert!(
        view["reason"].as_str().unwrap().contains("restarted"),
        "{view}"
    );
    wait_until("the job's record is gone", || {
        pending_jobs(url, &owner).is_empty()
    });

    // Bounded retention: many events later, at most the replay size plus
    // one trim interval are kept, and the newest id is among them.
    for n in 0..40 {
        let (status, _) = d.scale(&format!("churn-{n}"), &["local"]);
        assert_eq!(status, 200);
        let (status, _) = d.http("DELETE", &format!("/v1/scale/churn-{n}"), None);
        assert_eq!(status, 204);
    }
    d.terminate();
    let after = rows(url, &owner);
    let newest = after.events.iter().map(|e| e.seq).max().unwrap();
    assert!(newest > last + 80, "{newest} vs {last}");
    assert!(
        after.events.len() <= 16 + 64,
        "{} events kept",
        after.events.len()
    );
    assert!(after.pending.is_empty(), "{:?}", after.pending);
}

#[test]
fn serial_pending_requests_and_event_ids_survive_kill_9_on_sqlite() {
    let dir = Dir::bare_metal(1);
    let url = dir.sqlite_url();
    pending_and_event_ids_survive_kill_9(&dir, &[], &url);
}

#[test]
fn serial_pending_requests_and_event_ids_survive_kill_9_on_postgres() {
    let dir = Dir::bare_metal(1);
    let url = fresh_database(54329);
    // The host's own pending journal on PostgreSQL; a fleet's shared
    // queue has tests of its own.
    pending_and_event_ids_survive_kill_9(&dir, &["--state", &url, "--no-fleet"], &url);
}

// ----- standalone jobs across a crash --------------------------------------

/// `GET /v1/jobs/{id}/logs` read until the job's stdout contains `until`
/// (`Some`) or to the stream's end (`None`): the stdout read, and the `end`
/// event's job if the stream ended.
fn job_logs(d: &Daemon, id: &str, until: Option<&str>) -> (String, Option<Value>) {
    let mut s = std::net::TcpStream::connect(&d.addr).unwrap();
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    write!(
        s,
        "GET /v1/jobs/{id}/logs HTTP/1.0\r\nHost: x\r\nAuthorization: Bearer {}\r\n\r\n",
        crate::common::daemon::TEST_API_TOKEN
    )
    .unwrap();
    let mut raw = String::new();
    let mut body_started = false;
    let mut stdout = String::new();
    let mut buf = [0u8; 8192];
    loop {
        let k = s.read(&mut buf).unwrap();
        if k == 0 {
            assert!(
                until.is_none(),
                "the stream ended before {until:?}: {stdout:?}"
            );
            return (stdout, None);
        }
        raw.push_str(&String::from_utf8_lossy(&buf[..k]));
        if !body_started {
            let Some(at) = raw.find("\r\n\r\n") else {
                continue;
            };
            assert!(
                raw.starts_with("HTTP/1.0 200") || raw.starts_with("HTTP/1.1 200"),
                "{raw}"
            );
            raw.drain(..at + 4);
            body_started = true;
        }
        for e in take_sse_events(&mut raw) {
            match e.event.as_str() {
                "output" if e.data["stream"] == "stdout" => {
                    let chunk: kici_protocol::ChunkData =
                        serde_json::from_value(e.data["data"].clone()).unwrap();
                    stdout.push_str(&String::from_utf8(chunk.into_bytes()).unwrap());
                }
                "end" => return (stdout, Some(e.data)),
                _ => {}
            }
        }
        if until.is_some_and(|u| stdout.contains(u)) {
            return (stdout, None);
        }
    }
}

fn job(d: &Daemon, id: &str) -> Value {
    let (status, body) = d.http("GET", &format!("/v1/jobs/{id}"), None);
    assert_eq!(status, 200, "GET /v1/jobs/{id}: {body}");
    serde_json::from_str(&body).unwrap()
}

fn process_gone(pid: i32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    matches!(
        stat.rsplit(')')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .next(),
        None | Some("Z")
    )
}

/// Three started standalone jobs and a waiting one when the daemon is
/// killed: after the restart each started job is still there, ended
/// (`failed`, `end: aborted`, "kici-scaler restarted while the job ran"),
/// with the output it wrote before the crash readable; the waiting one is
/// failed as before; the recovery destroyed the started jobs' agents — no
/// process, no cgroup left.
fn started_jobs_survive_kill_9(state: &[&str]) {
    let dir = Dir::with_config(&format!(
        "version: 1\nscalers:\n  - name: local\n    type: bare-metal\n    maxAgents: 3\n    labelSets:\n      - labels: [local]\n        binaryPath: {}\n",
        common::daemon::agent_lite_dir().join("kici-agent-lite").display()
    ));
    let mut args = vec!["--listen", "127.0.0.1:0"];
    args.extend(state);
    let mut a = Daemon::start(&dir, &args, &[]);
    let mut started = Vec::new();
    for n in 0..3 {
        let pidfile = dir.path(&format!("job-{n}.pid"));
        let script = format!(
            "echo $$ > {}; echo line-{n}; exec sleep 1000",
            pidfile.display()
        );
        let body = serde_json::json!({"labels": ["local"], "command": ["sh", "-c", script]});
        let (status, answer) = a.http("POST", "/v1/jobs", Some(&body.to_string()));
        assert_eq!(status, 202, "{answer}");
        let answer: Value = serde_json::from_str(&answer).unwrap();
        started.push((answer["jobId"].as_str().unwrap().to_owned(), pidfile, n));
    }
    let body = r#"{"labels":["local"],"command":["sh","-c","echo never"]}"#;
    let (status, answer) = a.http("POST", "/v1/jobs", Some(body));
    assert_eq!(status, 202, "{answer}");
    let answer: Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(answer["state"], "pending", "{answer}");
    let waiting = answer["jobId"].as_str().unwrap().to_owned();

    let cgroups = Path::new(common::daemon::CGROUP_V2)
        .join("kici-scaler")
        .join(dir.instance())
        .join("local");
    let procs = |agent: &str| -> Vec<i32> {
        std::fs::read_to_string(cgroups.join(agent).join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    };
    let mut before = Vec::new();
    for (id, pidfile, n) in &started {
        let line = format!("line-{n}\n");
        let (stdout, end) = job_logs(&a, id, Some(&line));
        assert_eq!((stdout.as_str(), end), (line.as_str(), None));
        let view = job(&a, id);
        assert_eq!(view["state"], "running", "{view}");
        let pid: i32 = std::fs::read_to_string(pidfile)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let agent = view["agentId"].as_str().unwrap().to_owned();
        assert!(
            procs(&agent).contains(&pid),
            "{pid} not in {agent}'s cgroup"
        );
        before.push((agent, pid));
    }
    a.kill9();
    // Bare-metal agents outlive the daemon (their job dies with its
    // connection): the recovery must end them.
    let mut agent_pids = Vec::new();
    for (agent, _) in &before {
        let left = procs(agent);
        assert!(!left.is_empty(), "{agent} died with the daemon");
        agent_pids.extend(left);
    }

    let b = Daemon::start(&dir, &args, &[]);
    assert_eq!(
        b.pending_restored["standalone_failed"], 1,
        "{}",
        b.pending_restored
    );
    for ((id, _, n), (agent, _)) in started.iter().zip(&before) {
        let view = job(&b, id);
        assert_eq!(view["state"], "failed", "{view}");
        assert_eq!(view["end"], "aborted", "{view}");
        assert_eq!(
            view["reason"], "kici-scaler restarted while the job ran",
            "{view}"
        );
        assert_eq!(view["agentId"], agent.as_str(), "{view}");
        assert!(view.get("exitCode").is_none(), "{view}");
        assert!(view.get("outputLost").is_none(), "{view}");
        let line = format!("line-{n}\n");
        assert_eq!(view["outputBytes"], line.len(), "{view}");
        let (stdout, end) = job_logs(&b, id, None);
        assert_eq!(stdout, line, "the output before the crash");
        assert_eq!(end.as_ref(), Some(&view), "the logs' end is the job");
    }
    let view = job(&b, &waiting);
    assert_eq!(
        (&view["state"], &view["end"]),
        (&Value::from("failed"), &Value::from("aborted"))
    );
    assert!(
        view["reason"]
            .as_str()
            .unwrap()
            .contains("before the job got an agent"),
        "{view}"
    );
    assert!(view.get("agentId").is_none(), "{view}");

    // Nothing of the started jobs' agents is left.
    for pid in &agent_pids {
        wait_until(&format!("agent process {pid} ends"), || process_gone(*pid));
    }
    for (agent, pid) in &before {
        wait_until(&format!("{agent} is destroyed"), || {
            process_gone(*pid)
                && !cgroups.join(agent).exists()
                && matches!(b.state_of(agent).as_str(), "" | "gone")
        });
    }
    assert!(b.agents().is_empty(), "{:?}", b.agents());
    b.terminate();
}

#[test]
fn serial_started_jobs_survive_kill_9_aborted_with_their_output_on_sqlite() {
    started_jobs_survive_kill_9(&[]);
}

#[test]
fn serial_started_jobs_survive_kill_9_aborted_with_their_output_on_postgres() {
    // The single-host job store on PostgreSQL (in a fleet, jobs wait in
    // the fleet's queue instead: see the fleet tests).
    let url = fresh_database(54329);
    started_jobs_survive_kill_9(&["--state", &url, "--no-fleet"]);
}
