//! The state dir against real files, real `flock`s and a real second process.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use kici_model::InstanceId;
use kici_scaler::daemon::identity::{
    IdentityError, IdentitySource, LockHolder, StateDir, INSTANCE_ID_FILE, LOCK_FILE,
    MACHINE_ID_FILE,
};
use std::collections::BTreeSet;
use std::fs;
use std::io::{BufRead, BufReader, Read};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const MACHINE_A: &str = "0123456789abcdef0123456789abcdef";
const MACHINE_B: &str = "fedcba9876543210fedcba9876543210";

/// Env vars that turn [`child_holds_state_dir_until_stdin_closes`] into the
/// lock holder of [`a_second_process_cannot_open_a_held_state_dir`].
const CHILD_DIR_ENV: &str = "KICI_SCALER_TEST_HOLD_STATE_DIR";
const CHILD_MACHINE_ID_ENV: &str = "KICI_SCALER_TEST_HOLD_MACHINE_ID";

/// A temp root (swept by .ci/run if a killed run leaves it) with a fake
/// `/etc/machine-id` in it.
struct Fixture {
    root: tempfile::TempDir,
}

impl Fixture {
    fn new() -> Self {
        let root = tempfile::Builder::new()
            .prefix("kici-scaler-test-")
            .tempdir()
            .unwrap();
        let f = Fixture { root };
        f.set_machine_id(MACHINE_A);
        f
    }

    fn state(&self) -> PathBuf {
        self.root.path().join("var/lib/kici-scaler")
    }

    fn machine_id_file(&self) -> PathBuf {
        self.root.path().join("machine-id")
    }

    fn set_machine_id(&self, id: &str) {
        fs::write(self.machine_id_file(), format!("{id}\n")).unwrap();
    }

    fn open(&self, reset: bool) -> Result<StateDir, IdentityError> {
        StateDir::open_with_machine_id(&self.state(), &self.machine_id_file(), reset)
    }

    fn read(&self, name: &str) -> String {
        fs::read_to_string(self.state().join(name)).unwrap()
    }
}

fn entries(dir: &Path) -> BTreeSet<String> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect()
}

#[test]
fn first_open_creates_a_private_dir_with_identity_files() {
    let fx = Fixture::new();
    let dir = fx.open(false).unwrap();

    assert_eq!(dir.path(), fx.state());
    assert_eq!(dir.identity_source(), IdentitySource::Created);
    assert_eq!(dir.machine_id(), MACHINE_A);
    let mode = fs::metadata(fx.state()).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700);

    let id_text = fx.read(INSTANCE_ID_FILE);
    assert_eq!(id_text, format!("{}\n", dir.instance_id()));
    assert_eq!(id_text.trim().len(), 8);
    assert!(id_text.trim().parse::<InstanceId>().is_ok());
    assert_eq!(fx.read(MACHINE_ID_FILE), format!("{MACHINE_A}\n"));
    assert_eq!(fx.read(LOCK_FILE), format!("{}\n", std::process::id()));

    // Atomic writes leave no temp files behind.
    let expected: BTreeSet<String> = [INSTANCE_ID_FILE, LOCK_FILE, MACHINE_ID_FILE]
        .map(String::from)
        .into();
    assert_eq!(entries(&fx.state()), expected);
}

#[test]
fn reopening_keeps_the_instance_id() {
    let fx = Fixture::new();
    let first = fx.open(false).unwrap().instance_id();
    let again = fx.open(false).unwrap();
    assert_eq!(again.instance_id(), first);
    assert_eq!(again.identity_source(), IdentitySource::Existing);
    // A reset with nothing wrong keeps the identity too.
    drop(again);
    let reset = fx.open(true).unwrap();
    assert_eq!(reset.instance_id(), first);
    assert_eq!(reset.identity_source(), IdentitySource::Existing);
}

#[test]
fn an_existing_dir_is_made_private() {
    let fx = Fixture::new();
    fs::create_dir_all(fx.state()).unwrap();
    fs::set_permissions(fx.state(), fs::Permissions::from_mode(0o755)).unwrap();
    let _dir = fx.open(false).unwrap();
    let mode = fs::metadata(fx.state()).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700);
}

#[test]
fn a_second_open_in_the_same_process_is_refused_until_the_first_is_dropped() {
    let fx = Fixture::new();
    let held = fx.open(false).unwrap();
    match fx.open(false) {
        Err(IdentityError::InUse { dir, holder }) => {
            assert_eq!(dir, fx.state());
            assert_eq!(holder, LockHolder::Pid(std::process::id()));
        }
        other => panic!("expected InUse, got {other:?}"),
    }
    drop(held);
    assert!(fx.open(false).is_ok());
}

/// Not a test of its own: when [`CHILD_DIR_ENV`] is set, this is the child
/// process of [`a_second_process_cannot_open_a_held_state_dir`]. It opens the
/// state dir, says so on stdout, and holds it until its stdin is closed.
/// Without the env var it returns at once.
#[test]
fn child_holds_state_dir_until_stdin_closes() {
    let Ok(dir) = std::env::var(CHILD_DIR_ENV) else {
        return;
    };
    let machine_id = std::env::var(CHILD_MACHINE_ID_ENV).unwrap();
    let held =
        StateDir::open_with_machine_id(Path::new(&dir), Path::new(&machine_id), false).unwrap();
    println!("holding {}", held.instance_id());
    let mut rest = Vec::new();
    std::io::stdin().read_to_end(&mut rest).unwrap();
    drop(held);
}

#[test]
fn a_second_process_cannot_open_a_held_state_dir() {
    let fx = Fixture::new();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            // The test's name in the one integration-test binary (tests/it).
            "state_dir::child_holds_state_dir_until_stdin_closes",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_DIR_ENV, fx.state())
        .env(CHILD_MACHINE_ID_ENV, fx.machine_id_file())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();

    // Wait (without a timer) for the child to report that it holds the lock.
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let child_instance = loop {
        let line = lines
            .next()
            .expect("child exited before taking the lock")
            .unwrap();
        // libtest may print "test <name> ... " on the same line first.
        if let Some((_, id)) = line.split_once("holding ") {
            break id.trim().parse::<InstanceId>().unwrap();
        }
    };

    let err = fx.open(false).unwrap_err();
    match &err {
        IdentityError::InUse { dir, holder } => {
            assert_eq!(dir, &fx.state());
            assert_eq!(*holder, LockHolder::Pid(child.id()));
        }
        other => panic!("expected InUse, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains(&format!("pid {}", child.id())), "{msg}");
    assert!(msg.contains(&fx.state().display().to_string()), "{msg}");

    // Closing its stdin lets the child exit; the kernel drops its lock.
    drop(child.stdin.take());
    let status = child.wait().unwrap();
    assert!(status.success(), "child failed: {status}");
    let reopened = fx.open(false).unwrap();
    assert_eq!(reopened.instance_id(), child_instance);
}

#[test]
fn a_changed_machine_id_is_refused_without_reset() {
    let fx = Fixture::new();
    let original = fx.open(false).unwrap().instance_id();

    fx.set_machine_id(MACHINE_B);
    let err = fx.open(false).unwrap_err();
    let msg = err.to_string();
    match err {
        IdentityError::MachineIdMismatch {
            recorded,
            live,
            live_path,
            ..
        } => {
            assert_eq!(recorded, MACHINE_A);
            assert_eq!(live, MACHINE_B);
            assert_eq!(live_path, fx.machine_id_file());
        }
        other => panic!("expected MachineIdMismatch, got {other:?}"),
    }
    assert!(msg.contains("--reset-identity"), "{msg}");
    // Refusal changes nothing.
    assert_eq!(fx.read(INSTANCE_ID_FILE), format!("{original}\n"));
    assert_eq!(fx.read(MACHINE_ID_FILE), format!("{MACHINE_A}\n"));
}

#[test]
fn reset_after_a_machine_id_change_mints_a_new_identity() {
    let fx = Fixture::new();
    let original = fx.open(false).unwrap().instance_id();
    fx.set_machine_id(MACHINE_B);

    let reset = fx.open(true).unwrap();
    assert_ne!(reset.instance_id(), original);
    assert_eq!(
        reset.identity_source(),
        IdentitySource::Reset {
            previous: Some(original)
        }
    );
    assert_eq!(reset.machine_id(), MACHINE_B);
    assert_eq!(fx.read(MACHINE_ID_FILE), format!("{MACHINE_B}\n"));
    assert_eq!(
        fx.read(INSTANCE_ID_FILE),
        format!("{}\n", reset.instance_id())
    );
    let new_id = reset.instance_id();
    drop(reset);

    // The new identity is now this machine's: no reset needed any more.
    let again = fx.open(false).unwrap();
    assert_eq!(again.instance_id(), new_id);
    assert_eq!(again.identity_source(), IdentitySource::Existing);
}

#[test]
fn a_corrupt_instance_id_is_a_clear_error_and_reset_replaces_it() {
    let fx = Fixture::new();
    drop(fx.open(false).unwrap());
    fs::write(fx.state().join(INSTANCE_ID_FILE), "XYZ-not-hex\n").unwrap();

    let err = fx.open(false).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(&err, IdentityError::CorruptInstanceId { path, .. } if path == &fx.state().join(INSTANCE_ID_FILE)),
        "{err:?}"
    );
    assert!(msg.contains("instance-id"), "{msg}");
    assert!(msg.contains("XYZ-not-hex"), "{msg}");
    assert!(msg.contains("--reset-identity"), "{msg}");
    assert_eq!(fx.read(INSTANCE_ID_FILE), "XYZ-not-hex\n");

    let reset = fx.open(true).unwrap();
    assert_eq!(
        reset.identity_source(),
        IdentitySource::Reset { previous: None }
    );
    assert_eq!(
        fx.read(INSTANCE_ID_FILE),
        format!("{}\n", reset.instance_id())
    );
}

#[test]
fn binary_garbage_in_instance_id_is_reported_as_corruption() {
    let fx = Fixture::new();
    fs::create_dir_all(fx.state()).unwrap();
    fs::write(fx.state().join(INSTANCE_ID_FILE), [0xff, 0xfe, 0x00, 0x01]).unwrap();
    assert!(matches!(
        fx.open(false),
        Err(IdentityError::CorruptInstanceId { .. })
    ));
}

#[test]
fn an_unusable_live_machine_id_is_a_clear_error() {
    let fx = Fixture::new();
    fs::write(fx.machine_id_file(), "uninitialized\n").unwrap();
    let err = fx.open(false).unwrap_err();
    assert!(
        matches!(&err, IdentityError::BadMachineId { found, .. } if found == "uninitialized"),
        "{err:?}"
    );

    fs::remove_file(fx.machine_id_file()).unwrap();
    let err = fx.open(false).unwrap_err();
    assert!(
        matches!(&err, IdentityError::MachineIdUnreadable { path, .. } if path == &fx.machine_id_file()),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains(&fx.machine_id_file().display().to_string()),
        "{msg}"
    );
    assert!(msg.contains("systemd-machine-id-setup"), "{msg}");
    // Nothing was minted by the failed starts.
    assert!(!fx.state().join(INSTANCE_ID_FILE).exists());
}

#[test]
fn the_host_machine_id_is_readable_here() {
    // The daemon's default path: every dev and CI machine has one.
    let fx = Fixture::new();
    let dir = StateDir::open(&fx.state(), false).unwrap();
    assert_eq!(dir.machine_id().len(), 32);
}
