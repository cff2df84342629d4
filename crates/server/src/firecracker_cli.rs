//! `kici-scaler firecracker provision|verify|teardown`: the host bridge the
//! Firecracker backend attaches VMs to, from the configuration's
//! `firecracker` block alone (no engine, no store). `serve` only checks the
//! bridge; creating it is this one-time, explicit step.

use crate::cli::{CliError, ConfigArgs, Outcome};
use clap::{Args, Subcommand};
use kici_firecracker::{BridgeStatus, HostNetwork};
use serde::Serialize;
use std::io::Write;

#[derive(Debug, Args)]
pub struct FirecrackerArgs {
    #[command(subcommand)]
    pub action: FirecrackerAction,
}

#[derive(Debug, Subcommand)]
pub enum FirecrackerAction {
    /// Create the bridge (tagged as ours, up, with the gateway address);
    /// idempotent, never touches its ports.
    Provision(BridgeArgs),
    /// Report the bridge's state; change nothing.
    Verify(BridgeArgs),
    /// Delete the bridge, only if kici-scaler created it.
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
    problems: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    removed: Option<bool>,
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
    let host = HostNetwork { network: &network };
    let result = runtime.block_on(async {
        match &args.action {
            FirecrackerAction::Provision(_) => host.provision().await.map(|s| (s, None)),
            // `Rootfs` returned above.
            FirecrackerAction::Verify(_) | FirecrackerAction::Rootfs(_) => {
                host.check().await.map(|s| (s, None))
            }
            FirecrackerAction::Teardown(_) => {
                let removed = host.teardown().await?;
                host.check().await.map(|s| (s, Some(removed)))
            }
        }
    });
    let (status, removed): (BridgeStatus, Option<bool>) = match result {
        Ok(r) => r,
        Err(e) => {
            writeln!(err, "kici-scaler: bridge {}: {e}", network.bridge_name)?;
            return Ok(Outcome::Failed);
        }
    };
    let problems = if removed.is_some() {
        Vec::new()
    } else {
        status.problems(&network)
    };
    let ok = match removed {
        // Teardown succeeded when the bridge is gone (or was not ours).
        Some(_) => !status.exists || !status.tagged,
        None => status.healthy(),
    };
    let report = Report {
        bridge: network.bridge_name.clone(),
        ok,
        exists: status.exists,
        up: status.up,
        gateway_assigned: status.gateway_assigned,
        ours: status.tagged,
        problems,
        removed,
    };
    if bridge_args.json {
        serde_json::to_writer(&mut *out, &report)?;
        writeln!(out)?;
    } else {
        match removed {
            Some(true) => writeln!(out, "bridge {}: removed", report.bridge)?,
            Some(false) if status.exists => writeln!(
                out,
                "bridge {}: left alone (not created by kici-scaler)",
                report.bridge
            )?,
            Some(false) => writeln!(out, "bridge {}: not present", report.bridge)?,
            None if ok => writeln!(
                out,
                "bridge {}: ok ({}/{}, up)",
                report.bridge,
                network.gateway,
                network.cidr.prefix_len()
            )?,
            None => {
                for p in &report.problems {
                    writeln!(out, "bridge {}: {p}", report.bridge)?;
                }
            }
        }
    }
    Ok(if ok { Outcome::Ok } else { Outcome::Failed })
}
