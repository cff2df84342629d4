//! The commands that talk to a running daemon: `status`, `fleet`, `agents`,
//! `request`, `destroy`, `cordon`, `uncordon`, `drain`, through
//! [`kici_api::Client`].
//!
//! Text goes to stdout for a person; with `--json`, stdout is the daemon's
//! answer as a JSON document (for an answer without a body, a small
//! document saying what was done). API errors are printed as `error:
//! <code>: <message> (field: <path>)` on stderr (with `--json`, the error
//! document on stdout) and exit 1.

use crate::cli::client::{self, ClientError};
use crate::cli::{CliError, ClientArgs, Command, Outcome};
use kici_api::{
    AgentList, ApiError, BreakerName, Client, ErrorAnswer, ResourcesBody, ScaleAnswer, ScaleBody,
    StatusObject, UsageObject,
};
use rand::RngCore;
use serde::Serialize;
use std::io::Write;

/// Runs one remote command (anything but `validate`, `route`, `serve`).
pub fn execute(
    command: &Command,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<Outcome, CliError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(CliError::Runtime)?;
    runtime.block_on(run(command, out, err))
}

fn client(args: &ClientArgs) -> Result<Client, CliError> {
    Ok(client::connect(
        &args.server,
        args.ca_cert.as_deref(),
        client::token_from_env(),
    )?)
}

/// Job ids the CLI makes up: `cli-` + 16 hex.
fn random_job_id() -> String {
    let mut bytes = [0u8; 8];
    rand::thread_rng().fill_bytes(&mut bytes);
    format!("cli-{}", hex::encode(bytes))
}

/// `destroy --json`: what was done.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct AgentDone<'a> {
    agent_id: &'a str,
    result: &'static str,
}

/// `cordon|uncordon|drain --json`: what was done.
#[derive(Serialize)]
struct ScalerDone<'a> {
    scaler: &'a str,
    result: &'static str,
}

async fn run(
    command: &Command,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<Outcome, CliError> {
    match command {
        Command::Status(args) => {
            let answer = client(args)?.status().await;
            finish(args, answer, out, err, write_status)
        }
        Command::Fleet(args) => {
            let answer = client(args)?.fleet().await;
            finish(args, answer, out, err, write_fleet)
        }
        Command::Agents(a) => {
            let answer = client(&a.client)?.agents(a.all).await;
            finish(&a.client, answer, out, err, write_agents)
        }
        Command::Request(r) => {
            let body = ScaleBody {
                job_id: r.job_id.clone().unwrap_or_else(random_job_id),
                run_id: None,
                // `--labels ''`: a job with no labels (the server routes it).
                labels: r.labels.iter().filter(|l| !l.is_empty()).cloned().collect(),
                exclude_labels: (!r.exclude.is_empty()).then(|| r.exclude.clone()),
                resources: ResourcesBody::requests(r.cpus, r.memory.clone()),
            };
            let answer = client(&r.client)?.scale(&body).await;
            let outcome = match &answer {
                Ok(ScaleAnswer::NoBackend { .. }) => Outcome::NoBackend,
                Ok(ScaleAnswer::TooLarge { .. }) => Outcome::TooLarge,
                _ => Outcome::Ok,
            };
            let printed = finish(&r.client, answer, out, err, write_scale)?;
            Ok(if printed == Outcome::Ok {
                outcome
            } else {
                printed
            })
        }
        Command::Destroy(d) => {
            let answer = client(&d.client)?.destroy_agent(&d.agent).await;
            let done = AgentDone {
                agent_id: &d.agent,
                result: "destroying",
            };
            finish(&d.client, answer.map(|()| done), out, err, |_, out| {
                writeln!(out, "destroying {}", d.agent)
            })
        }
        Command::Cordon(s) | Command::Uncordon(s) | Command::Drain(s) => {
            let client = client(&s.client)?;
            let (answer, done) = match command {
                Command::Cordon(_) => (client.cordon(&s.scaler).await, "cordoned"),
                Command::Uncordon(_) => (client.uncordon(&s.scaler).await, "uncordoned"),
                _ => (client.drain(&s.scaler).await, "draining"),
            };
            let doc = ScalerDone {
                scaler: &s.scaler,
                result: done,
            };
            finish(&s.client, answer.map(|()| doc), out, err, |_, out| {
                writeln!(out, "scaler {} {done}", s.scaler)
            })
        }
        Command::Validate(_)
        | Command::Route(_)
        | Command::Simulate(_)
        | Command::Serve(_)
        | Command::Run(_)
        | Command::Doctor(_)
        | Command::Sweep(_)
        | Command::Firecracker(_)
        | Command::Generate(_)
        | Command::Ui(_)
        | Command::Schema
        | Command::Failpoints => Err(CliError::NotOneShot),
    }
}

/// An answer: print it (`--json`) or render it; an error answer is
/// reported (exit 1), a failure to talk to the daemon is the command's
/// error.
fn finish<T: Serialize>(
    args: &ClientArgs,
    answer: Result<T, ApiError>,
    out: &mut dyn Write,
    err: &mut dyn Write,
    render: impl FnOnce(&T, &mut dyn Write) -> std::io::Result<()>,
) -> Result<Outcome, CliError> {
    match answer {
        Ok(doc) => {
            if args.json {
                serde_json::to_writer(&mut *out, &doc)?;
                writeln!(out)?;
            } else {
                render(&doc, out)?;
            }
            Ok(Outcome::Ok)
        }
        Err(ApiError::Api(answer)) => report_error(args, &answer, out, err),
        Err(ApiError::Unexpected { status, body }) => {
            writeln!(err, "error: the daemon answered HTTP {status}: {body}")?;
            Ok(Outcome::Failed)
        }
        Err(other) => Err(ClientError::Api(other).into()),
    }
}

fn report_error(
    args: &ClientArgs,
    answer: &ErrorAnswer,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<Outcome, CliError> {
    if args.json {
        serde_json::to_writer(&mut *out, &answer.document)?;
        writeln!(out)?;
    }
    writeln!(err, "error: {answer} [HTTP {}]", answer.status)?;
    for line in &answer.errors {
        writeln!(err, "  {line}")?;
    }
    Ok(Outcome::Failed)
}

/// A number as the daemon's JSON spells it (`0.0`, `1.5`, `4`), so the
/// text output shows what `--json` shows.
fn num(v: impl Into<serde_json::Value>) -> String {
    match v.into() {
        serde_json::Value::Null => "-".to_owned(),
        v => v.to_string(),
    }
}

/// ", pool served by HOST, HOST" in a fleet; nothing on one host.
fn served_by(hosts: &[String]) -> String {
    if hosts.is_empty() {
        String::new()
    } else {
        format!(", pool served by {}", hosts.join(", "))
    }
}

fn write_scale(answer: &ScaleAnswer, out: &mut dyn Write) -> std::io::Result<()> {
    match answer {
        ScaleAnswer::Spawning {
            agent_id,
            scaler,
            backend,
            warm,
            hosts,
        } => writeln!(
            out,
            "spawning {agent_id} on scaler {scaler} ({backend}){}{}",
            if *warm { ", from the warm pool" } else { "" },
            served_by(hosts)
        ),
        ScaleAnswer::Pending { position, hosts } => {
            writeln!(out, "pending at position {position}{}", served_by(hosts))
        }
        ScaleAnswer::TooLarge { cap, detail } => writeln!(out, "too-large ({cap}): {detail}"),
        ScaleAnswer::NoBackend { explanation } => writeln!(out, "no-backend: {explanation}"),
    }
}

fn usage_text(u: &UsageObject) -> String {
    let amount = |used: String, max: Option<String>, unit: &str| match max {
        None => format!("{used}{unit}"),
        Some(m) => format!("{used}/{m}{unit}"),
    };
    format!(
        "agents {}, cpus {}, memory {}",
        amount(num(u.agents), u.max_agents.map(num), ""),
        amount(num(u.used.cpus), u.max_cpus.map(num), ""),
        amount(num(u.used.memory_bytes), u.max_memory_bytes.map(num), " B"),
    )
}

fn write_status(doc: &StatusObject, out: &mut dyn Write) -> std::io::Result<()> {
    writeln!(
        out,
        "instance {}: {} (global max {}), {} pending",
        doc.instance_id,
        usage_text(&doc.global),
        doc.global_max_agents,
        doc.pending
    )?;
    for sc in &doc.scalers {
        let a = &sc.agents;
        let mut flags = String::new();
        if sc.cordoned {
            flags.push_str(", cordoned");
        }
        if sc.draining {
            flags.push_str(", draining");
        }
        writeln!(
            out,
            "{} ({}): {} active ({} spawning, {} registered, {} idle, {} busy, {} draining, {} destroying); {}; warm {}/{}{}; {} pending; spawns {}/{} in flight, {} waiting{flags}",
            sc.name,
            sc.backend,
            a.active,
            a.spawning,
            a.registered,
            a.idle,
            a.busy,
            a.draining,
            a.destroying,
            sc.usage.as_ref().map_or_else(|| "usage unknown".to_owned(), usage_text),
            sc.warm_idle,
            sc.warm_target,
            sc.warm_source.as_ref().map_or_else(String::new, |w| match &w.description {
                Some(d) => format!(" ({}: {d})", w.kind),
                None => format!(" ({})", w.kind),
            }),
            sc.pending,
            sc.spawns.in_flight,
            sc.spawns.max_concurrent,
            sc.spawns.waiting,
        )?;
        for ls in &sc.label_sets {
            if ls.breaker != BreakerName::Closed {
                writeln!(
                    out,
                    "  label set {}: breaker {} after {} failures",
                    ls.index, ls.breaker, ls.consecutive_failures
                )?;
            }
        }
    }
    // In a fleet: every other host, the same way.
    for host in &doc.hosts {
        writeln!(out)?;
        write_status(host, out)?;
    }
    for h in &doc.unreachable_hosts {
        writeln!(
            out,
            "\ninstance {}: unreachable: {}",
            h.instance_id, h.reason
        )?;
    }
    Ok(())
}

/// Two tables: hosts, then pools.
fn write_fleet(doc: &kici_api::FleetObject, out: &mut dyn Write) -> std::io::Result<()> {
    writeln!(out, "fleet {} (answered by {})", doc.fleet, doc.answered_by)?;
    writeln!(
        out,
        "{:<18} {:<20} {:<8} {:>6} {:>9} {:<6} URL",
        "HOST", "HOSTNAME", "STATE", "EPOCH", "LEASE-AGE", "LEADER"
    )?;
    for h in &doc.hosts {
        writeln!(
            out,
            "{:<18} {:<20} {:<8} {:>6} {:>8.1}s {:<6} {}",
            h.instance_id,
            h.hostname,
            h.state,
            h.epoch,
            h.lease_age_seconds,
            if h.leader { "yes" } else { "" },
            h.url.as_deref().unwrap_or("-"),
        )?;
    }
    writeln!(
        out,
        "{:<24} {:>6} {:>7} {:>9} {:>6} {:>6}",
        "POOL", "HOSTS", "AGENTS", "CAPACITY", "FREE", "QUEUED"
    )?;
    let opt = |v: Option<u64>| v.map_or_else(|| "-".to_owned(), |v| v.to_string());
    for p in &doc.pools {
        writeln!(
            out,
            "{:<24} {:>6} {:>7} {:>9} {:>6} {:>6}",
            p.name,
            p.hosts.len(),
            p.agents,
            opt(p.capacity),
            opt(p.free),
            p.queue_depth
        )?;
    }
    for r in &doc.refused_pools {
        writeln!(out, "refused: {r}")?;
    }
    Ok(())
}

fn write_agents(doc: &AgentList, out: &mut dyn Write) -> std::io::Result<()> {
    if doc.agents.is_empty() {
        writeln!(out, "no agents")?;
    } else {
        // A fleet's agents carry their host: one more column then.
        let fleet = doc.agents.iter().any(|a| a.host.is_some());
        let host = |h: &str| {
            if fleet {
                format!("{h:<10} ")
            } else {
                String::new()
            }
        };
        writeln!(
            out,
            "{}{:<30} {:<13} {:<16} {:<24} {:>8}",
            host("HOST"),
            "AGENT",
            "STATE",
            "SCALER",
            "JOB",
            "AGE"
        )?;
        for a in &doc.agents {
            writeln!(
                out,
                "{}{:<30} {:<13} {:<16} {:<24} {:>7.0}s",
                host(a.host.as_deref().unwrap_or("-")),
                a.agent_id,
                a.state.as_str(),
                a.scaler,
                a.job_id.as_deref().unwrap_or("-"),
                a.age_seconds
            )?;
        }
    }
    for h in &doc.unreachable_hosts {
        writeln!(
            out,
            "unreachable: host {} ({}): {}",
            h.instance_id,
            h.url.as_deref().unwrap_or("no URL"),
            h.reason
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn random_job_ids_are_distinct() {
        let a = random_job_id();
        assert!(a.starts_with("cli-") && a.len() == 20);
        assert_ne!(a, random_job_id());
    }

    #[test]
    fn numbers_read_as_in_the_json() {
        assert_eq!(num(0.0), "0.0");
        assert_eq!(num(1.5), "1.5");
        assert_eq!(num(4u64), "4");
        assert_eq!(num(f64::NAN), "-");
    }
}
