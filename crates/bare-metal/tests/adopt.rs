#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Re-adopting bare-metal agents after a daemon restart, with a real first
//! daemon: a child process (this test binary, re-run as
//! [`first_daemon_helper`]) spawns the agent and exits without destroying
//! it, so the agent is orphaned and reparented exactly as after a crash —
//! it is not this process's child. A second backend over the same state dir
//! and instance then adopts it.

mod common;

use common::{next_report, read_fifo, simple_scaler, spec as spawn_spec, Fixture};
use kici_bare_metal::cgroup;
use kici_bare_metal::{BareMetalBackend, BareMetalOptions};
use kici_engine::{Adoption, Backend, BackendReport, ResourceHandle};
use kici_host::process::{ProcStat, ProcessIdentity};
use kici_model::{AgentId, InstanceId};
use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

const GRACE: Duration = Duration::from_secs(5);
const HELPER: &str = "first_daemon_helper";
const HELPER_ENV: &str = "KICI_TEST_FIRST_DAEMON";

/// Not a test of its own: the body of the first daemon, run in a child
/// process by [`first_daemon`]. Without its environment it does nothing.
#[tokio::test]
async fn first_daemon_helper() {
    let Ok(out) = std::env::var(HELPER_ENV) else {
        return;
    };
    let var = |name: &str| std::env::var(name).unwrap();
    let options = BareMetalOptions::new(
        var("KICI_TEST_INSTANCE").parse::<InstanceId>().unwrap(),
        PathBuf::from(var("KICI_TEST_STATE_DIR")),
        Vec::new(),
    );
    let backend = BareMetalBackend::new(options).unwrap();
    let scaler = simple_scaler(Path::new(&var("KICI_TEST_BINARY")));
    let (spec, _rx) = spawn_spec(&scaler, 0);
    let agent = spec.agent;
    let handle = backend.spawn(spec).await.unwrap();
    let mut text = format!("{agent}\n{}\n", handle.id);
    for (k, v) in &handle.extra {
        text.push_str(&format!("{k}={v}\n"));
    }
    std::fs::write(out, text).unwrap();
    // A crash: no destroy, no drain, nothing cleaned up.
    std::process::exit(0);
}

/// Runs the first daemon to the point where it spawned `binary` and died.
fn first_daemon(fx: &Fixture, binary: &Path) -> (AgentId, ResourceHandle) {
    let out = fx.path("first-daemon.out");
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", HELPER, "--nocapture", "--test-threads=1"])
        .env(HELPER_ENV, &out)
        .env("KICI_TEST_INSTANCE", fx.options.instance.to_string())
        .env("KICI_TEST_STATE_DIR", &fx.options.state_dir)
        .env("KICI_TEST_BINARY", binary)
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "the first daemon failed: {status}");
    let text = std::fs::read_to_string(out).unwrap();
    let mut lines = text.lines();
    let agent = lines.next().unwrap().parse().unwrap();
    let id = lines.next().unwrap().to_owned();
    let extra: BTreeMap<String, String> = lines
        .map(|l| {
            let (k, v) = l.split_once('=').unwrap();
            (k.to_owned(), v.to_owned())
        })
        .collect();
    (agent, ResourceHandle { id, extra })
}

fn parent_of(pid: rustix::process::Pid) -> i32 {
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", pid.as_raw_nonzero())).unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 1..];
    rest.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Writes `text` into a fifo (blocks until the agent opens it).
async fn write_fifo(path: PathBuf, text: &'static str) {
    tokio::task::spawn_blocking(move || {
        let mut f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        f.write_all(text.as_bytes()).unwrap();
    })
    .await
    .unwrap();
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
async fn serial_an_adopted_agent_is_watched_and_its_logs_resume() {
    use tracing_subscriber::layer::SubscriberExt;
    let capture = Capture::default();
    let subscriber = tracing_subscriber::registry().with(
        tracing_subscriber::fmt::layer()
            .json()
            .flatten_event(true)
            .with_writer(capture.clone()),
    );
    let _guard = tracing::subscriber::set_default(subscriber);

    let fx = Fixture::new();
    let ready = fx.fifo("ready");
    let down = fx.fifo("down");
    let ack = fx.fifo("ack");
    let go = fx.fifo("go");
    let binary = fx.script(
        "agent.sh",
        &format!(
            "echo 'before the restart'\necho up > {ready}\nread x < {down}\necho 'while no daemon ran'\necho done > {ack}\nread y < {go}\necho 'after adoption'\nexit 7",
            ready = ready.display(),
            down = down.display(),
            ack = ack.display(),
            go = go.display(),
        ),
    );
    let (agent, handle) = first_daemon(&fx, &binary);
    assert_eq!(read_fifo(ready).await, "up\n");
    let leader: ProcessIdentity = handle.id.parse().unwrap();
    assert!(leader.is_running());
    // Orphaned: the first daemon is gone and the agent is not our child, so
    // nothing here may (or could) reap it.
    assert_ne!(parent_of(leader.pid), std::process::id() as i32);
    // Output written while no daemon runs.
    write_fifo(down, "go\n").await;
    assert_eq!(read_fifo(ack).await, "done\n");

    let restarted = fx.restarted();
    let (reports, mut rx) = tokio::sync::mpsc::unbounded_channel();
    assert_eq!(
        restarted
            .adopt(&agent, &handle, reports.clone())
            .await
            .unwrap(),
        Adoption::Alive
    );
    // Adopting twice watches once.
    assert_eq!(
        restarted.adopt(&agent, &handle, reports).await.unwrap(),
        Adoption::Alive
    );
    write_fifo(go, "go\n").await;
    assert_eq!(
        next_report(&mut rx).await,
        BackendReport::Exited {
            agent,
            detail:
                "exited (status unknown: adopted after a daemon restart, reaped by its new parent)"
                    .into()
        }
    );
    // Reported once.
    restarted
        .destroy(&agent, Some(&handle), GRACE)
        .await
        .unwrap();
    assert!(rx.try_recv().is_err());
    assert!(!PathBuf::from(&handle.extra["cgroup"]).exists());
    assert!(!restarted.agent_dir(agent).exists());

    let out = String::from_utf8(capture.0.lock().unwrap().clone()).unwrap();
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|e| e["target"] == kici_host::logs::TARGET)
        .collect();
    let text: Vec<&str> = lines.iter().map(|e| e["line"].as_str().unwrap()).collect();
    // Whatever the first daemon had not forwarded yet is forwarded now: the
    // tailer resumed at the persisted offset, not at the end.
    assert!(text.contains(&"while no daemon ran"), "{text:?}");
    assert!(text.contains(&"after adoption"), "{text:?}");
    assert_eq!(
        text.iter().filter(|l| **l == "after adoption").count(),
        1,
        "{text:?}"
    );
    for e in &lines {
        assert_eq!(e["agent_id"], agent.to_string().as_str());
        assert_eq!(e["scaler"], "metal");
        assert_eq!(e["job_id"], "job-1");
    }
}

#[tokio::test]
async fn serial_a_reused_pid_is_gone_and_destroy_after_adopt_kills_the_cgroup() {
    let fx = Fixture::new();
    let ready = fx.fifo("ready");
    let binary = fx.script(
        "agent.sh",
        &format!(
            "setsid sh -c 'trap \"\" TERM; echo $$ > {}; exec sleep 1000' </dev/null >/dev/null 2>&1 &\nexec sleep 1000",
            ready.display()
        ),
    );
    let (agent, handle) = first_daemon(&fx, &binary);
    let grandchild: i32 = read_fifo(ready).await.trim().parse().unwrap();
    let leader: ProcessIdentity = handle.id.parse().unwrap();
    let tracking = PathBuf::from(&handle.extra["cgroup"]);
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
        leader.pid.as_raw_nonzero().get()
    );

    let restarted = fx.restarted();
    let (reports, mut rx) = tokio::sync::mpsc::unbounded_channel();
    // The pid names another process now (its start time differs).
    let reused = ResourceHandle {
        id: ProcessIdentity {
            start_time: leader.start_time + 1,
            ..leader
        }
        .to_string(),
        extra: handle.extra.clone(),
    };
    assert_eq!(
        restarted
            .adopt(&agent, &reused, reports.clone())
            .await
            .unwrap(),
        Adoption::Gone
    );
    // Gone is not watched: adopting with the right identity still works.
    assert_eq!(
        restarted.adopt(&agent, &handle, reports).await.unwrap(),
        Adoption::Alive
    );
    restarted
        .destroy(&agent, Some(&handle), Duration::from_millis(200))
        .await
        .unwrap();
    for member in &members {
        assert!(!member.is_running(), "{member} survived destroy");
    }
    assert!(!tracking.exists());
    assert!(!restarted.agent_dir(agent).exists());
    assert!(!fx.layout().instance_dir().exists());
    // The destroy-caused exit is not reported.
    assert!(rx.try_recv().is_err());
}

#[tokio::test]
async fn serial_an_agent_gone_during_the_restart_is_gone() {
    let fx = Fixture::new();
    let binary = fx.script("agent.sh", "exit 0");
    let (agent, handle) = first_daemon(&fx, &binary);
    let leader: ProcessIdentity = handle.id.parse().unwrap();
    let restarted = fx.restarted();
    let (reports, mut rx) = tokio::sync::mpsc::unbounded_channel();
    // Wait for its exit (its new parent reaps it) through a pidfd of our own.
    if let Ok(pidfd) = rustix::process::pidfd_open(leader.pid, rustix::process::PidfdFlags::empty())
    {
        let exited = tokio::task::spawn_blocking(move || {
            use rustix::event::{poll, PollFd, PollFlags};
            let mut fds = [PollFd::new(&pidfd, PollFlags::IN)];
            // Bounded only against a hang.
            let timeout = rustix::event::Timespec {
                tv_sec: 60,
                tv_nsec: 0,
            };
            poll(&mut fds, Some(&timeout)).unwrap()
        });
        assert_eq!(exited.await.unwrap(), 1, "the agent exits within a minute");
    }
    assert!(!leader.is_running());
    assert_eq!(
        restarted.adopt(&agent, &handle, reports).await.unwrap(),
        Adoption::Gone
    );
    // No handle recorded (a spawn cut short): the marker file is read, and
    // without one the agent is gone.
    let (reports2, _rx2) = tokio::sync::mpsc::unbounded_channel();
    let bare = ResourceHandle {
        id: format!("agent:{agent}"),
        extra: BTreeMap::new(),
    };
    assert_eq!(
        restarted.adopt(&agent, &bare, reports2).await.unwrap(),
        Adoption::Gone
    );
    // destroy still cleans up the cgroup and the files.
    restarted.destroy(&agent, None, GRACE).await.unwrap();
    assert!(!PathBuf::from(&handle.extra["cgroup"]).exists());
    assert!(!restarted.agent_dir(agent).exists());
    assert!(rx.try_recv().is_err());
}

#[tokio::test]
async fn serial_an_adopted_agent_that_is_our_child_is_reaped_with_its_status() {
    // As when the daemon is a child subreaper: the recorded agent's parent
    // is this very process. Its exit must be reaped here (no zombie) and
    // its status is then known.
    let fx = Fixture::new();
    let go = fx.fifo("go");
    let script = fx.script("child.sh", &format!("read x < {}\nexit 5", go.display()));
    let child = std::process::Command::new(&script)
        .process_group(0)
        .spawn()
        .unwrap();
    let pid = rustix::process::Pid::from_raw(child.id() as i32).unwrap();
    let identity = ProcessIdentity::of(pid).unwrap();
    let agent = AgentId::random(kici_model::ScalerType::BareMetal);
    let handle = ResourceHandle {
        id: identity.to_string(),
        extra: BTreeMap::new(),
    };
    let (reports, mut rx) = tokio::sync::mpsc::unbounded_channel();
    assert_eq!(
        fx.backend.adopt(&agent, &handle, reports).await.unwrap(),
        Adoption::Alive
    );
    write_fifo(go, "go\n").await;
    assert_eq!(
        next_report(&mut rx).await,
        BackendReport::Exited {
            agent,
            detail: "exit status 5".into()
        }
    );
    assert!(!identity.is_current(), "left as a zombie");
    fx.backend
        .destroy(&agent, Some(&handle), GRACE)
        .await
        .unwrap();
    drop(child);
}
