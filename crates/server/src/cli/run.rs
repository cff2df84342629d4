//! `kici-scaler run`: one job end to end from the command line.
//!
//! With `--config`, `run` is a small daemon of its own for the job's
//! lifetime: a temporary state dir (`kici-scaler-run-*` in a parent only
//! its user can write, see [`crate::daemon::run_dirs`]; removed at exit) with a fresh instance id — so it never touches a
//! running `serve` or its agents —, the engine, the agent gateway on an
//! ephemeral loopback port and the backends the configuration uses. It
//! submits the job, writes the job's output to its own stdout and stderr as
//! the command wrote them, destroys the agent, and exits with the job's exit
//! code. With `--server`, it submits to a running daemon (`POST /v1/jobs`)
//! and follows `GET /v1/jobs/{id}/logs` instead.
//!
//! Exit codes: the command's own; 128 + n if signal n killed it; 127 / 126
//! if it could not be started (not found / not executable); 125 if
//! kici-scaler itself failed (bad command line or configuration, no
//! backend, too large, the agent failed or never registered, no capacity in
//! time, the daemon unreachable), with the reason on stderr. SIGINT,
//! SIGTERM, SIGHUP and SIGQUIT cancel the job, destroy its agent and exit
//! 128 + the signal's number (130, 143, 129, 131). What a `run` killed with
//! SIGKILL left behind (its agents, their cgroups, its temporary state dir)
//! is swept by the next `run` or `serve` on the host (see
//! [`crate::daemon::dead_runs`]).

use crate::cli::client;
use crate::daemon::backends::{BackendContext, BackendRegistry};
use crate::daemon::identity::StateDir;
use crate::daemon::stack::{self, Stack, StackOptions};
use crate::gateway::GatewaySettings;
use crate::jobs::{self, EndKind, JobBook, JobRequest, JobView, Read, SubmitError};
use clap::Args;
use kici_admission::MachineLedger;
use kici_api::{JobBody, JobLogEvent, ResourcesBody};
use kici_engine::EngineSettings;
use kici_model::{LabelSet, MemoryBytes, MilliCpu, ResourceRequest, ResourceSpec};
use kici_protocol::{JobSpec, OutputStream};
use std::collections::BTreeMap;
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::signal::unix::{signal, Signal, SignalKind};

/// `run` failed before or beside the job: 125, as `docker run` does.
pub const EXIT_FAILED: u8 = 125;
/// How long `run` waits for its agents to be destroyed before it exits.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
/// Events kept by the in-process daemon (nobody resumes from them).
const EVENT_REPLAY: usize = 1024;

/// `kici-scaler run`.
#[derive(Debug, Clone, Args)]
#[command(
    after_help = "Exit codes: the command's own; 128+n if signal n killed it; \
                  126/127 if it could not be started; 125 if kici-scaler itself failed \
                  (the reason is on stderr); 128+n when interrupted by signal n \
                  (SIGINT 130, SIGTERM 143, SIGHUP 129, SIGQUIT 131)."
)]
pub struct RunArgs {
    /// The configuration (scalers.yaml): run an in-process daemon for this
    /// one job.
    #[arg(
        long,
        value_name = "FILE",
        required_unless_present = "server",
        conflicts_with = "server"
    )]
    pub config: Option<PathBuf>,
    /// Drop-in directory (*.yaml / *.yml merged after the main file).
    #[arg(long, value_name = "DIR", requires = "config")]
    pub config_dir: Option<PathBuf>,
    /// Submit to a running daemon instead (POST /v1/jobs): http://HOST:PORT,
    /// https://HOST:PORT or unix:/path. Its bearer token, if it needs one,
    /// comes from KICI_SCALER_API_TOKEN.
    #[arg(long, value_name = "URL")]
    pub server: Option<String>,
    /// PEM CA certificate(s) to trust for an https:// server.
    #[arg(long, value_name = "FILE", requires = "server")]
    pub ca_cert: Option<PathBuf>,
    /// The job's labels (its runsOn), comma-separated; `--labels ''` for
    /// none (routes to the first label set without a gate).
    #[arg(long, value_name = "LABELS", value_delimiter = ',', required = true)]
    pub labels: Vec<String>,
    /// An environment variable for the command (repeatable); a bare NAME
    /// passes kici-scaler's own value.
    #[arg(long = "env", value_name = "NAME=VALUE")]
    pub env: Vec<String>,
    /// Kill the command after this many seconds.
    #[arg(long, value_name = "SECONDS")]
    pub timeout: Option<u64>,
    /// CPUs to request (cores, e.g. 0.5).
    #[arg(long, value_name = "N")]
    pub cpus: Option<f64>,
    /// Memory to request (e.g. 512m, 1g).
    #[arg(long, value_name = "SIZE")]
    pub memory: Option<String>,
    /// Machine-pool ledger directory (only used when the configuration has
    /// machine pools).
    #[arg(long, value_name = "DIR", env = "KICI_MACHINE_LEDGER_DIR")]
    pub machine_ledger_dir: Option<PathBuf>,
    #[command(flatten)]
    pub backend: crate::daemon::settings::BackendArgs,
    /// The command and its arguments (after `--`).
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

/// A `run` failure: printed as `kici-scaler: <message>`, exit 125.
#[derive(Debug)]
struct Failed(String);

impl<E: std::fmt::Display> From<E> for Failed {
    fn from(e: E) -> Self {
        Failed(e.to_string())
    }
}

/// The whole command; returns the process exit code.
pub fn run(args: &RunArgs) -> u8 {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("kici-scaler-run")
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return fail(&format!("cannot start the async runtime: {e}")),
    };
    let result = runtime.block_on(async {
        let job = JobInput::parse(args)?;
        match &args.server {
            Some(server) => remote(args, server, job).await,
            None => local(args, job).await,
        }
    });
    match result {
        Ok(code) => code,
        Err(Failed(message)) => fail(&message),
    }
}

fn fail(message: &str) -> u8 {
    let _ = writeln!(std::io::stderr(), "kici-scaler: {message}");
    EXIT_FAILED
}

/// What the command line says about the job.
#[derive(Debug)]
struct JobInput {
    labels: LabelSet,
    argv: Vec<String>,
    env: BTreeMap<String, String>,
    timeout: Option<u64>,
    resources: Option<ResourceRequest>,
}

impl JobInput {
    fn parse(args: &RunArgs) -> Result<Self, Failed> {
        let labels = kici_routing::request_labels(&args.labels)
            .map_err(|e| Failed(format!("--labels: {e}")))?;
        let mut env = BTreeMap::new();
        for raw in &args.env {
            let (name, value) = match raw.split_once('=') {
                Some((n, v)) => (n.to_owned(), v.to_owned()),
                None => match std::env::var(raw) {
                    Ok(v) => (raw.clone(), v),
                    Err(_) => {
                        return Err(Failed(format!(
                            "--env {raw}: not set in kici-scaler's environment (use NAME=VALUE)"
                        )))
                    }
                },
            };
            env.insert(name, value);
        }
        let cpus = args
            .cpus
            .map(MilliCpu::from_cores)
            .transpose()
            .map_err(|e| Failed(format!("--cpus: {e}")))?;
        let memory = args
            .memory
            .as_deref()
            .map(MemoryBytes::parse_request)
            .transpose()
            .map_err(|e| Failed(format!("--memory: {e}")))?;
        let resources = (cpus.is_some() || memory.is_some()).then_some(ResourceRequest {
            requests: Some(ResourceSpec { cpus, memory }),
            limits: None,
        });
        let input = Self {
            labels,
            argv: args.command.clone(),
            env,
            timeout: args.timeout,
            resources,
        };
        // The job's own checks (argv, env names, timeout, size), at once.
        input.spec(JobBook::mint_id())?;
        Ok(input)
    }

    fn spec(&self, id: kici_model::JobId) -> Result<JobSpec, Failed> {
        JobSpec::new(id, self.argv.clone(), self.env.clone(), self.timeout)
            .map_err(|e| Failed(format!("the job: {e}")))
    }
}

/// SIGINT, SIGTERM, SIGHUP and SIGQUIT, which cancel the job. A closed
/// terminal or ssh session sends SIGHUP: left to its default action it
/// would kill `run` before it destroyed the agent, and the agent, the job's
/// escaped children and the agent's cgroup would outlive it.
struct Interrupts {
    int: Signal,
    term: Signal,
    hup: Signal,
    quit: Signal,
}

impl Interrupts {
    fn install() -> Result<Self, Failed> {
        Ok(Self {
            int: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
            hup: signal(SignalKind::hangup())?,
            quit: signal(SignalKind::quit())?,
        })
    }

    /// The exit code for the signal that arrived (128 + its number: 130,
    /// 143, 129, 131), as a shell reports a process that signal killed.
    async fn recv(&mut self) -> u8 {
        tokio::select! {
            _ = self.int.recv() => 130,
            _ = self.term.recv() => 143,
            _ = self.hup.recv() => 129,
            _ = self.quit.recv() => 131,
        }
    }
}

/// Writes the job's output as it wrote it: stdout to stdout, stderr to
/// stderr. A closed stream (`| head`) stops being written to; the job goes
/// on.
#[derive(Default)]
struct Terminal {
    stdout_closed: bool,
    stderr_closed: bool,
}

impl Terminal {
    fn write(&mut self, stream: OutputStream, data: &[u8]) {
        let (closed, result) = match stream {
            OutputStream::Stdout => {
                let mut out = std::io::stdout().lock();
                (
                    &mut self.stdout_closed,
                    out.write_all(data).and_then(|()| out.flush()),
                )
            }
            OutputStream::Stderr => {
                let mut err = std::io::stderr().lock();
                (
                    &mut self.stderr_closed,
                    err.write_all(data).and_then(|()| err.flush()),
                )
            }
        };
        if result.is_err() {
            *closed = true;
        }
    }

    fn note(&mut self, message: &str) {
        if !self.stderr_closed {
            let _ = writeln!(std::io::stderr(), "kici-scaler: {message}");
        }
    }

    fn dropped(&mut self, from: u64, to: u64) {
        self.note(&format!(
            "output chunks {from}..={to} were dropped (more than {} bytes buffered)",
            jobs::OUTPUT_CAP_BYTES
        ));
    }
}

/// The job's outcome as an exit code, with the reason on stderr when
/// kici-scaler (not the command) ended it.
fn finish(view: &JobView, terminal: &mut Terminal) -> u8 {
    let code = view.run_exit_code().unwrap_or(i32::from(EXIT_FAILED));
    // The command's own end speaks for itself; anything else is explained.
    if view.end != Some(EndKind::Exited) {
        let reason = view
            .reason
            .as_deref()
            .unwrap_or("the job ended without a result");
        terminal.note(&format!(
            "job {} {}: {reason}",
            view.job_id,
            view.state.as_str()
        ));
    }
    // Exit codes are 0..=255; anything else (an agent's odd report) is ours.
    u8::try_from(code).unwrap_or(EXIT_FAILED)
}

// ------------------------------------------------------------ in process

async fn local(args: &RunArgs, input: JobInput) -> Result<u8, Failed> {
    let Some(config_path) = &args.config else {
        return Err(Failed("--config or --server is required".into()));
    };
    let mut interrupts = Interrupts::install()?;
    let loaded = stack::load_config(config_path, args.config_dir.as_deref())
        .map_err(|e| Failed(format!("invalid configuration:\n{e}")))?;
    for w in &loaded.warnings {
        let _ = writeln!(std::io::stderr(), "warning: {w}");
    }
    let config = Arc::new(loaded.config);

    // No daemon-config file here: flags, environment, defaults.
    let tuning = args.backend.resolve(
        &crate::daemon::settings::DaemonFile::default(),
        &mut Vec::new(),
    );
    // Where its state dir goes, verified before anything is read from or
    // written there.
    let location = crate::daemon::run_dirs::Location::current();
    let parent = location.prepare().map_err(|e| {
        Failed(format!(
            "cannot keep the run's state dir in {}: {e}",
            location.parent().display()
        ))
    })?;
    // What an earlier `run` killed with SIGKILL left goes first.
    for swept in crate::daemon::dead_runs::sweep(&tuning).await {
        let _ = writeln!(
            std::io::stderr(),
            "kici-scaler: swept what a killed `kici-scaler run` left behind (instance {}: {} resource(s){})",
            swept.instance,
            swept.resources,
            if swept.errors.is_empty() {
                String::new()
            } else {
                format!("; not all of it: {}", swept.errors.join("; "))
            }
        );
    }

    // Its own state dir and instance id: nothing here is shared with a
    // running `serve`.
    let temp = tempfile::Builder::new()
        .prefix(crate::daemon::run_dirs::RUN_DIR_PREFIX)
        .tempdir_in(&parent.path)
        .map_err(|e| Failed(format!("cannot create a temporary state dir: {e}")))?;
    let state_dir = StateDir::open(temp.path(), false)?;
    let instance = state_dir.instance_id();
    // Before any agent exists: a `run` killed from here on leaves a dir the
    // next sweep can tear down completely.
    crate::daemon::dead_runs::RunDir::record(temp.path(), config_path, args.config_dir.as_deref())
        .map_err(|e| {
            Failed(format!(
                "cannot record the configuration in the state dir: {e}"
            ))
        })?;
    tracing::info!(instance = %instance, state_dir = %temp.path().display(), "run: in-process daemon");

    let gateway = stack::bind_gateway(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))
        .map_err(|e| Failed(format!("cannot listen for agents on 127.0.0.1: {e}")))?;
    // Containers and VMs need the IP allocator; a store in the temporary
    // dir gives it (nothing else is recorded: `run` has nothing to recover).
    let store = kici_store::open(
        &kici_store::StoreUrl::default_in(temp.path()),
        instance,
        kici_store::StoreOptions::default(),
    )
    .await
    .map_err(|e| Failed(format!("cannot open the temporary state store: {e}")))?;
    let ctx = BackendContext {
        config: None,
        instance,
        state_dir: temp.path().to_path_buf(),
        store: Some(store),
        tuning,
        // A fresh instance id per run: nothing of it is ever owned again.
        ephemeral: true,
        gateway_port: gateway
            .local_addr()
            .map_err(|e| Failed(format!("the agent gateway listener: {e}")))?
            .port(),
    };
    let backends = BackendRegistry::builtin()
        .start(&config, &ctx)
        .await
        .map_err(|errors| {
            Failed(format!(
                "the backends refuse the configuration:\n{}",
                errors.join("\n")
            ))
        })?;
    // The machine-pool ledger is shared with every process on the host;
    // only a configuration with pools needs it.
    let (ledger, owner_lock) = if config.machine_pools.is_empty() {
        (None, None)
    } else {
        let ledger = MachineLedger::open(args.machine_ledger_dir.as_deref(), instance)?;
        let lock = ledger.dir().join("owners").join(format!("{instance}.lock"));
        (Some(ledger), Some(lock))
    };
    let stack = Stack::start(
        config,
        backends,
        ledger,
        gateway,
        StackOptions {
            engine: EngineSettings::default(),
            event_replay: EVENT_REPLAY,
            gateway: GatewaySettings::default(),
            // The gateway of one job's agent: the defaults, within this
            // process's descriptors.
            gateway_limits: crate::daemon::serving::ConnectionLimits::gateway()
                .within_descriptors(crate::daemon::serving::raise_open_file_limit(), 4),
            job_output: None,
            in_fleet: false,
        },
        // `run` lives in a temporary state dir with a fresh identity:
        // nothing of it is left to recover, so nothing is recorded.
        None,
    )
    .await?
    .0;

    let outcome = run_job(&stack, input, &mut interrupts).await;
    let stopped = stack.shutdown(SHUTDOWN_GRACE).await;
    if stopped.agents_left > 0 {
        let _ = writeln!(
            std::io::stderr(),
            "kici-scaler: {} agent(s) could not be destroyed within {}s",
            stopped.agents_left,
            SHUTDOWN_GRACE.as_secs()
        );
    }
    if let Some(lock) = owner_lock {
        // A run's instance never comes back: its owner lock file would
        // only pile up.
        let _ = std::fs::remove_file(lock);
    }
    drop(state_dir);
    if let Err(e) = temp.close() {
        tracing::warn!(error = %e, "cannot remove the temporary state dir");
    }
    let code = outcome?;
    Ok(if stopped.agents_left > 0 && code == 0 {
        EXIT_FAILED
    } else {
        code
    })
}

async fn run_job(
    stack: &Stack,
    input: JobInput,
    interrupts: &mut Interrupts,
) -> Result<u8, Failed> {
    let spec = input.spec(JobBook::mint_id())?;
    let id = spec.job_id().clone();
    let request = JobRequest {
        labels: input.labels,
        resources: input.resources,
        spec,
    };
    jobs::submit(&stack.runtime, &stack.jobs, request).map_err(|e| match e {
        SubmitError::NoBackend(why) => Failed(format!("no-backend: {why}")),
        other => Failed(other.to_string()),
    })?;
    let mut terminal = Terminal::default();
    let mut next = 0;
    loop {
        let read = stack
            .jobs
            .read(&id, next)
            .ok_or_else(|| Failed(format!("job {id} vanished")))?;
        match read {
            Read::Chunks { missed, chunks } => {
                if let Some((from, to)) = missed {
                    terminal.dropped(from, to);
                    next = to + 1;
                }
                for chunk in chunks {
                    terminal.write(chunk.stream, chunk.data.as_bytes());
                    next = chunk.index + 1;
                }
            }
            Read::Wait(mut changed) => {
                tokio::select! {
                    _ = changed.changed() => {}
                    code = interrupts.recv() => {
                        jobs::cancel(&stack.runtime, &stack.jobs, &id, "interrupted");
                        terminal.note(&format!("interrupted: job {id} cancelled, its agent destroyed"));
                        return Ok(code);
                    }
                }
            }
            Read::End(view) => return Ok(finish(&view, &mut terminal)),
        }
    }
}

// ---------------------------------------------------------------- remote

async fn remote(args: &RunArgs, server: &str, input: JobInput) -> Result<u8, Failed> {
    let mut interrupts = Interrupts::install()?;
    let client = client::connect(server, args.ca_cert.as_deref(), client::token_from_env())?;
    let body = JobBody {
        labels: input.labels.iter().map(|l| l.as_str().to_owned()).collect(),
        command: input.argv,
        env: (!input.env.is_empty()).then_some(input.env),
        resources: ResourcesBody::requests(args.cpus, args.memory.clone()),
        timeout_seconds: input.timeout,
    };
    let id = client.submit_job(&body).await?.job_id;
    let mut terminal = Terminal::default();
    let mut logs = client.job_logs(&id, None).await?;
    loop {
        let event = tokio::select! {
            e = logs.next() => e,
            code = interrupts.recv() => {
                // Best effort: the daemon destroys the agent either way
                // once it notices; this is the prompt path.
                let _ = client.cancel_job(&id).await;
                terminal.note(&format!("interrupted: job {id} cancelled"));
                return Ok(code);
            }
        };
        match event {
            Some(Ok(JobLogEvent::Output { output, .. })) => {
                terminal.write(output.stream, output.data.as_bytes());
            }
            Some(Ok(JobLogEvent::Truncated(t))) => terminal.dropped(t.missed_from, t.missed_to),
            Some(Ok(JobLogEvent::End(view))) => return Ok(finish(&view, &mut terminal)),
            Some(Err(e)) => return Err(Failed(format!("the log stream of job {id} broke: {e}"))),
            None => {
                return Err(Failed(format!(
                    "the log stream of job {id} ended before the job did (daemon stopped?)"
                )))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn env_and_resources_from_the_command_line() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            run: RunArgs,
        }
        let cli = Cli::try_parse_from([
            "run",
            "--config",
            "c.yaml",
            "--labels",
            "linux,x64",
            "--env",
            "A=1=2",
            "--timeout",
            "5",
            "--cpus",
            "0.5",
            "--",
            "sh",
            "-c",
            "echo $A",
        ])
        .unwrap();
        let input = JobInput::parse(&cli.run).unwrap();
        assert_eq!(input.argv, ["sh", "-c", "echo $A"]);
        assert_eq!(input.env.get("A").map(String::as_str), Some("1=2"));
        assert_eq!(input.timeout, Some(5));
        assert!(input.resources.is_some());
        let bad = Cli::try_parse_from([
            "run", "--config", "c.yaml", "--labels", "linux", "--env", "1X=2", "--", "true",
        ])
        .unwrap();
        assert!(JobInput::parse(&bad.run).unwrap_err().0.contains("POSIX"));
        assert!(Cli::try_parse_from(["run", "--labels", "linux", "--", "true"]).is_err());
        assert!(Cli::try_parse_from([
            "run",
            "--config",
            "c",
            "--server",
            "http://h:1",
            "--labels",
            "l",
            "--",
            "true"
        ])
        .is_err());
    }
}
