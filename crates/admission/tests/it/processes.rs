//! Real processes sharing one ledger directory. The test binary re-executes
//! itself (`KICI_ADMISSION_TEST_CHILD` selects the child's role), so every
//! child is a separate process with its own owner lock, exactly as two
//! daemons on one host.
// Under `--cfg loom` the sync primitives only work inside `loom::model`.
#![cfg(not(loom))]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use common::{agent, demand, ConfigBuilder};
use kici_admission::ledger::LedgerOptions;
use kici_admission::{Admission, AdmitError, Cap, Holds, MachineLedger};
use kici_model::{AgentId, InstanceId};
use rustix::fs::{flock, FlockOperation};
use std::collections::HashSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const CHILD_ENV: &str = "KICI_ADMISSION_TEST_CHILD";
const POOL_CPU: u64 = 4000;
const AGENT_CPU: u64 = 1000;
const CHILDREN: u32 = 3;
const ITERATIONS: u32 = 100;

fn config() -> kici_model::Config {
    ConfigBuilder::new(1000)
        .pool("shared", Some(POOL_CPU), None)
        .scaler("s", 1000, None, None, Some("shared"))
        .build()
}

fn admission(dir: &Path, instance: &str) -> (Admission, MachineLedger) {
    let options = LedgerOptions {
        lock_timeout: Duration::from_secs(60),
        ..LedgerOptions::default()
    };
    let ledger = MachineLedger::open_with(Some(dir), instance.parse().unwrap(), options).unwrap();
    (
        Admission::new(&config(), Some(ledger.clone())).unwrap(),
        ledger,
    )
}

/// The entry point of child processes; a no-op in the parent's own run.
#[test]
fn child_entry() {
    let Ok(role) = std::env::var(CHILD_ENV) else {
        return;
    };
    let dir = PathBuf::from(std::env::var("CHILD_DIR").unwrap());
    let instance = std::env::var("CHILD_INSTANCE").unwrap();
    match role.as_str() {
        "hammer" => hammer(&dir, &instance),
        "hold" => hold(&dir, &instance),
        other => panic!("unknown child role {other}"),
    }
}

/// An independent witness of how much is reserved across processes: a
/// counter file under its own `flock`, raised after a reservation succeeds
/// and lowered before it is released, so it never exceeds the truth.
fn witness_add(dir: &Path, delta: i64) -> i64 {
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join("witness.lock"))
        .unwrap();
    flock(&lock, FlockOperation::LockExclusive).unwrap();
    let path = dir.join("witness.count");
    let now: i64 = std::fs::read_to_string(&path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
        + delta;
    std::fs::write(&path, now.to_string()).unwrap();
    now
}

fn hammer(dir: &Path, instance: &str) {
    let (adm, _ledger) = admission(dir, instance);
    let witness_dir = PathBuf::from(std::env::var("CHILD_WITNESS").unwrap());
    let (mut admitted, mut refused, mut violations) = (0u64, 0u64, 0u64);
    for i in 0..ITERATIONS {
        // Hold up to two at a time: three processes want up to six agents
        // of 1 cpu in a 4-cpu pool.
        let mut held = Vec::new();
        for k in 0..2 {
            match adm.try_reserve(
                demand(2 * i + k, "s", AGENT_CPU, 0, Some("shared")),
                &Holds::none(),
            ) {
                Ok(r) => {
                    admitted += 1;
                    let cpu = witness_add(&witness_dir, AGENT_CPU as i64);
                    if cpu > POOL_CPU as i64 {
                        violations += 1;
                    }
                    held.push(r);
                }
                Err(AdmitError::Refused(r)) if r.cap == Cap::PoolCpu => refused += 1,
                Err(e) => panic!("unexpected admission error: {e}"),
            }
        }
        for r in held {
            witness_add(&witness_dir, -(AGENT_CPU as i64));
            drop(r);
        }
    }
    println!("CHILD admitted={admitted} refused={refused} violations={violations}");
    std::io::stdout().flush().unwrap();
}

fn hold(dir: &Path, instance: &str) {
    let (adm, _ledger) = admission(dir, instance);
    let held: Vec<_> = (1..=3)
        .map(|i| {
            adm.try_reserve(demand(i, "s", AGENT_CPU, 0, Some("shared")), &Holds::none())
                .unwrap()
        })
        .collect();
    println!("CHILD ready");
    std::io::stdout().flush().unwrap();
    // Block until killed (the parent keeps our stdin open).
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    drop(held);
}

fn spawn_child(role: &str, dir: &Path, instance: &str, witness: Option<&Path>) -> ChildGuard {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "processes::child_entry",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD_ENV, role)
    .env("CHILD_DIR", dir)
    .env("CHILD_INSTANCE", instance)
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    if let Some(w) = witness {
        cmd.env("CHILD_WITNESS", w);
    }
    ChildGuard(cmd.spawn().unwrap())
}

/// A child process killed when the test ends, even by a failed assertion,
/// so that a failing test cannot leave a blocked child behind.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What follows `CHILD ` in the child's output (libtest prints its own
/// text around it, on the same line).
fn child_line(child: &mut Child) -> String {
    let stdout = child.stdout.as_mut().unwrap();
    BufReader::new(stdout)
        .lines()
        .map(Result::unwrap)
        .find_map(|l| {
            l.find("CHILD ")
                .map(|at| l[at + "CHILD ".len()..].trim().to_owned())
        })
        .expect("the child printed its result")
}

#[test]
fn processes_sharing_a_ledger_never_exceed_the_pool_cap() {
    let dir = tempfile::tempdir().unwrap();
    let witness = tempfile::tempdir().unwrap();
    let mut children: Vec<ChildGuard> = (0..CHILDREN)
        .map(|c| {
            spawn_child(
                "hammer",
                dir.path(),
                &format!("0000c0{c:02x}"),
                Some(witness.path()),
            )
        })
        .collect();
    let (mut admitted, mut refused, mut violations) = (0u64, 0u64, 0u64);
    for ChildGuard(child) in &mut children {
        let line = child_line(child);
        for field in line.split_whitespace() {
            let (k, v) = field.split_once('=').unwrap();
            let v: u64 = v.parse().unwrap();
            match k {
                "admitted" => admitted += v,
                "refused" => refused += v,
                "violations" => violations += v,
                _ => panic!("{line}"),
            }
        }
        assert!(child.wait().unwrap().success());
    }
    assert_eq!(violations, 0, "the pool cap was exceeded across processes");
    assert!(
        admitted > 0 && refused > 0,
        "the pool was contended: admitted {admitted}, refused {refused}"
    );
    assert_eq!(admitted + refused, u64::from(CHILDREN * ITERATIONS * 2));
    assert_eq!(witness_add(witness.path(), 0), 0);
    // Every child released every row before exiting.
    let observer = MachineLedger::open(Some(dir.path()), "0b5e4e40".parse().unwrap()).unwrap();
    assert!(observer.usage("shared").unwrap().rows.is_empty());
}

#[test]
fn a_killed_instance_keeps_its_rows_until_it_reopens_and_reconciles() {
    let dir = tempfile::tempdir().unwrap();
    let dead: InstanceId = "dead0001".parse().unwrap();
    let mut guard = spawn_child("hold", dir.path(), &dead.to_string(), None);
    let child = &mut guard.0;
    assert_eq!(child_line(child), "ready");
    child.kill().unwrap(); // SIGKILL: no destructor runs, no row is released.
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(9));

    // Another instance sees the dead instance's rows: kept, and counted.
    let (other, other_ledger) = admission(dir.path(), "0000000b");
    let rows = other_ledger.usage("shared").unwrap().rows;
    assert_eq!(rows.len(), 3);
    assert!(rows.iter().all(|r| r.instance == dead));
    let err = other
        .try_reserve(demand(10, "s", 2000, 0, Some("shared")), &Holds::none())
        .unwrap_err();
    assert!(
        matches!(err, AdmitError::Refused(r) if r.cap == Cap::PoolCpu && r.used == 3000),
        "{err}"
    );
    assert!(
        other_ledger.maintain().reaped.is_empty(),
        "not expired: kept"
    );

    // The dead instance restarts (its owner lock is free again) and
    // reconciles: agent 1 still exists, agents 2 and 3 do not.
    let (restarted, ledger) = admission(dir.path(), &dead.to_string());
    let keep: HashSet<AgentId> = [agent(1)].into();
    let mut dropped: Vec<AgentId> = ledger
        .reconcile_own(&keep)
        .unwrap()
        .into_iter()
        .map(|d| d.row.agent)
        .collect();
    dropped.sort();
    assert_eq!(dropped, [agent(2), agent(3)]);
    let kept = restarted
        .adopt(demand(1, "s", AGENT_CPU, 0, Some("shared")))
        .unwrap();
    let r = other
        .try_reserve(demand(10, "s", 2000, 0, Some("shared")), &Holds::none())
        .unwrap();
    assert_eq!(other_ledger.usage("shared").unwrap().cpu_millis, 3000);
    drop((kept, r));
    assert!(other_ledger.usage("shared").unwrap().rows.is_empty());
}
