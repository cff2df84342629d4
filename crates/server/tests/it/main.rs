//! The daemon's integration tests, one binary: each of these modules used to
//! be a test binary of its own, and every one linked the whole daemon. Test
//! names carry the module (`standalone::…`); nextest still runs each test in
//! a process of its own, so process-global state (env vars, signal handlers,
//! the `serial_` group) is as isolated as before.

mod agent_user;
mod api;
mod api_access;
mod cli;
mod common;
mod container;
mod container_crash;
mod container_egress;
mod daemon;
mod dashboard;
mod dispatch;
mod docs;
mod doctor;
mod durable;
mod event;
mod firecracker_crash;
mod firecracker_rootfs_cli;
mod firecracker_testkit_e2e;
mod fleet;
mod fleet_auth;
mod fleet_chaos;
mod fleet_scale;
mod gateway;
mod postgres;
mod reconcile;
mod recovery;
mod run_dirs;
mod schema;
mod standalone;
mod state_dir;
mod ui;
