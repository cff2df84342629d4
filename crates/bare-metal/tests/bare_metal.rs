#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The bare-metal backend against real processes and the host's real
//! cgroups (tests named `serial_*` run one at a time under nextest; each has
//! its own instance id and state dir, and the fixture sweeps on drop).

mod common;

use common::{next_report, read_fifo, scaler, simple_scaler, spec as spawn_spec, Fixture};
use kici_bare_metal::cgroup;
use kici_bare_metal::SpawnMethod;
use kici_engine::{Backend, BackendReport};
use kici_host::process::{ProcStat, ProcessIdentity};
use kici_model::{AgentId, ScalerType};
use std::collections::BTreeSet;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

const GRACE: Duration = Duration::from_secs(5);

fn exited(agent: AgentId, detail: &str) -> BackendReport {
    BackendReport::Exited {
        agent,
        detail: detail.to_owned(),
    }
}

fn pid_of(handle_id: &str) -> ProcessIdentity {
    handle_id.parse().expect("handle id pid:<pid>:<start>")
}

fn cgroup_of(handle: &kici_engine::ResourceHandle) -> PathBuf {
    PathBuf::from(&handle.extra["cgroup"])
}

#[tokio::test]
async fn serial_spawned_agent_gets_exactly_the_contract_environment() {
    let fx = Fixture::with(|o| {
        o.system_env = vec![
            ("PATH".into(), "/usr/bin:/bin".into()),
            ("HOME".into(), "/root".into()),
            ("DATABASE_URL".into(), "postgres://secret".into()),
        ];
        o.forwarded_env = vec![
            ("KICI_AGENT_ENV_FORWARDED".into(), "yes".into()),
            ("KICI_AGENT_ENV_HOME".into(), "/home/agent".into()),
        ];
    });
    let scaler = scaler(
        r#"
version: 1
scalers:
  - name: metal
    type: bare-metal
    maxAgents: 1
    roles: [builder, init-runner]
    labelSets:
      - labels: [linux, Metal]
        binaryPath: /usr/bin/env
        backpressureMode: pause
        env:
          FROM_LABEL_SET: "a b=c"
          KICI_LOG_LEVEL: debug
"#,
        "metal",
    );
    let (mut spec, mut rx) = spawn_spec(&scaler, 0);
    spec.token = Some(kici_model::Secret::new("kat_0123456789abcdef"));
    spec.idle_timeout_ms = Some(300_000);
    let agent = spec.agent;
    let labels = spec.agent_labels.join(",");
    let handle = fx.backend.spawn(spec).await.unwrap();
    // The token is only in the environment: argv is the binary alone.
    assert_eq!(next_report(&mut rx).await, exited(agent, "exit status 0"));

    let out = std::fs::read_to_string(fx.backend.agent_dir(agent).join("stdout.log")).unwrap();
    let mut env: Vec<&str> = out.lines().collect();
    env.sort_unstable();
    let agent_var = format!("KICI_AGENT_ID={agent}");
    let labels_var = format!("KICI_LABELS={labels}");
    assert_eq!(
        env,
        vec![
            "FORWARDED=yes",
            "FROM_LABEL_SET=a b=c",
            "HOME=/home/agent",
            agent_var.as_str(),
            "KICI_AGENT_TOKEN=kat_0123456789abcdef",
            "KICI_BACKPRESSURE_MODE=pause",
            "KICI_EXECUTION_MODE=bare-metal",
            labels_var.as_str(),
            "KICI_LOG_LEVEL=debug",
            "KICI_ORCHESTRATOR_URL=ws://127.0.0.1:7879/ws",
            "KICI_PORT=0",
            "KICI_ROLES=builder,init-runner",
            "KICI_SCALER_IDLE_TIMEOUT=300000",
            "KICI_SCALER_MANAGED=1",
            "PATH=/usr/bin:/bin",
        ]
    );
    assert!(labels.starts_with("linux,Metal,kici:agent:"));
    fx.backend
        .destroy(&agent, Some(&handle), GRACE)
        .await
        .unwrap();
    assert!(!cgroup_of(&handle).exists());
}

/// A signal mask line of `/proc/<pid>/status` (`SigBlk`, `SigIgn`, ...).
fn signal_mask(pid: i32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let mask = status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .unwrap();
    u64::from_str_radix(mask.trim(), 16).unwrap()
}

/// Linux ≥ 5.7 offers `clone3(CLONE_INTO_CGROUP)`.
fn kernel_has_clone_into_cgroup() -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    let major: u32 = parts.next().unwrap().parse().unwrap();
    let minor: u32 = parts.next().unwrap().parse().unwrap();
    (major, minor) >= (5, 7)
}

async fn agent_runs_in_its_own_session_and_cgroup(method: SpawnMethod) {
    let fx = Fixture::with(|o| o.spawn_method = method);
    let ready = fx.fifo("ready");
    let binary = fx.script(
        "agent.sh",
        &format!("echo up > {}\nexec sleep 1000", ready.display()),
    );
    let scaler = simple_scaler(&binary);
    let (mut spec, _rx) = spawn_spec(&scaler, 0);
    spec.token = Some(kici_model::Secret::new("kat_secret"));
    let agent = spec.agent;
    let handle = fx.backend.spawn(spec).await.unwrap();
    assert_eq!(read_fifo(ready).await, "up\n");
    if method == SpawnMethod::Auto && kernel_has_clone_into_cgroup() {
        assert_eq!(
            kici_bare_metal::launch::clone_into_cgroup_supported(),
            Some(true)
        );
    }
    let leader = pid_of(&handle.id);
    let pid = leader.pid.as_raw_nonzero().get();
    // `exec sleep` kept the pid: argv is sleep's own now; the kernel's
    // record of what we exec'd is the leader's first exec — check the
    // session and the cgroup, and that the token never was an argument.
    let stat = ProcStat::read(leader.pid).unwrap();
    assert_eq!(stat.session, pid, "the agent leads its own session");
    let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let expected = format!("0::/kici-scaler/{}/metal/{agent}", fx.options.instance);
    assert!(cg.lines().any(|l| l == expected), "{cg}");
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    assert!(!String::from_utf8_lossy(&cmdline).contains("kat_secret"));
    // stdio and working directory as documented; no signal blocked, and
    // SIGPIPE not ignored (the Rust runtime ignores it in the daemon).
    let dir = fx.backend.agent_dir(agent);
    let link = |name: &str| std::fs::read_link(format!("/proc/{pid}/{name}")).unwrap();
    assert_eq!(link("fd/0"), Path::new("/dev/null"));
    assert_eq!(link("fd/1"), dir.join("stdout.log"));
    assert_eq!(link("fd/2"), dir.join("stderr.log"));
    let work = fx.backend.work_dir(agent);
    assert_eq!(link("cwd"), work);
    assert!(!work.starts_with(fx.path("state")), "{}", work.display());
    assert_eq!(signal_mask(pid, "SigBlk"), 0);
    assert_eq!(
        signal_mask(pid, "SigIgn") & (1 << (13 - 1)),
        0,
        "SIGPIPE ignored"
    );
    // No descriptor the backend opened leaked into the agent: no cgroup
    // file, state file, pidfd, inotify or epoll instance, and no pipe but
    // those this test process itself inherited (the harness's jobserver).
    // (The agent's own transient descriptors — its script, the libraries
    // `exec sleep` loads — may come and go meanwhile.)
    let our_pipes: BTreeSet<PathBuf> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.unwrap().path()).ok())
        .filter(|t| t.to_string_lossy().starts_with("pipe:"))
        .collect();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap() {
        let entry = entry.unwrap();
        let fd = entry.file_name().into_string().unwrap();
        if ["0", "1", "2"].contains(&fd.as_str()) {
            continue;
        }
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        let shown = target.to_string_lossy();
        // The shell's own copies of its stdout/stderr (saved around a
        // redirection) are the agent's business.
        let own_log = target == dir.join("stdout.log") || target == dir.join("stderr.log");
        assert!(
            (own_log || !target.starts_with(&fx.options.state_dir))
                && !target.starts_with("/sys/fs/cgroup")
                && !shown.starts_with("anon_inode:")
                && (!shown.starts_with("pipe:") || our_pipes.contains(&target)),
            "fd {fd} leaked into the agent: {shown}"
        );
    }
    assert_eq!(handle.extra["logs"], dir.display().to_string());
    fx.backend
        .destroy(&agent, Some(&handle), GRACE)
        .await
        .unwrap();
    assert!(!leader.is_running());
}

#[tokio::test]
async fn serial_agent_runs_in_its_own_session_and_cgroup_with_argv0_only() {
    agent_runs_in_its_own_session_and_cgroup(SpawnMethod::Auto).await;
}

/// A host user of this test's own, removed when dropped.
struct TestUser(String);

impl TestUser {
    fn create() -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let name = format!("kici-b-{:08x}", nanos ^ std::process::id());
        let ok = std::process::Command::new("useradd")
            .args([
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                &name,
            ])
            .status()
            .unwrap()
            .success();
        assert!(ok, "useradd {name}");
        TestUser(name)
    }
}

impl Drop for TestUser {
    fn drop(&mut self) {
        let _ = std::process::Command::new("pkill")
            .args(["-KILL", "-u", &self.0])
            .status();
        let _ = std::process::Command::new("userdel").arg(&self.0).status();
    }
}

/// `Uid:` / `Gid:` / `Groups:` of `/proc/<pid>/status`.
fn ids(pid: i32) -> (String, String, String) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .unwrap()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    (field("Uid:"), field("Gid:"), field("Groups:"))
}

/// A scaler naming `x-kici-scaler.user` runs its agents as that user —
/// real, effective, saved ids and groups — whichever way the child is
/// started, in a work dir of its own, removed with the agent.
#[tokio::test]
async fn serial_agent_runs_as_the_scalers_user_either_way_it_is_started() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let user = TestUser::create();
    let creds = kici_bare_metal::Credentials::resolve(&kici_model::AgentUser {
        user: user.0.clone(),
        group: None,
    })
    .unwrap();
    for method in [SpawnMethod::Auto, SpawnMethod::PreExec] {
        let fx = Fixture::with(|o| o.spawn_method = method);
        // The user must reach the script and its work root.
        std::fs::set_permissions(fx.dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
        let binary = fx.script("agent.sh", "exec sleep 1000");
        let mut scaler = (*simple_scaler(&binary)).clone();
        scaler.ext.agent_user = Some(kici_model::AgentUser {
            user: user.0.clone(),
            group: None,
        });
        let scaler = Arc::new(scaler);
        fx.backend.validate(&scaler).await.unwrap();
        let (spec, _rx) = spawn_spec(&scaler, 0);
        let agent = spec.agent;
        let handle = fx.backend.spawn(spec).await.unwrap();
        let pid = pid_of(&handle.id).pid.as_raw_nonzero().get();
        let (uid, gid, groups) = ids(pid);
        let u = creds.uid.to_string();
        let g = creds.gid.to_string();
        assert_eq!(uid, [u.as_str(); 4].join(" "), "{method:?}");
        assert_eq!(gid, [g.as_str(); 4].join(" "), "{method:?}");
        let expected: Vec<String> = creds.groups.iter().map(u32::to_string).collect();
        assert_eq!(groups, expected.join(" "), "{method:?}");
        let work = fx.backend.work_dir(agent);
        let meta = std::fs::metadata(&work).unwrap();
        assert_eq!((meta.uid(), meta.mode() & 0o7777), (creds.uid, 0o700));
        fx.backend
            .destroy(&agent, Some(&handle), GRACE)
            .await
            .unwrap();
        assert!(!work.exists(), "{method:?}: {} is left", work.display());
    }
}

#[tokio::test]
async fn serial_agent_started_by_the_pre_exec_fallback_is_set_up_alike() {
    agent_runs_in_its_own_session_and_cgroup(SpawnMethod::PreExec).await;
}

#[tokio::test]
async fn serial_a_binary_that_cannot_be_exec_d_fails_the_spawn_and_leaves_nothing() {
    for method in [SpawnMethod::Auto, SpawnMethod::PreExec] {
        let fx = Fixture::with(|o| o.spawn_method = method);
        // Valid when the config was checked, gone by the spawn.
        let binary = fx.script("agent.sh", "exit 0");
        let scaler = simple_scaler(&binary);
        std::fs::remove_file(&binary).unwrap();
        let (spec, mut rx) = spawn_spec(&scaler, 0);
        let agent = spec.agent;
        let err = fx.backend.spawn(spec).await.unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "cannot start {}: No such file or directory (os error 2)",
                binary.display()
            ),
            "{method:?}"
        );
        assert!(!fx.backend.agent_dir(agent).exists(), "{method:?}");
        assert!(!fx.layout().instance_dir().exists(), "{method:?}");
        assert!(rx.try_recv().is_err(), "{method:?}");
    }
}

#[tokio::test]
async fn serial_destroy_kills_a_setsid_grandchild_and_removes_the_cgroup() {
    let fx = Fixture::new();
    let ready = fx.fifo("ready");
    // The grandchild leaves the agent's session and ignores SIGTERM: only the
    // cgroup can still find and kill it.
    let binary = fx.script(
        "agent.sh",
        &format!(
            "setsid sh -c 'trap \"\" TERM; echo $$ > {}; exec sleep 1000' </dev/null >/dev/null 2>&1 &\nexec sleep 1000",
            ready.display()
        ),
    );
    let scaler = simple_scaler(&binary);
    let (spec, mut rx) = spawn_spec(&scaler, 0);
    let agent = spec.agent;
    let handle = fx.backend.spawn(spec).await.unwrap();
    let grandchild: i32 = read_fifo(ready).await.trim().parse().unwrap();
    let leader = pid_of(&handle.id);
    let tracking = cgroup_of(&handle);

    let members: Vec<ProcessIdentity> = cgroup::procs(&tracking)
        .unwrap()
        .into_iter()
        .map(|pid| ProcessIdentity::of(pid).unwrap())
        .collect();
    assert!(members.iter().any(|m| m.pid == leader.pid));
    let escaped = members
        .iter()
        .find(|m| m.pid.as_raw_nonzero().get() == grandchild)
        .expect("the grandchild is in the agent's cgroup");
    assert_ne!(
        ProcStat::read(escaped.pid).unwrap().session,
        leader.pid.as_raw_nonzero().get(),
        "the grandchild left the agent's session"
    );

    fx.backend
        .destroy(&agent, Some(&handle), Duration::from_millis(200))
        .await
        .unwrap();
    for member in &members {
        assert!(!member.is_running(), "{member} survived destroy");
    }
    assert!(!tracking.exists());
    assert!(!fx.layout().instance_dir().exists());
    assert!(!fx.backend.agent_dir(agent).exists());
    // Logs retired, and the destroy-caused exit is not reported as a failure.
    assert!(fx
        .backend
        .retired_dir()
        .join(agent.to_string())
        .join("stderr.log")
        .exists());
    assert!(rx.try_recv().is_err());
    // Idempotent.
    fx.backend
        .destroy(&agent, Some(&handle), GRACE)
        .await
        .unwrap();
    fx.backend.destroy(&agent, None, GRACE).await.unwrap();
}

#[tokio::test]
async fn serial_an_agent_exit_is_reported_at_once_and_reaped() {
    let fx = Fixture::new();
    let binary = fx.script("agent.sh", "exit 3");
    let scaler = simple_scaler(&binary);
    let (spec, mut rx) = spawn_spec(&scaler, 0);
    let agent = spec.agent;
    let handle = fx.backend.spawn(spec).await.unwrap();
    assert_eq!(next_report(&mut rx).await, exited(agent, "exit status 3"));
    // Reaped: no zombie is left under the pid.
    assert!(!pid_of(&handle.id).is_current());

    let binary = fx.script("killed.sh", "kill -USR1 $$");
    let scaler = simple_scaler(&binary);
    let (spec, mut rx2) = spawn_spec(&scaler, 0);
    let agent2 = spec.agent;
    let handle2 = fx.backend.spawn(spec).await.unwrap();
    assert_eq!(
        next_report(&mut rx2).await,
        exited(agent2, "killed by signal 10")
    );
    fx.backend
        .destroy(&agent, Some(&handle), GRACE)
        .await
        .unwrap();
    fx.backend
        .destroy(&agent2, Some(&handle2), GRACE)
        .await
        .unwrap();
    assert!(!cgroup_of(&handle).exists() && !cgroup_of(&handle2).exists());
}

/// SIGTERM pending (delivered but blocked) for the process, from
/// `/proc/<pid>/status`.
fn term_pending(pid: u32) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .filter_map(|l| {
            l.strip_prefix("SigPnd:")
                .or_else(|| l.strip_prefix("ShdPnd:"))
        })
        .any(|mask| u64::from_str_radix(mask.trim(), 16).unwrap() & (1 << (15 - 1)) != 0)
}

#[tokio::test]
async fn serial_a_pid_whose_start_time_differs_is_not_signalled() {
    use std::io::BufRead;
    let fx = Fixture::new();
    // Not an agent: a process (its own group leader) that happens to hold
    // the pid a handle names. It blocks SIGTERM, so a SIGTERM sent to it
    // stays visible as pending instead of racing with its death.
    let mut bystander = std::process::Command::new("perl")
        .args([
            "-MPOSIX",
            "-e",
            r#"sigprocmask(SIG_BLOCK, POSIX::SigSet->new(SIGTERM)) or die; $| = 1; print "ready\n"; sleep 1000"#,
        ])
        .stdout(std::process::Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap();
    let mut ready = String::new();
    std::io::BufReader::new(bystander.stdout.take().unwrap())
        .read_line(&mut ready)
        .unwrap();
    assert_eq!(ready, "ready\n");
    let pid = rustix::process::Pid::from_raw(bystander.id() as i32).unwrap();
    let real = ProcessIdentity::of(pid).unwrap();
    let stale = ProcessIdentity {
        start_time: real.start_time - 1,
        ..real
    };
    let agent = AgentId::random(ScalerType::BareMetal);
    let handle = kici_engine::ResourceHandle {
        id: stale.to_string(),
        extra: Default::default(),
    };
    fx.backend
        .destroy(&agent, Some(&handle), GRACE)
        .await
        .unwrap();
    assert!(!term_pending(bystander.id()), "a reused pid was signalled");
    assert!(real.is_running());

    // The same handle with the matching start time is signalled (SIGTERM,
    // then SIGKILL after the grace since TERM is blocked): the check, not
    // luck, protected the bystander.
    let handle = kici_engine::ResourceHandle {
        id: real.to_string(),
        extra: Default::default(),
    };
    fx.backend
        .destroy(&agent, Some(&handle), Duration::from_millis(100))
        .await
        .unwrap();
    let status = bystander.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(9));
}

#[tokio::test]
async fn serial_memory_limit_oom_kills_the_agent_on_cgroup_v1() {
    let fx = Fixture::new();
    // `tail` keeps the "last line" of newline-free input: it grows forever.
    let binary = fx.script("hog.sh", "exec tail /dev/zero");
    let scaler = scaler(
        &format!(
            r#"
version: 1
scalers:
  - name: limited
    type: bare-metal
    maxAgents: 1
    enforceCgroups: true
    labelSets:
      - labels: [hog]
        binaryPath: {}
        resources: {{ cpus: 0.5, memory: 50m }}
"#,
            binary.display()
        ),
        "limited",
    );
    let (spec, mut rx) = spawn_spec(&scaler, 0);
    let agent = spec.agent;
    let handle = fx.backend.spawn(spec).await.unwrap();
    // This host's v2 mount has no controllers: limits land on v1.
    let memory = PathBuf::from(&handle.extra["cgroup-v1-memory"]);
    let cpu = PathBuf::from(&handle.extra["cgroup-v1-cpu"]);
    let read = |p: &Path| std::fs::read_to_string(p).unwrap().trim().to_owned();
    assert_eq!(read(&memory.join("memory.limit_in_bytes")), "52428800");
    assert_eq!(read(&cpu.join("cpu.cfs_quota_us")), "50000");
    assert_eq!(read(&cpu.join("cpu.cfs_period_us")), "100000");

    assert_eq!(
        next_report(&mut rx).await,
        exited(agent, "killed by signal 9")
    );
    let oom = read(&memory.join("memory.oom_control"));
    let kills: u64 = oom
        .lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .expect("oom_kill counter")
        .parse()
        .unwrap();
    assert!(kills >= 1, "{oom}");

    fx.backend
        .destroy(&agent, Some(&handle), GRACE)
        .await
        .unwrap();
    assert!(!memory.exists() && !cpu.exists() && !cgroup_of(&handle).exists());
    // Nothing of the instance is left in any hierarchy.
    let instance = fx.options.instance.to_string();
    for root in [
        fx.layout().v2_root().to_owned(),
        fx.layout().v1_dir(cgroup::V1Controller::Memory),
        fx.layout().v1_dir(cgroup::V1Controller::Cpu),
    ] {
        assert!(
            !root.join(cgroup::TREE).join(&instance).exists(),
            "{root:?}"
        );
    }
}

#[tokio::test]
async fn spawn_refuses_limits_no_controller_can_enforce() {
    // Fake roots: a v2 "mount" offering no controllers, no v1 hierarchies.
    let fake = tempfile::tempdir().unwrap();
    let v2 = fake.path().join("unified");
    std::fs::create_dir_all(&v2).unwrap();
    std::fs::write(v2.join("cgroup.controllers"), "").unwrap();
    std::fs::write(v2.join("cgroup.procs"), "").unwrap();
    let fx = Fixture::with(|o| {
        o.cgroup_root = v2.clone();
        o.cgroup_v1_root = fake.path().join("v1");
    });
    let scaler = scaler(
        r#"
version: 1
scalers:
  - name: limited
    type: bare-metal
    maxAgents: 1
    enforceCgroups: true
    labelSets:
      - labels: [x]
        binaryPath: /bin/true
        resources: { memory: 50m }
"#,
        "limited",
    );
    let (spec, _rx) = spawn_spec(&scaler, 0);
    let agent = spec.agent;
    let err = fx.backend.spawn(spec).await.unwrap_err();
    let message = err.to_string();
    assert!(
        message.starts_with("a memory limit of 50m cannot be enforced"),
        "{message}"
    );
    assert!(message.contains(&v2.display().to_string()));
    // Nothing was created.
    assert!(!fx.backend.agent_dir(agent).exists());
    assert!(!fx.layout().instance_dir().exists());
    // And validate says so before any spawn.
    let errors = fx.backend.validate(&scaler).await.unwrap_err().messages();
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(errors[0].starts_with("enforceCgroups: no memory controller"));
    assert!(errors[1].starts_with("enforceCgroups: no cpu controller"));
}

#[tokio::test]
async fn serial_destroy_works_without_handle_after_a_restart_and_after_exit() {
    let fx = Fixture::new();
    let ready = fx.fifo("ready");
    let sleeper = fx.script(
        "sleeper.sh",
        &format!("echo up > {}\nexec sleep 1000", ready.display()),
    );
    let (spec_a, _rx_a) = spawn_spec(&simple_scaler(&sleeper), 0);
    let a = spec_a.agent;
    let handle_a = fx.backend.spawn(spec_a).await.unwrap();
    read_fifo(ready).await;
    let leader = pid_of(&handle_a.id);

    // A new daemon knows nothing but the agent id.
    let restarted = fx.restarted();
    restarted.destroy(&a, None, GRACE).await.unwrap();
    assert!(!leader.is_running());
    assert!(!cgroup_of(&handle_a).exists());
    assert!(!fx.backend.agent_dir(a).exists());

    // An agent already gone: destroy without handle still cleans up.
    let quitter = fx.script("quitter.sh", "exit 0");
    let (spec_b, mut rx_b) = spawn_spec(&simple_scaler(&quitter), 0);
    let b = spec_b.agent;
    let handle_b = fx.backend.spawn(spec_b).await.unwrap();
    assert_eq!(next_report(&mut rx_b).await, exited(b, "exit status 0"));
    restarted.destroy(&b, None, GRACE).await.unwrap();
    assert!(!cgroup_of(&handle_b).exists());
    assert!(!fx.backend.agent_dir(b).exists());
    // The first daemon still tracked it: its destroy is a no-op now.
    fx.backend
        .destroy(&b, Some(&handle_b), GRACE)
        .await
        .unwrap();
    assert!(fx.backend.list_owned().await.unwrap().is_empty());
}

#[tokio::test]
async fn serial_list_owned_finds_exactly_our_agents() {
    let fx = Fixture::new();
    let other = Fixture::new();
    let binary = fx.script("sleeper.sh", "exec sleep 1000");
    let yaml = format!(
        r#"
version: 1
scalers:
  - name: one
    type: bare-metal
    maxAgents: 2
    labelSets:
      - labels: [one]
        binaryPath: {b}
  - name: two.with/odd:name
    type: bare-metal
    maxAgents: 2
    labelSets:
      - labels: [two]
        binaryPath: {b}
"#,
        b = binary.display()
    );
    let scaler_one = scaler(&yaml, "one");
    let scaler_two = scaler(&yaml, "two.with/odd:name");
    let mut handles = Vec::new();
    for s in [&scaler_one, &scaler_two] {
        let (spec, _rx) = spawn_spec(s, 0);
        let agent = spec.agent;
        handles.push((agent, fx.backend.spawn(spec).await.unwrap()));
    }
    // Another instance's agent on the same host is not ours.
    let (spec_other, _rx) = spawn_spec(&Arc::clone(&scaler_one), 0);
    let other_agent = spec_other.agent;
    let other_handle = other.backend.spawn(spec_other).await.unwrap();

    let owned = fx.backend.list_owned().await.unwrap();
    let found: BTreeSet<AgentId> = owned.iter().filter_map(|o| o.agent).collect();
    let expected: BTreeSet<AgentId> = handles.iter().map(|(a, _)| *a).collect();
    assert_eq!(found, expected);
    assert_eq!(owned.len(), 2);
    for (agent, handle) in &handles {
        let listed = owned.iter().find(|o| o.agent == Some(*agent)).unwrap();
        assert_eq!(&listed.handle, handle);
        let age = std::time::SystemTime::now()
            .duration_since(listed.created_at)
            .unwrap();
        assert!(age < Duration::from_secs(600));
    }
    assert!(handles[1].1.extra["cgroup"].contains("/two_with_odd_name/"));

    for (agent, handle) in &handles {
        fx.backend
            .destroy(agent, Some(handle), GRACE)
            .await
            .unwrap();
    }
    assert!(fx.backend.list_owned().await.unwrap().is_empty());
    other
        .backend
        .destroy(&other_agent, Some(&other_handle), GRACE)
        .await
        .unwrap();
    // The instance's directories went with its last agent.
    assert!(!fx.layout().instance_dir().exists());
    assert!(!other.layout().instance_dir().exists());
}

#[tokio::test]
async fn validate_checks_binaries_and_the_cgroup_root() {
    let fx = Fixture::new();
    let not_exec = fx.path("plain.txt");
    std::fs::write(&not_exec, "x").unwrap();
    let yaml = format!(
        r#"
version: 1
scalers:
  - name: metal
    type: bare-metal
    maxAgents: 1
    enforceCgroups: true
    labelSets:
      - labels: [a]
        binaryPath: /bin/true
      - labels: [b]
        binaryPath: {}
      - labels: [c]
        binaryPath: /nonexistent/agent
      - labels: [d]
        binaryPath: /usr
"#,
        not_exec.display()
    );
    let errors = fx
        .backend
        .validate(&scaler(&yaml, "metal"))
        .await
        .unwrap_err()
        .messages();
    assert_eq!(
        errors,
        vec![
            format!(
                "labelSets[1].binaryPath: {} is not executable",
                not_exec.display()
            ),
            "labelSets[2].binaryPath: /nonexistent/agent: No such file or directory (os error 2)"
                .to_owned(),
            "labelSets[3].binaryPath: /usr is not a file".to_owned(),
        ]
    );
    // The real host: v2 mounted and writable, v1 memory and cpu present.
    fx.backend
        .validate(&simple_scaler(Path::new("/bin/true")))
        .await
        .unwrap();

    let fake = tempfile::tempdir().unwrap();
    let broken = Fixture::with(|o| o.cgroup_root = fake.path().join("nothing"));
    let errors = broken
        .backend
        .validate(&simple_scaler(Path::new("/bin/true")))
        .await
        .unwrap_err()
        .messages();
    assert_eq!(errors.len(), 1);
    assert!(errors[0].ends_with(
        "is not a cgroup v2 mount: bare-metal agents need one to be tracked and killed"
    ));
}

/// A tracing writer into a shared buffer.
#[derive(Clone, Default)]
struct Capture(Arc<std::sync::Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Capture {
    type Writer = Capture;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

#[tokio::test]
async fn serial_agent_lines_are_forwarded_wrapped_never_merged() {
    use tracing_subscriber::layer::SubscriberExt;
    let capture = Capture::default();
    // The daemon's JSON log format, fields flattened into the event object.
    let subscriber = tracing_subscriber::registry().with(
        tracing_subscriber::fmt::layer()
            .json()
            .flatten_event(true)
            .with_writer(capture.clone()),
    );
    let _guard = tracing::subscriber::set_default(subscriber);

    let fx = Fixture::new();
    let evil = r#"{"agentId":"evil","level":"error","job_id":"other","source":"x"}"#;
    let binary = fx.script(
        "agent.sh",
        &format!("printf '%s\\n' '{evil}'\necho 'plain stderr' >&2\nprintf 'no newline at end'"),
    );
    let scaler = simple_scaler(&binary);
    let (spec, mut rx) = spawn_spec(&scaler, 0);
    let agent = spec.agent;
    let handle = fx.backend.spawn(spec).await.unwrap();
    assert_eq!(next_report(&mut rx).await, exited(agent, "exit status 0"));
    // Destroy drains the tailer: every line is out when it returns.
    fx.backend
        .destroy(&agent, Some(&handle), GRACE)
        .await
        .unwrap();

    let out = String::from_utf8(capture.0.lock().unwrap().clone()).unwrap();
    let mut events: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|e| e["target"] == kici_host::logs::TARGET)
        .collect();
    events.sort_by_key(|e| (e["stream"].to_string(), e["line"].to_string()));
    let summary: Vec<(&str, &str)> = events
        .iter()
        .map(|e| (e["stream"].as_str().unwrap(), e["line"].as_str().unwrap()))
        .collect();
    assert_eq!(
        summary,
        vec![
            ("stderr", "plain stderr"),
            ("stdout", "no newline at end"),
            ("stdout", evil),
        ]
    );
    for e in &events {
        assert_eq!(e["agent_id"], agent.to_string().as_str());
        assert_eq!(e["scaler"], "metal");
        assert_eq!(e["job_id"], "job-1");
        assert_eq!(e["source"], "bare-metal");
        assert_eq!(e["level"], "INFO");
        // The agent's JSON stayed inside `line`: nothing of it became a field.
        assert!(e.get("agentId").is_none());
        let keys: BTreeSet<&str> = e.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            BTreeSet::from([
                "timestamp",
                "level",
                "target",
                "message",
                "agent_id",
                "scaler",
                "job_id",
                "stream",
                "source",
                "line",
            ])
        );
    }
}

#[tokio::test]
async fn serial_a_pids_limit_stops_forks_on_cgroup_v1() {
    let fx = Fixture::with(|o| o.pids_max = std::num::NonZeroU64::new(8));
    let ready = fx.fifo("ready");
    // Tries 20 forks, counts the ones that worked, reports, then waits.
    let binary = fx.script(
        "forker.sh",
        &format!(
            r#"exec perl -e 'my $n = 0; for (1..20) {{ my $p = fork; last unless defined $p; if ($p == 0) {{ sleep 1000; exit }} $n++ }} open my $f, ">", "{}" or die; print $f "$n\n"; close $f; sleep 1000'"#,
            ready.display()
        ),
    );
    let scaler = simple_scaler(&binary);
    fx.backend.validate(&scaler).await.unwrap();
    let (spec, _rx) = spawn_spec(&scaler, 0);
    let agent = spec.agent;
    let handle = fx.backend.spawn(spec).await.unwrap();
    let forked: u32 = read_fifo(ready).await.trim().parse().unwrap();
    // This host's v2 mount has no pids controller: the limit is on v1.
    let pids = PathBuf::from(&handle.extra["cgroup-v1-pids"]);
    let read = |name: &str| std::fs::read_to_string(pids.join(name)).unwrap();
    assert_eq!(read("pids.max").trim(), "8");
    // The leader and 7 children: the 8th fork was refused.
    assert_eq!(forked, 7);
    assert_eq!(read("pids.current").trim(), "8");
    assert_eq!(cgroup::procs(&cgroup_of(&handle)).unwrap().len(), 8);
    fx.backend
        .destroy(&agent, Some(&handle), GRACE)
        .await
        .unwrap();
    assert!(!pids.exists() && !cgroup_of(&handle).exists());
    assert!(!fx
        .layout()
        .v1_dir(cgroup::V1Controller::Pids)
        .join(cgroup::TREE)
        .join(fx.options.instance.to_string())
        .exists());
}

#[tokio::test]
async fn a_pids_limit_no_controller_can_enforce_is_refused() {
    let fake = tempfile::tempdir().unwrap();
    let v2 = fake.path().join("unified");
    std::fs::create_dir_all(&v2).unwrap();
    std::fs::write(v2.join("cgroup.controllers"), "").unwrap();
    std::fs::write(v2.join("cgroup.procs"), "").unwrap();
    let fx = Fixture::with(|o| {
        o.cgroup_root = v2.clone();
        o.cgroup_v1_root = fake.path().join("v1");
        o.pids_max = std::num::NonZeroU64::new(100);
    });
    let scaler = simple_scaler(Path::new("/bin/true"));
    let errors = fx.backend.validate(&scaler).await.unwrap_err().messages();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].starts_with("pids limit 100: no pids controller"));
    let (spec, _rx) = spawn_spec(&scaler, 0);
    let agent = spec.agent;
    let err = fx.backend.spawn(spec).await.unwrap_err();
    assert!(err
        .to_string()
        .starts_with("a pids limit of 100 cannot be enforced"));
    assert!(!fx.backend.agent_dir(agent).exists());
}

/// Forwarded agent lines, as they are emitted.
struct ForwardedLines(tokio::sync::mpsc::UnboundedSender<String>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for ForwardedLines {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Visit(Option<String>);
        impl tracing::field::Visit for Visit {
            fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
                if field.name() == "line" {
                    self.0 = Some(value.to_owned());
                }
            }
            fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
        }
        let mut visit = Visit(None);
        event.record(&mut visit);
        if let Some(line) = visit.0 {
            let _ = self.0.send(line);
        }
    }
}

#[tokio::test]
async fn serial_a_running_agent_s_log_file_stays_bounded_on_disk() {
    use std::os::unix::fs::MetadataExt;
    use tracing_subscriber::layer::SubscriberExt;
    let (tx, mut lines) = tokio::sync::mpsc::unbounded_channel();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(ForwardedLines(tx)));
    let keep = kici_host::logs::RETAINED_BYTES_PER_FILE;
    let fx = Fixture::with(|o| o.log_keep_bytes = std::num::NonZeroU64::new(keep));
    // 100,000 lines of 7 bytes, then the agent keeps running.
    let binary = fx.script("chatty.sh", "seq -w 1 100000\nexec sleep 1000");
    let (spec, _rx) = spawn_spec(&simple_scaler(&binary), 0);
    let agent = spec.agent;
    let handle = fx.backend.spawn(spec).await.unwrap();
    let mut expected = 1;
    while expected <= 100_000 {
        let line = tokio::time::timeout(Duration::from_secs(60), lines.recv())
            .await
            .expect("forwarded within a minute")
            .unwrap();
        assert_eq!(line, format!("{expected:06}"));
        expected += 1;
    }
    let log = fx.backend.agent_dir(agent).join("stdout.log");
    let meta = std::fs::metadata(&log).unwrap();
    assert_eq!(meta.len(), 700_000);
    let on_disk = meta.blocks() * 512;
    assert!(
        on_disk <= keep + keep / 4 + 16 * 1024,
        "{on_disk} bytes on disk"
    );
    let head = std::fs::read(&log).unwrap();
    assert!(head.starts_with(b"[kici-scaler: the first "));
    fx.backend
        .destroy(&agent, Some(&handle), GRACE)
        .await
        .unwrap();
    // The retired tail is real output, not a hole.
    let retired = std::fs::read(
        fx.backend
            .retired_dir()
            .join(agent.to_string())
            .join("stdout.log"),
    )
    .unwrap();
    assert_eq!(retired.len() as u64, keep);
    assert!(retired.ends_with(b"099999\n100000\n") && !retired.contains(&0));
}
