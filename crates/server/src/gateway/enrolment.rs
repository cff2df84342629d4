//! The agent lifecycle policy, written once: which token an agent may
//! present, what a registration must satisfy, what a config-ack does and how
//! a disconnect is applied.
//!
//! Two front ends report an agent's life. In orchestrator mode the
//! orchestrator relays it over the control API (`POST
//! /v1/agents/{id}/registered`, `config-ack`, `disconnected`); in standalone
//! mode the agent speaks to our own WebSocket gateway. Both call
//! [`Enrolment`], which checks, tells the engine and logs; each front end
//! only maps a [`Refusal`] or [`ConfigAckFailed`] to an HTTP status or a
//! close code.

use crate::gateway::token::{TokenGrant, TokenRejection, TokenStore};
use kici_engine::runtime::Runtime;
use kici_engine::{AgentError, AgentState, Registration};
use kici_model::{AgentId, Label};
use std::sync::Arc;

/// Which front end reported (a field of every log line here).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// The control API, relaying for an orchestrator.
    Orchestrator,
    /// Our agent gateway (standalone mode).
    Gateway,
}

impl Via {
    fn as_str(self) -> &'static str {
        match self {
            Self::Orchestrator => "orchestrator",
            Self::Gateway => "gateway",
        }
    }
}

/// Why an agent may not register.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// Not an agent of this instance (never was, or already gone).
    #[error("agent {0} is not managed by this kici-scaler")]
    NotOurs(AgentId),
    /// The token presented is not a live one (for this agent).
    #[error("the agent token is not valid: {0}")]
    Token(#[source] TokenRejection),
    /// A live token, but minted for another agent.
    #[error("the token is not bound to agent {agent}")]
    ForeignToken {
        agent: AgentId,
        token_agent: AgentId,
    },
    /// The agent claims labels its token was not minted for (host-derived
    /// labels are exempt).
    #[error("labels outside the token's scope: {}", .0.join(", "))]
    LabelsOutOfScope(Vec<String>),
    /// The engine refuses the registration in the agent's state.
    #[error("agent {agent} cannot register: {source}")]
    Engine {
        agent: AgentId,
        #[source]
        source: AgentError,
    },
    /// The coordinator (a fleet) could not record the registration: it is
    /// not accepted, so the job has not run; the agent may try again.
    #[error("agent {agent} cannot register now: {reason}; try again")]
    Unrecorded { agent: AgentId, reason: String },
}

/// The backend could not clear the agent's bootstrap data (Firecracker's
/// MMDS): the agent was destroyed, and must get no job.
#[derive(Debug, thiserror::Error)]
#[error("clearing the bootstrap data of agent {agent} failed: {source}")]
pub struct ConfigAckFailed {
    pub agent: AgentId,
    #[source]
    pub source: kici_engine::BackendError,
}

/// The agent lifecycle policy over the engine and the token store.
#[derive(Clone)]
pub struct Enrolment {
    runtime: Runtime,
    tokens: Arc<TokenStore>,
}

impl Enrolment {
    pub fn new(runtime: Runtime, tokens: Arc<TokenStore>) -> Self {
        Self { runtime, tokens }
    }

    /// Orchestrator mode: the token an agent presented to its orchestrator,
    /// relayed with the agent id the agent claims. The agent must be ours
    /// (else [`Refusal::NotOurs`], before the token is looked at) and the
    /// token the live one minted for it.
    pub fn verify(&self, agent: AgentId, token: &str) -> Result<(), Refusal> {
        if self.runtime.agent(agent).is_none() {
            return Err(Refusal::NotOurs(agent));
        }
        self.tokens.verify(agent, token).map_err(|why| {
            tracing::warn!(agent_id = %agent, reason = %why, via = Via::Orchestrator.as_str(), "agent token refused");
            Refusal::Token(why)
        })
    }

    /// Gateway: the token comes first, before the agent names itself; the
    /// grant says whose it is and the labels it was minted for.
    pub fn identify(&self, token: &str) -> Result<TokenGrant, Refusal> {
        self.tokens.identify(token).map_err(|why| {
            tracing::warn!(reason = %why, via = Via::Gateway.as_str(), "agent token refused");
            Refusal::Token(why)
        })
    }

    /// Gateway: what the agent claims (its id, its labels) against what its
    /// token grants. Labels the agent reports about its host are exempt.
    pub fn check_claim(
        &self,
        grant: &TokenGrant,
        agent: AgentId,
        labels: impl IntoIterator<Item = Label>,
    ) -> Result<(), Refusal> {
        if agent != grant.agent {
            tracing::warn!(agent_id = %agent, token_agent = %grant.agent, "registration with another agent's token");
            return Err(Refusal::ForeignToken {
                agent,
                token_agent: grant.agent,
            });
        }
        let outside: Vec<String> = labels
            .into_iter()
            .filter(|l| !is_host_label(l) && !grant.scope.contains(l))
            .map(|l| l.as_str().to_owned())
            .collect();
        if !outside.is_empty() {
            tracing::warn!(agent_id = %agent, labels = %outside.join(","), "registration with labels outside the token's scope");
            return Err(Refusal::LabelsOutOfScope(outside));
        }
        Ok(())
    }

    /// The agent registered: the coordinator (in a fleet) records it, then
    /// the engine is told — in that order, so a job never runs unknown to
    /// the fleet. Its answer names the job the agent was spawned for and
    /// the labels a job must carry.
    pub async fn register(&self, agent: AgentId, via: Via) -> Result<Registration, Refusal> {
        if let Some(coordinator) = self.runtime.coordinator() {
            coordinator
                .record_registration(agent)
                .await
                .map_err(|reason| {
                    tracing::warn!(agent_id = %agent, reason = %reason, via = via.as_str(), "registration not recorded by the fleet; refused");
                    Refusal::Unrecorded { agent, reason }
                })?;
        }
        let registration = self.runtime.agent_registered(agent).map_err(|e| {
            tracing::warn!(agent_id = %agent, error = %e, via = via.as_str(), "registration refused by the engine");
            match e {
                AgentError::NotOurs(_) | AgentError::Gone(_) => Refusal::NotOurs(agent),
                source => Refusal::Engine { agent, source },
            }
        })?;
        tracing::info!(
            agent_id = %agent,
            job_id = registration.bound_job_id.as_ref().map(|j| j.as_str()),
            via = via.as_str(),
            "agent registered"
        );
        Ok(registration)
    }

    /// The agent acknowledged its configuration: bootstrap secrets handed
    /// over a side channel (Firecracker's MMDS) are removed, verified,
    /// before it may get a job. A leaving agent has nothing left to clear
    /// (and the report stays idempotent). On failure the agent is destroyed.
    pub async fn configured(&self, agent: AgentId, via: Via) -> Result<(), ConfigAckFailed> {
        let leaving = self
            .runtime
            .agent(agent)
            .is_some_and(|v| matches!(v.state, AgentState::Destroying | AgentState::Gone));
        if leaving {
            return Ok(());
        }
        if let Err(source) = self.runtime.agent_configured(agent).await {
            tracing::error!(agent_id = %agent, error = %source, via = via.as_str(), "clearing the agent's bootstrap data failed; the agent is destroyed");
            let _ = self.runtime.destroy_agent(agent);
            return Err(ConfigAckFailed { agent, source });
        }
        tracing::info!(agent_id = %agent, via = via.as_str(), "agent config acknowledged");
        Ok(())
    }

    /// The agent's connection closed: it is destroyed. Idempotent: an
    /// agent already gone is fine.
    pub fn disconnected(&self, agent: AgentId, via: Via) -> Result<(), AgentError> {
        match self.runtime.agent_disconnected(agent) {
            Ok(()) | Err(AgentError::Gone(_)) => {
                tracing::info!(agent_id = %agent, via = via.as_str(), "agent disconnected");
                Ok(())
            }
            Err(e) => Err(e),
        }
    }
}

/// Labels an agent reports about its own host (`kici:os:*`,
/// `kici:arch:*`, `kici:host:*`, `kici:runtime:*`), which no token scopes.
pub fn is_host_label(label: &Label) -> bool {
    ["kici:os:", "kici:arch:", "kici:host:", "kici:runtime:"]
        .iter()
        .any(|p| label.as_str().starts_with(p))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn the_labels_an_agent_reports_about_its_host_are_exempt_from_the_token_scope() {
        for exempt in [
            "kici:os:linux",
            "kici:arch:x64",
            "kici:host:builder-1",
            "kici:runtime:node",
        ] {
            assert!(is_host_label(&Label::parse(exempt).unwrap()), "{exempt}");
        }
        for scoped in ["linux", "kici:role:exec", "kici:scaler:local", "kici:osx"] {
            assert!(!is_host_label(&Label::parse(scoped).unwrap()), "{scoped}");
        }
    }
}
