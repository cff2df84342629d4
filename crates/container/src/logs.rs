//! Container output, forwarded exactly like a bare-metal agent's.
//!
//! The Engine's log stream (`GET /containers/{id}/logs?follow`, stdout and
//! stderr de-multiplexed by bollard) is cut into lines by the same
//! [`LineSplitter`] as bare-metal (cap, CRLF, split UTF-8 handled there) and
//! each line is emitted through [`LogContext::emit`]: one `tracing` event with
//! the daemon's fields and the agent's text as a plain string, so an agent
//! cannot forge attribution (docs/deviations.md, D-log-forwarding). The
//! stream is opened right after start and
//! replays from the container's beginning, so nothing written before it
//! opened is lost; it ends when the container stops, and destroy waits
//! for it to drain before removing the container (upstream closed it first). The last lines are
//! kept ([`Tail`]) so that an agent that exits on its own is reported with
//! what it said last (upstream lost that).

use bollard::container::LogOutput;
use bollard::query_parameters::LogsOptions;
use bollard::Docker;
use futures_util::StreamExt;
use kici_host::logs::{LineSplitter, LogContext, Stream};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;

/// Lines kept for the exit report.
pub const TAIL_LINES: usize = 20;
/// Characters of one kept line.
const TAIL_LINE_CHARS: usize = 300;

/// The last [`TAIL_LINES`] lines of an agent's output, and whether the
/// stream has ended.
#[derive(Debug)]
pub struct Tail {
    lines: parking_lot::Mutex<VecDeque<String>>,
    ended: tokio::sync::watch::Sender<bool>,
}

impl Default for Tail {
    fn default() -> Self {
        Self {
            lines: parking_lot::Mutex::new(VecDeque::new()),
            ended: tokio::sync::watch::Sender::new(false),
        }
    }
}

impl Tail {
    fn push(&self, line: &str) {
        let mut lines = self.lines.lock();
        if lines.len() == TAIL_LINES {
            lines.pop_front();
        }
        let mut kept: String = line.chars().take(TAIL_LINE_CHARS).collect();
        if kept.len() < line.len() {
            kept.push('…');
        }
        lines.push_back(kept);
    }

    /// The kept lines, after the stream ended (at most `wait` from now).
    pub async fn text(&self, wait: Duration) -> String {
        let mut ended = self.ended.subscribe();
        let _ = tokio::time::timeout(wait, ended.wait_for(|e| *e)).await;
        self.lines
            .lock()
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// Follows `container`'s output from `since` (unix seconds; 0 = from its
/// start) until the container stops or the stream breaks.
pub fn forward(
    docker: Docker,
    container: String,
    ctx: LogContext,
    since: i32,
    tail: Arc<Tail>,
) -> JoinHandle<()> {
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
                    stdout.push(&message, &mut |line| {
                        tail.push(&line);
                        ctx.emit(Stream::Stdout, &line);
                    });
                }
                Ok(LogOutput::StdErr { message }) => {
                    stderr.push(&message, &mut |line| {
                        tail.push(&line);
                        ctx.emit(Stream::Stderr, &line);
                    });
                }
                Ok(LogOutput::StdIn { .. }) => {}
                Err(e) => {
                    tracing::debug!(agent_id = %ctx.agent, error = %e, "container log stream ended with an error");
                    break;
                }
            }
        }
        stdout.finish(&mut |line| {
            tail.push(&line);
            ctx.emit(Stream::Stdout, &line);
        });
        stderr.finish(&mut |line| {
            tail.push(&line);
            ctx.emit(Stream::Stderr, &line);
        });
        tail.ended.send_replace(true);
    })
}
