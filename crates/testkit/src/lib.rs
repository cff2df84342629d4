//! Test infrastructure for kici-scaler's Firecracker backend, because no
//! Firecracker, jailer or usable `/dev/kvm` exists on the machines that run
//! the tests:
//!
//! - `fc-sim` (binary, [`sim`]): a Firecracker stand-in serving the v1.16.1 API
//!   on its unix socket, validating every request against the shipped swagger
//!   spec ([`spec`], [`schema`]) and Firecracker's semantic rules ([`vmm`]),
//!   with MMDS V1/V2 ([`mmds`]) and a simulated guest ([`guest`]) that reads
//!   MMDS like the kici guest `/init` and runs a guest agent.
//! - `fake-jailer` (binary, [`jailer`]): the jailer's documented contract
//!   (chroot layout, exec-file copy, device nodes, cgroups, uid/gid drop,
//!   `--new-pid-ns` pid file, `--daemonize`).
//! - [`fc`]: what tests in other crates call (build the static binaries,
//!   query a running simulator, set the guest's failure mode), and
//!   [`guestnet`]: a guest network namespace whose frames cross the VM's real
//!   host TAP and whose MMDS address is answered by the simulator.

pub mod fc;
pub mod guest;
pub mod guestlink;
pub mod guestnet;
pub mod http;
pub mod jailer;
pub mod logger;
pub mod mmds;
pub mod schema;
pub mod sim;
pub mod spec;
pub mod tap;
pub mod vmm;
