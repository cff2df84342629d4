//! `kici-scaler firecracker rootfs`: a guest root filesystem image built
//! from static binaries — the guest `/init` (`kici-guest-init`), the agent
//! (`kici-agent-lite`) and `busybox` with its applet links — staged in a
//! directory next to the output and written with `mkfs.ext4 -d`.
//!
//! Layout (what the guest side expects):
//!
//! | path | what |
//! |---|---|
//! | `/init`, `/sbin/init → /init` | the init (the scaler boots with `init=/init`) |
//! | `/usr/local/bin/kici-agent-lite` | the agent (`kici-guest-init`'s default) |
//! | `/bin/busybox` + one link per applet (`busybox --list-full`) | the shell and tools |
//! | `/dev /proc /sys /run /tmp /root /etc …` | mount points and homes |
//! | `/etc/passwd`, `group`, `nsswitch.conf`, `os-release`, `hostname`, `hosts`, `resolv.conf` | minimal system files (`/init` rewrites the last three) |
//!
//! Every input must be a static ELF executable (no `PT_INTERP`: the image
//! carries no dynamic loader or libraries), all for the same machine.
//! `mkfs.ext4 -d` copies the staging files' owners, so every inode is then
//! set to root with one `debugfs` run (a builder that is not root would
//! otherwise leave its own uid on the guest's files).

use std::fs;
use std::io::Read;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Where the agent lives in the image.
pub const AGENT_PATH: &str = "usr/local/bin/kici-agent-lite";
/// Default image size.
pub const DEFAULT_SIZE_MIB: u32 = 256;
/// Where `busybox-static` installs busybox on Debian and most distributions.
pub const DEFAULT_BUSYBOX: &str = "/bin/busybox";

/// What to build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RootfsSpec {
    pub out: PathBuf,
    pub init: PathBuf,
    pub agent: PathBuf,
    pub busybox: PathBuf,
    pub size_mib: u32,
}

/// What was built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RootfsReport {
    pub out: PathBuf,
    pub size_mib: u32,
    /// Bytes of regular files staged.
    pub staged_bytes: u64,
    pub applets: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum RootfsError {
    #[error("{what} {path}: not found")]
    Missing { what: &'static str, path: PathBuf },
    #[error("{what} {path}: not an ELF executable ({reason})")]
    NotElf {
        what: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("{what} {path}: dynamically linked (it asks for a program interpreter); the rootfs has no libraries — build it static (e.g. scripts/build-guest-musl.sh)")]
    NotStatic { what: &'static str, path: PathBuf },
    #[error("{what} {path} is for ELF machine {machine}, the init for {init_machine}")]
    MachineMismatch {
        what: &'static str,
        path: PathBuf,
        machine: u16,
        init_machine: u16,
    },
    #[error("the image needs more than {size_mib} MiB ({staged_bytes} bytes of files); pass a larger --size-mib")]
    TooSmall { size_mib: u32, staged_bytes: u64 },
    #[error("{path}: {err}")]
    Io { path: PathBuf, err: std::io::Error },
    #[error("`{command}` failed: {detail}")]
    Command { command: String, detail: String },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> RootfsError + '_ {
    move |err| RootfsError::Io {
        path: path.to_owned(),
        err,
    }
}

const PT_INTERP: u32 = 3;
const ET_EXEC: u16 = 2;
const ET_DYN: u16 = 3;

/// A static ELF executable's machine (`e_machine`), or why it is not one.
pub fn static_elf_machine(what: &'static str, path: &Path) -> Result<u16, RootfsError> {
    let not_elf = |reason: &str| RootfsError::NotElf {
        what,
        path: path.to_owned(),
        reason: reason.to_owned(),
    };
    let meta = fs::metadata(path).map_err(|_| RootfsError::Missing {
        what,
        path: path.to_owned(),
    })?;
    if !meta.is_file() {
        return Err(not_elf("not a regular file"));
    }
    let mut bytes = Vec::new();
    fs::File::open(path)
        .and_then(|f| f.take(1 << 30).read_to_end(&mut bytes))
        .map_err(io(path))?;
    if bytes.get(..4) != Some(b"\x7fELF") {
        return Err(not_elf("no ELF magic"));
    }
    let is64 = match bytes.get(4) {
        Some(1) => false,
        Some(2) => true,
        _ => return Err(not_elf("unknown ELF class")),
    };
    let little = match bytes.get(5) {
        Some(1) => true,
        Some(2) => false,
        _ => return Err(not_elf("unknown byte order")),
    };
    let u16_at = |off: usize| -> Option<u16> {
        let b: [u8; 2] = bytes.get(off..off + 2)?.try_into().ok()?;
        Some(if little {
            u16::from_le_bytes(b)
        } else {
            u16::from_be_bytes(b)
        })
    };
    let u32_at = |off: usize| -> Option<u32> {
        let b: [u8; 4] = bytes.get(off..off + 4)?.try_into().ok()?;
        Some(if little {
            u32::from_le_bytes(b)
        } else {
            u32::from_be_bytes(b)
        })
    };
    let u64_at = |off: usize| -> Option<u64> {
        let b: [u8; 8] = bytes.get(off..off + 8)?.try_into().ok()?;
        Some(if little {
            u64::from_le_bytes(b)
        } else {
            u64::from_be_bytes(b)
        })
    };
    let truncated = || not_elf("truncated header");
    let e_type = u16_at(16).ok_or_else(truncated)?;
    if e_type != ET_EXEC && e_type != ET_DYN {
        return Err(not_elf("not an executable"));
    }
    let machine = u16_at(18).ok_or_else(truncated)?;
    let (phoff, phentsize, phnum) = if is64 {
        (u64_at(32), u16_at(54), u16_at(56))
    } else {
        (u32_at(28).map(u64::from), u16_at(42), u16_at(44))
    };
    let (Some(phoff), Some(phentsize), Some(phnum)) = (phoff, phentsize, phnum) else {
        return Err(truncated());
    };
    if phnum == 0 {
        return Err(not_elf("no program headers"));
    }
    let phoff = usize::try_from(phoff).map_err(|_| truncated())?;
    for i in 0..usize::from(phnum) {
        let p_type = u32_at(phoff + i * usize::from(phentsize))
            .ok_or_else(|| not_elf("truncated program headers"))?;
        if p_type == PT_INTERP {
            return Err(RootfsError::NotStatic {
                what,
                path: path.to_owned(),
            });
        }
    }
    Ok(machine)
}

/// Builds the image. The staging directory (next to `out`) is removed
/// whatever happens.
pub fn build(spec: &RootfsSpec) -> Result<RootfsReport, RootfsError> {
    let init_machine = static_elf_machine("init", &spec.init)?;
    for (what, path) in [("agent", &spec.agent), ("busybox", &spec.busybox)] {
        let machine = static_elf_machine(what, path)?;
        if machine != init_machine {
            return Err(RootfsError::MachineMismatch {
                what,
                path: path.clone(),
                machine,
                init_machine,
            });
        }
    }
    let applets = busybox_applets(&spec.busybox)?;

    let parent = spec
        .out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let stage = Staging::create(parent, &spec.out)?;
    let root = stage.path();
    let staged_bytes = populate(root, spec, &applets)?;
    // ext4 metadata (journal, inode tables) on a small image: about a
    // quarter; leave it that much room.
    let capacity = u64::from(spec.size_mib) * 1024 * 1024;
    if staged_bytes.saturating_mul(4) / 3 > capacity {
        return Err(RootfsError::TooSmall {
            size_mib: spec.size_mib,
            staged_bytes,
        });
    }

    // mkfs.ext4 -F would write into an existing file in place; start afresh.
    match fs::remove_file(&spec.out) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(&spec.out)(e)),
    }
    run(
        Command::new("mkfs.ext4")
            .args(["-q", "-F", "-L", "kici-rootfs", "-d"])
            .arg(root)
            .arg(&spec.out)
            .arg(format!("{}M", spec.size_mib)),
        false,
    )?;
    if let Err(e) = set_owners_to_root(root, &spec.out) {
        let _ = fs::remove_file(&spec.out);
        return Err(e);
    }
    Ok(RootfsReport {
        out: spec.out.clone(),
        size_mib: spec.size_mib,
        staged_bytes,
        applets: applets.len(),
    })
}

/// The applet paths `busybox --list-full` prints (`bin/sh`, `usr/bin/awk`, …).
fn busybox_applets(busybox: &Path) -> Result<Vec<PathBuf>, RootfsError> {
    let out = Command::new(busybox)
        .arg("--list-full")
        .output()
        .map_err(|e| RootfsError::Command {
            command: format!("{} --list-full", busybox.display()),
            detail: e.to_string(),
        })?;
    if !out.status.success() {
        return Err(RootfsError::Command {
            command: format!("{} --list-full", busybox.display()),
            detail: format!("{}: {}", out.status, String::from_utf8_lossy(&out.stderr)),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::trim)
        // Relative, without `..`: the list must not place links outside the image.
        .filter(|l| {
            !l.is_empty()
                && Path::new(l)
                    .components()
                    .all(|c| matches!(c, std::path::Component::Normal(_)))
        })
        .map(PathBuf::from)
        .collect())
}

const DIRS: [(&str, u32); 16] = [
    ("bin", 0o755),
    ("sbin", 0o755),
    ("dev", 0o755),
    ("etc", 0o755),
    ("home", 0o755),
    ("mnt", 0o755),
    ("proc", 0o555),
    ("root", 0o700),
    ("run", 0o755),
    ("sys", 0o555),
    ("tmp", 0o1777),
    ("usr/bin", 0o755),
    ("usr/sbin", 0o755),
    ("usr/local/bin", 0o755),
    ("var/tmp", 0o1777),
    ("var/lib", 0o755),
];

const ETC_FILES: [(&str, &str); 7] = [
    ("etc/passwd", "root:x:0:0:root:/root:/bin/sh\n"),
    ("etc/group", "root:x:0:\n"),
    ("etc/nsswitch.conf", "hosts: files dns\n"),
    (
        "etc/os-release",
        "NAME=\"kici guest\"\nID=kici-guest\nPRETTY_NAME=\"kici-scaler Firecracker guest\"\n",
    ),
    ("etc/hostname", "kici-guest\n"),
    ("etc/hosts", "127.0.0.1\tlocalhost\n::1\tlocalhost\n"),
    ("etc/resolv.conf", ""),
];

/// Fills the staging root; the bytes of regular files written.
fn populate(root: &Path, spec: &RootfsSpec, applets: &[PathBuf]) -> Result<u64, RootfsError> {
    for (dir, mode) in DIRS {
        let p = root.join(dir);
        fs::create_dir_all(&p).map_err(io(&p))?;
        fs::set_permissions(&p, fs::Permissions::from_mode(mode)).map_err(io(&p))?;
    }
    let mut bytes = 0;
    for (src, dst) in [
        (&spec.init, "init"),
        (&spec.agent, AGENT_PATH),
        (&spec.busybox, "bin/busybox"),
    ] {
        let to = root.join(dst);
        bytes += fs::copy(src, &to).map_err(io(src))?;
        fs::set_permissions(&to, fs::Permissions::from_mode(0o755)).map_err(io(&to))?;
    }
    for (path, content) in ETC_FILES {
        let to = root.join(path);
        fs::write(&to, content).map_err(io(&to))?;
        fs::set_permissions(&to, fs::Permissions::from_mode(0o644)).map_err(io(&to))?;
        bytes += content.len() as u64;
    }
    let sbin_init = root.join("sbin/init");
    symlink("/init", &sbin_init).map_err(io(&sbin_init))?;
    for applet in applets {
        let link = root.join(applet);
        // Our files come first (busybox has its own `init`, `linuxrc`).
        if link.symlink_metadata().is_ok() {
            continue;
        }
        if let Some(dir) = link.parent() {
            fs::create_dir_all(dir).map_err(io(dir))?;
        }
        symlink("/bin/busybox", &link).map_err(io(&link))?;
    }
    Ok(bytes)
}

/// One `debugfs -w` run setting uid and gid 0 on every inode staged.
fn set_owners_to_root(root: &Path, image: &Path) -> Result<(), RootfsError> {
    let mut script = String::new();
    let mut stack = vec![root.to_owned()];
    let mut paths = vec!["/".to_owned()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).map_err(io(&dir))? {
            let entry = entry.map_err(io(&dir))?;
            let path = entry.path();
            let Ok(rel) = path.strip_prefix(root) else {
                continue;
            };
            paths.push(format!("/{}", rel.display()));
            if entry.file_type().map_err(io(&path))?.is_dir() {
                stack.push(path);
            }
        }
    }
    for p in &paths {
        // debugfs splits its arguments on blanks; our paths have none.
        script.push_str(&format!("sif \"{p}\" uid 0\nsif \"{p}\" gid 0\n"));
    }
    let script_path = root.with_extension("debugfs");
    fs::write(&script_path, script).map_err(io(&script_path))?;
    let result = run(
        Command::new("debugfs")
            .arg("-w")
            .arg("-f")
            .arg(&script_path)
            .arg(image),
        true,
    );
    let _ = fs::remove_file(&script_path);
    result
}

/// Runs a tool; `Err` on a failure exit. With `stderr_is_failure`, any
/// line on stderr but the tool's banner is one too (debugfs reports a
/// failed command there and still exits 0).
fn run(cmd: &mut Command, stderr_is_failure: bool) -> Result<(), RootfsError> {
    let command = format!("{cmd:?}");
    let out = cmd.output().map_err(|e| RootfsError::Command {
        command: command.clone(),
        detail: e.to_string(),
    })?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    let complaint = stderr
        .lines()
        .find(|l| !l.starts_with("debugfs ") && !l.trim().is_empty());
    if out.status.success() && !(stderr_is_failure && complaint.is_some()) {
        return Ok(());
    }
    Err(RootfsError::Command {
        command,
        detail: format!("{}: {}", out.status, complaint.unwrap_or("")),
    })
}

/// The staging directory, removed on drop.
struct Staging(PathBuf);

impl Staging {
    fn create(parent: &Path, out: &Path) -> Result<Self, RootfsError> {
        let name = out
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "rootfs".to_owned());
        let path = parent.join(format!(".{name}.stage-{}", std::process::id()));
        if path.exists() {
            fs::remove_dir_all(&path).map_err(io(&path))?;
        }
        fs::create_dir_all(&path).map_err(io(&path))?;
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).map_err(io(&path))?;
        Ok(Self(path))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn firecracker_rootfs_elf_checks() {
        let dir = tempfile::tempdir().unwrap();
        // A dynamically linked executable: this test binary itself.
        let me = std::env::current_exe().unwrap();
        assert!(matches!(
            static_elf_machine("agent", &me),
            Err(RootfsError::NotStatic { what: "agent", .. })
        ));
        // Static: busybox-static.
        assert_eq!(
            static_elf_machine("busybox", Path::new(DEFAULT_BUSYBOX)).unwrap(),
            62
        );
        let script = dir.path().join("script");
        fs::write(&script, "#!/bin/sh\n").unwrap();
        assert!(matches!(
            static_elf_machine("init", &script),
            Err(RootfsError::NotElf { .. })
        ));
        let truncated = dir.path().join("truncated");
        fs::write(&truncated, b"\x7fELF\x02\x01\x01").unwrap();
        assert!(matches!(
            static_elf_machine("init", &truncated),
            Err(RootfsError::NotElf { .. })
        ));
        assert!(matches!(
            static_elf_machine("init", &dir.path().join("nope")),
            Err(RootfsError::Missing { what: "init", .. })
        ));
        assert!(matches!(
            static_elf_machine("init", dir.path()),
            Err(RootfsError::NotElf { .. })
        ));
    }
}
