//! What tests in other crates call: build the static `fc-sim` / `fake-jailer`
//! binaries once per test run ([`build_binaries`]), lay out a per-test kit with
//! the names the jailer contract needs ([`Paths::kit`]: `firecracker` and
//! `jailer`, plus the guest's configuration), launch a simulator directly
//! ([`Simulator`]) and query any running one ([`SimClient`]).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

pub use crate::guest::{GuestMode, VmmMode};
use crate::guest::{
    GUEST_AGENT_ENV, GUEST_AGENT_FILE, GUEST_MODE_ENV, GUEST_MODE_FILE, VMM_MODE_ENV, VMM_MODE_FILE,
};
use crate::http::{unix_request, ClientResponse, HttpError};
pub use crate::jailer::{
    CGROUP_ROOT_ENV, CGROUP_ROOT_FILE, GUEST_DIR_BESIDE_JAILER, GUEST_DIR_ENV,
};
use crate::vmm::TESTKIT_STATE_PATH;

/// The musl target the binaries are built for (they run inside a chroot).
pub const MUSL_TARGET: &str = "x86_64-unknown-linux-musl";
/// Env var overriding the target directory of the nested static build.
pub const TARGET_DIR_ENV: &str = "KICI_TESTKIT_TARGET_DIR";
/// Env var selecting the profile of the nested static build: `release` for
/// benchmarks (the simulator's own cost is then ~µs per request), debug otherwise.
pub const PROFILE_ENV: &str = "KICI_TESTKIT_PROFILE";

/// Errors of the test helpers.
#[derive(Debug, thiserror::Error)]
pub enum TestkitError {
    #[error("building the testkit binaries failed: {0}")]
    Build(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("API request failed: {0}")]
    Http(#[from] HttpError),
    #[error("the simulator's API socket {0} did not answer within {1:?}")]
    NotReady(PathBuf, Duration),
    #[error("the simulator exited with {0:?} before answering: {1}")]
    Exited(Option<i32>, String),
    #[error("unexpected response {status}: {body}")]
    Unexpected { status: u16, body: String },
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> TestkitError {
    let what = what.into();
    move |source| TestkitError::Io { what, source }
}

/// The built binaries.
#[derive(Debug, Clone)]
pub struct Paths {
    /// `fc-sim`, static.
    pub fc_sim: PathBuf,
    /// `fake-jailer`, static.
    pub fake_jailer: PathBuf,
    /// `testkit-agent`, static: a guest agent that reports its environment to
    /// `agent-report.json` in the jail root and blocks (or exits with `TESTKIT_AGENT_EXIT`).
    pub testkit_agent: PathBuf,
}

static BUILT: OnceLock<Result<Paths, String>> = OnceLock::new();

fn target_dir() -> PathBuf {
    if let Some(d) = std::env::var_os(TARGET_DIR_ENV) {
        return PathBuf::from(d);
    }
    let base = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target"));
    base.join("kici-testkit-static")
}

/// Build `fc-sim` and `fake-jailer` as static musl binaries (once per process;
/// cargo makes repeated builds no-ops). Uses its own target directory
/// (`$KICI_TESTKIT_TARGET_DIR`, else `$CARGO_TARGET_DIR/kici-testkit-static`)
/// so it never waits on the build lock of the `cargo test` that runs the caller.
pub fn build_binaries() -> Result<Paths, TestkitError> {
    BUILT
        .get_or_init(|| {
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let target = target_dir();
            let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
            let release = std::env::var(PROFILE_ENV).is_ok_and(|p| p == "release");
            let mut cmd = Command::new(cargo);
            cmd.args([
                "build",
                "--quiet",
                "--bins",
                "--target",
                MUSL_TARGET,
                "--manifest-path",
            ])
            .arg(&manifest)
            .env("CARGO_TARGET_DIR", &target)
            .stdin(Stdio::null());
            if release {
                cmd.arg("--release");
            }
            let out = cmd.output().map_err(|e| format!("cannot run cargo: {e}"))?;
            if !out.status.success() {
                return Err(String::from_utf8_lossy(&out.stderr).into_owned());
            }
            let dir = target
                .join(MUSL_TARGET)
                .join(if release { "release" } else { "debug" });
            Ok(Paths {
                fc_sim: dir.join("fc-sim"),
                fake_jailer: dir.join("fake-jailer"),
                testkit_agent: dir.join("testkit-agent"),
            })
        })
        .clone()
        .map_err(TestkitError::Build)
}

/// Hard link `src` to `dst` (copy across file systems), replacing `dst`.
pub fn link_or_copy(src: &Path, dst: &Path) -> Result<(), TestkitError> {
    if dst.exists() {
        fs::remove_file(dst).map_err(io_err(format!("removing {}", dst.display())))?;
    }
    if fs::hard_link(src, dst).is_err() {
        fs::copy(src, dst).map_err(io_err(format!(
            "copying {} to {}",
            src.display(),
            dst.display()
        )))?;
    }
    Ok(())
}

/// A per-test directory with the binaries under the names the jailer contract needs.
#[derive(Debug, Clone)]
pub struct Kit {
    /// The fake jailer (`<dir>/jailer`).
    pub jailer: PathBuf,
    /// The simulator named `firecracker` (the jailer requires the name to contain it,
    /// and it becomes the chroot path segment: `<base>/firecracker/<id>/root`).
    pub firecracker: PathBuf,
    /// `<dir>/testkit-guest`: the fake jailer copies its guest files into every jail.
    pub guest_dir: PathBuf,
}

impl Paths {
    /// Lay out `<dir>/jailer`, `<dir>/firecracker` and `<dir>/testkit-guest/`.
    pub fn kit(&self, dir: &Path) -> Result<Kit, TestkitError> {
        fs::create_dir_all(dir).map_err(io_err(format!("creating {}", dir.display())))?;
        let kit = Kit {
            jailer: dir.join("jailer"),
            firecracker: dir.join("firecracker"),
            guest_dir: dir.join(GUEST_DIR_BESIDE_JAILER),
        };
        link_or_copy(&self.fake_jailer, &kit.jailer)?;
        link_or_copy(&self.fc_sim, &kit.firecracker)?;
        fs::create_dir_all(&kit.guest_dir)
            .map_err(io_err(format!("creating {}", kit.guest_dir.display())))?;
        Ok(kit)
    }
}

/// How the simulated guest of the next VMs behaves.
#[derive(Debug, Clone, Default)]
pub struct GuestSetup {
    pub mode: GuestMode,
    /// A (static) binary run as the guest agent with the MMDS-derived environment.
    pub agent: Option<PathBuf>,
    /// Failure mode of the VMM process itself.
    pub vmm: VmmMode,
}

impl GuestSetup {
    /// Write the setup as files into `dir` (a jail root, or a [`Kit::guest_dir`]).
    pub fn write_into(&self, dir: &Path) -> Result<(), TestkitError> {
        let mode_file = dir.join(GUEST_MODE_FILE);
        fs::write(&mode_file, self.mode.as_str())
            .map_err(io_err(format!("writing {}", mode_file.display())))?;
        let vmm_file = dir.join(VMM_MODE_FILE);
        fs::write(&vmm_file, self.vmm.as_str())
            .map_err(io_err(format!("writing {}", vmm_file.display())))?;
        let agent_file = dir.join(GUEST_AGENT_FILE);
        match &self.agent {
            Some(agent) => link_or_copy(agent, &agent_file)?,
            None => {
                if agent_file.exists() {
                    fs::remove_file(&agent_file)
                        .map_err(io_err(format!("removing {}", agent_file.display())))?;
                }
            }
        }
        Ok(())
    }
}

impl Kit {
    /// Set the guest behaviour for VMs the jailer starts from now on.
    pub fn set_guest(&self, setup: &GuestSetup) -> Result<(), TestkitError> {
        setup.write_into(&self.guest_dir)
    }

    /// Make the jailer create its cgroups under `root` instead of the host's
    /// cgroup mounts (v2: `<root>/<parent>/<id>`, v1: `<root>/<controller>/<parent>/<id>`).
    pub fn set_cgroup_root(&self, root: &Path) -> Result<(), TestkitError> {
        let file = self.dir().join(CGROUP_ROOT_FILE);
        fs::write(&file, root.as_os_str().as_encoded_bytes())
            .map_err(io_err(format!("writing {}", file.display())))
    }

    /// The kit directory.
    pub fn dir(&self) -> &Path {
        self.jailer.parent().unwrap_or_else(|| Path::new("/"))
    }

    /// The API socket of the VM `id` jailed under `chroot_base` by this kit's jailer.
    pub fn api_socket(&self, chroot_base: &Path, id: &str) -> PathBuf {
        jail_root(chroot_base, id).join("run/firecracker.socket")
    }

    /// The guest-link socket of that VM (for [`crate::guestnet::GuestNet::attach`]).
    pub fn guest_link(&self, chroot_base: &Path, id: &str) -> PathBuf {
        jail_root(chroot_base, id)
            .join("run")
            .join(crate::guestlink::GUEST_LINK_SOCKET)
    }
}

/// `<chroot_base>/firecracker/<id>/root`: where the kit's jailer puts VM `id`.
pub fn jail_root(chroot_base: &Path, id: &str) -> PathBuf {
    chroot_base.join("firecracker").join(id).join("root")
}

/// A client for a running simulator's API socket.
#[derive(Debug, Clone)]
pub struct SimClient {
    pub socket: PathBuf,
    pub timeout: Duration,
}

impl SimClient {
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Self {
            socket: socket.into(),
            timeout: Duration::from_secs(5),
        }
    }

    /// Any request; `body` is sent as JSON.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<ClientResponse, TestkitError> {
        let text = body.map(Value::to_string);
        Ok(unix_request(
            &self.socket,
            method,
            path,
            text.as_deref(),
            self.timeout,
        )?)
    }

    /// A request with a raw (possibly invalid) body.
    pub fn request_raw(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> Result<ClientResponse, TestkitError> {
        Ok(unix_request(
            &self.socket,
            method,
            path,
            body,
            self.timeout,
        )?)
    }

    pub fn put(&self, path: &str, body: &Value) -> Result<ClientResponse, TestkitError> {
        self.request("PUT", path, Some(body))
    }

    pub fn patch(&self, path: &str, body: &Value) -> Result<ClientResponse, TestkitError> {
        self.request("PATCH", path, Some(body))
    }

    pub fn get(&self, path: &str) -> Result<ClientResponse, TestkitError> {
        self.request("GET", path, None)
    }

    /// `GET /` (InstanceInfo).
    pub fn instance_info(&self) -> Result<Value, TestkitError> {
        expect_json(self.get("/")?)
    }

    /// `GET /testkit/state`: requests in order, configuration, MMDS, guest progress.
    pub fn state(&self) -> Result<SimState, TestkitError> {
        expect_json(self.get(TESTKIT_STATE_PATH)?).map(SimState)
    }

    /// Poll `GET /` until it answers (bounded): what a backend does after spawning the jailer.
    pub fn wait_ready(&self, within: Duration) -> Result<(), TestkitError> {
        let deadline = Instant::now() + within;
        loop {
            if self.get("/").is_ok() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(TestkitError::NotReady(self.socket.clone(), within));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Poll the introspection state until `pred` holds (bounded).
    pub fn wait_state(
        &self,
        within: Duration,
        pred: impl Fn(&SimState) -> bool,
    ) -> Result<SimState, TestkitError> {
        let deadline = Instant::now() + within;
        loop {
            let st = self.state()?;
            if pred(&st) {
                return Ok(st);
            }
            if Instant::now() >= deadline {
                return Err(TestkitError::Unexpected {
                    status: 0,
                    body: format!("state condition not met within {within:?}: {}", st.0),
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

fn expect_json(r: ClientResponse) -> Result<Value, TestkitError> {
    if r.status == 200 {
        Ok(r.json())
    } else {
        Err(TestkitError::Unexpected {
            status: r.status,
            body: r.body,
        })
    }
}

/// The introspection document of a running simulator.
#[derive(Debug, Clone)]
pub struct SimState(pub Value);

impl SimState {
    /// `"Not started"` or `"Running"`.
    pub fn vm_state(&self) -> &str {
        self.0
            .get("state")
            .and_then(Value::as_str)
            .unwrap_or_default()
    }

    /// `(method, path, status)` of every API request in arrival order.
    pub fn request_log(&self) -> Vec<(String, String, u16)> {
        self.0
            .get("requests")
            .and_then(Value::as_array)
            .map(|reqs| {
                reqs.iter()
                    .map(|r| {
                        (
                            r.get("method")
                                .and_then(Value::as_str)
                                .unwrap_or_default()
                                .to_string(),
                            r.get("path")
                                .and_then(Value::as_str)
                                .unwrap_or_default()
                                .to_string(),
                            r.get("status").and_then(Value::as_u64).unwrap_or_default() as u16,
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The MMDS data store.
    pub fn mmds(&self) -> &Value {
        self.0.get("mmds").unwrap_or(&Value::Null)
    }

    /// The simulated guest's progress (`phase`, `metadata`, `agent_pid`, ...).
    pub fn guest(&self) -> &Value {
        self.0.get("guest").unwrap_or(&Value::Null)
    }

    pub fn guest_phase(&self) -> &str {
        self.guest()
            .get("phase")
            .and_then(Value::as_str)
            .unwrap_or_default()
    }

    /// Effective uid the simulator runs as (the jailer's `--uid`).
    pub fn uid(&self) -> Option<u64> {
        self.0.get("uid").and_then(Value::as_u64)
    }
}

/// Where a directly launched simulator's stdout (the serial console) goes, in its directory.
pub const SERIAL_FILE: &str = "serial.log";
/// Where its stderr goes.
pub const STDERR_FILE: &str = "fc-sim.stderr";

/// A simulator launched directly (no jailer, no chroot): for API-level tests.
#[derive(Debug)]
pub struct Simulator {
    /// `None` once [`Simulator::wait_exit`] took it.
    child: Option<Child>,
    pub client: SimClient,
    pub dir: PathBuf,
}

impl Simulator {
    /// Start `fc-sim` in `dir` (its working directory, where the API socket
    /// `api.sock` goes) with extra command-line `args` and the guest `setup`.
    pub fn start(
        paths: &Paths,
        dir: &Path,
        args: &[&str],
        setup: &GuestSetup,
    ) -> Result<Self, TestkitError> {
        let socket = dir.join("api.sock");
        let serial =
            fs::File::create(dir.join(SERIAL_FILE)).map_err(io_err("creating the serial log"))?;
        let stderr =
            fs::File::create(dir.join(STDERR_FILE)).map_err(io_err("creating the stderr log"))?;
        let mut cmd = Command::new(&paths.fc_sim);
        cmd.current_dir(dir)
            .arg("--api-sock")
            .arg(&socket)
            .args(args)
            .env(GUEST_MODE_ENV, setup.mode.as_str())
            .env(VMM_MODE_ENV, setup.vmm.as_str())
            .stdin(Stdio::null())
            .stdout(Stdio::from(serial))
            .stderr(Stdio::from(stderr));
        match &setup.agent {
            Some(a) => cmd.env(GUEST_AGENT_ENV, a),
            None => cmd.env_remove(GUEST_AGENT_ENV),
        };
        let child = cmd.spawn().map_err(io_err("spawning fc-sim"))?;
        let mut sim = Self {
            child: Some(child),
            client: SimClient::new(socket),
            dir: dir.to_path_buf(),
        };
        let within = Duration::from_secs(10);
        let deadline = Instant::now() + within;
        loop {
            if sim.client.get("/").is_ok() {
                return Ok(sim);
            }
            // A simulator that exited (bad arguments, a VMM failure mode) will never answer.
            if let Some(status) = sim.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                let stderr = fs::read_to_string(dir.join(STDERR_FILE)).unwrap_or_default();
                return Err(TestkitError::Exited(status.code(), stderr));
            }
            if Instant::now() >= deadline {
                return Err(TestkitError::NotReady(sim.client.socket.clone(), within));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The serial console so far (the simulator's stdout, `<dir>/serial.log`).
    pub fn serial(&self) -> String {
        fs::read_to_string(self.dir.join(SERIAL_FILE)).unwrap_or_default()
    }

    /// Wait for the process to exit; its exit code and the serial console.
    pub fn wait_exit(mut self) -> Result<(Option<i32>, String), TestkitError> {
        let Some(mut child) = self.child.take() else {
            return Ok((None, self.serial()));
        };
        let status = child.wait().map_err(io_err("waiting for fc-sim"))?;
        Ok((status.code(), self.serial()))
    }
}

impl Drop for Simulator {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
