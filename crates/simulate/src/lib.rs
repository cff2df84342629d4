//! Capacity planning: replays a job history through the real engine
//! (routing, admission, caps, warm pools, the pending queue, backoff) with
//! a virtual clock and a simulated backend, and measures what the jobs and
//! the operator would have seen.
//!
//! - [`trace`]: the job history (JSON Lines or CSV) and its parser.
//! - [`run`]: the replay: the engine's effects are served by a backend
//!   whose agents register a fixed time after their spawn, jobs run for
//!   their recorded duration, and the clock jumps from one event to the
//!   next (the engine takes `now` as an argument, so nothing waits).
//! - [`report`]: waits (arrival → an agent ready for the job), idle
//!   agent-seconds, peaks and refusals, per scaler and overall.

pub mod report;
pub mod run;
pub mod trace;

pub use report::{Report, Stats, WaitStats};
pub use run::{simulate, SimOptions, SpawnTimes};
pub use trace::{parse_trace, Trace, TraceError, TraceJob};
