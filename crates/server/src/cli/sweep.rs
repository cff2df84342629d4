//! `kici-scaler sweep`: one reconcile pass, run by hand while no daemon
//! uses the state dir (the daemon runs the same pass periodically).
//!
//! It takes the state dir's lock (so it refuses to run beside a daemon),
//! opens the store, starts the configured backends and runs
//! [`Reconciler::pass`]: recorded agents whose resource is gone are
//! destroyed and forgotten, unowned resources older than the age
//! threshold are removed, leases of unknown agents are released. With
//! `--dry-run` it only reports.

use crate::cli::{CliError, ConfigArgs, Outcome};
use crate::daemon::backends::{BackendContext, BackendRegistry};
use crate::daemon::identity::StateDir;
use crate::daemon::settings::StoreUrl;
use crate::durable::reconcile::{Reaping, Reconciler, SweepReport};
use clap::Args;
use kici_store::StoreOptions;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Args)]
pub struct SweepArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// The daemon's state directory [default: /var/lib/kici-scaler].
    #[arg(long, value_name = "DIR", env = "KICI_SCALER_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    // Also the --help text, where <…> is a placeholder, not an HTML tag.
    #[allow(rustdoc::invalid_html_tags)]
    /// The state store URL [default: sqlite:<state-dir>/state.db].
    #[arg(long, value_name = "URL", env = "KICI_SCALER_STATE")]
    pub state: Option<String>,
    /// Unowned resources younger than this are left alone.
    #[arg(long, value_name = "SECONDS", default_value_t = 120)]
    pub age_seconds: u64,
    /// Report what would be done, change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Print the report as one JSON document.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    #[error("{0}")]
    StateDir(#[from] crate::daemon::identity::IdentityError),
    #[error("{0}")]
    Store(#[from] kici_store::StoreError),
    #[error("{0}")]
    Config(String),
    #[error("{}", .0.join("\n"))]
    Backends(Vec<String>),
}

pub fn sweep(args: &SweepArgs, out: &mut dyn Write) -> Result<Outcome, CliError> {
    // Test builds: `KICI_SCALER_CRASH_AT` crashes the sweep too (the
    // offline-only steps, e.g. settling a recorded agent that is gone).
    let armed =
        crate::daemon::crashpoints::arm_from_env().map_err(|e| CliError::Sweep(e.to_string()))?;
    if !armed.is_empty() {
        tracing::warn!(failpoints = ?armed, "crash failpoints armed");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(CliError::Runtime)?;
    let report = runtime
        .block_on(run(args))
        .map_err(|e| CliError::Sweep(e.to_string()))?;
    if args.json {
        serde_json::to_writer(&mut *out, &report)?;
        writeln!(out)?;
    } else {
        print(&report, out)?;
    }
    Ok(if report.errors.is_empty() {
        Outcome::Ok
    } else {
        Outcome::Failed
    })
}

async fn run(args: &SweepArgs) -> Result<SweepReport, SweepError> {
    let dir = args
        .state_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from(crate::daemon::identity::DEFAULT_STATE_DIR));
    // Held for the whole pass: a daemon starting meanwhile waits for it.
    let state_dir = StateDir::open(&dir, false)?;
    let instance = state_dir.instance_id();
    let url = match &args.state {
        Some(s) => s.parse::<StoreUrl>()?,
        None => StoreUrl::default_in(&dir),
    };
    let loaded =
        crate::daemon::stack::load_config(&args.config.config, args.config.config_dir.as_deref())
            .map_err(|e| SweepError::Config(e.to_string()))?;
    let store = kici_store::open(&url, instance, StoreOptions::default()).await?;
    let ctx = BackendContext {
        config: None,
        instance,
        state_dir: dir.clone(),
        store: Some(Arc::clone(&store)),
        // No agent connects during a sweep.
        gateway_port: 0,
        // Nothing is spawned.
        tuning: crate::daemon::settings::BackendTuning::default(),
        ephemeral: false,
    };
    let built = BackendRegistry::builtin()
        .start(&loaded.config, &ctx)
        .await
        .map_err(SweepError::Backends)?;
    let reconciler = Reconciler::new(
        Arc::clone(&store),
        built.backends,
        None,
        None,
        Duration::from_secs(args.age_seconds),
    )
    .with_rule_sweeps(built.rule_sweeps);
    let reaping = if args.dry_run {
        Reaping::DryRun
    } else {
        Reaping::Now
    };
    let report = reconciler.pass(reaping).await;
    store.close().await;
    drop(state_dir);
    Ok(report)
}

fn print(r: &SweepReport, out: &mut dyn Write) -> std::io::Result<()> {
    let verb = if r.dry_run { "would remove" } else { "removed" };
    for o in &r.orphans {
        let agent = o
            .agent_id
            .map(|a| a.to_string())
            .unwrap_or_else(|| "-".into());
        writeln!(
            out,
            "orphan {} {} (agent {agent}, {} s old): {}",
            o.kind,
            o.id,
            o.age_seconds,
            if r.reaped.contains(&o.id) || r.dry_run {
                verb
            } else {
                "left"
            }
        )?;
    }
    for a in &r.gone_recorded {
        writeln!(
            out,
            "recorded agent {a}: its resource is gone; {verb} and forgotten"
        )?;
    }
    for a in &r.stale_rules_removed {
        writeln!(out, "egress rules of agent {a} (no resource left): removed")?;
    }
    for l in &r.leases_released {
        writeln!(out, "lease {l}: {verb}")?;
    }
    for e in &r.errors {
        writeln!(out, "error: {e}")?;
    }
    writeln!(
        out,
        "sweep: {} orphan(s), {} recorded agent(s) gone, {} lease(s), {} young resource(s) left, {} tracked{}",
        r.orphans.len(),
        r.gone_recorded.len(),
        r.leases_released.len(),
        r.young,
        r.tracked,
        if r.dry_run { " (dry run: nothing changed)" } else { "" }
    )
}
