//! The fleet's daemon settings: which fleet to join, how peers reach this
//! host, the lease, placement and the fleet-wide caps.

use clap::Args;
use kici_fleet::{Caps, Placement};
use kici_model::{MemoryBytes, MilliCpu};
use std::path::PathBuf;
use std::time::Duration;

/// The fleet a daemon joins when none is named.
pub const DEFAULT_FLEET: &str = "default";
/// Lease length when none is given.
pub const DEFAULT_LEASE_SECONDS: u64 = 15;

/// `serve`'s fleet flags (effective with `--state postgres://…` only).
#[derive(Debug, Clone, Default, Args)]
pub struct FleetArgs {
    /// With a PostgreSQL --state: the fleet this host joins (one database
    /// can hold several) [default: default].
    #[arg(long, value_name = "NAME", env = "KICI_SCALER_FLEET")]
    pub fleet: Option<String>,
    /// With a PostgreSQL --state: serve alone, as with SQLite (the database
    /// is shared, the queue and caps are this host's).
    #[arg(long)]
    pub no_fleet: bool,
    /// This host's control API as the fleet's other hosts reach it
    /// (http://HOST:PORT or https://HOST:PORT); needed when --listen is not reachable from
    /// them [default: the --listen address].
    #[arg(long, value_name = "URL", env = "KICI_SCALER_ADVERTISE_URL")]
    pub advertise_url: Option<String>,
    /// The fleet key (the same on every host; at least 32 bytes) read from
    /// FILE, which only its owner may read; or set KICI_SCALER_FLEET_KEY.
    /// Hosts sign their calls to each other with it; a fleet host needs one.
    #[arg(long, value_name = "FILE", env = "KICI_SCALER_FLEET_KEY_FILE")]
    pub fleet_key_file: Option<PathBuf>,
    /// PEM CA certificate(s) the certificates of peers advertised as
    /// https:// are verified against [default: the platform's trusted
    /// roots].
    #[arg(long, value_name = "FILE", env = "KICI_SCALER_FLEET_CA_CERT")]
    pub fleet_ca_cert: Option<PathBuf>,
    /// Fleet lease length, renewed every third of it; a host silent this
    /// long is declared lost (3 to 3600) [default: 15].
    #[arg(long, value_name = "SECONDS", env = "KICI_SCALER_FLEET_LEASE_SECONDS")]
    pub fleet_lease_seconds: Option<u64>,
    /// Which host takes a request: spread (equal hosts stay within one agent
    /// of each other) or pack (fill one host before the next)
    /// [default: spread].
    #[arg(long, value_name = "spread|pack", env = "KICI_SCALER_FLEET_PLACEMENT")]
    pub fleet_placement: Option<String>,
    /// Most agents in the whole fleet [default: no cap].
    #[arg(long, value_name = "N", env = "KICI_SCALER_FLEET_MAX_AGENTS")]
    pub fleet_max_agents: Option<u32>,
    /// Most CPUs requested in the whole fleet [default: no cap].
    #[arg(long, value_name = "CPUS", env = "KICI_SCALER_FLEET_MAX_CPU")]
    pub fleet_max_cpu: Option<f64>,
    /// Most memory requested in the whole fleet, e.g. 64g [default: no cap].
    #[arg(long, value_name = "SIZE", env = "KICI_SCALER_FLEET_MAX_MEMORY")]
    pub fleet_max_memory: Option<String>,
}

/// The same settings as `--daemon-config` keys.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FleetFile {
    pub fleet: Option<String>,
    pub no_fleet: Option<bool>,
    pub advertise_url: Option<String>,
    pub fleet_key_file: Option<PathBuf>,
    pub fleet_ca_cert: Option<PathBuf>,
    pub fleet_lease_seconds: Option<u64>,
    pub fleet_placement: Option<String>,
    pub fleet_max_agents: Option<u32>,
    pub fleet_max_cpu: Option<f64>,
    pub fleet_max_memory: Option<String>,
}

/// The fleet settings, resolved and checked.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetSettings {
    /// The fleet's name.
    pub name: String,
    /// This host's control API as peers reach it (`None`: not reachable;
    /// calls only this host can carry out are refused elsewhere).
    pub advertise_url: Option<String>,
    /// `--fleet-key-file` (else the key is in `KICI_SCALER_FLEET_KEY`).
    pub key_file: Option<PathBuf>,
    /// `--fleet-ca-cert`: what https peers are verified against (else the
    /// platform's roots).
    pub ca_cert: Option<PathBuf>,
    pub lease: Duration,
    pub placement: Placement,
    pub global_caps: Caps,
}

impl FleetArgs {
    /// Flags over `file` over the defaults. `postgres`: whether the state
    /// store is PostgreSQL — the only store a fleet can share; a fleet
    /// setting with SQLite is refused rather than silently ignored.
    /// `listen`: the control API address, advertised when no URL is given
    /// and it is a TCP address.
    pub fn resolve(
        &self,
        file: &FleetFile,
        postgres: bool,
        listen: Option<&str>,
        errors: &mut Vec<String>,
    ) -> Option<FleetSettings> {
        let name = self.fleet.clone().or_else(|| file.fleet.clone());
        let url = self
            .advertise_url
            .clone()
            .or_else(|| file.advertise_url.clone());
        let key_file = self
            .fleet_key_file
            .clone()
            .or_else(|| file.fleet_key_file.clone());
        let ca_cert = self
            .fleet_ca_cert
            .clone()
            .or_else(|| file.fleet_ca_cert.clone());
        let lease = self.fleet_lease_seconds.or(file.fleet_lease_seconds);
        let placement = self
            .fleet_placement
            .clone()
            .or_else(|| file.fleet_placement.clone());
        let max_agents = self.fleet_max_agents.or(file.fleet_max_agents);
        let max_cpu = self.fleet_max_cpu.or(file.fleet_max_cpu);
        let max_memory = self
            .fleet_max_memory
            .clone()
            .or_else(|| file.fleet_max_memory.clone());
        let alone = self.no_fleet || file.no_fleet == Some(true);
        if !postgres || alone {
            let given: Vec<&str> = [
                ("fleet", name.is_some()),
                ("advertise-url", url.is_some()),
                ("fleet-key-file", key_file.is_some()),
                ("fleet-ca-cert", ca_cert.is_some()),
                ("fleet-lease-seconds", lease.is_some()),
                ("fleet-placement", placement.is_some()),
                ("fleet-max-agents", max_agents.is_some()),
                ("fleet-max-cpu", max_cpu.is_some()),
                ("fleet-max-memory", max_memory.is_some()),
            ]
            .into_iter()
            .filter_map(|(n, set)| set.then_some(n))
            .collect();
            if !given.is_empty() {
                errors.push(if alone {
                    format!("{}: set, but no-fleet says this host serves alone", given.join(", "))
                } else {
                    format!(
                        "{}: a fleet needs a PostgreSQL state store (--state postgres://…); with SQLite this host serves alone",
                        given.join(", ")
                    )
                });
            }
            return None;
        }
        let before = errors.len();
        let name = name.unwrap_or_else(|| DEFAULT_FLEET.to_owned());
        if name.trim().is_empty() || name.len() > 128 || name.chars().any(char::is_control) {
            errors.push(format!(
                "fleet: {name:?}: expected 1 to 128 printable characters"
            ));
        }
        let url = match url {
            Some(u) => check_url(&u, errors),
            None => listen.and_then(|l| {
                l.parse::<std::net::SocketAddr>()
                    .ok()
                    .filter(|a| !a.ip().is_unspecified())
                    .map(|a| format!("http://{a}"))
            }),
        };
        let lease = lease.unwrap_or(DEFAULT_LEASE_SECONDS);
        if !(3..=3600).contains(&lease) {
            errors.push(format!("fleet-lease-seconds: {lease}: expected 3 to 3600"));
        }
        let placement = match placement {
            None => Placement::Spread,
            Some(p) => match p.parse::<Placement>() {
                Ok(p) => p,
                Err(_) => {
                    errors.push(format!("fleet-placement: {p:?}: expected spread or pack"));
                    Placement::Spread
                }
            },
        };
        if max_agents == Some(0) {
            errors.push("fleet-max-agents: must be at least 1".to_owned());
        }
        let max_cpu = max_cpu.and_then(|c| {
            MilliCpu::cap_from_cores(c)
                .map_err(|e| errors.push(format!("fleet-max-cpu: {e}")))
                .ok()
        });
        let max_memory = max_memory.and_then(|m| {
            m.parse::<MemoryBytes>()
                .map_err(|e| errors.push(format!("fleet-max-memory: {e}")))
                .ok()
        });
        (errors.len() == before).then(|| FleetSettings {
            name,
            advertise_url: url,
            key_file,
            ca_cert,
            lease: Duration::from_secs(lease),
            placement,
            global_caps: Caps {
                max_agents,
                max_cpu,
                max_memory,
            },
        })
    }
}

/// An advertised URL: http or https, a host, no path beyond `/`.
fn check_url(raw: &str, errors: &mut Vec<String>) -> Option<String> {
    let trimmed = raw.trim_end_matches('/');
    let ok = match trimmed.parse::<hyper::Uri>() {
        Ok(uri) => {
            matches!(uri.scheme_str(), Some("http" | "https"))
                && uri.host().is_some_and(|h| !h.is_empty())
                && uri
                    .path_and_query()
                    .is_none_or(|p| p.as_str().is_empty() || p.as_str() == "/")
        }
        Err(_) => false,
    };
    if ok {
        Some(trimmed.to_owned())
    } else {
        errors.push(format!(
            "advertise-url: {raw:?}: expected http://HOST:PORT or https://HOST:PORT"
        ));
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(args: FleetArgs, postgres: bool) -> Result<Option<FleetSettings>, Vec<String>> {
        let mut errors = Vec::new();
        let s = args.resolve(
            &FleetFile::default(),
            postgres,
            Some("10.1.0.2:7878"),
            &mut errors,
        );
        if errors.is_empty() {
            Ok(s)
        } else {
            Err(errors)
        }
    }

    #[test]
    fn postgres_joins_the_default_fleet_with_the_listen_address_advertised() {
        let s = resolve(FleetArgs::default(), true).unwrap().unwrap();
        assert_eq!(s.name, "default");
        assert_eq!(s.advertise_url.as_deref(), Some("http://10.1.0.2:7878"));
        assert_eq!(s.lease, Duration::from_secs(15));
        assert_eq!(s.placement, Placement::Spread);
        assert!(!s.global_caps.any());
    }

    #[test]
    fn fleet_settings_with_sqlite_are_refused_by_name() {
        let args = FleetArgs {
            fleet: Some("ci".into()),
            fleet_max_agents: Some(3),
            ..FleetArgs::default()
        };
        let errors = resolve(args, false).unwrap_err();
        assert_eq!(errors.len(), 1);
        assert!(
            errors[0].starts_with("fleet, fleet-max-agents: a fleet needs a PostgreSQL"),
            "{errors:?}"
        );
        assert_eq!(resolve(FleetArgs::default(), false).unwrap(), None);
    }

    #[test]
    fn no_fleet_serves_alone_and_refuses_fleet_settings_beside_it() {
        let alone = FleetArgs {
            no_fleet: true,
            ..FleetArgs::default()
        };
        assert_eq!(resolve(alone.clone(), true).unwrap(), None);
        let errors = resolve(
            FleetArgs {
                fleet_placement: Some("pack".into()),
                ..alone
            },
            true,
        )
        .unwrap_err();
        assert_eq!(
            errors,
            ["fleet-placement: set, but no-fleet says this host serves alone"]
        );
    }

    #[test]
    fn every_bad_value_is_reported_with_its_setting() {
        let args = FleetArgs {
            fleet: Some(" ".into()),
            advertise_url: Some("ftp://x/y".into()),
            fleet_lease_seconds: Some(2),
            fleet_placement: Some("random".into()),
            fleet_max_agents: Some(0),
            fleet_max_cpu: Some(-1.0),
            fleet_max_memory: Some("lots".into()),
            no_fleet: false,
            fleet_key_file: None,
            fleet_ca_cert: None,
        };
        let errors = resolve(args, true).unwrap_err();
        let starts: Vec<&str> = errors
            .iter()
            .map(|e| e.split(':').next().unwrap())
            .collect();
        assert_eq!(
            starts,
            [
                "fleet",
                "advertise-url",
                "fleet-lease-seconds",
                "fleet-placement",
                "fleet-max-agents",
                "fleet-max-cpu",
                "fleet-max-memory"
            ]
        );
    }

    #[test]
    fn caps_and_url_parse() {
        let args = FleetArgs {
            advertise_url: Some("https://host-a.example:7878/".into()),
            fleet_placement: Some("pack".into()),
            fleet_max_agents: Some(40),
            fleet_max_cpu: Some(64.0),
            fleet_max_memory: Some("128g".into()),
            ..FleetArgs::default()
        };
        let s = resolve(args, true).unwrap().unwrap();
        assert_eq!(
            s.advertise_url.as_deref(),
            Some("https://host-a.example:7878")
        );
        assert_eq!(s.placement, Placement::Pack);
        assert_eq!(s.global_caps.max_agents, Some(40));
        assert_eq!(s.global_caps.max_cpu, Some(MilliCpu::from_millis(64_000)));
        assert_eq!(
            s.global_caps.max_memory,
            Some(MemoryBytes::from_bytes(128 << 30))
        );
    }
}
