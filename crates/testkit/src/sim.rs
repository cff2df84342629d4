//! `fc-sim`'s process: Firecracker's command line, the API socket, the
//! thread per connection, and the guest thread started by `InstanceStart`.

use std::io::BufReader;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;

use crate::guest::{GuestConfig, VmmMode};
use crate::http::{read_request, write_response, HttpError, HttpResponse, DEFAULT_MAX_PAYLOAD};
use crate::logger::{Level, VmmLogger};
use crate::spec::{ApiSpec, SPEC_VERSION};
use crate::vmm::{handle, Shared, SimConfig};

/// Firecracker's exit code for argument parsing errors.
pub const EXIT_ARG_PARSING: i32 = 153;
/// Exit code for everything else that stops start-up (bad socket, bad log path, ...).
pub const EXIT_GENERIC: i32 = 1;

/// Parsed command line.
#[derive(Debug, Clone)]
pub struct SimArgs {
    pub api_sock: PathBuf,
    pub id: String,
    pub log_path: Option<PathBuf>,
    pub level: Option<Level>,
    pub show_level: bool,
    pub show_log_origin: bool,
    pub boot_timer: bool,
    pub mmds_size_limit: Option<usize>,
    pub max_payload: usize,
    pub metadata: Option<PathBuf>,
    pub config_file: Option<PathBuf>,
    pub no_api: bool,
}

/// Why the command line was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArgError {
    #[error("Arguments parsing error: Found argument '{0}' which wasn't expected, or isn't valid in this context.")]
    Unexpected(String),
    #[error(
        "Arguments parsing error: The argument '{0}' requires a value, but none was supplied."
    )]
    MissingValue(String),
    #[error("Arguments parsing error: The argument '{0}' was provided more than once.")]
    Duplicate(String),
    #[error("Invalid value for {0}: {1}")]
    BadValue(String, String),
    #[error("Invalid instance ID: {0}")]
    InstanceId(String),
}

/// The instance-id rule shared by Firecracker and the jailer: 1..=64 of `[A-Za-z0-9-]`.
pub fn validate_instance_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > 64 {
        return Err(format!("Invalid len for instance ID: {}", id.len()));
    }
    if let Some(c) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '-'))
    {
        return Err(format!(
            "Invalid char ({c}) at position {}",
            id.find(c).unwrap_or(0)
        ));
    }
    Ok(())
}

/// Flags Firecracker v1.16 accepts, with whether they take a value.
const FLAGS: &[(&str, bool)] = &[
    ("api-sock", true),
    ("id", true),
    ("seccomp-filter", true),
    ("no-seccomp", false),
    ("start-time-us", true),
    ("start-time-cpu-us", true),
    ("parent-cpu-time-us", true),
    ("config-file", true),
    ("no-api", false),
    ("log-path", true),
    ("level", true),
    ("module", true),
    ("show-level", false),
    ("show-log-origin", false),
    ("boot-timer", false),
    ("metadata", true),
    ("mmds-size-limit", true),
    ("http-api-max-payload-size", true),
    ("metrics-path", true),
    ("enable-pci", false),
    ("describe-snapshot", true),
    ("version", false),
    ("help", false),
    ("snapshot-version", false),
];

impl SimArgs {
    pub fn parse(args: &[String]) -> Result<Self, ArgError> {
        let mut values: std::collections::BTreeMap<&str, Option<String>> = Default::default();
        let mut i = 0;
        while i < args.len() {
            let a = &args[i];
            let Some(name) = a.strip_prefix("--") else {
                return Err(ArgError::Unexpected(a.clone()));
            };
            let Some((flag, takes)) = FLAGS.iter().find(|(f, _)| *f == name) else {
                return Err(ArgError::Unexpected(a.clone()));
            };
            if values.contains_key(flag) {
                return Err(ArgError::Duplicate(name.to_string()));
            }
            if *takes {
                let v = args
                    .get(i + 1)
                    .filter(|v| !v.starts_with("--"))
                    .ok_or_else(|| ArgError::MissingValue(name.to_string()))?;
                values.insert(flag, Some(v.clone()));
                i += 2;
            } else {
                values.insert(flag, None);
                i += 1;
            }
        }
        let get = |k: &str| values.get(k).cloned().flatten();
        let id = get("id").unwrap_or_else(|| "anonymous-instance".to_string());
        validate_instance_id(&id).map_err(ArgError::InstanceId)?;
        let level = match get("level") {
            Some(l) => {
                Some(Level::parse(&l).ok_or_else(|| ArgError::BadValue("--level".into(), l))?)
            }
            None => None,
        };
        let parse_usize = |k: &str| -> Result<Option<usize>, ArgError> {
            get(k)
                .map(|v| {
                    v.parse::<usize>()
                        .map_err(|_| ArgError::BadValue(format!("--{k}"), v))
                })
                .transpose()
        };
        let max_payload = parse_usize("http-api-max-payload-size")?.unwrap_or(DEFAULT_MAX_PAYLOAD);
        Ok(Self {
            api_sock: PathBuf::from(
                get("api-sock").unwrap_or_else(|| "/run/firecracker.socket".into()),
            ),
            id,
            log_path: get("log-path").map(PathBuf::from),
            level,
            show_level: values.contains_key("show-level"),
            show_log_origin: values.contains_key("show-log-origin"),
            boot_timer: values.contains_key("boot-timer"),
            mmds_size_limit: parse_usize("mmds-size-limit")?,
            max_payload,
            metadata: get("metadata").map(PathBuf::from),
            config_file: get("config-file").map(PathBuf::from),
            no_api: values.contains_key("no-api") || values.contains_key("version"),
        })
    }
}

/// Run the simulator; returns the process exit code (only on start-up failure:
/// a running simulator exits from the guest thread).
pub fn main_with_args(args: &[String]) -> i32 {
    let parsed = match SimArgs::parse(args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return EXIT_ARG_PARSING;
        }
    };
    if args.iter().any(|a| a == "--version") {
        println!("Firecracker v{SPEC_VERSION} (kici-testkit fc-sim)");
        return 0;
    }
    if let Some(cfg) = &parsed.config_file {
        eprintln!(
            "kici-testkit fc-sim: --config-file {} is not simulated: configure through the API (kici never boots from a config file)",
            cfg.display()
        );
        return EXIT_GENERIC;
    }
    if parsed.no_api {
        eprintln!("kici-testkit fc-sim: --no-api is not simulated");
        return EXIT_GENERIC;
    }
    let spec = match ApiSpec::load() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kici-testkit fc-sim: {e}");
            return EXIT_GENERIC;
        }
    };
    let guest = match GuestConfig::from_env_and_cwd() {
        Ok(g) => g,
        Err(e) => {
            eprintln!("kici-testkit fc-sim: {e}");
            return EXIT_GENERIC;
        }
    };
    let mut logger = VmmLogger::new(&parsed.id);
    if let Err(e) = logger.configure(
        parsed.log_path.as_deref(),
        parsed.level,
        Some(parsed.show_level),
        Some(parsed.show_log_origin),
    ) {
        eprintln!("Logger error: Failed to open target file: {e}");
        return EXIT_GENERIC;
    }
    logger.log(
        Level::Info,
        "main",
        &format!("Running Firecracker v{SPEC_VERSION}"),
    );
    let config = SimConfig {
        instance_id: parsed.id.clone(),
        mmds_size_limit: parsed.mmds_size_limit.unwrap_or(parsed.max_payload),
        max_payload: parsed.max_payload,
        boot_timer: parsed.boot_timer,
        guest,
    };
    let shared = Shared::new(spec, config, logger);
    if let Some(meta) = &parsed.metadata {
        let loaded = std::fs::read_to_string(meta)
            .map_err(|e| e.to_string())
            .and_then(|t| serde_json::from_str(&t).map_err(|e| e.to_string()))
            .and_then(|v| shared.lock().mmds.put(v).map_err(|e| e.to_string()));
        if let Err(e) = loaded {
            eprintln!("Populating MMDS from file failed: {e}.");
            return EXIT_GENERIC;
        }
    }
    match shared.lock().config.guest.vmm {
        VmmMode::ExitAtStart => {
            eprintln!(
                "kici-testkit fc-sim: simulated start-up failure (testkit-vmm-mode exit-at-start)"
            );
            return EXIT_GENERIC;
        }
        VmmMode::NoSocket => loop {
            std::thread::park();
        },
        _ => {}
    }
    let hang_api = shared.lock().config.guest.vmm == VmmMode::HangApi;
    let listener = match UnixListener::bind(&parsed.api_sock) {
        Ok(l) => l,
        Err(e) => {
            shared.lock().logger.log(
                Level::Error,
                "main",
                &format!(
                    "Failed to open the API socket at: {}. Check that it is not already used.",
                    parsed.api_sock.display()
                ),
            );
            eprintln!(
                "Failed to open the API socket at: {}: {e}",
                parsed.api_sock.display()
            );
            return EXIT_GENERIC;
        }
    };
    crate::guestlink::spawn(Arc::clone(&shared), &parsed.api_sock);
    let mut held = Vec::new();
    for conn in listener.incoming() {
        if hang_api {
            // Accept and never answer: the wedged VMM a backend must time out on.
            if let Ok(stream) = conn {
                held.push(stream);
            }
            continue;
        }
        let Ok(stream) = conn else { continue };
        let shared = Arc::clone(&shared);
        std::thread::spawn(move || serve_connection(shared, stream));
    }
    0
}

fn serve_connection(shared: Arc<Shared>, stream: UnixStream) {
    let Ok(write_half) = stream.try_clone() else {
        return;
    };
    let mut writer = write_half;
    let mut reader = BufReader::new(stream);
    let max_payload = shared.lock().config.max_payload;
    loop {
        let req = match read_request(&mut reader, &mut writer, max_payload) {
            Ok(r) => r,
            Err(HttpError::Closed) => return,
            Err(e) => {
                let _ = write_response(&mut writer, &HttpResponse::fault(400, &e.to_string()));
                return;
            }
        };
        shared.lock().in_flight += 1;
        let (resp, start) = handle(&shared, &req);
        if start {
            let guest_shared = Arc::clone(&shared);
            std::thread::spawn(move || crate::guest::run(guest_shared));
        }
        let written = write_response(&mut writer, &resp);
        shared.lock().in_flight -= 1;
        // Every request may have changed what a waiting guest looks at (MMDS,
        // Ctrl+Alt+Del), and an exiting VMM waits for in-flight answers: wake them.
        shared.events.notify_all();
        if written.is_err() || req.wants_close() || req.oversized.is_some() {
            return;
        }
    }
}

#[cfg(test)]
mod firecracker_tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn parses_the_jailer_handed_command_line() {
        let a = SimArgs::parse(&args(
            "--id vm-1 --start-time-us 1 --start-time-cpu-us 2 --parent-cpu-time-us 3 --api-sock /run/x.sock --log-path /vmm.log --level Warning --show-level",
        ))
        .unwrap();
        assert_eq!(a.id, "vm-1");
        assert_eq!(a.level, Some(Level::Warning));
        assert!(a.show_level);
        assert_eq!(
            SimArgs::parse(&args("--bogus")).unwrap_err(),
            ArgError::Unexpected("--bogus".into())
        );
        assert!(matches!(
            SimArgs::parse(&args("--id bad_id")),
            Err(ArgError::InstanceId(_))
        ));
        assert!(matches!(
            SimArgs::parse(&args("--api-sock")),
            Err(ArgError::MissingValue(_))
        ));
    }
}
