//! Container output, forwarded exactly like a bare-metal agent's.
//!
//! The Engine's log stream (`GET /containers/{id}/logs?follow`, stdout and
//! stderr de-multiplexed by bollard) is cut into lines by the same
//! [`LineSplitter`] as bare-metal (cap, CRLF, split UTF-8 handled there) and
//! each line is emitted through [`LogContext::emit`]: one `tracing` event with
//! the daemon's fields and the agent's text as a plain string, so an agent
//! cannot forge attribution (B36). The stream is opened right after start and
//! replays from the container's beginning, so nothing written before it
//! opened is lost (B3); it ends when the container stops, and destroy waits
//! for it to drain before removing the container (B15).

use bollard::container::LogOutput;
use bollard::query_parameters::LogsOptions;
use bollard::Docker;
use futures_util::StreamExt;
use kici_backends::logs::{LineSplitter, LogContext, Stream};
use tokio::task::JoinHandle;

/// Follows `container`'s output from `since` (unix seconds; 0 = from its
/// start) until the container stops or the stream breaks.
pub fn forward(docker: Docker, container: String, ctx: LogContext, since: i32) -> JoinHandle<()> {
    tokio::spawn(async move {
        let options = LogsOptions {
            follow: true,
            stdout: true,
            stderr: true,
            since,
            timestamps: false,
            tail: "all".to_owned(),
            ..Default::default()
        };
        let mut stream = docker.logs(&container, Some(options));
        let mut stdout = LineSplitter::default();
        let mut stderr = LineSplitter::default();
        while let Some(item) = stream.next().await {
            match item {
                Ok(LogOutput::StdOut { message } | LogOutput::Console { message }) => {
                    stdout.push(&message, &mut |line| ctx.emit(Stream::Stdout, &line));
                }
                Ok(LogOutput::StdErr { message }) => {
                    stderr.push(&message, &mut |line| ctx.emit(Stream::Stderr, &line));
                }
                Ok(LogOutput::StdIn { .. }) => {}
                Err(e) => {
                    tracing::debug!(agent_id = %ctx.agent, error = %e, "container log stream ended with an error");
                    break;
                }
            }
        }
        stdout.finish(&mut |line| ctx.emit(Stream::Stdout, &line));
        stderr.finish(&mut |line| ctx.emit(Stream::Stderr, &line));
    })
}
