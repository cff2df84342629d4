//! `kici-scaler simulate`: replays a job history through the engine under a
//! configuration and prints what the jobs would have waited and what the
//! agents would have cost (the replay itself is `kici-simulate`'s).

use super::{load, CliError, ConfigArgs, Outcome};
use clap::Args;
use kici_model::ScalerType;
use kici_simulate::{parse_trace, simulate, SimOptions};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Args)]
pub struct SimulateArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// The job history: JSON Lines, one job a line
    /// (`{"at": SECONDS-or-RFC3339, "labels": [...], "durationSeconds": N}`,
    /// optional `resources` as in POST /v1/scale), or CSV with those columns.
    #[arg(long, value_name = "FILE")]
    pub trace: PathBuf,
    /// Spawn → registered time of a backend type (container, bare-metal,
    /// firecracker, event), seconds; repeatable. Defaults: bare-metal 1,
    /// container 5, firecracker 3, event 60.
    #[arg(long = "spawn-seconds", value_name = "BACKEND=SECONDS", value_parser = spawn_seconds)]
    pub spawn_seconds: Vec<(ScalerType, Duration)>,
    /// The wall-clock time of the trace's start when its `at` values are
    /// seconds (warm pool schedules read it) [default: 2024-01-01T00:00:00Z,
    /// a Monday].
    #[arg(long, value_name = "RFC3339")]
    pub start: Option<jiff::Timestamp>,
    /// Print one JSON document instead of the table.
    #[arg(long)]
    pub json: bool,
}

fn spawn_seconds(raw: &str) -> Result<(ScalerType, Duration), String> {
    let (kind, secs) = raw
        .split_once('=')
        .ok_or_else(|| format!("expected BACKEND=SECONDS, got {raw:?}"))?;
    let kind: ScalerType = kind.parse().map_err(|_| {
        format!("expected a backend type (container, bare-metal, firecracker, event), got {kind:?}")
    })?;
    let secs: f64 = secs
        .parse()
        .ok()
        .filter(|s: &f64| (0.0..1e6).contains(s))
        .ok_or_else(|| format!("expected a number of seconds >= 0, got {secs:?}"))?;
    Ok((kind, Duration::from_secs_f64(secs)))
}

pub fn run(
    args: &SimulateArgs,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<Outcome, CliError> {
    let loaded = load(&args.config, err)?;
    let name = args.trace.display().to_string();
    let text = std::fs::read_to_string(&args.trace)
        .map_err(|e| CliError::Simulate(format!("{name}: {e}")))?;
    let trace = parse_trace(&name, &text).map_err(|e| CliError::Simulate(e.to_string()))?;
    let mut options = SimOptions::default();
    for (kind, took) in &args.spawn_seconds {
        options.spawn.set(*kind, *took);
    }
    if let Some(start) = args.start {
        options.start = start;
    }
    let report = simulate(Arc::new(loaded.config), &trace, &options);
    if args.json {
        serde_json::to_writer(&mut *out, &report)?;
        writeln!(out)?;
    } else {
        writeln!(out, "{report}")?;
    }
    Ok(Outcome::Ok)
}
