//! Following a running agent: its log stream and the exit watch that
//! reports its end to the engine.

use super::*;

/// Waits for the container to stop and reports how it ended, unless
/// destroy caused it.
pub(super) async fn watch_exit(
    rt: Arc<Runtime>,
    container: String,
    agent: AgentId,
    reports: ReportSender,
    destroying: Arc<AtomicBool>,
    tail: Arc<logs::Tail>,
) {
    let docker = &rt.conn.docker;
    let mut failures = 0;
    let detail = loop {
        let mut stream = docker.wait_container(
            &container,
            Some(WaitContainerOptions {
                condition: "not-running".to_owned(),
            }),
        );
        let code = match stream.next().await {
            Some(Ok(answer)) => Some(answer.status_code),
            Some(Err(DockerError::DockerContainerWaitError { code, .. })) => Some(code),
            Some(Err(DockerError::DockerResponseServerError {
                status_code: 404, ..
            })) => break "container removed".to_owned(),
            // bollard's own header timeout on a very long wait: ask again.
            Some(Err(DockerError::RequestTimeoutError)) => continue,
            Some(Err(e)) => {
                failures += 1;
                if failures >= WATCH_ATTEMPTS {
                    break format!("lost track of the container: {e}");
                }
                tokio::time::sleep(WATCH_RETRY).await;
                continue;
            }
            None => {
                failures += 1;
                if failures >= WATCH_ATTEMPTS {
                    break "lost track of the container: wait stream ended".to_owned();
                }
                tokio::time::sleep(WATCH_RETRY).await;
                continue;
            }
        };
        let inspected = states::inspect_container(docker, &container).await.ok();
        let state = inspected.and_then(|c| c.state);
        let oom = state.as_ref().and_then(|s| s.oom_killed).unwrap_or(false);
        let code = state
            .as_ref()
            .and_then(|s| s.exit_code)
            .or(code)
            .unwrap_or(-1);
        break describe_exit(code, oom);
    };
    tracing::info!(agent_id = %agent, container = %container, detail = %detail, "container agent exited");
    if !destroying.load(Ordering::SeqCst) {
        // Why it ended is usually in what it said last.
        let output = tail.text(LOG_DRAIN).await;
        let detail = if output.is_empty() {
            detail
        } else {
            format!("{detail}\n--- captured output ---\n{output}")
        };
        // The engine may be gone (shutdown): nothing to tell then.
        let _ = reports.send(BackendReport::Exited { agent, detail });
    }
}

impl ContainerBackend {
    /// Starts forwarding output and watching the exit of a running agent.
    pub(super) fn follow(
        &self,
        rt: &Arc<Runtime>,
        agent: AgentId,
        container: &str,
        spec: &SpawnSpec,
        reports: ReportSender,
        logs_since: i32,
    ) {
        let ctx = LogContext {
            agent,
            scaler: spec.scaler.name.clone(),
            job: spec.job.clone(),
            source: rt.conn.kind.as_str(),
        };
        self.follow_with(rt, agent, container, ctx, reports, logs_since);
    }

    pub(super) fn follow_with(
        &self,
        rt: &Arc<Runtime>,
        agent: AgentId,
        container: &str,
        ctx: LogContext,
        reports: ReportSender,
        logs_since: i32,
    ) {
        let tail = Arc::new(logs::Tail::default());
        let logs = logs::forward(
            rt.conn.docker.clone(),
            container.to_owned(),
            ctx,
            logs_since,
            tail.clone(),
        );
        let destroying = Arc::new(AtomicBool::new(false));
        let watch = tokio::spawn(watch_exit(
            rt.clone(),
            container.to_owned(),
            agent,
            reports,
            destroying.clone(),
            tail,
        ));
        let previous = self.inner.tracked.lock().insert(
            agent,
            Tracked {
                runtime: rt.clone(),
                destroying,
                logs: Some(logs),
                watch,
            },
        );
        if let Some(previous) = previous {
            previous.destroying.store(true, Ordering::SeqCst);
            previous.watch.abort();
            if let Some(logs) = previous.logs {
                logs.abort();
            }
        }
    }
}
