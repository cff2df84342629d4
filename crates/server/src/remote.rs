//! The commands that talk to a running daemon: `status`, `agents`,
//! `request`, `destroy`, `cordon`, `uncordon`, `drain`.
//!
//! Text goes to stdout for a person; with `--json`, stdout is exactly the
//! daemon's JSON document (for an answer without a body, a small document
//! saying what was done). API errors are printed as `error: <code>:
//! <message> (field: <path>)` on stderr (with `--json`, the error document
//! on stdout) and exit 1.

use crate::cli::{CliError, ClientArgs, Command, Outcome};
use crate::client::{Client, Reply};
use crate::settings::API_TOKEN_ENV;
use crate::token::Secret;
use hyper::Method;
use rand::RngCore;
use serde_json::{json, Value};
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
    let token = std::env::var(API_TOKEN_ENV)
        .ok()
        .filter(|t| !t.trim().is_empty())
        .map(|t| Secret::new(t.trim().to_owned()));
    Ok(Client::new(&args.server, args.ca_cert.as_deref(), token)?)
}

/// Job ids the CLI makes up: `cli-` + 16 hex.
fn random_job_id() -> String {
    let mut bytes = [0u8; 8];
    rand::thread_rng().fill_bytes(&mut bytes);
    format!("cli-{}", hex::encode(bytes))
}

async fn run(
    command: &Command,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<Outcome, CliError> {
    match command {
        Command::Status(args) => {
            let reply = client(args)?
                .request(Method::GET, "/v1/status", None)
                .await?;
            finish(args, &reply, out, err, |doc, out| write_status(doc, out))
        }
        Command::Agents(a) => {
            let path = if a.all {
                "/v1/agents?all=true"
            } else {
                "/v1/agents"
            };
            let reply = client(&a.client)?.request(Method::GET, path, None).await?;
            finish(&a.client, &reply, out, err, |doc, out| {
                write_agents(doc, out)
            })
        }
        Command::Request(r) => {
            let mut body = json!({
                "jobId": r.job_id.clone().unwrap_or_else(random_job_id),
                "labels": r.labels,
            });
            if !r.exclude.is_empty() {
                body["excludeLabels"] = json!(r.exclude);
            }
            if r.cpus.is_some() || r.memory.is_some() {
                let mut spec = serde_json::Map::new();
                if let Some(c) = r.cpus {
                    spec.insert("cpus".into(), json!(c));
                }
                if let Some(m) = &r.memory {
                    spec.insert("memory".into(), json!(m));
                }
                body["resources"] = json!({ "requests": spec });
            }
            let reply = client(&r.client)?
                .request(Method::POST, "/v1/scale", Some(&body))
                .await?;
            let outcome = finish(&r.client, &reply, out, err, |doc, out| {
                write_scale(doc, out)
            })?;
            if outcome != Outcome::Ok {
                return Ok(outcome);
            }
            Ok(
                match reply.json().as_ref().and_then(|d| d["result"].as_str()) {
                    Some("no-backend") => Outcome::NoBackend,
                    Some("too-large") => Outcome::TooLarge,
                    _ => Outcome::Ok,
                },
            )
        }
        Command::Destroy(d) => {
            let path = format!("/v1/agents/{}", path_segment(&d.agent));
            let reply = client(&d.client)?
                .request(Method::DELETE, &path, None)
                .await?;
            let done = json!({ "agentId": d.agent, "result": "destroying" });
            finish_empty(&d.client, &reply, &done, out, err, |out| {
                writeln!(out, "destroying {}", d.agent)
            })
        }
        Command::Cordon(s) | Command::Uncordon(s) | Command::Drain(s) => {
            let (verb, done) = match command {
                Command::Cordon(_) => ("cordon", "cordoned"),
                Command::Uncordon(_) => ("uncordon", "uncordoned"),
                _ => ("drain", "draining"),
            };
            let path = format!("/v1/scalers/{}/{verb}", path_segment(&s.scaler));
            let reply = client(&s.client)?
                .request(Method::POST, &path, None)
                .await?;
            let doc = json!({ "scaler": s.scaler, "result": done });
            finish_empty(&s.client, &reply, &doc, out, err, |out| {
                writeln!(out, "scaler {} {done}", s.scaler)
            })
        }
        Command::Validate(_)
        | Command::Route(_)
        | Command::Serve(_)
        | Command::Run(_)
        | Command::Doctor(_)
        | Command::Sweep(_)
        | Command::Firecracker(_)
        | Command::Generate(_)
        | Command::Failpoints => Err(CliError::NotOneShot),
    }
}

/// Percent-encodes a path segment (ids and names are plain, but a typo
/// must not turn into another route).
fn path_segment(raw: &str) -> String {
    let mut s = String::with_capacity(raw.len());
    for b in raw.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            s.push(char::from(b));
        } else {
            s.push_str(&format!("%{b:02X}"));
        }
    }
    s
}

/// A reply with a JSON document: print it (`--json`) or render it.
fn finish(
    args: &ClientArgs,
    reply: &Reply,
    out: &mut dyn Write,
    err: &mut dyn Write,
    render: impl FnOnce(&Value, &mut dyn Write) -> std::io::Result<()>,
) -> Result<Outcome, CliError> {
    let doc = reply.json();
    if !(200..300).contains(&reply.status) {
        return report_error(args, reply, doc.as_ref(), out, err);
    }
    let Some(doc) = doc else {
        writeln!(
            err,
            "error: the daemon answered {} with a body that is not JSON",
            reply.status
        )?;
        return Ok(Outcome::Failed);
    };
    if args.json {
        serde_json::to_writer(&mut *out, &doc)?;
        writeln!(out)?;
    } else {
        render(&doc, out)?;
    }
    Ok(Outcome::Ok)
}

/// A reply without a body (204/202): print `done` (`--json`) or a line.
fn finish_empty(
    args: &ClientArgs,
    reply: &Reply,
    done: &Value,
    out: &mut dyn Write,
    err: &mut dyn Write,
    render: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> Result<Outcome, CliError> {
    if !(200..300).contains(&reply.status) {
        return report_error(args, reply, reply.json().as_ref(), out, err);
    }
    if args.json {
        serde_json::to_writer(&mut *out, done)?;
        writeln!(out)?;
    } else {
        render(out)?;
    }
    Ok(Outcome::Ok)
}

fn report_error(
    args: &ClientArgs,
    reply: &Reply,
    doc: Option<&Value>,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<Outcome, CliError> {
    if let (true, Some(doc)) = (args.json, doc) {
        serde_json::to_writer(&mut *out, doc)?;
        writeln!(out)?;
    }
    let e = doc.map(|d| &d["error"]);
    match e.and_then(|e| e["code"].as_str()) {
        Some(code) => {
            let e = e.unwrap_or(&Value::Null);
            let message = e["message"].as_str().unwrap_or("");
            write!(err, "error: {code}: {message}")?;
            if let Some(field) = e["field"].as_str() {
                write!(err, " (field: {field})")?;
            }
            writeln!(err, " [HTTP {}]", reply.status)?;
            if let Some(lines) = doc.and_then(|d| d["errors"].as_array()) {
                for l in lines {
                    writeln!(err, "  {}", l.as_str().unwrap_or_default())?;
                }
            }
        }
        None => writeln!(
            err,
            "error: the daemon answered HTTP {}: {}",
            reply.status,
            String::from_utf8_lossy(&reply.body)
        )?,
    }
    Ok(Outcome::Failed)
}

fn s(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".to_owned(),
        other => other.to_string(),
    }
}

fn write_scale(doc: &Value, out: &mut dyn Write) -> std::io::Result<()> {
    match doc["result"].as_str().unwrap_or("") {
        "spawning" => writeln!(
            out,
            "spawning {} on scaler {} ({}){}",
            s(&doc["agentId"]),
            s(&doc["scaler"]),
            s(&doc["backend"]),
            if doc["warm"].as_bool() == Some(true) {
                ", from the warm pool"
            } else {
                ""
            }
        ),
        "pending" => writeln!(out, "pending at position {}", s(&doc["position"])),
        "too-large" => writeln!(out, "too-large ({}): {}", s(&doc["cap"]), s(&doc["detail"])),
        "no-backend" => writeln!(out, "no-backend: {}", s(&doc["explanation"])),
        other => writeln!(out, "{other}: {doc}"),
    }
}

fn usage_text(u: &Value) -> String {
    let amount = |used: &Value, max: &Value, unit: &str| match max {
        Value::Null => format!("{}{unit}", s(used)),
        m => format!("{}/{}{unit}", s(used), s(m)),
    };
    format!(
        "agents {}, cpus {}, memory {}",
        amount(&u["agents"], &u["maxAgents"], ""),
        amount(&u["used"]["cpus"], &u["maxCpus"], ""),
        amount(&u["used"]["memoryBytes"], &u["maxMemoryBytes"], " B"),
    )
}

fn write_status(doc: &Value, out: &mut dyn Write) -> std::io::Result<()> {
    writeln!(
        out,
        "instance {}: {} (global max {}), {} pending",
        s(&doc["instanceId"]),
        usage_text(&doc["global"]),
        s(&doc["globalMaxAgents"]),
        s(&doc["pending"])
    )?;
    for sc in doc["scalers"].as_array().into_iter().flatten() {
        let a = &sc["agents"];
        let mut flags = String::new();
        if sc["cordoned"].as_bool() == Some(true) {
            flags.push_str(", cordoned");
        }
        if sc["draining"].as_bool() == Some(true) {
            flags.push_str(", draining");
        }
        writeln!(
            out,
            "{} ({}): {} active ({} spawning, {} registered, {} idle, {} busy, {} draining, {} destroying); {}; warm {}/{}; {} pending{flags}",
            s(&sc["name"]),
            s(&sc["backend"]),
            s(&a["active"]),
            s(&a["spawning"]),
            s(&a["registered"]),
            s(&a["idle"]),
            s(&a["busy"]),
            s(&a["draining"]),
            s(&a["destroying"]),
            if sc["usage"].is_null() { "usage unknown".to_owned() } else { usage_text(&sc["usage"]) },
            s(&sc["warmIdle"]),
            s(&sc["warmTarget"]),
            s(&sc["pending"]),
        )?;
        for ls in sc["labelSets"].as_array().into_iter().flatten() {
            if ls["breaker"].as_str() != Some("closed") {
                writeln!(
                    out,
                    "  label set {}: breaker {} after {} failures",
                    s(&ls["index"]),
                    s(&ls["breaker"]),
                    s(&ls["consecutiveFailures"])
                )?;
            }
        }
    }
    Ok(())
}

fn write_agents(doc: &Value, out: &mut dyn Write) -> std::io::Result<()> {
    let agents = doc["agents"].as_array().cloned().unwrap_or_default();
    if agents.is_empty() {
        return writeln!(out, "no agents");
    }
    writeln!(
        out,
        "{:<30} {:<13} {:<16} {:<24} {:>8}",
        "AGENT", "STATE", "SCALER", "JOB", "AGE"
    )?;
    for a in &agents {
        writeln!(
            out,
            "{:<30} {:<13} {:<16} {:<24} {:>7.0}s",
            s(&a["agentId"]),
            s(&a["state"]),
            s(&a["scaler"]),
            s(&a["jobId"]),
            a["ageSeconds"].as_f64().unwrap_or(0.0)
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn path_segments_are_encoded() {
        assert_eq!(
            path_segment("scaler-bare-metal-0a1b2c3d"),
            "scaler-bare-metal-0a1b2c3d"
        );
        assert_eq!(path_segment("a/b c"), "a%2Fb%20c");
    }

    #[test]
    fn random_job_ids_are_distinct() {
        let a = random_job_id();
        assert!(a.starts_with("cli-") && a.len() == 20);
        assert_ne!(a, random_job_id());
    }
}
