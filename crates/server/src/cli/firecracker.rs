//! `kici-scaler firecracker provision|verify|teardown`: the host side of
//! the Firecracker network (the bridge VMs attach to, IP forwarding, NAT for
//! the CIDR, forward accepts, `DOCKER-USER` where dockerd runs), from the
//! configuration's `firecracker` block alone (no engine, no store). `serve`
//! only checks the bridge; setting the host up is this one-time, explicit step.

use crate::cli::{CliError, ConfigArgs, Outcome};
use clap::{Args, Subcommand};
use kici_firecracker::{HostSetup, HostSetupStatus, HostTeardown};
use serde::Serialize;
use std::io::Write;

#[derive(Debug, Args)]
pub struct FirecrackerArgs {
    #[command(subcommand)]
    pub action: FirecrackerAction,
}

#[derive(Debug, Subcommand)]
pub enum FirecrackerAction {
    /// Create the bridge (tagged as ours, up, with the gateway address),
    /// turn IP forwarding on, add NAT and forward accepts for the CIDR;
    /// idempotent, never touches the bridge's ports or per-VM rules.
    Provision(BridgeArgs),
    /// Report what is in place; change nothing. Exits 0 only when all is.
    Verify(BridgeArgs),
    /// Remove the NAT and forward rules provision added, and the bridge if
    /// kici-scaler created it.
    Teardown(BridgeArgs),
    /// Build a guest rootfs image (ext4) from static binaries: the guest
    /// /init, kici-agent-lite and busybox.
    Rootfs(RootfsArgs),
}

#[derive(Debug, Args)]
pub struct RootfsArgs {
    /// The image to write (replaced if it exists).
    #[arg(long)]
    pub out: std::path::PathBuf,
    /// Static kici-agent-lite (scripts/build-guest-musl.sh builds it).
    #[arg(
        long,
        default_value = "target/x86_64-unknown-linux-musl/release/kici-agent-lite"
    )]
    pub agent: std::path::PathBuf,
    /// Static guest /init (kici-guest-init).
    #[arg(
        long,
        default_value = "target/x86_64-unknown-linux-musl/release/kici-guest-init"
    )]
    pub init: std::path::PathBuf,
    /// Static busybox (busybox-static).
    #[arg(long, default_value = kici_firecracker::rootfs::DEFAULT_BUSYBOX)]
    pub busybox: std::path::PathBuf,
    /// Image size in MiB.
    #[arg(long, default_value_t = kici_firecracker::rootfs::DEFAULT_SIZE_MIB)]
    pub size_mib: u32,
}

fn rootfs(
    args: &RootfsArgs,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<Outcome, CliError> {
    let spec = kici_firecracker::rootfs::RootfsSpec {
        out: args.out.clone(),
        init: args.init.clone(),
        agent: args.agent.clone(),
        busybox: args.busybox.clone(),
        size_mib: args.size_mib,
    };
    match kici_firecracker::rootfs::build(&spec) {
        Ok(r) => {
            writeln!(
                out,
                "rootfs {}: {} MiB, {} bytes of files, {} busybox applets",
                r.out.display(),
                r.size_mib,
                r.staged_bytes,
                r.applets
            )?;
            Ok(Outcome::Ok)
        }
        Err(e) => {
            writeln!(err, "kici-scaler: rootfs: {e}")?;
            Ok(Outcome::Failed)
        }
    }
}

#[derive(Debug, Args)]
pub struct BridgeArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Print one JSON document.
    #[arg(long)]
    pub json: bool,
    /// Masquerade only out of this interface (default: the default
    /// route's; without one, any interface but the bridge).
    #[arg(long, value_name = "IFACE")]
    pub uplink: Option<String>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Report {
    bridge: String,
    ok: bool,
    exists: bool,
    up: bool,
    gateway_assigned: bool,
    ours: bool,
    ip_forward: bool,
    nat: bool,
    forward_accepts: bool,
    /// `noChain`, `present` or `missing`.
    docker_user: &'static str,
    /// Where NAT leaves: `out <iface>` or `out any`.
    uplink: String,
    problems: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    removed: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rules_removed: Option<usize>,
}

pub fn firecracker(
    args: &FirecrackerArgs,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<Outcome, CliError> {
    let bridge_args = match &args.action {
        FirecrackerAction::Rootfs(a) => return rootfs(a, out, err),
        FirecrackerAction::Provision(a)
        | FirecrackerAction::Verify(a)
        | FirecrackerAction::Teardown(a) => a,
    };
    let loaded = kici_config::load(
        &bridge_args.config.config,
        bridge_args.config.config_dir.as_deref(),
    )
    .map_err(CliError::Config)?;
    let network = loaded.config.firecracker.clone();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(CliError::Runtime)?;
    let host = HostSetup {
        network: &network,
        uplink: bridge_args.uplink.clone(),
    };
    let result = runtime.block_on(async {
        match &args.action {
            FirecrackerAction::Provision(_) => host.provision().await.map(|s| (s, None)),
            // `Rootfs` returned above.
            FirecrackerAction::Verify(_) | FirecrackerAction::Rootfs(_) => {
                host.verify().await.map(|s| (s, None))
            }
            FirecrackerAction::Teardown(_) => {
                let removed = host.teardown().await?;
                host.verify().await.map(|s| (s, Some(removed)))
            }
        }
    });
    let (status, removed): (HostSetupStatus, Option<HostTeardown>) = match result {
        Ok(r) => r,
        Err(e) => {
            writeln!(
                err,
                "kici-scaler: firecracker network {}: {e}",
                network.bridge_name
            )?;
            return Ok(Outcome::Failed);
        }
    };
    let problems = if removed.is_some() {
        Vec::new()
    } else {
        status.problems(&host)
    };
    let bridge = &status.bridge;
    let forwarding = &status.forwarding;
    let ok = match removed {
        // Teardown succeeded when the bridge is gone (or was not ours) and
        // none of our rules is left.
        Some(_) => {
            (!bridge.exists || !bridge.tagged)
                && !forwarding.nat
                && !forwarding.forward_accepts
                && forwarding.docker_user != kici_netpolicy::DockerUserState::Present
        }
        None => status.healthy(),
    };
    let report = Report {
        bridge: network.bridge_name.clone(),
        ok,
        exists: bridge.exists,
        up: bridge.up,
        gateway_assigned: bridge.gateway_assigned,
        ours: bridge.tagged,
        ip_forward: forwarding.ip_forward,
        nat: forwarding.nat,
        forward_accepts: forwarding.forward_accepts,
        docker_user: match forwarding.docker_user {
            kici_netpolicy::DockerUserState::NoChain => "noChain",
            kici_netpolicy::DockerUserState::Present => "present",
            kici_netpolicy::DockerUserState::Missing => "missing",
        },
        uplink: forwarding.uplink.to_string(),
        problems,
        removed: removed.map(|r| r.bridge_removed),
        rules_removed: removed.map(|r| r.rules_removed),
    };
    if bridge_args.json {
        serde_json::to_writer(&mut *out, &report)?;
        writeln!(out)?;
    } else {
        let name = &report.bridge;
        match removed {
            Some(r) => {
                if r.bridge_removed {
                    writeln!(out, "bridge {name}: removed")?;
                } else if bridge.exists {
                    writeln!(
                        out,
                        "bridge {name}: left alone (not created by kici-scaler)"
                    )?;
                } else {
                    writeln!(out, "bridge {name}: not present")?;
                }
                writeln!(
                    out,
                    "bridge {name}: {} NAT/forward rule(s) removed",
                    r.rules_removed
                )?;
            }
            None if ok => writeln!(
                out,
                "bridge {name}: ok ({}/{}, up; forwarding on, NAT {}, forward accepts{})",
                network.gateway,
                network.cidr.prefix_len(),
                report.uplink,
                if forwarding.docker_user == kici_netpolicy::DockerUserState::Present {
                    ", DOCKER-USER accepts"
                } else {
                    ""
                }
            )?,
            None => {
                for p in &report.problems {
                    writeln!(out, "bridge {name}: {p}")?;
                }
            }
        }
    }
    Ok(if ok { Outcome::Ok } else { Outcome::Failed })
}
