//! kici-scaler's daemon and command-line front end, as a library so that the
//! binary (`src/main.rs`) stays a thin shell and integration tests can reach
//! the same code.
//!
//! - [`cli`]: argument parsing, the one-shot commands, exit codes, logging.
//! - [`identity`]: the state dir, its lock and the instance identity.
//! - [`settings`]: the daemon's own settings (flags > env > file > defaults).
//! - [`daemon`]: `serve`: start-up, listeners, signals, shutdown.
//! - [`stack`]: what `serve` and `run` share: the engine runtime, the agent
//!   gateway, the job book, the event pump, and their shutdown.
//! - [`gateway`]: the agent gateway (`/ws`, the KiCI handshake, dispatch).
//! - [`jobs`]: standalone jobs (their state, output and end).
//! - [`run`]: `kici-scaler run`, a job end to end from the command line.
//! - [`agent_binary`]: where a bare-metal `binaryPath` points.
//! - [`firecracker_cli`]: `kici-scaler firecracker provision|verify|teardown`.
//! - [`doctor`]: `kici-scaler doctor`, what the bare-metal backend needs.
//! - [`api`]: the control API (routes, errors, JSON shapes, OpenAPI).
//! - [`token`]: agent tokens and redacted secrets.
//! - [`events`]: the SSE replay buffer; [`pump`]: the event fan-out;
//!   [`persist`]: pending requests and events in the state store.
//! - [`metrics`]: Prometheus series.
//! - [`reload`]: configuration reload.
//! - [`backends`]: which backends this build runs.
//! - [`client`]: the CLI's HTTP client for the control API; [`remote`]: the
//!   commands that talk to a running daemon.
//! - [`tls`]: rustls configurations.
//! - [`crashpoints`]: failpoints turned into kill -9 (test builds).
//! - [`state`]: the engine's journal in the state store, and back.
//! - [`reconcile`]: store ↔ host reality: orphans, leases, stale rows;
//!   [`sweep`]: one pass by hand.

#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod agent_binary;
pub mod api;
pub mod backends;
pub mod cgroups;
pub mod cli;
pub mod client;
pub mod crashpoints;
pub mod daemon;
pub mod dead_runs;
pub mod doctor;
pub mod enrolment;
pub mod events;
pub mod firecracker_cli;
pub mod gateway;
pub mod generate;
pub mod identity;
pub mod jobs;
pub mod metrics;
pub mod persist;
pub mod pump;
pub mod reconcile;
pub mod reload;
pub mod remote;
pub mod run;
pub mod serving;
pub mod settings;
pub mod stack;
pub mod state;
pub mod sweep;
pub mod systemd;
pub mod tls;
pub mod token;
pub mod user_scope;
