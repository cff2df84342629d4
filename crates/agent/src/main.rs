//! `kici-agent-lite`: the reference ephemeral agent for kici-scaler's
//! standalone mode.
//!
//! It reads its bootstrap from the `KICI_*` environment (refusing unknown
//! `KICI_*` names, as the KiCI agent does) — or, with `--bootstrap mmds`,
//! from Firecracker's MMDS V2 (see `kici_agent_lite::mmds`), whose entries
//! are laid over the process environment — connects to the gateway's
//! WebSocket, authenticates with its token, registers, acknowledges its
//! configuration, runs the jobs it is given one at a time — each in its own
//! process group, output streamed as it comes — and leaves when its idle
//! (or pending-dispatch) window passes. See `session` for the connection
//! and its timers, `job` for running a job, `backoff` for reconnecting.
//!
//! On an instance a `type: event` scaler's provisioner booted, the agent
//! starts with `--claim CODE --claim-url URL` (or `KICI_CLAIM_CODE` +
//! `KICI_CLAIM_URL`): it first redeems the single-use code for its token,
//! agent id, gateway URL and labels (`kici_agent_lite::claim`), which become
//! its bootstrap.
//!
//! Exit codes: see [`exit::AgentExit`].
//!
//! Logs are JSON lines on stderr; stdout stays empty. The token is never
//! logged (its type cannot be formatted).

mod backoff;
mod exit;
mod host;
mod job;
mod session;

use exit::AgentExit;
use kici_agent_lite::claim::{self, Claim, ClaimError, RedeemPolicy};
use kici_agent_lite::mmds;
use kici_protocol::bootstrap::{Bootstrap, WsScheme, LOG_LEVEL};
use std::collections::BTreeMap;
use std::time::Duration;
use tracing::Instrument;

/// Settings that are not part of the agent's environment contract (so they
/// cannot be `KICI_*` variables): command-line flags.
#[derive(Debug, Clone)]
pub struct Flags {
    /// `--heartbeat-interval-ms`: the connection heartbeat (KiCI: 30 s).
    pub heartbeat_interval: Duration,
}

/// Where the bootstrap comes from.
#[derive(Debug, Clone)]
enum BootstrapSource {
    /// The `KICI_*` environment (bare-metal, container).
    Env,
    /// Firecracker's MMDS V2, waited for under this policy.
    Mmds(mmds::FetchPolicy),
}

/// The command line.
#[derive(Debug, Clone)]
struct CommandLine {
    flags: Flags,
    source: BootstrapSource,
    /// `--claim`, `--claim-url` (the environment is the fallback).
    claim_code: Option<String>,
    claim_url: Option<String>,
    redeem: RedeemPolicy,
}

const USAGE: &str = "usage: kici-agent-lite [--heartbeat-interval-ms MS]
       [--bootstrap env|mmds] [--mmds-address IP:PORT] [--mmds-timeout-secs S]
       [--claim CODE --claim-url URL] [--claim-timeout-secs S]
Configuration comes from the KICI_* environment (KICI_ORCHESTRATOR_URL, KICI_AGENT_ID, ...),
or with --bootstrap mmds from Firecracker's MMDS V2 (default address 169.254.169.254:80,
waiting up to 60 s for the host to populate it).
With --claim (or KICI_CLAIM_CODE + KICI_CLAIM_URL) the agent first redeems a type: event
scaler's single-use claim code at the claim URL (http://; retried up to 60 s) for its token,
agent id, gateway URL and labels. Prefer the environment: arguments are visible to every
local user.";

fn parse_flags(args: impl Iterator<Item = String>) -> Result<Option<CommandLine>, String> {
    let mut flags = Flags {
        heartbeat_interval: Duration::from_secs(30),
    };
    let mut use_mmds = false;
    let mut policy = mmds::FetchPolicy::default();
    let mut mmds_tuned = false;
    let (mut claim_code, mut claim_url) = (None, None);
    let mut redeem = RedeemPolicy::default();
    let mut args = args.skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--bootstrap" => match args.next().as_deref() {
                Some("env") => use_mmds = false,
                Some("mmds") => use_mmds = true,
                _ => return Err("--bootstrap needs `env` or `mmds`".into()),
            },
            "--mmds-address" => {
                policy.address = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .ok_or("--mmds-address needs IP:PORT")?;
                mmds_tuned = true;
            }
            "--mmds-timeout-secs" => {
                let secs = args
                    .next()
                    .and_then(|v| v.parse::<u64>().ok())
                    .filter(|s| *s > 0)
                    .ok_or("--mmds-timeout-secs needs a positive number of seconds")?;
                policy.deadline = Duration::from_secs(secs);
                mmds_tuned = true;
            }
            "--claim" => {
                claim_code = Some(args.next().ok_or("--claim needs the claim code")?);
            }
            "--claim-url" => {
                claim_url = Some(
                    args.next()
                        .ok_or("--claim-url needs the URL to redeem at")?,
                );
            }
            "--claim-timeout-secs" => {
                let secs = args
                    .next()
                    .and_then(|v| v.parse::<u64>().ok())
                    .filter(|s| *s > 0)
                    .ok_or("--claim-timeout-secs needs a positive number of seconds")?;
                redeem.deadline = Duration::from_secs(secs);
            }
            "--heartbeat-interval-ms" => {
                let ms = args
                    .next()
                    .and_then(|v| v.parse::<u64>().ok())
                    .filter(|ms| *ms > 0)
                    .ok_or("--heartbeat-interval-ms needs a positive number of milliseconds")?;
                flags.heartbeat_interval = Duration::from_millis(ms);
            }
            "--version" | "-V" => {
                println!("kici-agent-lite {}", env!("CARGO_PKG_VERSION"));
                return Ok(None);
            }
            "--help" | "-h" => {
                println!("{USAGE}");
                return Ok(None);
            }
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    if mmds_tuned && !use_mmds {
        return Err("--mmds-* flags need --bootstrap mmds".into());
    }
    let source = if use_mmds {
        BootstrapSource::Mmds(policy)
    } else {
        BootstrapSource::Env
    };
    Ok(Some(CommandLine {
        flags,
        source,
        claim_code,
        claim_url,
        redeem,
    }))
}

/// Lays the MMDS bootstrap over the process environment.
fn apply_mmds(
    env: &mut BTreeMap<String, String>,
    runtime: &tokio::runtime::Runtime,
    policy: &mmds::FetchPolicy,
) -> Result<(), String> {
    tracing::info!(address = %policy.address, deadline = ?policy.deadline, "waiting for the MMDS bootstrap");
    let meta = runtime
        .block_on(mmds::fetch(policy))
        .map_err(|e| e.to_string())?;
    let guest = mmds::GuestBootstrap::from_meta(&meta).map_err(|e| e.to_string())?;
    if !guest.skipped.is_empty() {
        tracing::warn!(entries = %guest.skipped.join(","), "kici-env entries not applied (not POSIX names, not strings, or naming a dedicated key)");
    }
    env.extend(guest.env);
    Ok(())
}

/// The process environment as strings. A `KICI_*` variable that is not
/// valid UTF-8 is reported as a problem; other non-UTF-8 variables are not
/// the agent's business and are skipped.
fn environment() -> Result<BTreeMap<String, String>, String> {
    let mut env = BTreeMap::new();
    for (name, value) in std::env::vars_os() {
        let Ok(name) = name.into_string() else {
            continue;
        };
        match value.into_string() {
            Ok(value) => {
                env.insert(name, value);
            }
            Err(_) if name.starts_with("KICI_") => {
                return Err(format!("{name} is not valid UTF-8"));
            }
            Err(_) => {}
        }
    }
    Ok(env)
}

fn init_logging(level: Option<&str>) {
    let filter = level
        .and_then(|l| tracing_subscriber::EnvFilter::try_new(l).ok())
        .unwrap_or_else(|| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .json()
        .flatten_event(true)
        .with_current_span(true)
        .with_span_list(false)
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Reporting a failed log write would itself write to stderr, with
        // `eprintln!`, which panics when stderr is gone: an agent must
        // outlive the loss of its log reader.
        .log_internal_errors(false)
        .init();
}

fn main() -> std::process::ExitCode {
    let CommandLine {
        flags,
        source,
        claim_code,
        claim_url,
        redeem,
    } = match parse_flags(std::env::args()) {
        Ok(Some(cmd)) => cmd,
        Ok(None) => return std::process::ExitCode::SUCCESS,
        Err(msg) => {
            init_logging(None);
            tracing::error!(error = %msg, "bad command line");
            return AgentExit::BadBootstrap.into();
        }
    };
    let mut env = match environment() {
        Ok(env) => env,
        Err(msg) => {
            init_logging(None);
            tracing::error!(error = %msg, "invalid agent bootstrap");
            return AgentExit::BadBootstrap.into();
        }
    };
    init_logging(env.get(LOG_LEVEL).map(String::as_str));
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %e, "cannot start the async runtime");
            return AgentExit::Internal.into();
        }
    };
    if let BootstrapSource::Mmds(policy) = &source {
        if let Err(msg) = apply_mmds(&mut env, &runtime, policy) {
            tracing::error!(error = %msg, "no bootstrap from MMDS; not connecting");
            return AgentExit::BadBootstrap.into();
        }
    }
    let claim = match Claim::from_flags_or_env(claim_code, claim_url, &mut env) {
        Ok(c) => c,
        Err(msg) => {
            tracing::error!(error = %msg, "invalid claim; not connecting");
            return AgentExit::BadBootstrap.into();
        }
    };
    if let Some(claim) = claim {
        tracing::info!(url = %claim.url, "redeeming the claim code");
        match runtime.block_on(claim::redeem(&claim, &redeem)) {
            Ok(creds) => {
                tracing::info!(agent_id = %creds.agent_id, gateway = %creds.gateway_url, "claim redeemed");
                claim::apply(&mut env, &creds);
            }
            Err(e) => {
                let reason = match &e {
                    ClaimError::Refused { reason, .. } => reason.clone(),
                    _ => None,
                };
                tracing::error!(
                    reason = reason.as_deref().unwrap_or("none"),
                    error = %e,
                    "claim failed; not connecting"
                );
                return AgentExit::ClaimFailed.into();
            }
        }
    }
    let bootstrap = match Bootstrap::from_env(&env) {
        Ok(b) => b,
        Err(e) => {
            tracing::error!(error = %e, "invalid agent bootstrap; not connecting");
            return AgentExit::BadBootstrap.into();
        }
    };
    if !bootstrap.tolerated_unknown.is_empty() {
        tracing::warn!(
            variables = %bootstrap.tolerated_unknown.join(","),
            "unknown KICI_* variables tolerated because KICI_DEV=true"
        );
    }
    if bootstrap.orchestrator_url.scheme() == WsScheme::Wss {
        tracing::error!(
            url = %bootstrap.orchestrator_url,
            "wss:// is not supported by this build (plain ws:// only); not connecting"
        );
        return AgentExit::BadBootstrap.into();
    }
    // Each job's environment starts from the agent's own host basics, never
    // from the rest of its environment (which holds the token).
    let base_env = job::base_env(&env);
    drop(env);

    // Every line carries the agent id (in its `span` object).
    let span = tracing::info_span!("agent", agent_id = %bootstrap.agent_id);
    let exit = runtime.block_on(session::run(bootstrap, flags, base_env).instrument(span.clone()));
    let _entered = span.enter();
    tracing::info!(exit_code = exit.code(), reason = %exit, "agent exiting");
    exit.into()
}
