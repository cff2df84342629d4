//! A fleet of real `kici-scaler serve` processes, each in a network
//! namespace of its own with its own address, state dir and instance id,
//! sharing one PostgreSQL server reachable from all of them over a bridge
//! the test makes (`10.213.77.0/24`; the server listens on the bridge's
//! address). Partitions are real: nftables drops a host's packets to the
//! database. Agents are bare-metal processes that record their own id, so
//! "served exactly once" is counted by the agents themselves.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use common::daemon::{http, pg, psql, wait_until, Daemon, Dir, BIN, PATIENCE};
use kici_scaler::jobs::HOST_LOST_WHILE_RUNNING;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::time::{Duration, Instant};

/// A private server: the tests stop and restart it with the bridge address.
const PG_PORT: u16 = 54349;
const SUBNET: &str = "10.213.77";
const TOKEN: &str = "fleet-test-token-0123456789abcdef0123";
/// The fleet key every host signs its calls to the others with.
const FLEET_KEY: &str = "fleet-test-fleet-key-0123456789abcdef0123";
/// Short leases keep failover tests quick: renewed every second.
const LEASE_SECONDS: &str = "3";

fn sh(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The hosts' network: one namespace per host, all joined by a bridge that
/// lives in a namespace of its own (the switch), and a veth from the switch
/// to the root namespace holding the subnet's gateway address (where the
/// test's PostgreSQL listens). Removed on drop.
///
/// The bridge is kept out of the root namespace so that the tests do not
/// depend on the host's firewall: once dockerd has loaded `br_netfilter`,
/// bridged frames in the root namespace go through iptables' `FORWARD` chain,
/// which dockerd sets to `DROP`, and the hosts could not reach each other. The
/// `bridge-nf-call-*` switches are per namespace; they are off in the
/// switch's, so frames between hosts never meet a firewall the test did not
/// write. Traffic to the gateway address ends in the root namespace (its
/// `INPUT`), never forwarded there.
struct Net {
    switch: String,
    namespaces: Vec<String>,
}

impl Net {
    fn new(hosts: usize) -> Net {
        Self::remove_leftovers();
        let tag = format!("{:06x}", rand::random::<u32>() & 0xff_ffff);
        let switch = format!("kfl{tag}-sw");
        sh(&["ip", "netns", "add", &switch]);
        let mut net = Net {
            switch: switch.clone(),
            namespaces: Vec::new(),
        };
        for key in [
            "net.bridge.bridge-nf-call-iptables",
            "net.bridge.bridge-nf-call-ip6tables",
            "net.bridge.bridge-nf-call-arptables",
        ] {
            // Absent when br_netfilter is not loaded: nothing to turn off.
            let path = format!("/proc/sys/{}", key.replace('.', "/"));
            if std::path::Path::new(&path).exists() {
                sh(&[
                    "ip",
                    "netns",
                    "exec",
                    &switch,
                    "sysctl",
                    "-q",
                    "-w",
                    &format!("{key}=0"),
                ]);
            }
        }
        let bridge = format!("kfl{tag}");
        sh(&[
            "ip", "-n", &switch, "link", "add", &bridge, "type", "bridge",
        ]);
        sh(&["ip", "-n", &switch, "link", "set", &bridge, "up"]);
        // The root namespace's leg: the gateway address the hosts reach
        // PostgreSQL at.
        let root_leg = format!("kfl{tag}r");
        let switch_leg = format!("kfl{tag}s");
        sh(&[
            "ip",
            "link",
            "add",
            &root_leg,
            "type",
            "veth",
            "peer",
            "name",
            &switch_leg,
            "netns",
            &switch,
        ]);
        sh(&[
            "ip",
            "-n",
            &switch,
            "link",
            "set",
            &switch_leg,
            "master",
            &bridge,
            "up",
        ]);
        sh(&[
            "ip",
            "addr",
            "add",
            &format!("{SUBNET}.1/24"),
            "dev",
            &root_leg,
        ]);
        sh(&["ip", "link", "set", &root_leg, "up"]);
        for i in 0..hosts {
            let ns = format!("kfl{tag}-{i}");
            sh(&["ip", "netns", "add", &ns]);
            net.namespaces.push(ns.clone());
            let outer = format!("kfl{tag}h{i}");
            let inner = format!("kfl{tag}n{i}");
            sh(&[
                "ip", "-n", &switch, "link", "add", &outer, "type", "veth", "peer", "name", &inner,
                "netns", &ns,
            ]);
            sh(&[
                "ip", "-n", &switch, "link", "set", &outer, "master", &bridge, "up",
            ]);
            let addr = format!("{}/24", net.addr(i));
            sh(&["ip", "-n", &ns, "addr", "add", &addr, "dev", &inner]);
            sh(&["ip", "-n", &ns, "link", "set", &inner, "up"]);
            sh(&["ip", "-n", &ns, "link", "set", "lo", "up"]);
        }
        net
    }

    /// The namespaces and bridge of an earlier fleet test killed before it
    /// could remove them (fleet tests run one at a time, so any found is
    /// dead): its bridge holds the subnet's gateway address, which would
    /// leave this test's hosts unable to reach the database.
    fn remove_leftovers() {
        let list = |args: &[&str]| {
            let out = Command::new("ip").args(args).output().unwrap();
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        for line in list(&["netns", "list"]).lines() {
            let ns = line.split_whitespace().next().unwrap_or_default();
            if ns.starts_with("kfl") {
                sh(&["ip", "netns", "delete", ns]);
            }
        }
        for line in list(&["-br", "link", "show", "type", "bridge"]).lines() {
            let dev = line.split_whitespace().next().unwrap_or_default();
            if dev.starts_with("kfl") {
                sh(&["ip", "link", "delete", dev]);
            }
        }
    }

    fn addr(&self, host: usize) -> String {
        format!("{SUBNET}.{}", 10 + host)
    }

    /// Drops every packet host `i` sends to the database (or lets them
    /// through again).
    fn partition(&self, host: usize, cut: bool) {
        let ns = &self.namespaces[host];
        if cut {
            let rules = format!(
                "table inet kfl_part {{ chain out {{ type filter hook output priority 0; ip daddr {SUBNET}.1 tcp dport {PG_PORT} drop; }}; }}"
            );
            let out = Command::new("ip")
                .args(["netns", "exec", ns, "nft", "-f", "-"])
                .stdin(std::process::Stdio::piped())
                .spawn()
                .and_then(|mut c| {
                    use std::io::Write;
                    c.stdin.take().unwrap().write_all(rules.as_bytes())?;
                    c.wait_with_output()
                })
                .unwrap();
            assert!(out.status.success());
        } else {
            sh(&[
                "ip", "netns", "exec", ns, "nft", "delete", "table", "inet", "kfl_part",
            ]);
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // The switch's namespace takes its bridge and every veth (the root
        // leg's peer included) with it.
        for ns in self.namespaces.iter().chain([&self.switch]) {
            let _ = Command::new("ip").args(["netns", "delete", ns]).status();
        }
    }
}

/// One host: its dir and (while it runs) its daemon.
struct Host {
    index: usize,
    addr: String,
    dir: Dir,
    daemon: Option<Daemon>,
}

impl Host {
    fn call(&self, method: &str, path: &str, body: Option<&str>) -> (u16, Value) {
        let auth = format!("Bearer {TOKEN}");
        let (status, text) = http(
            &format!("{}:7878", self.addr),
            method,
            path,
            &[("Authorization", &auth)],
            body,
        );
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    fn scale(&self, job: &str) -> (u16, Value) {
        let body = serde_json::json!({"jobId": job, "labels": ["local"]}).to_string();
        self.call("POST", "/v1/scale", Some(&body))
    }

    /// Its own live agents: id → (state, job id or "").
    fn agents_with_jobs(&self) -> BTreeMap<String, (String, String)> {
        let (status, v) = self.call("GET", "/v1/agents?local=true", None);
        if status != 200 {
            return BTreeMap::new();
        }
        v["agents"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| {
                (
                    a["agentId"].as_str().unwrap().to_owned(),
                    (
                        a["state"].as_str().unwrap().to_owned(),
                        a["jobId"].as_str().unwrap_or_default().to_owned(),
                    ),
                )
            })
            .collect()
    }

    /// Its own live agents: id → state.
    fn agents(&self) -> BTreeMap<String, String> {
        self.agents_with_jobs()
            .into_iter()
            .map(|(agent, (state, _))| (agent, state))
            .collect()
    }

    fn instance(&self) -> String {
        self.dir.instance()
    }
}

/// PostgreSQL, the network and the hosts.
struct Fleet {
    hosts: Vec<Host>,
    net: Net,
    /// The database as the hosts reach it.
    url: String,
    /// The same database from the test (loopback).
    local_url: String,
    /// Where every agent appends its id.
    record: tempfile::TempDir,
    /// Extra environment of every host's daemon.
    env: Vec<(&'static str, String)>,
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for h in &mut self.hosts {
            h.daemon.take();
        }
        pg("stop", PG_PORT);
    }
}

/// The agent: records its id, then waits to be destroyed.
fn agent_script(record: &std::path::Path) -> String {
    format!(
        "#!/bin/sh\necho \"$KICI_AGENT_ID\" >> {}\nexec sleep 1000\n",
        record.join("agents.log").display()
    )
}

/// `labels` of the pool `local` on this host, then `extra` (more
/// scalers).
fn config(
    agent: &std::path::Path,
    max_agents: u32,
    fleet_max: u32,
    labels: &str,
    extra: &str,
) -> String {
    format!(
        "version: 1\nscalers:\n  - name: local\n    type: bare-metal\n    maxAgents: {max_agents}\n    x-kici-scaler:\n      fleetMaxAgents: {fleet_max}\n    labelSets:\n      - labels: [{labels}]\n        binaryPath: {}\n{extra}",
        agent.display()
    )
}

/// The pool `jobs`: the real agent (which runs standalone jobs), two per
/// host, three in the fleet.
fn jobs_pool() -> String {
    format!(
        "  - name: jobs\n    type: bare-metal\n    maxAgents: 2\n    x-kici-scaler:\n      fleetMaxAgents: 3\n    labelSets:\n      - labels: [job]\n        binaryPath: {}\n",
        common::daemon::agent_lite_dir()
            .join("kici-agent-lite")
            .display()
    )
}

/// Starts the fleet's PostgreSQL server, listening on the bridge's address
/// (which must exist).
fn start_pg() {
    common::daemon::pg_with(
        "start",
        PG_PORT,
        &[("KICI_PG_LISTEN", &format!("{SUBNET}.1"))],
    );
}

impl Fleet {
    /// `n` hosts, each with `max_agents`, the pool capped at `fleet_max`
    /// fleet-wide; `labels[i]` overrides host i's label set.
    fn start(n: usize, max_agents: u32, fleet_max: u32, labels: &[&str]) -> Fleet {
        Self::start_with(n, max_agents, fleet_max, labels, "", &[])
    }

    /// [`Fleet::start`] with `extra` scalers and `env` on every host.
    fn start_with(
        n: usize,
        max_agents: u32,
        fleet_max: u32,
        labels: &[&str],
        extra: &str,
        env: &[(&'static str, &str)],
    ) -> Fleet {
        let net = Net::new(n);
        // The server listens on the bridge address, which exists now.
        pg("stop", PG_PORT);
        start_pg();
        let admin = pg("url", PG_PORT);
        let name = format!("kici_fleet_{:08x}", rand::random::<u32>());
        psql(&admin, &format!("CREATE DATABASE {name}"));
        let local_url = format!("postgres://postgres@127.0.0.1:{PG_PORT}/{name}");
        let url = format!("postgres://postgres@{SUBNET}.1:{PG_PORT}/{name}");
        let record = tempfile::tempdir().unwrap();
        let mut fleet = Fleet {
            hosts: Vec::new(),
            url,
            local_url,
            record,
            net,
            env: env.iter().map(|(k, v)| (*k, (*v).to_owned())).collect(),
        };
        for i in 0..n {
            let dir = Dir::with_config("");
            let agent = dir.write_script("agent.sh", &agent_script(fleet.record.path()));
            let labels = labels.get(i).copied().unwrap_or("local");
            std::fs::write(
                dir.path("scalers.yaml"),
                config(&agent, max_agents, fleet_max, labels, extra),
            )
            .unwrap();
            fleet.hosts.push(Host {
                index: i,
                addr: fleet.net.addr(i),
                dir,
                daemon: None,
            });
        }
        for i in 0..n {
            fleet.run(i);
        }
        fleet
    }

    /// Starts host `i`'s daemon in its namespace.
    fn run(&mut self, i: usize) {
        let host = &self.hosts[i];
        // nsenter, not `ip netns exec`: only the network namespace changes
        // (`ip netns exec` remounts /sys, hiding the cgroup hierarchy).
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net=/run/netns/{}", self.net.namespaces[i]))
            .args([BIN, "serve"]);
        cmd.arg("--config")
            .arg(host.dir.path("scalers.yaml"))
            .arg("--state-dir")
            .arg(host.dir.path("state"))
            .arg("--machine-ledger-dir")
            .arg(host.dir.path("ledger"))
            .args([
                "--gateway-listen",
                "127.0.0.1:0",
                "--listen",
                &format!("{}:7878", host.addr),
                "--state",
                &self.url,
                "--fleet-lease-seconds",
                LEASE_SECONDS,
                "--reconcile-interval-seconds",
                "1",
            ]);
        for (k, _) in std::env::vars() {
            if k.starts_with("KICI_") {
                cmd.env_remove(k);
            }
        }
        cmd.env("KICI_SCALER_API_TOKEN", TOKEN);
        cmd.env("KICI_SCALER_FLEET_KEY", FLEET_KEY);
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        // What a failure dump needs: the claim path's decisions.
        cmd.env(
            "KICI_SCALER_LOG",
            "info,kici_scaler::fleet=debug,kici_engine=debug",
        );
        let daemon = Daemon::spawn(cmd).unwrap_or_else(|s| panic!("host {i} died at start: {s:?}"));
        self.hosts[i].daemon = Some(daemon);
    }

    /// Fails the test on `what`, with every host's warnings, errors, fleet
    /// messages and lines about `job` logged so far, and its own agents.
    fn fail(&mut self, what: &str, job: &str) -> ! {
        for (i, h) in self.hosts.iter_mut().enumerate() {
            let (_, agents) = h.call("GET", "/v1/agents?local=true&all=true", None);
            eprintln!("host {i} agents: {agents}");
            let Some(d) = h.daemon.as_mut() else { continue };
            for line in d.lines_so_far() {
                let notable = line.contains("\"WARN\"")
                    || line.contains("\"ERROR\"")
                    || line.contains("fleet")
                    || line.contains(job);
                if notable {
                    eprintln!("host {i}: {line}");
                }
            }
        }
        panic!("never: {what}");
    }

    fn sql(&self, query: &str) -> Vec<String> {
        psql(&self.local_url, query)
    }

    /// Agent ids the agents recorded, with how often each recorded itself.
    fn recorded(&self) -> BTreeMap<String, usize> {
        let text =
            std::fs::read_to_string(self.record.path().join("agents.log")).unwrap_or_default();
        let mut m = BTreeMap::new();
        for line in text.lines().filter(|l| !l.is_empty()) {
            *m.entry(line.to_owned()).or_insert(0) += 1;
        }
        m
    }

    /// job → the agents (that ran, by their own record) started for it.
    fn agents_per_job(&self) -> BTreeMap<String, BTreeSet<String>> {
        let recorded = self.recorded();
        let mut per_job: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for row in self.sql("SELECT agent_id || ' ' || job_id FROM fleet_agents") {
            let (agent, job) = row.split_once(' ').unwrap();
            if recorded.contains_key(agent) {
                per_job
                    .entry(job.to_owned())
                    .or_default()
                    .insert(agent.to_owned());
            }
        }
        per_job
    }

    /// Every host's control API address.
    fn api_addrs(&self) -> Vec<String> {
        self.hosts
            .iter()
            .map(|h| format!("{}:7878", h.addr))
            .collect()
    }

    /// Each job had exactly one agent, and each agent recorded itself once.
    fn assert_one_agent_per_job(&self) {
        for (job, agents) in self.agents_per_job() {
            assert_eq!(agents.len(), 1, "{job}: {agents:?}");
        }
        let recorded = self.recorded();
        assert!(recorded.values().all(|n| *n == 1), "{recorded:?}");
    }

    /// The requests no agent ran for, each as `job state host agent
    /// outcome`.
    fn unserved(&self) -> Vec<String> {
        let ran = self.agents_per_job();
        self.sql(
            "SELECT job_id || ' ' || state || ' ' || coalesce(claimed_by, '-') || ' ' \
             || coalesce(agent_id, '-') || ' ' || coalesce(outcome, '-') FROM fleet_requests",
        )
        .into_iter()
        .filter(|row| !ran.contains_key(row.split(' ').next().unwrap_or_default()))
        .collect()
    }

    /// Claimed requests + live agents of the pool, as the caps count them.
    fn fleet_usage(&self) -> u64 {
        self.sql(
            "SELECT (SELECT count(*) FROM fleet_requests WHERE pool = 'local' AND state = 'claimed') \
                  + (SELECT count(*) FROM fleet_agents WHERE pool = 'local' AND state = 'live')",
        )[0]
            .parse()
            .unwrap()
    }

    /// Destroys every booted agent on every running host (their "job" is
    /// done), through the host that runs it.
    fn finish_booted(&self) -> usize {
        self.finish_booted_if(|_| true)
    }

    /// [`Fleet::finish_booted`] for the agents whose job `done` accepts:
    /// a repeat of a request sent after its agent ended is a new request.
    fn finish_booted_if(&self, done: impl Fn(&str) -> bool) -> usize {
        let all: Vec<usize> = (0..self.hosts.len()).collect();
        self.finish_booted_on_if(&all, done)
    }

    fn finish_booted_on(&self, hosts: &[usize]) -> usize {
        self.finish_booted_on_if(hosts, |_| true)
    }

    /// Only agents that recorded themselves are finished: an agent is
    /// `booted` as soon as its process exists, a moment before its command
    /// wrote the record that counts it as having served its job.
    fn finish_booted_on_if(&self, hosts: &[usize], done: impl Fn(&str) -> bool) -> usize {
        let recorded = self.recorded();
        let mut n = 0;
        for h in hosts
            .iter()
            .map(|i| &self.hosts[*i])
            .filter(|h| h.daemon.is_some())
        {
            for (agent, (state, job)) in h.agents_with_jobs() {
                if state == "booted" && done(&job) && recorded.contains_key(&agent) {
                    // Through the next host when it runs: the call is
                    // carried to the owner.
                    let next = &self.hosts[(h.index + 1) % self.hosts.len()];
                    let via = if next.daemon.is_some() { next } else { h };
                    let (status, body) = via.call("DELETE", &format!("/v1/agents/{agent}"), None);
                    assert!(status == 202 || status == 404, "{status} {body}");
                    if status == 202 {
                        n += 1;
                    }
                }
            }
        }
        n
    }
}

/// A standalone job's command: it appends `mark` to the record (so each
/// run counts itself), prints `out-<mark>` and holds its agent a moment.
fn job_body(record: &std::path::Path, mark: &str, hold: &str) -> String {
    serde_json::json!({
        "labels": ["job"],
        "command": ["sh", "-c", format!("echo \"$MARK\" >> {}; echo out-$MARK; sleep {hold}", record.join("jobs.log").display())],
        "env": {"MARK": mark},
    })
    .to_string()
}

impl Fleet {
    /// `n` hosts serving the `jobs` pool too (with `env`), once all are up.
    fn start_jobs(n: usize, env: &[(&'static str, &str)]) -> Fleet {
        let fleet = Self::start_with(n, 2, 2 * n as u32, &[], &jobs_pool(), env);
        wait_until("every host up", || {
            let (status, v) = fleet.hosts[0].call("GET", "/v1/fleet", None);
            status == 200 && v["hosts"].as_array().unwrap().len() == n
        });
        fleet
    }

    /// Posts through host `h` the job marked `mark` (see [`job_body`]),
    /// accepted: its id.
    fn post_job(&self, h: usize, mark: &str, hold: &str) -> String {
        let body = job_body(self.record.path(), mark, hold);
        let (status, answer) = self.hosts[h].call("POST", "/v1/jobs", Some(&body));
        assert_eq!(status, 202, "{answer}");
        answer["jobId"].as_str().unwrap().to_owned()
    }

    /// Job `id` as host `h` shows it.
    fn job(&self, h: usize, id: &str) -> Value {
        self.hosts[h].call("GET", &format!("/v1/jobs/{id}"), None).1
    }

    /// The index of the host that claimed job `id`.
    fn job_host(&self, id: &str) -> usize {
        let host = self.sql(&format!(
            "SELECT claimed_by FROM fleet_requests WHERE job_id = '{id}'"
        ));
        self.hosts
            .iter()
            .position(|h| h.instance() == host[0])
            .unwrap()
    }

    /// The marks the jobs' commands recorded, one line per run.
    fn job_runs(&self) -> String {
        std::fs::read_to_string(self.record.path().join("jobs.log")).unwrap_or_default()
    }

    /// How often the job marked `mark` ran.
    fn runs_of(&self, mark: &str) -> usize {
        self.job_runs().lines().filter(|l| *l == mark).count()
    }

    /// The `jobs` pool's live agents, as the database counts them.
    fn live_job_agents(&self) -> String {
        self.sql("SELECT count(*) FROM fleet_agents WHERE pool = 'jobs' AND state = 'live'")
            .remove(0)
    }
}

fn wait_long(what: &str, limit: Duration, f: impl FnMut() -> bool) {
    assert!(poll_until(limit, f), "never: {what}");
}

/// Whether `f` held within `limit` (polled every 50 ms).
fn poll_until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while !f() {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    true
}

#[test]
fn serial_fleet_three_hosts_serve_every_request_once_under_the_fleet_cap_in_order() {
    let mut fleet = Fleet::start(3, 3, 5, &[]);
    // Every host sees the same fleet: three hosts up, one leader.
    wait_until("one leader among three hosts", || {
        let (status, v) = fleet.hosts[2].call("GET", "/v1/fleet", None);
        status == 200
            && v["hosts"].as_array().unwrap().len() == 3
            && v["hosts"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|h| h["leader"] == true)
                .count()
                == 1
    });

    const JOBS: usize = 300;
    const CLIENTS: usize = 4;
    let addrs = fleet.api_addrs();
    let mut max_usage = 0;
    // Four clients send through random entry hosts (a deterministic spread
    // over the three), each request twice — the repeat through another
    // host is the same request: no second agent. Meanwhile this thread
    // ends the agents' "jobs" and samples the pool's usage in the database.
    let done = std::sync::atomic::AtomicUsize::new(0);
    // Jobs whose two sends are both answered: only their agents are ended
    // while clients still send.
    let posted = std::sync::Mutex::new(BTreeSet::new());
    std::thread::scope(|scope| {
        for client in 0..CLIENTS {
            let (addrs, done, posted) = (&addrs, &done, &posted);
            scope.spawn(move || {
                for n in (client..JOBS).step_by(CLIENTS) {
                    let job = format!("job-{n:03}");
                    let body = serde_json::json!({"jobId": job, "labels": ["local"]}).to_string();
                    let auth = format!("Bearer {TOKEN}");
                    let headers = [("Authorization", auth.as_str())];
                    for entry in [(n * 7 + n / 3) % 3, (n + 1) % 3] {
                        let (status, answer) =
                            http(&addrs[entry], "POST", "/v1/scale", &headers, Some(&body));
                        assert!(status == 202 || status == 200, "{job}: {status} {answer}");
                        let answer: Value = serde_json::from_str(&answer).unwrap();
                        assert!(
                            matches!(answer["result"].as_str(), Some("spawning" | "pending")),
                            "{answer}"
                        );
                    }
                    posted.lock().unwrap().insert(job);
                    done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            });
        }
        while done.load(std::sync::atomic::Ordering::Relaxed) < JOBS {
            max_usage = max_usage.max(fleet.fleet_usage());
            fleet.finish_booted_if(|job| posted.lock().unwrap().contains(job));
        }
    });
    // The rest are served as capacity frees; the cap holds throughout.
    let served = poll_until(PATIENCE * 6, || {
        max_usage = max_usage.max(fleet.fleet_usage());
        for h in &fleet.hosts {
            assert!(h.agents().len() <= 3, "host {} over its own cap", h.index);
        }
        fleet.finish_booted();
        fleet.agents_per_job().len() == JOBS
    });
    if !served {
        let left = fleet.unserved();
        fleet.fail(&format!("every request served (not: {left:?})"), "job-");
    }
    assert!(
        max_usage <= 5,
        "the pool's fleet cap was exceeded: {max_usage}"
    );

    fleet.assert_one_agent_per_job();
    // Work went to every host (spread).
    let per_host = fleet.sql("SELECT count(DISTINCT instance_id) FROM fleet_agents");
    assert_eq!(per_host, ["3"], "every host served some requests");
    // FIFO within the pool: claims follow arrival.
    let order = fleet.sql("SELECT job_id FROM fleet_requests ORDER BY claim_seq");
    let mut by_arrival = fleet.sql("SELECT job_id FROM fleet_requests ORDER BY seq");
    by_arrival.retain(|j| order.contains(j));
    if let Some((claimed, arrived)) = order.iter().zip(&by_arrival).find(|(a, b)| a != b) {
        let (claimed, arrived) = (claimed.clone(), arrived.clone());
        fleet.fail(
            &format!("claims follow arrival order ({claimed} was claimed where {arrived} arrived)"),
            &arrived,
        );
    }

    // One agent's view from a host that does not run it: carried to its
    // owner. An unknown agent is 404 from anywhere.
    let (status, v) = fleet.hosts[0].scale("probe");
    assert!(status == 202 || status == 200, "{v}");
    // The answer names the hosts serving the pool.
    let serving: BTreeSet<&str> = v["hosts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_str().unwrap())
        .collect();
    let every: BTreeSet<String> = fleet.hosts.iter().map(|h| h.instance()).collect();
    assert_eq!(serving, every.iter().map(String::as_str).collect(), "{v}");
    let mut found = None;
    wait_long("the probe's agent boots", PATIENCE, || {
        found = fleet.hosts.iter().find_map(|h| {
            h.agents()
                .into_iter()
                .find(|(_, s)| s == "booted")
                .map(|(a, _)| (h.index, a))
        });
        found.is_some()
    });
    let (owner, agent) = found.unwrap();
    let (status, view) =
        fleet.hosts[(owner + 1) % 3].call("GET", &format!("/v1/agents/{agent}"), None);
    assert_eq!(status, 200, "{view}");
    assert_eq!(view["agentId"], agent.as_str());
    let (status, _) = fleet.hosts[0].call("GET", "/v1/agents/scaler-bare-metal-00000000", None);
    assert_eq!(status, 404);

    // Any host lists the whole fleet's agents, each with its host; with
    // `local=true`, only its own.
    let other = &fleet.hosts[(owner + 1) % 3];
    let (status, list) = other.call("GET", "/v1/agents", None);
    assert_eq!(status, 200, "{list}");
    assert!(list.get("unreachableHosts").is_none(), "{list}");
    let hosts: BTreeMap<String, String> = list["agents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["agentId"].as_str().unwrap().to_owned(),
                a["host"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        hosts.get(&agent),
        Some(&fleet.hosts[owner].dir.instance()),
        "{list}"
    );
    let instances: Vec<String> = fleet.hosts.iter().map(|h| h.dir.instance()).collect();
    assert!(hosts.values().all(|h| instances.contains(h)), "{list}");
    assert!(!other.agents().contains_key(&agent));

    // `route --server` names the hosts that serve the chosen scaler.
    let out = fleet.hosts[0]
        .dir
        .command(&["route", "--labels", "local", "--json", "--server"])
        .arg(format!("http://{}:7878", fleet.hosts[2].addr))
        .arg("--config")
        .arg(fleet.hosts[0].dir.path("scalers.yaml"))
        .env("KICI_SCALER_API_TOKEN", TOKEN)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let route: Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut served_by: Vec<String> = route["hosts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_str().unwrap().to_owned())
        .collect();
    served_by.sort();
    let mut expected = instances.clone();
    expected.sort();
    assert_eq!(served_by, expected, "{route}");

    // A body that differs for a known job id is a conflict, from any host.
    let (status, body) = fleet.hosts[1].call(
        "POST",
        "/v1/scale",
        Some(r#"{"jobId":"job-000","labels":["local"],"runId":"other"}"#),
    );
    assert_eq!(status, 409, "{body}");

    // The metrics show the fleet.
    let (_, text) = http(
        &format!("{}:7878", fleet.hosts[0].addr),
        "GET",
        "/metrics",
        &[("Authorization", &format!("Bearer {TOKEN}"))],
        None,
    );
    assert!(
        text.contains("kici_orch_scaler_fleet_hosts{state=\"up\"} 3"),
        "{text}"
    );
    let claims: f64 = common::daemon::metric(
        &text,
        "kici_orch_scaler_fleet_claims_total",
        "result=\"started\"",
    );
    assert!(claims >= 1.0, "{text}");
}

#[test]
fn serial_fleet_kill_9_of_a_host_moves_its_unregistered_work_and_fences_it_on_return() {
    let mut fleet = Fleet::start(3, 2, 6, &[]);
    // Two agents on every host (spread): six booted, none registered.
    for n in 0..6 {
        let (status, answer) = fleet.hosts[n % 3].scale(&format!("j{n}"));
        assert!(status == 202 || status == 200, "{answer}");
    }
    wait_long("six agents booted", PATIENCE, || {
        fleet
            .hosts
            .iter()
            .map(|h| h.agents().values().filter(|s| *s == "booted").count())
            .sum::<usize>()
            == 6
    });
    // The victim is the leader: leadership must move too, and the new
    // leader do the chores.
    let leader_id = fleet.sql("SELECT leader FROM fleet_fleets")[0].clone();
    let victim = fleet
        .hosts
        .iter()
        .position(|h| h.instance() == leader_id)
        .expect("the leader is a host");
    let victim_id = fleet.hosts[victim].instance();
    let victims: BTreeSet<String> = fleet.hosts[victim].agents().into_keys().collect();
    assert_eq!(victims.len(), 2, "spread put two on each host");
    let moved: BTreeSet<String> = fleet
        .sql(&format!(
            "SELECT job_id FROM fleet_agents WHERE instance_id = '{victim_id}'"
        ))
        .into_iter()
        .collect();
    // Room for them elsewhere: the other hosts' jobs end.
    let others: Vec<usize> = (0..3).filter(|i| *i != victim).collect();
    fleet.finish_booted_on(&others);

    let killed = Instant::now();
    fleet.hosts[victim].daemon.as_mut().unwrap().kill9();
    // Its requests (agents never registered) are served by the others.
    wait_long(
        "the lost host's requests are served elsewhere",
        PATIENCE,
        || {
            fleet
            .sql(&format!(
                "SELECT job_id FROM fleet_agents WHERE state = 'live' AND instance_id <> '{victim_id}'"
            ))
            .into_iter()
            .filter(|j| moved.contains(j))
            .count()
            == moved.len()
        },
    );
    let took = killed.elapsed();
    // Lease 3 s, the new leader's wait of one lease, chores every second,
    // plus the new spawn.
    assert!(took < Duration::from_secs(3 + 4), "failover took {took:?}");
    let new_leader = fleet.sql("SELECT leader FROM fleet_fleets")[0].clone();
    assert_ne!(new_leader, victim_id, "leadership moved");
    let (_, v) = fleet.hosts[others[0]].call("GET", "/v1/fleet", None);
    let lost: Vec<&Value> = v["hosts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|h| h["state"] == "lost")
        .collect();
    assert_eq!(lost.len(), 1, "{v}");
    assert_eq!(lost[0]["instanceId"], victim_id.as_str());

    // Back: it rejoins under a new epoch and destroys the agents whose
    // requests moved; no job ever has two live agents.
    fleet.run(victim);
    wait_long(
        "the returning host destroys its moved agents",
        PATIENCE,
        || {
            let now: BTreeSet<String> = fleet.hosts[victim].agents().into_keys().collect();
            now.is_disjoint(&victims)
        },
    );
    let doubles = fleet.sql(
        "SELECT job_id FROM fleet_agents WHERE state = 'live' GROUP BY job_id HAVING count(*) > 1",
    );
    assert!(doubles.is_empty(), "jobs with two live agents: {doubles:?}");
    let epoch = fleet.sql(&format!(
        "SELECT epoch FROM fleet_hosts WHERE instance_id = '{victim_id}'"
    ));
    assert_eq!(epoch, ["2"], "rejoined under a new epoch");
}

#[test]
fn serial_fleet_partitioned_host_stops_claiming_and_destroys_moved_agents_when_healed() {
    let mut fleet = Fleet::start(2, 2, 4, &[]);
    for n in 0..2 {
        let (status, answer) = fleet.hosts[0].scale(&format!("p{n}"));
        assert!(status == 202 || status == 200, "{answer}");
    }
    wait_long("two agents booted", PATIENCE, || {
        fleet
            .hosts
            .iter()
            .map(|h| h.agents().values().filter(|s| *s == "booted").count())
            .sum::<usize>()
            == 2
    });
    let cut_id = fleet.hosts[0].instance();
    let before: BTreeSet<String> = fleet.hosts[0].agents().into_keys().collect();
    let moved: BTreeSet<String> = fleet
        .sql(&format!(
            "SELECT job_id FROM fleet_agents WHERE instance_id = '{cut_id}'"
        ))
        .into_iter()
        .collect();
    assert!(!moved.is_empty());
    fleet.net.partition(0, true);
    // The other host serves what the cut host held, once its lease expired.
    wait_long(
        "the cut host's requests are served by the other",
        PATIENCE,
        || {
            fleet
                .sql(&format!(
                "SELECT job_id FROM fleet_agents WHERE state = 'live' AND instance_id <> '{cut_id}'"
            ))
                .into_iter()
                .filter(|j| moved.contains(j))
                .count()
                == moved.len()
        },
    );
    // The cut host's fence closed: it answers new requests 503 (it cannot
    // record them) rather than starting anything.
    let (status, _) = fleet.hosts[0].scale("during-partition");
    assert_eq!(status, 503);
    // And it started nothing while cut off.
    let during: BTreeSet<String> = fleet.hosts[0].agents().into_keys().collect();
    assert!(
        during.is_subset(&before),
        "started while cut off: {during:?} vs {before:?}"
    );
    fleet.net.partition(0, false);
    wait_long("healed: the moved agents are destroyed", PATIENCE, || {
        let now: BTreeSet<String> = fleet.hosts[0].agents().into_keys().collect();
        now.is_disjoint(&before)
    });
    let doubles = fleet.sql(
        "SELECT job_id FROM fleet_agents WHERE state = 'live' GROUP BY job_id HAVING count(*) > 1",
    );
    assert!(doubles.is_empty(), "jobs with two live agents: {doubles:?}");
    let _ = &mut fleet;
}

#[test]
fn serial_fleet_sigterm_leaves_keeping_the_queue_and_a_pool_defined_differently_is_refused() {
    let mut fleet = Fleet::start(2, 1, 4, &["local, other"]);
    // Host 1 defines `local` differently: it joined without the pool.
    let (status, v) = fleet.hosts[1].call("GET", "/v1/fleet", None);
    assert_eq!(status, 200, "{v}");
    let refused = v["refusedPools"].as_array().unwrap();
    assert_eq!(refused.len(), 1, "{v}");
    assert!(refused[0].as_str().unwrap().contains("pool `local`"), "{v}");
    let host1 = v["hosts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["instanceId"] == fleet.hosts[1].instance().as_str())
        .unwrap()
        .clone();
    assert_eq!(host1["pools"], serde_json::json!([]), "{v}");
    let pools = v["pools"].as_array().unwrap();
    assert_eq!(pools.len(), 1);
    assert_eq!(
        pools[0]["hosts"].as_array().unwrap().len(),
        1,
        "only host 0 serves it"
    );

    // Host 0 (capacity 1) holds one agent; two more wait in the queue.
    // SIGTERM: it leaves, its row says so, and the queue keeps the waiting
    // requests for whoever serves the pool next.
    for n in 0..3 {
        let (status, _) = fleet.hosts[1].scale(&format!("t{n}"));
        assert!(status == 200 || status == 202);
    }
    // Started, not just claimed: a claim not yet bound to its agent would be
    // handed back by the SIGTERM (and its agent never created).
    wait_long("t0 started on host 0", PATIENCE, || {
        fleet.sql("SELECT state FROM fleet_requests WHERE job_id = 't0'") == ["started"]
    });
    let id0 = fleet.hosts[0].instance();
    fleet.hosts[0].daemon.take().unwrap().terminate();
    let state = fleet.sql(&format!(
        "SELECT state FROM fleet_hosts WHERE instance_id = '{id0}'"
    ));
    assert_eq!(state, ["left"]);
    let queued = fleet.sql("SELECT job_id FROM fleet_requests WHERE state = 'queued' ORDER BY seq");
    assert_eq!(queued, ["t1", "t2"], "nothing acknowledged is lost");
    let t0 = fleet.sql("SELECT state || ' ' || outcome FROM fleet_requests WHERE job_id = 't0'");
    assert_eq!(t0, ["finished host shut down"]);
    // Back: it serves the queue in order.
    fleet.run(0);
    wait_long("t1 is served after the restart", PATIENCE, || {
        fleet.sql("SELECT state FROM fleet_requests WHERE job_id = 't1'") == ["started"]
    });
}

#[test]
fn serial_fleet_rolling_restart_under_load_loses_nothing_and_serves_nothing_twice() {
    let mut fleet = Fleet::start(3, 2, 6, &[]);
    let mut next_job = 0;
    let mut submitted = Vec::new();
    let mut submit = |fleet: &Fleet, n: usize| {
        for _ in 0..n {
            let job = format!("r{next_job:03}");
            next_job += 1;
            // Any running host takes it.
            let (status, answer) = fleet
                .hosts
                .iter()
                .filter(|h| h.daemon.is_some())
                .map(|h| h.scale(&job))
                .find(|(status, _)| *status == 200 || *status == 202)
                .expect("some host answers");
            assert!(status == 200 || status == 202, "{answer}");
            submitted.push(job);
        }
    };
    submit(&fleet, 6);
    for i in 0..3 {
        fleet.finish_booted();
        submit(&fleet, 4);
        fleet.hosts[i].daemon.take().unwrap().terminate();
        submit(&fleet, 4);
        fleet.finish_booted();
        fleet.run(i);
    }
    let total = submitted.len();
    // Every acknowledged request got an agent (served, or ended by its
    // host's shutdown), and none got two.
    wait_long("every request got its agent", PATIENCE * 2, || {
        fleet.finish_booted();
        fleet.sql("SELECT count(DISTINCT job_id) FROM fleet_agents")[0] == total.to_string()
    });
    let doubles = fleet.sql("SELECT job_id FROM fleet_agents GROUP BY job_id HAVING count(*) > 1");
    assert!(doubles.is_empty(), "served twice: {doubles:?}");
    let unknown =
        fleet.sql("SELECT count(*) FROM fleet_requests WHERE state IN ('queued', 'claimed')");
    assert_eq!(unknown, ["0"]);
}

/// The same request sent to one host by several clients at once, while
/// that host's claim loop may be serving it: whichever path admits it
/// first, the other never undoes that admission, and every request ends
/// with exactly one agent — none is left claimed with no agent.
#[test]
fn serial_fleet_concurrent_repeats_of_one_request_start_it_once() {
    let mut fleet = Fleet::start(2, 2, 4, &[]);
    const JOBS: usize = 40;
    const CLIENTS: usize = 8;
    let addrs = fleet.api_addrs();
    std::thread::scope(|scope| {
        for _ in 0..CLIENTS {
            let addrs = &addrs;
            scope.spawn(move || {
                for n in 0..JOBS {
                    let job = format!("race-{n:02}");
                    let body = serde_json::json!({"jobId": job, "labels": ["local"]}).to_string();
                    let auth = format!("Bearer {TOKEN}");
                    let headers = [("Authorization", auth.as_str())];
                    let (status, answer) =
                        http(&addrs[n % 2], "POST", "/v1/scale", &headers, Some(&body));
                    assert!(status == 202 || status == 200, "{job}: {status} {answer}");
                }
            });
        }
    });
    // Only now are agents' "jobs" ended: a repeat arriving after its
    // request finished would rightly be a new request.
    let served = poll_until(PATIENCE, || {
        fleet.finish_booted();
        fleet.agents_per_job().len() == JOBS
    });
    if !served {
        let left = fleet.unserved();
        fleet.fail(
            &format!("every request ran an agent (not: {left:?})"),
            "race-",
        );
    }
    fleet.assert_one_agent_per_job();
    // Served by the entry and claim paths themselves, not healed by the
    // sweep that gives back claims no agent took.
    for h in &mut fleet.hosts {
        let d = h.daemon.as_mut().unwrap();
        let orphaned: Vec<String> = d
            .lines_so_far()
            .into_iter()
            .filter(|l| l.contains("a claim no agent took is given back"))
            .collect();
        assert!(orphaned.is_empty(), "host {}: {orphaned:?}", h.index);
    }
}

#[test]
fn serial_fleet_database_restart_answers_503_fast_and_heals_without_restarting_hosts() {
    let mut fleet = Fleet::start(2, 2, 4, &[]);
    let (status, answer) = fleet.hosts[0].scale("before");
    assert!(status == 202 || status == 200, "{answer}");
    wait_long("before's agent boots", PATIENCE, || {
        fleet
            .hosts
            .iter()
            .any(|h| h.agents().values().any(|s| s == "booted"))
    });
    pg("stop", PG_PORT);
    for h in &fleet.hosts {
        let asked = Instant::now();
        let (status, body) = h.scale("during");
        assert_eq!(status, 503, "{body}");
        assert!(
            asked.elapsed() < Duration::from_secs(5),
            "503 took {:?}",
            asked.elapsed()
        );
    }
    start_pg();
    // Both hosts serve again, without a restart; the agent that ran through
    // the outage is still the only one of its job.
    let served = poll_until(PATIENCE, || {
        let (status, _) = fleet.hosts[1].scale("after");
        (status == 200 || status == 202)
            && fleet.sql("SELECT state FROM fleet_requests WHERE job_id = 'after'") == ["started"]
    });
    if !served {
        let row = fleet.sql("SELECT state || ' ' || coalesce(claimed_by, '-') FROM fleet_requests WHERE job_id = 'after'");
        let hosts =
            fleet.sql("SELECT instance_id || ' ' || state || ' ' || epoch FROM fleet_hosts");
        fleet.fail(
            &format!("after is served (request: {row:?}; hosts: {hosts:?})"),
            "after",
        );
    }
    let before =
        fleet.sql("SELECT count(*) FROM fleet_agents WHERE job_id = 'before' AND state = 'live'");
    assert_eq!(before, ["1"]);
    let lost = fleet.sql("SELECT count(*) FROM fleet_hosts WHERE state = 'lost'");
    assert_eq!(
        lost,
        ["0"],
        "no host was declared lost for the database's outage"
    );
}

/// Reads `GET /v1/events` from `addr` in the background: everything
/// that arrived so far, as raw SSE text.
fn watch_events(addr: &str) -> std::sync::Arc<std::sync::Mutex<String>> {
    use std::io::{Read, Write};
    let seen = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let req =
        format!("GET /v1/events HTTP/1.0\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n");
    s.write_all(req.as_bytes()).unwrap();
    let sink = std::sync::Arc::clone(&seen);
    std::thread::spawn(move || {
        let mut buf = [0u8; 8192];
        while let Ok(k) = s.read(&mut buf) {
            if k == 0 {
                return;
            }
            sink.lock()
                .unwrap()
                .push_str(&String::from_utf8_lossy(&buf[..k]));
        }
    });
    seen
}

#[test]
fn serial_fleet_standalone_jobs_through_any_host_run_once_in_order_under_the_cap() {
    let mut fleet = Fleet::start_jobs(3, &[]);
    // Any host's status and events show the whole fleet.
    let instances: BTreeSet<String> = fleet.hosts.iter().map(|h| h.instance()).collect();
    wait_until("host 1's status lists the other two hosts", || {
        let (status, v) = fleet.hosts[1].call("GET", "/v1/status", None);
        let others: BTreeSet<String> = v["hosts"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|h| h["instanceId"].as_str().unwrap().to_owned())
                    .collect()
            })
            .unwrap_or_default();
        status == 200
            && others.len() == 2
            && !others.contains(&fleet.hosts[1].instance())
            && others.is_subset(&instances)
    });
    let (_, own) = fleet.hosts[1].call("GET", "/v1/status?local=true", None);
    assert!(own.get("hosts").is_none(), "{own}");
    let events = watch_events(&fleet.api_addrs()[0]);
    // The stream follows its peers once it has found them.
    std::thread::sleep(Duration::from_secs(3));
    const JOBS: usize = 60;
    const CLIENTS: usize = 4;
    let record = fleet.record.path().to_owned();
    let addrs = fleet.api_addrs();
    let ids = std::sync::Mutex::new(BTreeMap::new());
    let done = std::sync::atomic::AtomicUsize::new(0);
    let mut max_usage = 0u64;
    let usage = |f: &Fleet| -> u64 {
        f.sql(
            "SELECT (SELECT count(*) FROM fleet_requests WHERE pool = 'jobs' AND state = 'claimed') \
                  + (SELECT count(*) FROM fleet_agents WHERE pool = 'jobs' AND state = 'live')",
        )[0]
            .parse()
            .unwrap()
    };
    // Four clients submit through entry hosts spread over the three; this
    // thread samples the pool's usage in the database meanwhile.
    std::thread::scope(|scope| {
        for client in 0..CLIENTS {
            let (addrs, ids, done, record) = (&addrs, &ids, &done, &record);
            scope.spawn(move || {
                for n in (client..JOBS).step_by(CLIENTS) {
                    let auth = format!("Bearer {TOKEN}");
                    let body = job_body(record, &format!("m{n:02}"), "0.2");
                    let (status, answer) = http(
                        &addrs[(n * 7 + n / 3) % 3],
                        "POST",
                        "/v1/jobs",
                        &[("Authorization", &auth)],
                        Some(&body),
                    );
                    assert_eq!(status, 202, "{answer}");
                    let answer: Value = serde_json::from_str(&answer).unwrap();
                    assert_eq!(answer["state"], "pending", "{answer}");
                    let id = answer["jobId"].as_str().unwrap().to_owned();
                    ids.lock().unwrap().insert(n, id);
                    done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            });
        }
        while done.load(std::sync::atomic::Ordering::Relaxed) < JOBS {
            max_usage = max_usage.max(usage(&fleet));
        }
    });
    let ids = ids.into_inner().unwrap();
    // Each ends succeeded, seen from a host chosen apart from where it ran.
    let finished = poll_until(PATIENCE * 4, || {
        max_usage = max_usage.max(usage(&fleet));
        fleet.sql("SELECT count(*) FROM fleet_requests WHERE kind = 'job' AND state = 'finished'")
            == [JOBS.to_string()]
    });
    if !finished {
        let left = fleet.sql(
            "SELECT job_id || ' ' || state || ' ' || coalesce(claimed_by, '-') FROM fleet_requests \
             WHERE kind = 'job' AND state <> 'finished'",
        );
        fleet.fail(&format!("every job finished (not: {left:?})"), "job-");
    }
    assert!(
        max_usage <= 3,
        "the pool's fleet cap was exceeded: {max_usage}"
    );
    let ran_on: BTreeMap<String, String> = fleet
        .sql("SELECT job_id || ' ' || claimed_by FROM fleet_requests WHERE kind = 'job'")
        .into_iter()
        .map(|row| {
            let (job, host) = row.split_once(' ').unwrap();
            (job.to_owned(), host.to_owned())
        })
        .collect();
    for (n, id) in &ids {
        let (status, view) = fleet.hosts[n % 3].call("GET", &format!("/v1/jobs/{id}"), None);
        assert_eq!(status, 200, "{view}");
        assert_eq!(view["state"], "succeeded", "{view}");
        assert_eq!(view["exitCode"], 0, "{view}");
        assert_eq!(
            view["host"].as_str(),
            ran_on.get(id).map(String::as_str),
            "{view}"
        );
    }
    // Every job ran exactly once, by its own record; every host ran some.
    let text = fleet.job_runs();
    let mut runs: BTreeMap<&str, usize> = BTreeMap::new();
    for line in text.lines() {
        *runs.entry(line).or_default() += 1;
    }
    assert_eq!(runs.len(), JOBS, "{runs:?}");
    assert!(runs.values().all(|n| *n == 1), "{runs:?}");
    assert_eq!(
        fleet.sql("SELECT count(DISTINCT claimed_by) FROM fleet_requests WHERE kind = 'job'"),
        ["3"]
    );
    // FIFO within the pool; no secret outlives its job.
    let order =
        fleet.sql("SELECT job_id FROM fleet_requests WHERE pool = 'jobs' ORDER BY claim_seq");
    let by_arrival =
        fleet.sql("SELECT job_id FROM fleet_requests WHERE pool = 'jobs' ORDER BY seq");
    assert_eq!(order, by_arrival, "claims follow arrival order");
    assert_eq!(
        fleet.sql("SELECT count(*) FROM fleet_requests WHERE secret IS NOT NULL"),
        ["0"]
    );
    // Host 0's event stream carried every host's agent transitions.
    let text = events.lock().unwrap().clone();
    let mut buffer = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    let hosts_seen: BTreeSet<String> = common::take_sse_events(&mut buffer)
        .into_iter()
        .filter(|e| e.event == "agent-transition")
        .map(|e| e.data["host"].as_str().unwrap_or("none").to_owned())
        .collect();
    assert_eq!(hosts_seen, instances, "{text}");

    // The log stream, from a host that does not run the job, from the
    // moment the job is queued to its end.
    let id = fleet.post_job(0, "streamed", "0.5");
    let stream = http(
        &addrs[1],
        "GET",
        &format!("/v1/jobs/{id}/logs"),
        &[("Authorization", &format!("Bearer {TOKEN}"))],
        None,
    );
    assert_eq!(stream.0, 200, "{}", stream.1);
    assert!(stream.1.contains("event: output"), "{}", stream.1);
    // `out-streamed\n`, base64.
    assert!(stream.1.contains("b3V0LXN0cmVhbWVk"), "{}", stream.1);
    assert!(stream.1.contains("event: end"), "{}", stream.1);
    assert!(stream.1.contains("\"succeeded\""), "{}", stream.1);

    // `run --server` works the same through any host.
    let out = fleet.hosts[0]
        .dir
        .command(&["run", "--labels", "job", "--server"])
        .arg(format!("http://{}", addrs[2]))
        .args(["--", "sh", "-c", "echo from-run; exit 3"])
        .env("KICI_SCALER_API_TOKEN", TOKEN)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("from-run"));

    // A queued job cancelled through any host never runs; a running one
    // is cancelled on its host. With the pool full of long jobs, one more
    // waits in the queue.
    let long: Vec<String> = (0..4)
        .map(|n| fleet.post_job(n % 3, &format!("long{n}"), "1000"))
        .collect();
    let state_of = |f: &Fleet, id: &str| {
        f.job(2, id)["state"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    wait_long("three long jobs run", PATIENCE, || {
        long.iter()
            .filter(|id| state_of(&fleet, id) == "running")
            .count()
            == 3
    });
    let waiting = long
        .iter()
        .find(|id| state_of(&fleet, id) == "pending")
        .unwrap()
        .clone();
    let (status, v) = fleet.hosts[1].call("DELETE", &format!("/v1/jobs/{waiting}"), None);
    assert_eq!(
        (status, v["state"].as_str()),
        (202, Some("cancelled")),
        "{v}"
    );
    for id in long.iter().filter(|id| **id != waiting) {
        let (status, v) = fleet.hosts[0].call("DELETE", &format!("/v1/jobs/{id}"), None);
        assert_eq!(
            (status, v["state"].as_str()),
            (202, Some("cancelled")),
            "{v}"
        );
    }
    wait_long(
        "the cancelled jobs end and their agents go",
        PATIENCE,
        || {
            fleet.live_job_agents() == "0"
                && long.iter().all(|id| state_of(&fleet, id) == "cancelled")
        },
    );
    let text = fleet.job_runs();
    let waited = long.iter().position(|id| *id == waiting).unwrap();
    assert!(
        !text.lines().any(|l| l == format!("long{waited}")),
        "a cancelled queued job ran: {text}"
    );
    assert_eq!(
        text.lines().filter(|l| l.starts_with("long")).count(),
        3,
        "only the running long jobs ran: {text}"
    );
}

#[test]
fn serial_fleet_standalone_job_on_a_killed_host_ends_aborted_host_lost() {
    let mut fleet = Fleet::start_jobs(3, &[]);
    let id = fleet.post_job(0, "doomed", "1000");
    wait_long("the job runs", PATIENCE, || {
        fleet.job(1, &id)["state"] == "running"
    });
    let owner = fleet.job_host(&id);
    fleet.hosts[owner].daemon.as_mut().unwrap().kill9();
    common::daemon::kill_instance_cgroups(&fleet.hosts[owner].instance());
    let other = (owner + 1) % 3;
    let t = Instant::now();
    wait_long("the job ends aborted (host lost)", PATIENCE, || {
        let v = fleet.job(other, &id);
        v["state"] == "failed"
            && v["end"] == "aborted"
            && v["reason"]
                .as_str()
                .is_some_and(|r| r.starts_with("host lost"))
    });
    let lease: u64 = LEASE_SECONDS.parse().unwrap();
    assert!(
        t.elapsed() < Duration::from_secs(lease + 5),
        "aborted only after {:?}",
        t.elapsed()
    );
    // It ran once and is not run again elsewhere.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(fleet.runs_of("doomed"), 1, "{}", fleet.job_runs());
    assert_eq!(
        fleet.sql(&format!(
            "SELECT secret IS NULL FROM fleet_requests WHERE job_id = '{id}'"
        )),
        ["t"]
    );
    // One reason, wherever it is read: the queue's outcome, any host's view
    // and, once it is back, the lost host's own (its book, restored after
    // the kill, answers for the job on every host again).
    assert_eq!(
        fleet.sql(&format!(
            "SELECT outcome FROM fleet_requests WHERE job_id = '{id}'"
        )),
        [kici_fleet::HOST_LOST]
    );
    assert_eq!(fleet.job(other, &id)["reason"], HOST_LOST_WHILE_RUNNING);
    fleet.run(owner);
    wait_long("the lost host is back", PATIENCE, || {
        fleet.hosts[owner].call("GET", "/v1/fleet", None).0 == 200
    });
    for h in [owner, other] {
        let v = fleet.job(h, &id);
        assert_eq!(
            (&v["state"], &v["end"], &v["reason"]),
            (
                &Value::from("failed"),
                &Value::from("aborted"),
                &Value::from(HOST_LOST_WHILE_RUNNING)
            ),
            "host {h}: {v}"
        );
    }
}

/// The database refuses the first write of a registration (a failpoint,
/// as a transient error would), then the host that ran the job is killed:
/// the registration was recorded before the agent got its job (retried, not
/// fire-and-forget), so the fleet knows the job ran on the lost host and
/// does not run it again elsewhere.
#[test]
fn serial_fleet_a_registration_the_database_refused_once_is_recorded_and_the_job_runs_once() {
    let mut fleet = Fleet::start_jobs(
        3,
        &[(
            "KICI_SCALER_FAIL_AT",
            "kici_scaler::registration::record=1*return",
        )],
    );
    let id = fleet.post_job(0, "refused-once", "1000");
    wait_long("the job runs", PATIENCE, || {
        fleet.job(1, &id)["state"] == "running"
    });
    let owner = fleet.job_host(&id);
    let injected = fleet.hosts[owner]
        .daemon
        .as_mut()
        .unwrap()
        .lines_so_far()
        .iter()
        .any(|l| l.contains("recording a registration failed"));
    assert!(injected, "the failpoint refused the first write");
    assert_eq!(
        fleet.sql(&format!(
            "SELECT a.registered_at IS NOT NULL FROM fleet_agents a JOIN fleet_requests r \
             ON r.agent_id = a.agent_id WHERE r.job_id = '{id}'"
        )),
        ["t"],
        "the registration is recorded before the job runs"
    );
    fleet.hosts[owner].daemon.as_mut().unwrap().kill9();
    common::daemon::kill_instance_cgroups(&fleet.hosts[owner].instance());
    let other = (owner + 1) % 3;
    wait_long("the job ends aborted (host lost)", PATIENCE, || {
        let v = fleet.job(other, &id);
        v["state"] == "failed" && v["end"] == "aborted"
    });
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(fleet.runs_of("refused-once"), 1, "{}", fleet.job_runs());
}

#[test]
fn serial_fleet_standalone_job_on_a_host_restarted_at_once_ends_aborted_and_runs_once() {
    let mut fleet = Fleet::start_jobs(3, &[]);
    let id = fleet.post_job(0, "restarted", "1000");
    wait_long("the job runs", PATIENCE, || {
        fleet.job(1, &id)["state"] == "running"
    });
    let owner = fleet.job_host(&id);
    // Back before its lease can lapse: the host itself settles the job it
    // held (its agent did not survive the restart).
    fleet.hosts[owner].daemon.as_mut().unwrap().kill9();
    fleet.run(owner);
    let other = (owner + 1) % 3;
    wait_long("the job ends aborted", PATIENCE, || {
        let v = fleet.job(other, &id);
        v["state"] == "failed" && v["end"] == "aborted"
    });
    let v = fleet.job(other, &id);
    // Its host died while it ran: the same reason as when the leader
    // gives the job up, in the view and in the queue's outcome (the view
    // the host recorded).
    assert_eq!(v["reason"], HOST_LOST_WHILE_RUNNING, "{v}");
    assert_eq!(
        fleet.sql(&format!(
            "SELECT state, outcome::json->>'reason' FROM fleet_requests WHERE job_id = '{id}'"
        )),
        [format!("finished|{HOST_LOST_WHILE_RUNNING}")]
    );
    wait_long("no agent of the pool is left", PATIENCE, || {
        fleet.live_job_agents() == "0" && fleet.hosts[owner].agents().is_empty()
    });
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(fleet.runs_of("restarted"), 1, "{}", fleet.job_runs());
}

#[test]
fn serial_fleet_a_job_waiting_past_the_pending_ttl_ends_aborted() {
    let fleet = Fleet::start_jobs(3, &[("KICI_SCALER_PENDING_TTL_SECONDS", "2")]);
    // The pool's fleet cap is three: the fourth long job waits.
    let ids: Vec<String> = (0..4)
        .map(|n| fleet.post_job(n % 3, &format!("ttl{n}"), "1000"))
        .collect();
    wait_long("the waiting job expires", PATIENCE, || {
        ids.iter().any(|id| {
            let v = fleet.job(1, id);
            v["end"] == "aborted"
                && v["reason"]
                    .as_str()
                    .is_some_and(|r| r.contains("pending TTL"))
        })
    });
    let running = ids
        .iter()
        .filter(|id| fleet.job(1, id)["state"] == "running")
        .count();
    assert_eq!(running, 3, "only the waiting one expired");
    for id in &ids {
        fleet.hosts[0].call("DELETE", &format!("/v1/jobs/{id}"), None);
    }
    wait_long("every agent of the pool goes", PATIENCE, || {
        fleet.live_job_agents() == "0"
    });
}

#[test]
fn serial_fleet_standalone_job_of_a_partitioned_host_is_aborted_there_when_healed() {
    let mut fleet = Fleet::start_jobs(2, &[]);
    let id = fleet.post_job(1, "cut", "1000");
    wait_long("the job runs", PATIENCE, || {
        fleet.job(0, &id)["state"] == "running"
    });
    let owner = fleet.job_host(&id);
    let other = 1 - owner;
    fleet.net.partition(owner, true);
    // The fleet gives the job up once the cut host's lease expired.
    wait_long("the job ends aborted (host lost)", PATIENCE, || {
        let v = fleet.job(other, &id);
        v["end"] == "aborted"
            && v["reason"]
                .as_str()
                .is_some_and(|r| r.starts_with("host lost"))
    });
    fleet.net.partition(owner, false);
    // Back, the host finds the job no longer its own: its agent goes and
    // its own record ends aborted too.
    wait_long("healed: the job's agent is destroyed", PATIENCE, || {
        fleet.hosts[owner].agents().is_empty()
    });
    wait_long("the host's own view of the job ends", PATIENCE, || {
        let v = fleet.job(owner, &id);
        v["state"] == "failed" && v["end"] == "aborted"
    });
    assert_eq!(fleet.runs_of("cut"), 1, "{}", fleet.job_runs());
    assert_eq!(fleet.live_job_agents(), "0");
    // It was the rejoin's reconciliation that let the agent go.
    let lines = fleet.hosts[owner].daemon.as_mut().unwrap().lines_so_far();
    assert!(
        lines
            .iter()
            .any(|l| l.contains("no longer this host's; destroying it") && l.contains(&id)),
        "{lines:#?}"
    );
}

/// The pool `waiters`: the real agent, which registers and then waits for a
/// job nobody dispatches; it leaves after a second (`pending-dispatch-timeout`).
fn waiters_pool(per_host: u32, fleet_max: u32) -> String {
    format!(
        "  - name: waiters\n    type: bare-metal\n    maxAgents: {per_host}\n    x-kici-scaler:\n      fleetMaxAgents: {fleet_max}\n      pendingDispatchTimeoutSeconds: 1\n    labelSets:\n      - labels: [waiter]\n        binaryPath: {}\n",
        common::daemon::agent_lite_dir()
            .join("kici-agent-lite")
            .display()
    )
}

/// Forty scale requests nobody dispatches, through three hosts, under a
/// fleet cap of four: each agent registers, waits out its pending-dispatch
/// timeout and leaves, and its request ends with it. Agent *processes*
/// (counted in the hosts' cgroups, not in the database) never exceed the
/// cap, each job id gets exactly one agent, and every request is served.
#[test]
fn serial_fleet_undispatched_requests_end_at_their_timeout_and_the_cap_holds_in_processes() {
    const FLEET_MAX: usize = 4;
    let fleet = Fleet::start_with(3, 2, 6, &[], &waiters_pool(3, FLEET_MAX as u32), &[]);
    wait_until("every host up", || {
        let (status, v) = fleet.hosts[0].call("GET", "/v1/fleet", None);
        status == 200 && v["hosts"].as_array().unwrap().len() == 3
    });
    let instances: Vec<String> = fleet.hosts.iter().map(Host::instance).collect();
    // Agent cgroups of the pool holding at least one process, all hosts.
    let live_processes = || -> usize {
        instances
            .iter()
            .map(|i| {
                let pool = std::path::Path::new(common::daemon::CGROUP_V2)
                    .join("kici-scaler")
                    .join(i)
                    .join("waiters");
                std::fs::read_dir(&pool)
                    .map(|d| {
                        d.filter_map(Result::ok)
                            .filter(|e| {
                                std::fs::read_to_string(e.path().join("cgroup.procs"))
                                    .is_ok_and(|p| !p.trim().is_empty())
                            })
                            .count()
                    })
                    .unwrap_or(0)
            })
            .sum()
    };
    for n in 0..40 {
        let body =
            serde_json::json!({"jobId": format!("waiting-{n}"), "labels": ["waiter"]}).to_string();
        let (status, answer) = fleet.hosts[n % 3].call("POST", "/v1/scale", Some(&body));
        assert!(status == 200 || status == 202, "{status} {answer}");
    }
    let mut most = 0;
    wait_long(
        "every request is served and ends",
        Duration::from_secs(150),
        || {
            most = most.max(live_processes());
            fleet.sql("SELECT count(*) FROM fleet_requests WHERE state = 'finished'")[0] == "40"
        },
    );
    assert!(
        most <= FLEET_MAX,
        "{most} agent processes at once against a fleet cap of {FLEET_MAX}"
    );
    assert!(most > 0, "no agent process was ever seen");
    // Each job id got one agent that came up: forty agents waited out
    // their timeout, every one gone, none made after; the fleet recorded no
    // job with a second agent. (Agents the entry path admitted and undid
    // before their spawn are gone without a failure and never ran.)
    std::thread::sleep(Duration::from_secs(3));
    let mut timed_out = 0;
    for h in &fleet.hosts {
        let (status, v) = h.call("GET", "/v1/agents?all=true&local=true", None);
        assert_eq!(status, 200, "{v}");
        for a in v["agents"].as_array().unwrap() {
            if a["scaler"] == "waiters" {
                assert_eq!(a["state"], "gone", "{a}");
                if a["failureReason"] == "pending-dispatch-timeout" {
                    timed_out += 1;
                }
            }
        }
    }
    assert_eq!(timed_out, 40, "one agent per job id came up");
    let twice = fleet.sql(
        "SELECT job_id FROM fleet_agents WHERE pool = 'waiters' GROUP BY job_id HAVING count(*) > 1",
    );
    assert!(twice.is_empty(), "job ids with a second agent: {twice:?}");
    assert_eq!(
        fleet.sql("SELECT count(DISTINCT job_id) FROM fleet_agents WHERE pool = 'waiters'")[0],
        "40"
    );
    assert_eq!(live_processes(), 0);
    let outcomes = fleet.sql("SELECT DISTINCT outcome FROM fleet_requests WHERE pool = 'waiters'");
    assert_eq!(
        outcomes,
        vec!["agent ended: pending-dispatch-timeout".to_owned()],
        "{outcomes:?}"
    );
}

/// A request whose agent fails before it registers (here: every agent of
/// host 0 exits at once) goes back to the fleet's queue at its place —
/// never to the failing host's own engine, which would serve it again
/// outside the fleet's caps, nor finished — and is served once, when a host
/// can.
#[test]
fn serial_fleet_a_request_whose_agent_never_registered_goes_back_to_the_fleets_queue() {
    let fleet = Fleet::start(2, 2, 4, &[]);
    wait_until("both hosts up", || {
        let (status, v) = fleet.hosts[0].call("GET", "/v1/fleet", None);
        status == 200 && v["hosts"].as_array().unwrap().len() == 2
    });
    // Host 0's agent now exits at once (exited-early, before registering).
    std::fs::write(fleet.hosts[0].dir.path("agent.sh"), "#!/bin/sh\nexit 1\n").unwrap();
    for n in 0..4 {
        let (status, answer) = fleet.hosts[n % 2].scale(&format!("r-{n}"));
        assert!(status == 200 || status == 202, "{answer}");
    }
    let failed_on_0 = || {
        let (_, v) = fleet.hosts[0].call("GET", "/v1/agents?all=true&local=true", None);
        v["agents"].as_array().map_or(0, |a| {
            a.iter()
                .filter(|a| a["failureReason"] == "exited-early")
                .count()
        })
    };
    wait_long(
        "host 1 is full and host 0's agents fail before registering",
        Duration::from_secs(60),
        || fleet.hosts[1].agents().len() == 2 && failed_on_0() >= 2,
    );
    // The failures finished nothing.
    assert_eq!(
        fleet.sql("SELECT count(*) FROM fleet_requests WHERE state = 'finished'"),
        vec!["0".to_owned()]
    );
    // Host 0's agent works again: after its backoff the two requests it
    // failed are served — each once, by whichever host claims them.
    std::fs::write(
        fleet.hosts[0].dir.path("agent.sh"),
        agent_script(fleet.record.path()),
    )
    .unwrap();
    let serving = || -> BTreeMap<String, usize> {
        let mut jobs = BTreeMap::new();
        for h in &fleet.hosts {
            for (state, job) in h.agents_with_jobs().into_values() {
                if state != "destroying" && !job.is_empty() {
                    *jobs.entry(job).or_insert(0) += 1;
                }
            }
        }
        jobs
    };
    wait_long(
        "all four requests are served",
        Duration::from_secs(90),
        || serving().len() == 4,
    );
    let jobs = serving();
    assert!(
        jobs.values().all(|n| *n == 1),
        "one agent per job: {jobs:?}"
    );
    assert_eq!(
        fleet.sql("SELECT count(*) FROM fleet_requests WHERE state = 'started'"),
        vec!["4".to_owned()]
    );
}

/// The engine is asked before it admits: a request that arrives while its
/// pool is at the fleet cap is only queued, and the idle warm agent the
/// entry host could have given it stays in the pool. Before, the entry
/// admitted first — the warm agent was bound to the request — then undid
/// that when the queue said "not now", destroying the warm agent: every
/// arrival at the cap cost a warm agent and a spawn.
#[test]
fn serial_fleet_an_arrival_at_the_fleet_cap_leaves_the_warm_pool_alone() {
    let warm = format!(
        "  - name: warm\n    type: bare-metal\n    maxAgents: 3\n    warmPool: {{ enabled: true, size: 1, idleTimeoutSeconds: 600 }}\n    x-kici-scaler:\n      fleetMaxAgents: 1\n    labelSets:\n      - labels: [warm]\n        binaryPath: {}\n",
        common::daemon::agent_lite_dir()
            .join("kici-agent-lite")
            .display()
    );
    let fleet = Fleet::start_with(1, 2, 2, &[], &warm, &[]);
    let host = &fleet.hosts[0];
    let idle_warm = || -> Vec<String> {
        let (_, v) = host.call("GET", "/v1/agents?local=true", None);
        v["agents"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter(|a| a["scaler"] == "warm" && a["state"] == "idle" && a["warm"] == true)
                    .map(|a| a["agentId"].as_str().unwrap().to_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    let send = |job: &str| {
        let body = serde_json::json!({"jobId": job, "labels": ["warm"]}).to_string();
        host.call("POST", "/v1/scale", Some(&body))
    };
    wait_until("the warm pool fills", || idle_warm().len() == 1);
    // The first request takes the warm agent; the pool is at its fleet cap.
    let (status, v) = send("w-1");
    assert!(status == 202 || status == 200, "{v}");
    assert_eq!(v["result"], "spawning", "{v}");
    assert_eq!(v["warm"], true, "{v}");
    let mut replacement = Vec::new();
    wait_until("the warm pool is refilled", || {
        replacement = idle_warm();
        replacement.len() == 1
    });
    // Arrivals at the cap: queued, and the warm agent is not touched.
    for n in 2..=6 {
        let (status, v) = send(&format!("w-{n}"));
        assert!(status == 202 || status == 200, "{v}");
        assert_eq!(v["result"], "pending", "{v}");
    }
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(idle_warm(), replacement, "the same warm agent, still idle");
    let (_, all) = host.call("GET", "/v1/agents?local=true&all=true", None);
    let ever: Vec<&Value> = all["agents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["scaler"] == "warm")
        .collect();
    assert_eq!(
        ever.len(),
        2,
        "one warm agent served w-1, one replaced it; none was made and destroyed: {ever:?}"
    );
    let queued =
        fleet.sql("SELECT count(*) FROM fleet_requests WHERE pool = 'warm' AND state = 'queued'");
    assert_eq!(queued, ["5"]);
}

/// A scale request a host of the previous version queued — its body
/// stored as that version wrote it, the `POST /v1/scale` body's JSON — is
/// read back as the typed body, claimed and served; the same request sent
/// again through the API is that request (the stored text is the dedupe
/// key: answered where it is, no second agent), another body for its job
/// id is a conflict.
#[test]
fn serial_fleet_a_scale_request_stored_by_the_previous_version_is_claimed_and_served() {
    let fleet = Fleet::start(1, 2, 4, &[]);
    wait_until("the host is up", || {
        let (status, v) = fleet.hosts[0].call("GET", "/v1/fleet", None);
        status == 200 && v["hosts"].as_array().unwrap().len() == 1
    });
    let stored = r#"{"jobId":"old-1","labels":["local"]}"#;
    fleet.sql(&format!(
        "INSERT INTO fleet_requests (fleet, job_id, kind, pool, body, answer, milli_cpu, \
         memory_bytes, entry_host, secret, state, arrived_at) VALUES ('default', 'old-1', \
         'scale', 'local', '{stored}', '', 0, 0, 'a-host-of-the-previous-version', NULL, \
         'queued', fleet_now_ms())"
    ));
    let agent_of = || {
        fleet.hosts[0]
            .agents_with_jobs()
            .into_iter()
            .find(|(_, (_, job))| job == "old-1")
            .map(|(agent, _)| agent)
    };
    wait_long(
        "the queued request is served",
        Duration::from_secs(30),
        || agent_of().is_some(),
    );
    let agent = agent_of().unwrap();
    let (status, answer) = fleet.hosts[0].scale("old-1");
    assert_eq!(status, 202, "{answer}");
    assert_eq!(answer["agentId"], agent.as_str(), "{answer}");
    let other = r#"{"jobId":"old-1","labels":["local"],"runId":"another"}"#;
    let (status, answer) = fleet.hosts[0].call("POST", "/v1/scale", Some(other));
    assert_eq!(status, 409, "{answer}");
    assert_eq!(
        fleet.sql("SELECT count(*) FROM fleet_agents WHERE job_id = 'old-1'"),
        vec!["1".to_owned()]
    );
}
