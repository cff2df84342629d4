//! Chaos against a three-host fleet, black-box: real `kici-scaler serve`
//! processes on loopback sharing a private PostgreSQL, driven only through
//! their API, with standalone jobs (`POST /v1/jobs`, run by the real agent;
//! each command appends its mark to a file) and scale requests (bare-metal
//! agents that record their id and sleep) arriving all along, through
//! kill -9 of a host (its machine gone: its agents die with it), SIGTERM and
//! restart, a PostgreSQL restart, a partition of one host from the database
//! and kill -9 of a daemon restarted at once (its agents survive it).
//!
//! Every host reaches the database through a TCP proxy of its own in this
//! process; cutting a host's proxy stalls its traffic both ways (the
//! connections stay open and their bytes wait, as packets do in a real
//! partition) until it is healed.
//!
//! Checked throughout and at the end:
//! - every job's command ran at most once, and the job ended in a state
//!   matching whether it ran (succeeded ⇒ ran once; none left pending or
//!   running);
//! - no job id ever had two live agents (the database's live agent rows,
//!   and agent processes counted in the hosts' cgroups);
//! - agent processes of each pool never exceeded its `fleetMaxAgents`;
//! - after every host's SIGTERM: no agent process, no agent cgroup, no agent
//!   run dir left.
//!
//! Across a partition the cut host's agents outlive its lease by design (it
//! cannot reach the database to learn that its requests moved; it destroys
//! them once healed), so while a host is cut off, and until it has
//! reconciled after the heal, its agent processes are counted apart: the
//! caps and the one-agent-per-job check apply to the hosts in good standing,
//! and the overlap is reported.
//!
//! `KICI_SCALER_CHAOS_ROUNDS` (default 1) repeats the fault sequence: the
//! long run of `bench/fleet.sh chaos`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use common::firecracker::free_port;

use common::daemon::{http, pg, pg_with, psql, Daemon, Dir, CGROUP_V2, PATIENCE};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A private server: the test restarts it.
const PG_PORT: u16 = 54353;
const HOSTS: usize = 3;
const TOKEN: &str = "fleet-chaos-operator-token-0123456789ab";
const KEY: &str = "fleet-chaos-fleet-key-0123456789abcdef01";
const LEASE_SECONDS: u64 = 3;
/// `local`: scale requests; agents record themselves and sleep.
const LOCAL_PER_HOST: usize = 2;
const LOCAL_FLEET_MAX: usize = 4;
/// `jobs`: standalone jobs on the real agent.
const JOBS_PER_HOST: usize = 2;
const JOBS_FLEET_MAX: usize = 3;

/// Stops the private server however the test ends.
struct PrivateServer;

impl Drop for PrivateServer {
    fn drop(&mut self) {
        pg("stop", PG_PORT);
    }
}

/// A TCP proxy from a local port to the database. While cut, nothing
/// passes either way and new connections wait; healed, everything that
/// waited goes on.
struct Proxy {
    port: u16,
    cut: Arc<(Mutex<bool>, Condvar)>,
}

impl Proxy {
    fn start(upstream: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let cut = Arc::new((Mutex::new(false), Condvar::new()));
        let gate = cut.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let gate = gate.clone();
                std::thread::spawn(move || {
                    wait_open(&gate);
                    let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
                        return;
                    };
                    let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                    let g2 = gate.clone();
                    std::thread::spawn(move || pump(c2, s2, &g2));
                    pump(server, client, &gate);
                });
            }
        });
        Proxy { port, cut }
    }

    fn set_cut(&self, cut: bool) {
        let (lock, cvar) = &*self.cut;
        *lock.lock().unwrap() = cut;
        cvar.notify_all();
    }
}

fn wait_open(gate: &(Mutex<bool>, Condvar)) {
    let (lock, cvar) = gate;
    let mut cut = lock.lock().unwrap();
    while *cut {
        cut = cvar.wait(cut).unwrap();
    }
}

/// Copies `from` to `to` while the gate is open; either side's end closes
/// both.
fn pump(mut from: TcpStream, mut to: TcpStream, gate: &(Mutex<bool>, Condvar)) {
    let mut buf = [0u8; 16384];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        wait_open(gate);
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = from.shutdown(std::net::Shutdown::Both);
    let _ = to.shutdown(std::net::Shutdown::Both);
}

fn call(addr: &str, method: &str, path: &str, body: Option<&str>) -> (u16, Value) {
    let auth = format!("Bearer {TOKEN}");
    let (status, text) = http(addr, method, path, &[("Authorization", &auth)], body);
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// One host: its dir, fixed API address, proxy and (while it runs) daemon.
struct Host {
    dir: Dir,
    addr: String,
    proxy: Proxy,
    /// Its instance id (kept in its state dir across restarts).
    instance: String,
}

impl Host {
    fn state_dir(&self) -> PathBuf {
        self.dir.path("state")
    }

    /// Its agent cgroups (`<instance>/<pool>/<agent>`) per pool.
    fn agent_cgroups(&self) -> BTreeMap<String, Vec<PathBuf>> {
        let mut out = BTreeMap::new();
        let root = Path::new(CGROUP_V2)
            .join("kici-scaler")
            .join(&self.instance);
        for pool in ["local", "jobs"] {
            let dirs = std::fs::read_dir(root.join(pool))
                .map(|d| {
                    d.filter_map(Result::ok)
                        .map(|e| e.path())
                        .filter(|p| p.is_dir())
                        .collect()
                })
                .unwrap_or_default();
            out.insert(pool.to_owned(), dirs);
        }
        out
    }

    /// Agents with at least one process, per pool: (agent id, job id).
    fn live_agent_processes(&self) -> BTreeMap<String, Vec<(String, String)>> {
        self.agent_cgroups()
            .into_iter()
            .map(|(pool, dirs)| {
                let live = dirs
                    .iter()
                    .filter(|d| {
                        std::fs::read_to_string(d.join("cgroup.procs"))
                            .is_ok_and(|p| !p.trim().is_empty())
                    })
                    .map(|d| {
                        let agent = d.file_name().unwrap().to_string_lossy().into_owned();
                        let job = self.job_of(&agent);
                        (agent, job)
                    })
                    .collect();
                (pool, live)
            })
            .collect()
    }

    /// The job an agent of this host serves, from the agent's context file
    /// (`job=…`); "" if it has none (yet).
    fn job_of(&self, agent: &str) -> String {
        std::fs::read_to_string(self.state_dir().join("agents").join(agent).join("context"))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("job="))
            .unwrap_or_default()
            .to_owned()
    }
}

struct Fleet {
    hosts: Vec<Host>,
    daemons: Mutex<Vec<Option<Daemon>>>,
    /// Every host's log lines of its earlier (killed, stopped) daemons.
    logs: Mutex<Vec<Vec<String>>>,
    url: String,
    record: tempfile::TempDir,
}

/// Starts host `h`'s daemon against `url` (through its proxy).
fn run_host(h: &Host, url: &str) -> Daemon {
    let state = format!(
        "postgres://postgres@127.0.0.1:{}/{}",
        h.proxy.port,
        url.rsplit_once('/').unwrap().1
    );
    let mut cmd = h.dir.serve_command(&[
        "--listen",
        &h.addr,
        "--state",
        &state,
        "--fleet",
        "chaos",
        "--fleet-lease-seconds",
        &LEASE_SECONDS.to_string(),
        "--reconcile-interval-seconds",
        "1",
    ]);
    cmd.envs([
        ("KICI_SCALER_API_TOKEN", TOKEN),
        ("KICI_SCALER_FLEET_KEY", KEY),
        ("KICI_SCALER_LOG", "info,kici_scaler::fleet=debug"),
    ]);
    Daemon::spawn(cmd).unwrap_or_else(|s| panic!("host {} died at start: {s:?}", h.addr))
}

impl Fleet {
    fn start_host(&self, i: usize) {
        let daemon = run_host(&self.hosts[i], &self.url);
        self.daemons.lock().unwrap()[i] = Some(daemon);
    }

    fn kill9(&self, i: usize) {
        let mut d = self.daemons.lock().unwrap()[i].take().unwrap();
        d.kill9();
        self.logs.lock().unwrap()[i].extend(d.rest_of_log());
    }

    /// SIGTERM; it must exit 0.
    fn terminate(&self, i: usize) {
        let mut d = self.daemons.lock().unwrap()[i].take().unwrap();
        d.signal(rustix::process::Signal::TERM);
        let status = d.wait_exit();
        self.logs.lock().unwrap()[i].extend(d.rest_of_log());
        assert_eq!(status.code(), Some(0), "host {i}'s exit after SIGTERM");
    }

    fn sql(&self, query: &str) -> Vec<String> {
        psql(&self.url, query)
    }

    /// Agent ids the `local` agents recorded.
    fn recorded(&self) -> BTreeSet<String> {
        std::fs::read_to_string(self.record.path().join("agents.log"))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// Marks the jobs' commands wrote, with how often each.
    fn job_runs(&self) -> BTreeMap<String, usize> {
        let mut runs = BTreeMap::new();
        for l in std::fs::read_to_string(self.record.path().join("jobs.log"))
            .unwrap_or_default()
            .lines()
        {
            *runs.entry(l.to_owned()).or_insert(0) += 1;
        }
        runs
    }

    /// Destroys the booted `local` agents that recorded themselves (their
    /// "job" is done), each through its own host.
    fn finish_booted(&self) {
        let recorded = self.recorded();
        for h in &self.hosts {
            // A host that is down answers nothing (status 0).
            let (status, v) = call(&h.addr, "GET", "/v1/agents?local=true", None);
            if status != 200 {
                continue;
            }
            for a in v["agents"].as_array().into_iter().flatten() {
                let id = a["agentId"].as_str().unwrap_or_default();
                if a["scaler"] == "local" && a["state"] == "booted" && recorded.contains(id) {
                    call(&h.addr, "DELETE", &format!("/v1/agents/{id}"), None);
                }
            }
        }
    }

    /// Fails on `what` with every host's warnings, errors and lines naming
    /// `about`.
    fn fail(&self, what: &str, about: &[String]) -> ! {
        let mut daemons = self.daemons.lock().unwrap();
        let mut logs = self.logs.lock().unwrap();
        for (i, d) in daemons.iter_mut().enumerate() {
            if let Some(d) = d.as_mut() {
                logs[i].extend(d.lines_so_far());
            }
            for line in &logs[i] {
                let notable = if about.is_empty() {
                    line.contains("\"WARN\"") || line.contains("\"ERROR\"")
                } else {
                    about.iter().any(|a| line.contains(a.as_str()))
                };
                if notable {
                    eprintln!("host {i}: {line}");
                }
            }
        }
        // Whole logs for a closer look, kept after the test.
        let keep = std::env::temp_dir().join(format!("kici-fleet-chaos-{}", std::process::id()));
        std::fs::create_dir_all(&keep).unwrap();
        for (i, lines) in logs.iter().enumerate() {
            std::fs::write(keep.join(format!("host-{i}.log")), lines.join("\n")).unwrap();
        }
        std::fs::copy(self.record.path().join("jobs.log"), keep.join("jobs.log")).ok();
        std::fs::copy(
            self.record.path().join("agents.log"),
            keep.join("agents.log"),
        )
        .ok();
        panic!("{what} (the hosts' logs: {})", keep.display());
    }
}

/// What the sampler saw.
#[derive(Default)]
struct Seen {
    /// Most agent processes of each pool at once, hosts in good standing.
    most: BTreeMap<String, usize>,
    /// The same, every host counted (a cut host's included).
    most_raw: BTreeMap<String, usize>,
    /// Job ids with two live agent processes at once (good standing).
    doubled: BTreeMap<String, Vec<String>>,
    /// Job ids with two live agent rows in the database at once.
    doubled_rows: BTreeSet<String>,
    samples: usize,
}

fn sample(fleet: &Fleet, excused: &[bool], seen: &mut Seen) {
    let mut per_pool: BTreeMap<String, usize> = BTreeMap::new();
    let mut raw: BTreeMap<String, usize> = BTreeMap::new();
    let mut per_job: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (i, h) in fleet.hosts.iter().enumerate() {
        for (pool, agents) in h.live_agent_processes() {
            *raw.entry(pool.clone()).or_default() += agents.len();
            if excused[i] {
                continue;
            }
            *per_pool.entry(pool).or_default() += agents.len();
            for (agent, job) in agents {
                if !job.is_empty() {
                    per_job.entry(job).or_default().push(agent);
                }
            }
        }
    }
    for (pool, n) in per_pool {
        let m = seen.most.entry(pool).or_default();
        *m = (*m).max(n);
    }
    for (pool, n) in raw {
        let m = seen.most_raw.entry(pool).or_default();
        *m = (*m).max(n);
    }
    for (job, agents) in per_job {
        if agents.len() > 1 {
            seen.doubled.insert(job, agents);
        }
    }
    seen.samples += 1;
    if !seen.samples.is_multiple_of(3) {
        return;
    }
    // The database may be down (its restart): no rows then.
    let out = std::process::Command::new("psql")
        .args([
            &fleet.url,
            "-Atq",
            "-c",
            "SELECT job_id FROM fleet_agents WHERE state = 'live' GROUP BY job_id HAVING count(*) > 1",
        ])
        .output()
        .unwrap();
    if out.status.success() {
        for l in String::from_utf8_lossy(&out.stdout).lines() {
            if !l.is_empty() {
                seen.doubled_rows.insert(l.to_owned());
            }
        }
    }
}

fn rounds() -> usize {
    std::env::var("KICI_SCALER_CHAOS_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
}

/// Until `f` holds, at most `limit`; panics naming `what`.
fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !f() {
        assert!(Instant::now() < deadline, "never within {limit:?}: {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn serial_fleet_chaos_kill_restart_database_restart_and_partition_keep_the_invariants() {
    let began = Instant::now();
    pg("stop", PG_PORT);
    pg_with("start", PG_PORT, &[]);
    let _server = PrivateServer;
    let admin = pg("url", PG_PORT);
    let database = format!("kici_chaos_{:08x}", rand::random::<u32>());
    psql(&admin, &format!("CREATE DATABASE {database}"));
    let url = format!("{}/{database}", admin.rsplit_once('/').unwrap().0);
    let record = tempfile::tempdir().unwrap();
    let agent_lite = common::daemon::agent_lite_dir().join("kici-agent-lite");

    let mut hosts = Vec::new();
    for _ in 0..HOSTS {
        let dir = Dir::with_config("");
        let agent = dir.write_script(
            "agent.sh",
            &format!(
                "#!/bin/sh\necho \"$KICI_AGENT_ID\" >> {}\nexec sleep 1000\n",
                record.path().join("agents.log").display()
            ),
        );
        std::fs::write(
            dir.path("scalers.yaml"),
            format!(
                "version: 1\nscalers:\n  - name: local\n    type: bare-metal\n    maxAgents: {LOCAL_PER_HOST}\n    x-kici-scaler:\n      fleetMaxAgents: {LOCAL_FLEET_MAX}\n    labelSets:\n      - labels: [local]\n        binaryPath: {}\n  - name: jobs\n    type: bare-metal\n    maxAgents: {JOBS_PER_HOST}\n    x-kici-scaler:\n      fleetMaxAgents: {JOBS_FLEET_MAX}\n    labelSets:\n      - labels: [job]\n        binaryPath: {}\n",
                agent.display(),
                agent_lite.display()
            ),
        )
        .unwrap();
        hosts.push(Host {
            dir,
            addr: format!("127.0.0.1:{}", free_port()),
            proxy: Proxy::start(PG_PORT),
            instance: String::new(),
        });
    }
    let mut daemons = Vec::new();
    for h in &mut hosts {
        daemons.push(Some(run_host(h, &url)));
        h.instance = h.dir.instance();
    }
    let fleet = Fleet {
        hosts,
        daemons: Mutex::new(daemons),
        logs: Mutex::new(vec![Vec::new(); HOSTS]),
        url,
        record,
    };
    wait_for("every host up", PATIENCE, || {
        let (status, v) = call(&fleet.hosts[0].addr, "GET", "/v1/fleet", None);
        status == 200
            && v["hosts"]
                .as_array()
                .is_some_and(|h| h.iter().filter(|h| h["state"] == "up").count() == HOSTS)
    });

    let addrs: Vec<String> = fleet.hosts.iter().map(|h| h.addr.clone()).collect();
    let jobs_log = fleet.record.path().join("jobs.log");
    let stop = AtomicBool::new(false);
    // mark → job id, for jobs accepted (202).
    let jobs: Mutex<BTreeMap<String, String>> = Mutex::new(BTreeMap::new());
    let job_posts = AtomicUsize::new(0);
    // Scale requests some host acknowledged.
    let scales: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());
    let scale_posts = AtomicUsize::new(0);
    let excused = Mutex::new(vec![false; HOSTS]);
    let seen = Mutex::new(Seen::default());
    let fleet_lock = Mutex::new(());
    let mut faults: Vec<String> = Vec::new();

    std::thread::scope(|scope| {
        // Standalone jobs, one every 200 ms, through the hosts in turn.
        scope.spawn(|| {
            let mut n = 0;
            while !stop.load(Ordering::SeqCst) {
                let mark = format!("m{n:04}");
                let body = serde_json::json!({
                    "labels": ["job"],
                    "command": ["sh", "-c", format!("echo \"$MARK\" >> {}; sleep 0.3", jobs_log.display())],
                    "env": {"MARK": mark},
                })
                .to_string();
                job_posts.fetch_add(1, Ordering::SeqCst);
                let (status, v) = call(&addrs[n % HOSTS], "POST", "/v1/jobs", Some(&body));
                if status == 202 {
                    let id = v["jobId"].as_str().unwrap().to_owned();
                    jobs.lock().unwrap().insert(mark, id);
                }
                n += 1;
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        // Scale requests, one every 250 ms; an unanswered one is sent again
        // (the same request) through the next host, a few times.
        scope.spawn(|| {
            let mut n = 0;
            while !stop.load(Ordering::SeqCst) {
                let job = format!("s{n:04}");
                let body = serde_json::json!({"jobId": job, "labels": ["local"]}).to_string();
                scale_posts.fetch_add(1, Ordering::SeqCst);
                for attempt in 0..HOSTS {
                    let (status, _) = call(
                        &addrs[(n + attempt) % HOSTS],
                        "POST",
                        "/v1/scale",
                        Some(&body),
                    );
                    if status == 200 || status == 202 {
                        scales.lock().unwrap().insert(job.clone());
                        break;
                    }
                }
                n += 1;
                std::thread::sleep(Duration::from_millis(250));
            }
        });

        let sampler_stop = AtomicBool::new(false);
        std::thread::scope(|inner| {
            // The sampler and the finisher of `local` agents.
            inner.spawn(|| {
                let mut k = 0u64;
                while !sampler_stop.load(Ordering::SeqCst) {
                    {
                        let _g = fleet_lock.lock().unwrap();
                        let ex = excused.lock().unwrap().clone();
                        sample(&fleet, &ex, &mut seen.lock().unwrap());
                        if k.is_multiple_of(3) {
                            fleet.finish_booted();
                        }
                    }
                    k += 1;
                    std::thread::sleep(Duration::from_millis(100));
                }
            });

            let pause = |secs: u64| std::thread::sleep(Duration::from_secs(secs));
            for round in 0..rounds() {
                pause(4);
                // 1. A host's machine dies: kill -9 and its agents with it;
                //    back after its lease lapsed.
                let victim = round % HOSTS;
                {
                    let _g = fleet_lock.lock().unwrap();
                    fleet.kill9(victim);
                    common::daemon::kill_instance_cgroups(&fleet.hosts[victim].instance);
                }
                faults.push(format!("kill -9 host {victim} (its agents too)"));
                pause(LEASE_SECONDS + 3);
                fleet.start_host(victim);
                pause(4);
                // 2. SIGTERM, restarted at once.
                let victim = (round + 1) % HOSTS;
                fleet.terminate(victim);
                fleet.start_host(victim);
                faults.push(format!("SIGTERM + restart host {victim}"));
                pause(4);
                // 3. The database restarts.
                pg("stop", PG_PORT);
                pause(1);
                pg_with("start", PG_PORT, &[]);
                faults.push("PostgreSQL restart".to_owned());
                pause(5);
                // 4. A host cut off from the database past its lease, then
                //    healed.
                let victim = (round + 2) % HOSTS;
                excused.lock().unwrap()[victim] = true;
                fleet.hosts[victim].proxy.set_cut(true);
                pause(LEASE_SECONDS * 2);
                fleet.hosts[victim].proxy.set_cut(false);
                faults.push(format!(
                    "partition host {victim} for {} s",
                    LEASE_SECONDS * 2
                ));
                // Counted again once it has destroyed the agents whose
                // requests moved: no job then has a live agent on it and on
                // another host.
                let healed = Instant::now();
                let mut reconciled = false;
                while healed.elapsed() < PATIENCE {
                    let mut on_victim = BTreeSet::new();
                    let mut elsewhere = BTreeSet::new();
                    {
                        let _g = fleet_lock.lock().unwrap();
                        for (i, h) in fleet.hosts.iter().enumerate() {
                            for agents in h.live_agent_processes().into_values() {
                                for (_, job) in agents.into_iter().filter(|(_, j)| !j.is_empty()) {
                                    if i == victim {
                                        on_victim.insert(job);
                                    } else {
                                        elsewhere.insert(job);
                                    }
                                }
                            }
                        }
                    }
                    if on_victim.is_disjoint(&elsewhere) {
                        reconciled = true;
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
                assert!(
                    reconciled,
                    "the healed host {victim} kept agents whose requests run elsewhere for {PATIENCE:?}"
                );
                excused.lock().unwrap()[victim] = false;
                pause(3);
                // 5. kill -9 of a daemon only, restarted at once (before its
                //    lease lapses): its agents live on and it takes them back.
                let victim = round % HOSTS;
                fleet.kill9(victim);
                fleet.start_host(victim);
                faults.push(format!(
                    "kill -9 + restart at once host {victim} (agents survive)"
                ));
                pause(3);
            }
            stop.store(true, Ordering::SeqCst);
            // Drain: every acknowledged request served or ended, every job
            // ended.
            let drained = Instant::now();
            let mut done = false;
            while drained.elapsed() < Duration::from_secs(60) {
                let open = fleet.sql(
                    "SELECT count(*) FROM fleet_requests WHERE state IN ('queued', 'claimed', 'lost')",
                );
                let ids: Vec<String> = jobs.lock().unwrap().values().cloned().collect();
                let unended = ids
                    .iter()
                    .filter(|id| {
                        let (_, v) =
                            call(&fleet.hosts[0].addr, "GET", &format!("/v1/jobs/{id}"), None);
                        !matches!(
                            v["state"].as_str(),
                            Some("succeeded" | "failed" | "cancelled")
                        )
                    })
                    .count();
                if open == ["0"] && unended == 0 {
                    done = true;
                    break;
                }
                std::thread::sleep(Duration::from_millis(500));
            }
            sampler_stop.store(true, Ordering::SeqCst);
            if !done {
                let left = fleet.sql(
                    "SELECT job_id || ' ' || kind || ' ' || state || ' ' || coalesce(claimed_by, '-') \
                     FROM fleet_requests WHERE state IN ('queued', 'claimed', 'lost')",
                );
                let ids: Vec<String> = jobs.lock().unwrap().values().cloned().collect();
                let unended: Vec<String> = ids
                    .iter()
                    .filter_map(|id| {
                        let (_, v) =
                            call(&fleet.hosts[0].addr, "GET", &format!("/v1/jobs/{id}"), None);
                        (!matches!(
                            v["state"].as_str(),
                            Some("succeeded" | "failed" | "cancelled")
                        ))
                        .then(|| format!("{id}: {v}"))
                    })
                    .collect();
                fleet.fail(
                    &format!("stuck after 60 s of drain: requests {left:?}; jobs {unended:?}"),
                    &[],
                );
            }
        });
    });

    // Every job: ran at most once; its end matches whether it ran.
    //
    // What this caught before a host recorded an agent's registration
    // before its engine accepted it: a host cut off from the database just
    // after its agent registered let the job run without the fleet knowing;
    // when its lease lapsed the leader found the agent "never registered",
    // put the request back in the queue, and another host ran the job a
    // second time.
    let runs = fleet.job_runs();
    let jobs = jobs.into_inner().unwrap();
    let twice: Vec<(&String, &usize)> = runs.iter().filter(|(_, n)| **n > 1).collect();
    if !twice.is_empty() {
        let about: Vec<String> = twice
            .iter()
            .filter_map(|(m, _)| jobs.get(*m).cloned())
            .collect();
        fleet.fail(&format!("jobs ran more than once: {twice:?}"), &about);
    }
    let mut ends: BTreeMap<String, usize> = BTreeMap::new();
    for (mark, id) in &jobs {
        let (status, v) = call(&fleet.hosts[1].addr, "GET", &format!("/v1/jobs/{id}"), None);
        assert_eq!(status, 200, "{id}: {v}");
        let ran = runs.get(mark).copied().unwrap_or(0);
        let state = v["state"].as_str().unwrap_or_default().to_owned();
        match state.as_str() {
            "succeeded" => assert!(ran == 1 && v["exitCode"] == 0, "{mark} ran {ran}×: {v}"),
            "failed" => {
                // Ended by its command: it ran. Aborted: it may have run
                // once (its host was lost or restarted under it) or not.
                if v["end"] == "exited" {
                    assert_eq!(ran, 1, "{mark}: {v}");
                } else {
                    assert_eq!(v["end"], "aborted", "{mark}: {v}");
                }
            }
            _ => panic!("{mark} ended {state}: {v}"),
        }
        *ends
            .entry(format!(
                "{state}{}",
                v["reason"]
                    .as_str()
                    .map(|r| format!(" ({})", r.split(':').next().unwrap_or(r)))
                    .unwrap_or_default()
            ))
            .or_default() += 1;
    }

    // A `local` agent never registers, so a request whose host was lost
    // (crash, partition) is rightly served again elsewhere: what must hold
    // is that its agents never lived at once (the sampler's check).
    let recorded = fleet.recorded();
    let reserved = fleet.sql(
        "SELECT count(*) FROM (SELECT job_id FROM fleet_agents WHERE pool = 'local' \
         GROUP BY job_id HAVING count(*) > 1) AS t",
    );

    let seen = seen.into_inner().unwrap();
    eprintln!(
        "chaos: {} rounds, faults {faults:?}; {} jobs posted, {} accepted, ends {ends:?}; \
         {} scale requests posted, {} acknowledged, {} agents ran, {} requests served again after \
         their host was lost; samples {}, most agent processes \
         {:?} (every host counted: {:?}); {:?} elapsed",
        rounds(),
        job_posts.load(Ordering::SeqCst),
        jobs.len(),
        scale_posts.load(Ordering::SeqCst),
        scales.lock().unwrap().len(),
        recorded.len(),
        reserved[0],
        seen.samples,
        seen.most,
        seen.most_raw,
        began.elapsed()
    );
    assert!(
        seen.doubled_rows.is_empty(),
        "job ids with two live agent rows: {:?}",
        seen.doubled_rows
    );
    assert!(
        seen.doubled.is_empty(),
        "job ids with two live agent processes: {:?}",
        seen.doubled
    );
    let caps = [("local", LOCAL_FLEET_MAX), ("jobs", JOBS_FLEET_MAX)];
    for (pool, cap) in caps {
        let most = seen.most.get(pool).copied().unwrap_or(0);
        assert!(
            most <= cap,
            "{most} agent processes of {pool} at once, cap {cap}"
        );
        assert!(most > 0, "no agent process of {pool} was ever seen");
    }
    // Recorded once each (an agent process started once), one per job.
    let agents_log = std::fs::read_to_string(fleet.record.path().join("agents.log")).unwrap();
    assert_eq!(
        agents_log.lines().count(),
        recorded.len(),
        "an agent recorded twice"
    );
    // Shutdown: every host exits 0 and leaves nothing behind.
    for i in 0..HOSTS {
        fleet.terminate(i);
    }
    for (i, h) in fleet.hosts.iter().enumerate() {
        for (pool, dirs) in h.agent_cgroups() {
            assert!(
                dirs.is_empty(),
                "host {i}: agent cgroups of {pool} left: {dirs:?}"
            );
        }
        let work = h.dir.path("state-work").join(&h.instance);
        let left: Vec<PathBuf> = std::fs::read_dir(&work)
            .map(|d| d.filter_map(Result::ok).map(|e| e.path()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "host {i}: agent run dirs left: {left:?}");
        let agents: Vec<PathBuf> = std::fs::read_dir(h.state_dir().join("agents"))
            .map(|d| {
                d.filter_map(Result::ok)
                    .map(|e| e.path())
                    .filter(|p| !p.ends_with("retired"))
                    .collect()
            })
            .unwrap_or_default();
        assert!(agents.is_empty(), "host {i}: agent dirs left: {agents:?}");
    }
    let live = fleet.sql("SELECT count(*) FROM fleet_agents WHERE state = 'live'");
    assert_eq!(live, ["0"], "live agent rows after shutdown");
    eprintln!("chaos test took {:?}", began.elapsed());
}
