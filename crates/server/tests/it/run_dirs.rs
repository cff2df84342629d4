//! Where `kici-scaler run` keeps its state dirs, and that the sweep of dead
//! runs acts only on dirs of its own user: run as root against what a
//! second, real, local user planted.
//!
//! Each test creates its own user (removed when the test ends, also on
//! failure) and gives root's `run` an `XDG_RUNTIME_DIR` and a `TMPDIR` of
//! the test's own, the `TMPDIR` shared and sticky like `/tmp`, where
//! state dirs used to live.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use crate::common::daemon::{wait_until, Daemon, Dir as DaemonDir, CGROUP_V2};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_kici-scaler");
/// What the root-owned file the attacker points a `lock` at holds.
const PRECIOUS: &str = "root's precious content\n";

/// A local user made for one test (removed on drop).
type User = crate::common::users::LocalUser;

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn mode(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// Root's side: a private dir (its `XDG_RUNTIME_DIR` under `runtime/`, a
/// root-owned file under `secret/`) and a shared sticky temp dir the
/// attacker can write (`shared/`).
struct World {
    dir: tempfile::TempDir,
    precious: PathBuf,
}

impl World {
    fn new() -> World {
        let dir = tempfile::Builder::new()
            .prefix("kici-scaler-test-")
            .tempdir()
            .unwrap();
        // Others must reach `shared/` (and only it) through the test dir.
        mode(dir.path(), 0o711);
        for (sub, m) in [("runtime", 0o700), ("secret", 0o700), ("shared", 0o1777)] {
            std::fs::create_dir(dir.path().join(sub)).unwrap();
            mode(&dir.path().join(sub), m);
        }
        let precious = dir.path().join("secret/precious");
        std::fs::write(&precious, PRECIOUS).unwrap();
        World { dir, precious }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    /// Root's `kici-scaler run` of the quickstart with `-- true`, with
    /// `XDG_RUNTIME_DIR` set to `runtime` and `TMPDIR` to the shared dir.
    fn run_quickstart(&self, runtime: &Path) -> Output {
        let mut cmd = Command::new(BIN);
        for (k, _) in std::env::vars() {
            if k.starts_with("KICI_") {
                cmd.env_remove(k);
            }
        }
        cmd.env("XDG_RUNTIME_DIR", runtime)
            .env("TMPDIR", self.path("shared"))
            .env(
                "PATH",
                format!(
                    "{}:/usr/bin:/bin",
                    common::daemon::agent_lite_dir().display()
                ),
            )
            .args(["run", "--config"])
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/quickstart.yaml"))
            .args(["--labels", "linux", "--", "true"])
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    /// As `user`, a run dir `name` in the shared temp dir naming
    /// `instance`, with `lock` a symbolic link to root's precious file and
    /// `config` as its configuration snapshot.
    fn plant(&self, user: &User, name: &str, instance: &str, config: &str) -> PathBuf {
        let planted = self.path("shared").join(name);
        user.sh(
            "mkdir \"$1\"; printf '%s\\n' \"$2\" > \"$1/instance-id\"; ln -s \"$3\" \"$1/lock\"; \
             mkdir \"$1/config\"; printf '%s' \"$4\" > \"$1/config/scalers.yaml\"",
            &[
                planted.to_str().unwrap(),
                instance,
                self.precious.to_str().unwrap(),
                config,
            ],
        );
        planted
    }

    /// Root's precious file is as the test made it, and the planted dir is
    /// as the attacker left it: nothing locked, written or recorded in it.
    fn assert_untouched(&self, planted: &Path) {
        assert_eq!(std::fs::read_to_string(&self.precious).unwrap(), PRECIOUS);
        assert!(planted.is_dir(), "{} was removed", planted.display());
        let lock = std::fs::symlink_metadata(planted.join("lock")).unwrap();
        assert!(
            lock.file_type().is_symlink(),
            "the planted lock was replaced"
        );
        let mut names: Vec<_> = std::fs::read_dir(planted)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["config", "instance-id", "lock"], "{planted:?}");
    }
}

/// A bare-metal configuration running `binary` (for a planted snapshot).
fn bare_metal_config(binary: &str) -> String {
    format!(
        "version: 1\nscalers:\n  - name: local\n    type: bare-metal\n    maxAgents: 1\n    labelSets:\n      - labels: [local]\n        binaryPath: {binary}\n"
    )
}

/// Another user plants, in the shared temp dir where run dirs used to
/// live, a run dir whose `lock` is a symbolic link to a root-owned file.
/// Root's `run` neither writes that file nor touches the planted dir; its
/// own state dir lives in its runtime dir and is gone after it.
#[test]
fn run_as_root_ignores_a_run_dir_another_user_planted_in_the_temp_dir() {
    let world = World::new();
    let attacker = User::create("kicird-");
    let planted = world.plant(
        &attacker,
        "kici-scaler-run-planted",
        "0badc0de",
        &bare_metal_config("/bin/true"),
    );

    let out = world.run_quickstart(&world.path("runtime"));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    world.assert_untouched(&planted);
    let runs = world.path("runtime/kici-scaler");
    let meta = std::fs::symlink_metadata(&runs).unwrap();
    assert!(meta.is_dir());
    assert_eq!(meta.permissions().mode() & 0o077, 0, "{runs:?} is private");
    assert_eq!(
        std::fs::read_dir(&runs).unwrap().count(),
        0,
        "run left its dir"
    );
}

/// In the new place, too, the sweep acts only on dirs that are its user's,
/// private, with files of its own: a run dir of another owner, a run dir
/// of root's but open to others, and a run dir of root's whose `lock` is a
/// symbolic link are all left alone.
#[test]
fn run_as_root_ignores_run_dirs_in_its_runtime_dir_it_cannot_trust() {
    let world = World::new();
    let attacker = User::create("kicird-");
    let runs = world.path("runtime/kici-scaler");
    std::fs::create_dir(&runs).unwrap();
    mode(&runs, 0o700);
    let plant = |name: &str, dir_mode: u32, owner: Option<u32>| {
        let d = runs.join(name);
        std::fs::create_dir(&d).unwrap();
        std::fs::write(d.join("instance-id"), "0badc0de\n").unwrap();
        std::os::unix::fs::symlink(&world.precious, d.join("lock")).unwrap();
        std::fs::create_dir(d.join("config")).unwrap();
        std::fs::write(
            d.join("config/scalers.yaml"),
            bare_metal_config("/bin/true"),
        )
        .unwrap();
        mode(&d, dir_mode);
        if let Some(uid) = owner {
            for p in ["", "instance-id", "lock", "config", "config/scalers.yaml"] {
                std::os::unix::fs::lchown(d.join(p), Some(uid), None).unwrap();
            }
        }
        d
    };
    let planted = [
        plant("kici-scaler-run-theirs", 0o700, Some(attacker.uid)),
        plant("kici-scaler-run-open", 0o755, None),
        plant("kici-scaler-run-linked", 0o700, None),
    ];

    let out = world.run_quickstart(&world.path("runtime"));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    for p in &planted {
        world.assert_untouched(p);
    }
}

/// A runtime dir that is not root's (here: the attacker's) is refused
/// with an error naming it and what is wrong; nothing runs.
#[test]
fn run_refuses_a_runtime_dir_of_another_user() {
    let world = World::new();
    let attacker = User::create("kicird-");
    let theirs = world.path("shared/theirs");
    attacker.sh("mkdir -m 700 \"$1\"", &[theirs.to_str().unwrap()]);

    let out = world.run_quickstart(&theirs);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    assert!(
        stderr.contains(&theirs.display().to_string())
            && stderr.contains(&format!("owned by uid {}", attacker.uid)),
        "{stderr}"
    );
}

/// Another user plants a run dir naming a live daemon's instance id, with
/// the daemon's own configuration as its snapshot. Root's `run` must not
/// take it for a dead run of its own: the daemon's agent lives on.
#[test]
fn run_as_root_does_not_sweep_a_live_daemons_agents_for_a_planted_dir() {
    let world = World::new();
    let attacker = User::create("kicird-");
    let dir = DaemonDir::bare_metal(1);
    let daemon_runtime = dir.path("runtime");
    std::fs::create_dir(&daemon_runtime).unwrap();
    mode(&daemon_runtime, 0o700);
    let d = Daemon::start(
        &dir,
        &["--listen", "127.0.0.1:0"],
        &[("XDG_RUNTIME_DIR", daemon_runtime.to_str().unwrap())],
    );
    let (status, body) = d.scale("j1", &["local"]);
    assert_eq!(status, 202, "{body}");
    let agent = body["agentId"].as_str().unwrap().to_owned();
    let instance = dir.instance();
    let procs = Path::new(CGROUP_V2)
        .join("kici-scaler")
        .join(&instance)
        .join("local")
        .join(&agent)
        .join("cgroup.procs");
    let mut pids = Vec::new();
    wait_until("the agent runs", || {
        pids = std::fs::read_to_string(&procs)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse::<i32>().ok())
            .collect();
        !pids.is_empty()
    });
    d.wait_state(&agent, "booted");

    let config = std::fs::read_to_string(dir.path("scalers.yaml")).unwrap();
    let planted = world.plant(&attacker, "kici-scaler-run-daemon", &instance, &config);
    let out = world.run_quickstart(&world.path("runtime"));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));

    for pid in &pids {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .next();
        assert!(
            !matches!(state, None | Some("Z")),
            "the daemon's agent process {pid} was killed"
        );
    }
    assert_eq!(d.state_of(&agent), "booted", "the daemon's agent");
    world.assert_untouched(&planted);
}
