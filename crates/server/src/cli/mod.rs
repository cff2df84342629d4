//! The `kici-scaler` command line: argument parsing, the one-shot commands
//! and their exit codes.
//!
//! `validate` and `route` read only the configuration: no file existence,
//! engine or host-capacity checks (those belong to the daemon's start-up).
//! What a command prints for its user goes to stdout (with `--json`, exactly
//! one JSON document); diagnostics go to stderr as `file:line:col: path:
//! message` lines; logs are JSON lines on stderr (see [`init_logging`]).

pub mod client;
pub mod console;
pub mod doctor;
pub mod firecracker;
pub mod generate;
pub mod log_format;
pub mod remote;
pub mod run;
pub mod simulate;
pub mod sweep;
pub mod user_scope;

use crate::daemon::settings::ServeArgs;
use clap::{Args, Parser, Subcommand};
use kici_config::{ConfigErrors, Diagnostic, Loaded};
use kici_model::{Config, LabelError, LabelSet};
use kici_routing::{CordonSet, Explanation, HostPlatform, Router};
use serde::Serialize;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Exit codes of every command.
pub mod exit {
    /// Success; for `route`, a scaler was chosen.
    pub const OK: u8 = 0;
    /// Invalid configuration, a bad label, or an I/O failure.
    pub const ERROR: u8 = 1;
    /// `route`, `request`: no label set accepts the job.
    pub const NO_BACKEND: u8 = 2;
    /// `request`: the job can never fit under a cap (`too-large`).
    pub const TOO_LARGE: u8 = 3;
    /// The command line itself is wrong (unknown flag, missing argument).
    /// Not clap's default 2, which would read as `no-backend`.
    pub const USAGE: u8 = 64;
}

/// Environment variable holding the log filter (`tracing` env-filter syntax).
pub const LOG_ENV: &str = "KICI_SCALER_LOG";

#[derive(Debug, Parser)]
#[command(
    name = "kici-scaler",
    version,
    about = "Provisions ephemeral CI agents routed by job labels.",
    after_help = "Exit codes: 0 ok; 1 invalid configuration, bad label, I/O or API error; \
                  2 no backend accepts the job (route, request); 3 the job is too large (request); \
                  64 bad command line. `run` exits with its job's exit code (see `run --help`)."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Check a configuration and print a one-line summary; every error is
    /// printed (stderr), not just the first.
    Validate(ValidateArgs),
    /// Show where a job with these labels would go, and why every other
    /// label set was not chosen.
    Route(RouteArgs),
    /// Replay a job history through the engine under a configuration:
    /// waits, idle agent-seconds, peaks, refusals (no daemon, no backend).
    Simulate(crate::cli::simulate::SimulateArgs),
    /// Run the daemon: the control API, the agent gateway, the engine, the
    /// backends.
    Serve(Box<ServeArgs>),
    /// Run one command on a fresh agent and exit with its exit code: an
    /// in-process daemon for the job (--config), or a running one (--server).
    Run(Box<crate::cli::run::RunArgs>),
    /// Per-scaler status of a running daemon.
    Status(ClientArgs),
    /// The fleet a running daemon belongs to: its hosts and pools (the same
    /// from any host).
    Fleet(ClientArgs),
    /// The agents of a running daemon.
    Agents(AgentsArgs),
    /// Ask a running daemon for an agent for a job (POST /v1/scale).
    Request(RequestArgs),
    /// Destroy an agent now.
    Destroy(DestroyArgs),
    /// Stop routing new jobs to a scaler.
    Cordon(ScalerArgs),
    /// Route to a scaler again (also ends a drain).
    Uncordon(ScalerArgs),
    /// Cordon a scaler, cancel its pending requests, destroy its idle
    /// agents; busy ones leave after their job.
    Drain(ScalerArgs),
    /// Print the link to a running daemon's web console (with the token
    /// from KICI_SCALER_API_TOKEN in its fragment; for a unix socket, the
    /// SSH tunnel to open first).
    Ui(ClientArgs),
    /// Print the JSON Schema (draft 2020-12) of scalers.yaml, for editors.
    Schema,
    /// Check what the bare-metal backend needs on this host: agent
    /// binaries, cgroups, the state and ledger directories.
    Doctor(crate::cli::doctor::DoctorArgs),
    /// One reconcile pass while no daemon runs: forget recorded agents whose
    /// resource is gone, remove our unowned resources older than the age
    /// threshold, release leases nobody holds.
    Sweep(crate::cli::sweep::SweepArgs),
    /// The host bridge of the Firecracker backend: provision, verify,
    /// teardown (from the configuration's `firecracker` block).
    Firecracker(crate::cli::firecracker::FirecrackerArgs),
    /// Every named failpoint of this binary, one per line (for the crash
    /// tests; `KICI_SCALER_CRASH_AT` arms them in `failpoints` builds).
    #[command(hide = true)]
    Failpoints,
    /// Shell completions and man pages from this definition (packaging).
    #[command(hide = true)]
    Generate(crate::cli::generate::GenerateArgs),
}

/// How to reach a running daemon. The bearer token, which every TCP
/// listener needs, comes from KICI_SCALER_API_TOKEN.
#[derive(Debug, Clone, Args)]
pub struct ClientArgs {
    /// The daemon: unix:/path, http://HOST:PORT or https://HOST:PORT
    /// [default: the unix socket a `serve` without --listen serves on:
    /// unix:/run/kici-scaler/api.sock for root,
    /// unix:$XDG_RUNTIME_DIR/kici-scaler/api.sock for other users].
    #[arg(long, value_name = "URL", env = "KICI_SCALER_SERVER", default_value_t = crate::cli::client::default_server(), hide_default_value = true)]
    pub server: String,
    /// PEM CA certificate(s) to trust for an https:// server.
    #[arg(long, value_name = "FILE", env = "KICI_SCALER_CA_CERT")]
    pub ca_cert: Option<PathBuf>,
    /// Print exactly the daemon's JSON document instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct AgentsArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    /// Include recently gone agents.
    #[arg(long)]
    pub all: bool,
}

#[derive(Debug, Args)]
pub struct RequestArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    /// The job's labels (its runsOn), comma-separated; `--labels ''` for
    /// none (routes to the first label set without a gate).
    #[arg(long, value_name = "LABELS", value_delimiter = ',', required = true)]
    pub labels: Vec<String>,
    /// Labels the agent must not have, comma-separated (repeatable).
    #[arg(long, value_name = "LABELS", value_delimiter = ',')]
    pub exclude: Vec<String>,
    /// The job id [default: cli-<16 random hex>].
    #[arg(long, value_name = "ID")]
    pub job_id: Option<String>,
    /// CPUs to request (cores, e.g. 0.5).
    #[arg(long, value_name = "N")]
    pub cpus: Option<f64>,
    /// Memory to request (e.g. 512m, 1g).
    #[arg(long, value_name = "SIZE")]
    pub memory: Option<String>,
}

#[derive(Debug, Args)]
pub struct DestroyArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    // Also the --help text, where <…> is a placeholder, not an HTML tag.
    #[allow(rustdoc::invalid_html_tags)]
    /// The agent id (scaler-<type>-<8 hex>).
    pub agent: String,
}

#[derive(Debug, Args)]
pub struct ScalerArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    /// The scaler's name.
    pub scaler: String,
}

/// Where the configuration is.
#[derive(Debug, Args)]
pub struct ConfigArgs {
    /// The main configuration file (scalers.yaml).
    #[arg(long, value_name = "FILE", env = "KICI_SCALER_CONFIG_PATH")]
    pub config: PathBuf,
    /// A drop-in directory whose *.yaml / *.yml files are merged after the
    /// main file, sorted by name. None unless given (as upstream).
    #[arg(long, value_name = "DIR", env = "KICI_SCALER_CONFIG_DIR")]
    pub config_dir: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct ValidateArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Print one JSON document instead of the summary line.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct RouteArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// The job's labels (its runsOn), comma-separated; `--labels ''` for
    /// none (routes to the first label set without a gate).
    #[arg(long, value_name = "LABELS", value_delimiter = ',', required = true)]
    pub labels: Vec<String>,
    /// Labels the job must not land on, comma-separated (repeatable).
    #[arg(long, value_name = "LABELS", value_delimiter = ',')]
    pub exclude: Vec<String>,
    /// Print one JSON document instead of the text explanation.
    #[arg(long)]
    pub json: bool,
    /// Also ask this daemon, a host of a fleet, which hosts serve the chosen
    /// scaler (http://HOST:PORT, https://HOST:PORT or unix:/path; the token
    /// from KICI_SCALER_API_TOKEN). Without it, routing reads the file only.
    #[arg(long, value_name = "URL")]
    pub server: Option<String>,
    /// PEM CA certificate(s) to trust for an https:// --server.
    #[arg(long, value_name = "FILE", requires = "server")]
    pub ca_cert: Option<PathBuf>,
}

/// Why a command failed (exit code [`exit::ERROR`]).
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The configuration has errors; each is printed on its own line.
    #[error("{0}")]
    Config(ConfigErrors),
    #[error("{flag}: {source}")]
    BadLabel {
        flag: &'static str,
        source: LabelError,
    },
    #[error("cannot write the output: {0}")]
    Output(#[from] io::Error),
    #[error("cannot encode the output as JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("{0}")]
    Client(#[from] crate::cli::client::ClientError),
    #[error("cannot start the async runtime: {0}")]
    Runtime(io::Error),
    #[error("serve and run are not one-shot commands")]
    NotOneShot,
    #[error("sweep: {0}")]
    Sweep(String),
    #[error("simulate: {0}")]
    Simulate(String),
    #[error("{server}: {message}")]
    Fleet { server: String, message: String },
}

/// How a command that did not fail ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    NoBackend,
    TooLarge,
    /// The command failed and already said why (on stderr, or as the JSON
    /// document on stdout).
    Failed,
}

impl Outcome {
    pub fn exit_code(self) -> u8 {
        match self {
            Outcome::Ok => exit::OK,
            Outcome::NoBackend => exit::NO_BACKEND,
            Outcome::TooLarge => exit::TOO_LARGE,
            Outcome::Failed => exit::ERROR,
        }
    }
}

/// The binary's whole life: parse `args`, set up logging, run the command,
/// map the result to an exit code.
pub fn main_with_args<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let args: Vec<std::ffi::OsString> = args.into_iter().map(Into::into).collect();
    let cli = match Cli::try_parse_from(&args) {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version are not errors. `run`'s own failures
            // are 125, so that they cannot be mistaken for the job's.
            let code = if !e.use_stderr() {
                exit::OK
            } else if args.get(1).is_some_and(|a| a == "run") {
                crate::cli::run::EXIT_FAILED
            } else {
                exit::USAGE
            };
            // Nothing sensible is left to do if the terminal is gone.
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    if let Command::Run(args) = &cli.command {
        // stderr carries the job's own stderr: only kici-scaler's errors
        // join it unless KICI_SCALER_LOG asks for more.
        init_logging_with(RUN_LOG_FILTER);
        // Not root on a systemd host: into a delegated user scope first.
        if crate::cli::user_scope::wanted(args) {
            let why = crate::cli::user_scope::reexec(&std::env::args_os().collect::<Vec<_>>());
            // `run` logs errors only, and it is about to fail for this.
            tracing::error!(reason = %why, "cannot enter a delegated user scope");
        }
        return ExitCode::from(crate::cli::run::run(args));
    }
    init_logging();
    if let Command::Serve(args) = &cli.command {
        return match crate::daemon::serve(args) {
            Ok(()) => ExitCode::from(exit::OK),
            Err(e) => {
                tracing::error!(error = %e, "kici-scaler serve stopped");
                // Every line on its own, as `validate` prints them.
                let _ = writeln!(io::stderr(), "{e}");
                ExitCode::from(exit::ERROR)
            }
        };
    }
    let stdout = io::stdout();
    let stderr = io::stderr();
    let code = match execute(&cli.command, &mut stdout.lock(), &mut stderr.lock()) {
        Ok(outcome) => outcome.exit_code(),
        Err(e) => {
            tracing::debug!(error = %e, "command failed");
            let mut err = stderr.lock();
            // If stderr itself is broken the exit code still tells.
            let _ = writeln!(err, "{}", render_error(&e));
            exit::ERROR
        }
    };
    ExitCode::from(code)
}

fn render_error(e: &CliError) -> String {
    match e {
        // Already one `file:line:col: path: message` per line.
        CliError::Config(errors) => errors.to_string(),
        other => format!("error: {other}"),
    }
}

/// The log filter when [`LOG_ENV`] is unset. The engine's own per-event
/// line (a debug dump) is left out: the daemon logs every event with
/// `agent_id`, `scaler` and `job_id` as fields (see [`crate::events::pump`]).
pub const DEFAULT_LOG_FILTER: &str = "info,kici_engine::event=warn";

/// `run`'s log filter when [`LOG_ENV`] is unset.
pub const RUN_LOG_FILTER: &str = "error";

/// JSON logs, one event per line, on stderr only; filter from
/// [`LOG_ENV`] (default [`DEFAULT_LOG_FILTER`]). Calling it twice is harmless.
pub fn init_logging() {
    init_logging_with(DEFAULT_LOG_FILTER);
}

/// [`init_logging`] with another default filter.
pub fn init_logging_with(default_filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env(LOG_ENV)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    // Err only when a subscriber is already installed, which is fine.
    let _ = tracing_subscriber::fmt()
        .event_format(log_format::DaemonFormat::daemon())
        .fmt_fields(log_format::DaemonFormat::fields())
        .with_writer(io::stderr)
        .with_env_filter(filter)
        .try_init();
}

/// Runs one command, writing its output to `out` and warnings to `err`.
pub fn execute(
    command: &Command,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<Outcome, CliError> {
    match command {
        Command::Validate(args) => validate(args, out, err),
        Command::Route(args) => route(args, out, err),
        Command::Simulate(args) => crate::cli::simulate::run(args, out, err),
        Command::Serve(_) | Command::Run(_) => Err(CliError::NotOneShot),
        Command::Doctor(args) => crate::cli::doctor::doctor(args, out),
        Command::Sweep(args) => crate::cli::sweep::sweep(args, out),
        Command::Firecracker(args) => crate::cli::firecracker::firecracker(args, out, err),
        Command::Generate(args) => crate::cli::generate::generate(args, out),
        Command::Ui(args) => crate::cli::console::ui(args, out),
        Command::Schema => crate::cli::console::schema(out),
        Command::Failpoints => {
            for name in crate::daemon::crashpoints::all() {
                writeln!(out, "{name}")?;
            }
            Ok(Outcome::Ok)
        }
        remote => crate::cli::remote::execute(remote, out, err),
    }
}

fn load(args: &ConfigArgs, err: &mut dyn Write) -> Result<Loaded, CliError> {
    let loaded =
        kici_config::load(&args.config, args.config_dir.as_deref()).map_err(CliError::Config)?;
    tracing::debug!(
        files = loaded.files.len(),
        scalers = loaded.config.scalers.len(),
        warnings = loaded.warnings.len(),
        "configuration loaded"
    );
    for w in &loaded.warnings {
        writeln!(err, "warning: {w}")?;
    }
    Ok(loaded)
}

// ---------------------------------------------------------------- validate

fn validate(
    args: &ValidateArgs,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<Outcome, CliError> {
    let mut loaded = match load(&args.config, err) {
        Ok(loaded) => loaded,
        Err(CliError::Config(errors)) if args.json => {
            // The JSON document reports the errors too; stderr still lists them.
            serde_json::to_writer(&mut *out, &ValidateJson::invalid(&errors))?;
            writeln!(out)?;
            return Err(CliError::Config(errors));
        }
        Err(e) => return Err(e),
    };
    for w in root_agent_warnings(&loaded.config) {
        writeln!(err, "warning: {w}")?;
        loaded.warnings.push(w);
    }
    if args.json {
        serde_json::to_writer(&mut *out, &ValidateJson::valid(&loaded))?;
        writeln!(out)?;
    } else {
        writeln!(out, "{}", validate_summary(&loaded))?;
    }
    Ok(Outcome::Ok)
}

/// A warning for each bare-metal scaler that names no
/// `x-kici-scaler.user`: its agents run as the daemon's own user, root
/// under the packaged service. (Not a loader warning: `run` rightly runs
/// such agents as the user who runs it.)
pub fn root_agent_warnings(config: &kici_model::Config) -> Vec<kici_config::Diagnostic> {
    config
        .scalers
        .iter()
        .enumerate()
        .filter(|(_, s)| s.kind == kici_model::ScalerType::BareMetal && s.ext.agent_user.is_none())
        .map(|(i, s)| {
            kici_config::Diagnostic::new(
                s.origin.clone(),
                format!("scalers[{i}]"),
                ROOT_AGENTS_WARNING,
            )
        })
        .collect()
}

/// What [`root_agent_warnings`] and `doctor` say.
pub const ROOT_AGENTS_WARNING: &str = "bare-metal agents of this scaler run as the daemon's own user: under a root `serve` (the packaged service) they run as root and can read the daemon's state and secrets; name an unprivileged user in x-kici-scaler.user (the package creates kici-agent)";

/// `ok: 3 scalers, 7 label sets, 0 warnings (scalers.yaml, scalers.d/10-gpu.yaml)`
pub fn validate_summary(loaded: &Loaded) -> String {
    let c = &loaded.config;
    let files: Vec<String> = loaded
        .files
        .iter()
        .map(|f| f.display().to_string())
        .collect();
    format!(
        "ok: {}, {}, {} ({})",
        plural(c.scalers.len(), "scaler", "scalers"),
        plural(label_set_count(c), "label set", "label sets"),
        plural(loaded.warnings.len(), "warning", "warnings"),
        files.join(", ")
    )
}

fn label_set_count(c: &Config) -> usize {
    c.scalers.iter().map(|s| s.label_sets.len()).sum()
}

fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// `validate --json`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct ValidateJson {
    valid: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    scalers: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    label_sets: Option<usize>,
    files: Vec<String>,
    warnings: Vec<DiagnosticJson>,
    errors: Vec<DiagnosticJson>,
}

impl ValidateJson {
    fn valid(loaded: &Loaded) -> Self {
        Self {
            valid: true,
            scalers: Some(loaded.config.scalers.len()),
            label_sets: Some(label_set_count(&loaded.config)),
            files: loaded
                .files
                .iter()
                .map(|f| f.display().to_string())
                .collect(),
            warnings: loaded.warnings.iter().map(DiagnosticJson::from).collect(),
            errors: Vec::new(),
        }
    }

    fn invalid(errors: &ConfigErrors) -> Self {
        Self {
            valid: false,
            scalers: None,
            label_sets: None,
            files: Vec::new(),
            warnings: Vec::new(),
            errors: errors.iter().map(DiagnosticJson::from).collect(),
        }
    }
}

#[derive(Debug, Serialize)]
struct DiagnosticJson {
    file: String,
    line: u32,
    col: u32,
    path: String,
    message: String,
}

impl From<&Diagnostic> for DiagnosticJson {
    fn from(d: &Diagnostic) -> Self {
        Self {
            file: d.origin.file.to_string(),
            line: d.origin.line,
            col: d.origin.col,
            path: d.path.clone(),
            message: d.message.clone(),
        }
    }
}

// ------------------------------------------------------------------- route

fn route(args: &RouteArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<Outcome, CliError> {
    // Labels first: a typo on the command line is reported even when the
    // configuration is also broken.
    let job = job_labels(&args.labels).map_err(|source| CliError::BadLabel {
        flag: "--labels",
        source,
    })?;
    let exclude = LabelSet::parse(&args.exclude).map_err(|source| CliError::BadLabel {
        flag: "--exclude",
        source,
    })?;
    let loaded = load(&args.config, err)?;
    let config = &loaded.config;
    let host = HostPlatform::current();
    let router = Router::new(config, &host);
    let explanation = router.explain(&job, &exclude, &CordonSet::none());
    tracing::debug!(
        chosen = explanation.chosen.is_some(),
        candidates = explanation.candidates.len(),
        "routed"
    );

    let chosen = explanation
        .chosen
        .and_then(|r| config.scalers.get(r.scaler))
        .map(|s| s.name.to_string());
    let hosts = match (&args.server, &chosen) {
        (Some(server), Some(pool)) => Some(fleet_hosts(server, args.ca_cert.as_deref(), pool)?),
        _ => None,
    };
    if args.json {
        let mut doc = RouteJson::new(config, &explanation);
        doc.hosts = hosts;
        serde_json::to_writer(&mut *out, &doc)?;
        writeln!(out)?;
    } else {
        write_route_text(out, config, &job, &exclude, &explanation)?;
        if let (Some(hosts), Some(pool)) = (&hosts, &chosen) {
            if hosts.is_empty() {
                writeln!(out, "no live host of the fleet serves {pool}")?;
            } else {
                writeln!(out, "served by hosts: {}", hosts.join(", "))?;
            }
        }
    }
    Ok(if explanation.chosen.is_some() {
        Outcome::Ok
    } else {
        Outcome::NoBackend
    })
}

/// The live hosts of the fleet `server` belongs to that serve `pool` (their
/// instance ids), as its `GET /v1/fleet` says.
fn fleet_hosts(server: &str, ca_cert: Option<&Path>, pool: &str) -> Result<Vec<String>, CliError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(CliError::Runtime)?;
    let client =
        crate::cli::client::connect(server, ca_cert, crate::cli::client::token_from_env())?;
    let fleet = runtime
        .block_on(client.fleet())
        .map_err(|e| CliError::Fleet {
            server: server.to_owned(),
            message: e.to_string(),
        })?;
    Ok(fleet
        .pools
        .into_iter()
        .find(|p| p.name == pool)
        .map(|p| p.hosts)
        .unwrap_or_default())
}

/// `route --json`: exactly this shape.
#[derive(Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct RouteJson {
    pub scaler: Option<String>,
    pub label_set_index: Option<usize>,
    pub candidates: Vec<CandidateJson>,
    /// With `--server`: the fleet's live hosts serving the chosen scaler.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hosts: Option<Vec<String>>,
}

#[derive(Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct CandidateJson {
    pub scaler: String,
    pub label_set_index: usize,
    pub reason: String,
}

impl RouteJson {
    pub fn new(config: &Config, explanation: &Explanation) -> Self {
        let chosen = explanation.chosen;
        Self {
            scaler: chosen
                .and_then(|r| config.scalers.get(r.scaler))
                .map(|s| s.name.to_string()),
            label_set_index: chosen.map(|r| r.label_set),
            candidates: explanation
                .candidates
                .iter()
                .map(|c| CandidateJson {
                    scaler: c.scaler_name.to_string(),
                    label_set_index: c.label_set,
                    reason: c.reason.to_string(),
                })
                .collect(),
            hosts: None,
        }
    }
}

fn write_route_text(
    out: &mut dyn Write,
    config: &Config,
    job: &LabelSet,
    exclude: &LabelSet,
    explanation: &Explanation,
) -> io::Result<()> {
    let labels_of = |scaler: usize, set: usize| {
        config
            .scalers
            .get(scaler)
            .and_then(|s| s.label_sets.get(set))
            .map_or_else(String::new, |ls| bracketed(&ls.labels))
    };
    let mut asked = format!("labels {}", bracketed(job));
    if !exclude.is_empty() {
        asked.push_str(&format!(" excluding {}", bracketed(exclude)));
    }
    match explanation.chosen {
        Some(r) => {
            let name = config
                .scalers
                .get(r.scaler)
                .map_or_else(String::new, |s| s.name.to_string());
            writeln!(
                out,
                "scaler {name}, label set {} {} for {asked}",
                r.label_set,
                labels_of(r.scaler, r.label_set)
            )?;
        }
        None => writeln!(out, "no-backend: no label set accepts {asked}")?,
    }
    for c in &explanation.candidates {
        writeln!(
            out,
            "  {}[{}] {}: {}",
            c.scaler_name,
            c.label_set,
            labels_of(c.scaler, c.label_set),
            c.reason
        )?;
    }
    Ok(())
}

/// A job's `--labels` as upstream reads a request's labels (trimmed,
/// lower-cased); `--labels ''` is a job with no labels at all.
pub(crate) fn job_labels(raw: &[String]) -> Result<LabelSet, kici_model::LabelError> {
    match raw {
        [only] if only.is_empty() => Ok(LabelSet::default()),
        _ => kici_routing::request_labels(raw),
    }
}

fn bracketed(labels: &LabelSet) -> String {
    let names: Vec<&str> = labels.iter().map(|l| l.as_str()).collect();
    format!("[{}]", names.join(", "))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn labels_split_on_commas_and_repeat() {
        let cli = Cli::try_parse_from([
            "kici-scaler",
            "route",
            "--config",
            "c.yaml",
            "--labels",
            "linux,x64",
            "--exclude",
            "gpu",
            "--exclude",
            "arm64,slow",
        ])
        .unwrap();
        let Command::Route(args) = cli.command else {
            panic!("not route");
        };
        assert_eq!(args.labels, ["linux", "x64"]);
        assert_eq!(args.exclude, ["gpu", "arm64", "slow"]);
        assert_eq!(args.config.config_dir, None);
    }

    #[test]
    fn summary_pluralises() {
        assert_eq!(plural(1, "scaler", "scalers"), "1 scaler");
        assert_eq!(plural(0, "scaler", "scalers"), "0 scalers");
        assert_eq!(plural(7, "label set", "label sets"), "7 label sets");
    }
}
