//! The Firecracker backend: agents as jailed microVMs.
//!
//! - [`backend`]: [`FirecrackerBackend`] — spawn (transactional: every
//!   failure releases what was taken), destroy, adopt, list_owned, the MMDS
//!   clear after `config.ack`;
//! - [`names`]: TAP names, owner tags, the jail layout — derived in one place;
//! - [`jailer`]: the jailer's argv and cgroup directories;
//! - [`api`]: a typed client of the Firecracker API (v1.16.1) with a
//!   per-call timeout;
//! - [`vmconfig`]: machine size, boot args, drives, interface;
//! - [`mmds`]: the MMDS document (32 KiB env budget, POSIX key filter);
//! - [`tap`]: TAP ioctls and rtnetlink (bridge port isolation, ifalias);
//! - [`chroot`]: the VM directory, images, overlay, log files;
//! - [`logs`]: serial and VMM logs followed for the VM's life, boot failures;
//! - [`sweep`]: the orphan sweep;
//! - [`host`]: the host bridge ([`HostNetwork`]) and, with the host's
//!   forwarding for it, `firecracker provision|verify|teardown` ([`HostSetup`]).
//!
//! This crate owns everything a microVM agent holds on the host — the jail
//! and its chroot, the TAP and its bridge port, the per-VM egress rules
//! (through `kici_netpolicy::EgressRules`), the
//! MMDS document with the agent's bootstrap (version 2 sessions, cleared and
//! verified before the first job: see docs/deviations.md, D-mmds-v2) — and
//! the sweep that finds what a crashed daemon left. Each name is derived from
//! the agent id in one place ([`names`]), so spawn, destroy and the sweep
//! cannot disagree:
//!
//! ```
//! use kici_firecracker::names;
//! use kici_model::{AgentId, InstanceId};
//!
//! let agent: AgentId = "scaler-firecracker-0a1b2c3d".parse().unwrap();
//! let instance: InstanceId = "5e6f7a8b".parse().unwrap();
//! assert_eq!(names::tap_name(&agent), "kici-0a1b2c3d"); // fits IFNAMSIZ
//! let tag = names::owner_tag(instance, &agent); // the TAP's ifalias
//! assert_eq!(tag, "kici-scaler:5e6f7a8b:scaler-firecracker-0a1b2c3d");
//! assert_eq!(names::parse_owner_tag(&tag), Some((instance, agent)));
//! assert!(names::parse_owner_tag("kici-scaler:someone-else").is_none());
//! ```
//!
//! Running VMs needs the `firecracker` and `jailer` binaries, a kernel, a
//! root filesystem and `/dev/kvm`; `kici-testkit` simulates the first two
//! for tests.

pub mod api;
pub mod backend;
pub mod chroot;
pub mod host;
pub mod jailer;
pub mod logs;
pub mod mmds;
pub mod names;
mod pidfd;
pub mod rootfs;
pub mod sweep;
pub mod tap;
mod validate;
pub mod vmconfig;

pub use backend::{
    DestroyError, FirecrackerBackend, FirecrackerError, FirecrackerOptions, MmdsClearError,
    SetupError, SpawnError, SpawnTimings, Timeouts,
};
pub use host::{
    BridgeStatus, HostNetwork, HostSetup, HostSetupError, HostSetupStatus, HostTeardown,
};
pub use jailer::{CgroupVersion, JailerCgroups};
pub use sweep::{SweepReport, DEFAULT_SWEEP_INTERVAL};
pub use validate::FirecrackerProblem;

/// Failpoint names, one per provisioning, release and reconcile step, each
/// placed right after the step's side effect.
pub mod fp {
    pub const SPAWN_VM_DIR: &str = "kici_firecracker::spawn::vm_dir";
    pub const SPAWN_LEASE: &str = "kici_firecracker::spawn::lease";
    pub const SPAWN_TAP: &str = "kici_firecracker::spawn::tap";
    pub const SPAWN_ATTACH: &str = "kici_firecracker::spawn::attach";
    pub const SPAWN_RULES: &str = "kici_firecracker::spawn::rules";
    pub const SPAWN_CHROOT: &str = "kici_firecracker::spawn::chroot";
    pub const SPAWN_OVERLAY: &str = "kici_firecracker::spawn::overlay";
    pub const SPAWN_JAILER: &str = "kici_firecracker::spawn::jailer";
    pub const SPAWN_SOCKET: &str = "kici_firecracker::spawn::socket";
    pub const SPAWN_CONFIGURE: &str = "kici_firecracker::spawn::configure";
    pub const SPAWN_MMDS: &str = "kici_firecracker::spawn::mmds";
    pub const SPAWN_START: &str = "kici_firecracker::spawn::start";
    pub const MMDS_CLEAR: &str = "kici_firecracker::mmds::clear";
    pub const DESTROY_STOP: &str = "kici_firecracker::destroy::stop";
    pub const DESTROY_RULES: &str = "kici_firecracker::destroy::rules";
    pub const DESTROY_TAP: &str = "kici_firecracker::destroy::tap";
    pub const DESTROY_LEASE: &str = "kici_firecracker::destroy::lease";
    pub const DESTROY_CHROOT: &str = "kici_firecracker::destroy::chroot";
    pub const SWEEP_TAP: &str = "kici_firecracker::sweep::tap";
    pub const SWEEP_LEASES: &str = "kici_firecracker::sweep::leases";

    /// The spawn steps, in order.
    pub const SPAWN: &[&str] = &[
        SPAWN_VM_DIR,
        SPAWN_LEASE,
        SPAWN_TAP,
        SPAWN_ATTACH,
        SPAWN_RULES,
        SPAWN_CHROOT,
        SPAWN_OVERLAY,
        SPAWN_JAILER,
        SPAWN_SOCKET,
        SPAWN_CONFIGURE,
        SPAWN_MMDS,
        SPAWN_START,
    ];
}

/// Every failpoint of the crate.
pub const FAILPOINTS: &[&str] = &[
    fp::SPAWN_VM_DIR,
    fp::SPAWN_LEASE,
    fp::SPAWN_TAP,
    fp::SPAWN_ATTACH,
    fp::SPAWN_RULES,
    fp::SPAWN_CHROOT,
    fp::SPAWN_OVERLAY,
    fp::SPAWN_JAILER,
    fp::SPAWN_SOCKET,
    fp::SPAWN_CONFIGURE,
    fp::SPAWN_MMDS,
    fp::SPAWN_START,
    fp::MMDS_CLEAR,
    fp::DESTROY_STOP,
    fp::DESTROY_RULES,
    fp::DESTROY_TAP,
    fp::DESTROY_LEASE,
    fp::DESTROY_CHROOT,
    fp::SWEEP_TAP,
    fp::SWEEP_LEASES,
];
