//! kici-scaler's daemon and command-line front end, as a library so that the
//! binary (`src/main.rs`) stays a thin shell and integration tests can reach
//! the same code. Grouped by what runs:
//!
//! - [`cli`]: the `kici-scaler` commands — argument parsing, exit codes,
//!   logging; `run` (a job end to end), the commands that talk to a running
//!   daemon and their HTTP client, `doctor`, `generate`, `sweep`,
//!   `firecracker provision|verify|teardown`, and an unprivileged `run`'s
//!   user scope.
//! - [`daemon`]: `serve` — start-up, settings, the state dir and its
//!   identity, listeners (HTTP with connection caps, TLS, systemd
//!   readiness), the backends this build runs, cgroup placement, reload,
//!   signals and shutdown; [`daemon::stack`] is what `serve` and `run`
//!   share (engine runtime, gateway, job book, event pump).
//! - [`api`]: the control API (routes, errors, the edge to `kici-api`'s
//!   types, OpenAPI).
//! - [`gateway`]: the agent gateway (`/ws`, KiCI's handshake, dispatch, the
//!   job driver), the one agent lifecycle service behind it and the HTTP
//!   agent reports ([`gateway::enrolment`]), and agent tokens.
//! - [`jobs`]: standalone jobs (their state, output and end).
//! - [`durable`]: the state store — the engine's journal as rows, jobs and
//!   events, and the reconciler.
//! - [`events`]: the engine's event stream to observers: the SSE replay
//!   buffer, the fan-out pump, Prometheus metrics.
//! - [`fleet`]: this daemon as one host of a fleet sharing a PostgreSQL
//!   database — membership, leadership, the claim loop, handover.

#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod api;
pub mod cli;
pub mod daemon;
pub mod durable;
pub mod events;
pub mod fleet;
pub mod gateway;
pub mod jobs;
pub mod provisioning;
pub mod service;
