//! [`Deliverer`]: takes one event to every configured target, retrying
//! each under the [`RetryPolicy`], and says how it went.
//!
//! Targets are tried concurrently and independently; the event is
//! delivered when every target took it ([`DeliveryOutcome::delivered`]).
//! A target that failed its last attempt is final for this call: the caller
//! (the daemon's event backend) counts a failed scale-up as a spawn failure
//! and keeps the event in its outbox; the deliverer itself keeps no state,
//! so calling it again with the same event is a redelivery (same
//! `requestId`).

use crate::command::{self, CommandEnd, CommandEnv, EventEnv, DEFAULT_CAPTURE_LIMIT};
use crate::config::{CommandTarget, ProvisionerConfig, WebhookTarget};
use crate::event::ProvisionEvent;
use crate::retry::RetryPolicy;
use crate::webhook::{self, EventHeaders, TlsSetupError, WebhookEnd, WebhookTls};
use kici_model::Secret;
use std::fmt;
use std::time::Duration;

/// Which kind of target a report is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TargetKind {
    Command,
    Webhook,
}

impl TargetKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Command => "command",
            Self::Webhook => "webhook",
        }
    }
}

impl fmt::Display for TargetKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How one target fared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetReport {
    pub target: TargetKind,
    /// Attempts made (≥ 1).
    pub attempts: u32,
    /// `None` when delivered; else why the last attempt failed.
    pub failure: Option<String>,
}

/// The outcome of [`Deliverer::deliver`]: one report per configured target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryOutcome {
    pub reports: Vec<TargetReport>,
}

impl DeliveryOutcome {
    /// Every target took the event.
    pub fn delivered(&self) -> bool {
        self.reports.iter().all(|r| r.failure.is_none())
    }

    /// The failed targets' reasons, for a log line or a spawn failure.
    pub fn failure_summary(&self) -> Option<String> {
        let parts: Vec<String> = self
            .reports
            .iter()
            .filter_map(|r| {
                r.failure
                    .as_ref()
                    .map(|f| format!("{} after {} attempt(s): {f}", r.target, r.attempts))
            })
            .collect();
        (!parts.is_empty()).then(|| parts.join("; "))
    }
}

/// The deliverer could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DelivererError {
    #[error("webhook secret: environment variable {0} is not set or empty")]
    MissingSecret(String),
    #[error("webhook over https: {0}")]
    Tls(#[from] TlsSetupError),
}

/// Delivers events to one scaler's provisioner.
#[derive(Debug, Clone)]
pub struct Deliverer {
    command: Option<CommandTarget>,
    /// The command's environment, resolved when the deliverer is built.
    command_env: CommandEnv,
    webhook: Option<(WebhookTarget, Secret)>,
    /// Set when the webhook URL is https.
    tls: Option<WebhookTls>,
    timeout: Duration,
    retry: RetryPolicy,
    capture_limit: usize,
}

impl Deliverer {
    /// Resolves the webhook secret and the command's environment
    /// ([`CommandEnv::resolve`]) through `lookup_env` (the daemon passes
    /// the process environment; tests a map). An unset or empty secret
    /// variable is an error: an unsigned webhook is never sent. An `https` webhook
    /// trusts the system's root certificates, loaded here.
    pub fn new(
        config: &ProvisionerConfig,
        lookup_env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, DelivererError> {
        let webhook = match &config.webhook {
            None => None,
            Some(w) => {
                let secret = lookup_env(&w.secret_env)
                    .filter(|s| !s.is_empty())
                    .ok_or_else(|| DelivererError::MissingSecret(w.secret_env.clone()))?;
                Some((w.clone(), Secret::new(secret)))
            }
        };
        let tls = match &config.webhook {
            Some(w) if w.url.scheme() == "https" => Some(WebhookTls::system_roots()?),
            _ => None,
        };
        let command_env = match &config.command {
            Some(_) => CommandEnv::resolve(config, &lookup_env),
            None => CommandEnv::default(),
        };
        Ok(Self {
            command: config.command.clone(),
            command_env,
            webhook,
            tls,
            timeout: config.timeout,
            retry: config.retry,
            capture_limit: DEFAULT_CAPTURE_LIMIT,
        })
    }

    /// Verify an `https` webhook against these roots instead (a private CA).
    pub fn with_webhook_tls(mut self, tls: WebhookTls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Bytes of each output stream kept per command attempt.
    pub fn with_capture_limit(mut self, bytes: usize) -> Self {
        self.capture_limit = bytes;
        self
    }

    /// Delivers `event` to every target, each retried up to the policy.
    pub async fn deliver(&self, event: &ProvisionEvent) -> DeliveryOutcome {
        let body = match event.to_json() {
            Ok(b) => b,
            Err(e) => {
                // Plain structs of strings and numbers always serialise;
                // reported rather than assumed.
                let failure = Some(format!("cannot serialise the event: {e}"));
                return DeliveryOutcome {
                    reports: self
                        .targets()
                        .map(|target| TargetReport {
                            target,
                            attempts: 0,
                            failure: failure.clone(),
                        })
                        .collect(),
                };
            }
        };
        let command = async {
            match &self.command {
                Some(c) => Some(self.deliver_command(c, event, &body).await),
                None => None,
            }
        };
        let webhook = async {
            match &self.webhook {
                Some((w, secret)) => Some(self.deliver_webhook(w, secret, event, &body).await),
                None => None,
            }
        };
        let (c, w) = tokio::join!(command, webhook);
        DeliveryOutcome {
            reports: c.into_iter().chain(w).collect(),
        }
    }

    fn targets(&self) -> impl Iterator<Item = TargetKind> {
        self.command
            .as_ref()
            .map(|_| TargetKind::Command)
            .into_iter()
            .chain(self.webhook.as_ref().map(|_| TargetKind::Webhook))
    }

    async fn deliver_command(
        &self,
        target: &CommandTarget,
        event: &ProvisionEvent,
        body: &[u8],
    ) -> TargetReport {
        let env = EventEnv {
            event: event.kind().as_str(),
            request_id: event.request_id().as_str(),
            agent_id: event.agent_id(),
            base: &self.command_env,
        };
        let mut attempts = 0;
        loop {
            attempts += 1;
            let attempt =
                command::run_once(&target.argv, body, env, self.timeout, self.capture_limit).await;
            for (stream, out) in [("stdout", &attempt.stdout), ("stderr", &attempt.stderr)] {
                if !out.is_empty() {
                    tracing::info!(
                        request_id = %event.request_id(),
                        agent_id = event.agent_id(),
                        attempt = attempts,
                        stream,
                        output = %out.text(),
                        "provisioner command output"
                    );
                }
            }
            if attempt.delivered() {
                tracing::info!(
                    request_id = %event.request_id(),
                    event = %event.kind(),
                    attempt = attempts,
                    elapsed_ms = attempt.elapsed.as_millis() as u64,
                    "provisioner command took the event"
                );
                return TargetReport {
                    target: TargetKind::Command,
                    attempts,
                    failure: None,
                };
            }
            let failure = match &attempt.end {
                CommandEnd::TimedOut => format!("{} ({:?})", attempt.end, self.timeout),
                other => other.to_string(),
            };
            if !self.retry.should_retry(attempts) {
                tracing::warn!(request_id = %event.request_id(), event = %event.kind(), attempts, failure = %failure, "provisioner command failed; giving up");
                return TargetReport {
                    target: TargetKind::Command,
                    attempts,
                    failure: Some(failure),
                };
            }
            let delay = self.retry.jittered_delay_after(attempts);
            tracing::warn!(request_id = %event.request_id(), event = %event.kind(), attempt = attempts, failure = %failure, retry_in_ms = delay.as_millis() as u64, "provisioner command failed; retrying");
            tokio::time::sleep(delay).await;
        }
    }

    async fn deliver_webhook(
        &self,
        target: &WebhookTarget,
        secret: &Secret,
        event: &ProvisionEvent,
        body: &[u8],
    ) -> TargetReport {
        let headers = EventHeaders {
            event: event.kind().as_str(),
            request_id: event.request_id().as_str(),
        };
        let mut attempts = 0;
        loop {
            attempts += 1;
            let end = webhook::post_once(
                &target.url,
                self.tls.as_ref(),
                secret,
                body,
                headers,
                self.timeout,
            )
            .await;
            if end.delivered() {
                tracing::info!(request_id = %event.request_id(), event = %event.kind(), attempt = attempts, url = %target.url, "provisioner webhook took the event");
                return TargetReport {
                    target: TargetKind::Webhook,
                    attempts,
                    failure: None,
                };
            }
            let failure = match &end {
                WebhookEnd::TimedOut => format!("{end} ({:?})", self.timeout),
                other => other.to_string(),
            };
            if !self.retry.should_retry(attempts) {
                tracing::warn!(request_id = %event.request_id(), event = %event.kind(), attempts, url = %target.url, failure = %failure, "provisioner webhook failed; giving up");
                return TargetReport {
                    target: TargetKind::Webhook,
                    attempts,
                    failure: Some(failure),
                };
            }
            let delay = self.retry.jittered_delay_after(attempts);
            tracing::warn!(request_id = %event.request_id(), event = %event.kind(), attempt = attempts, url = %target.url, failure = %failure, retry_in_ms = delay.as_millis() as u64, "provisioner webhook failed; retrying");
            tokio::time::sleep(delay).await;
        }
    }
}
