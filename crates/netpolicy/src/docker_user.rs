//! Accepts in dockerd's `DOCKER-USER` chain, through the `iptables` binary.
//!
//! Why `iptables` and not our nft table: dockerd owns the iptables `filter`
//! table (it sets the `FORWARD` policy to DROP and jumps to `DOCKER-USER`
//! first), and on an iptables-nft host those chains live in the nft table
//! `ip filter`, whose rules carry xtables-compat expressions that `nft -j`
//! cannot round-trip safely. Rules written by `iptables` stay readable by
//! dockerd and by operators using `iptables -L`, and survive dockerd's own
//! reprogramming of `DOCKER-USER` (it creates the chain but never flushes it).
//!
//! Why accepts there are safe: an accept ends evaluation only for its own base
//! chain, so accepting the agent subnet in iptables' `FORWARD` keeps dockerd's
//! DROP from deciding for us, while kici-scaler's own nft tables (separate
//! base chains on the same hooks) still apply and their drops are final.
//!
//! Each command is argv (no shell), and idempotent: `-C` first, `-I` only when
//! the check fails.

use crate::nft::Runner;
use crate::NetPolicyError;
use ipnet::Ipv4Net;
use kici_model::ids::InstanceId;

/// What [`crate::EgressTable::ensure`] did about `DOCKER-USER`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DockerUserOutcome {
    /// [`crate::DockerUserMode::Leave`]: not looked at.
    NotRequested,
    /// No `DOCKER-USER` chain (no dockerd on this host/namespace): nothing to do.
    NoChain,
    /// Our accepts were inserted now.
    Inserted,
    /// Our accepts were already there.
    AlreadyPresent,
}

/// Whether our accepts for a subnet are in `DOCKER-USER`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DockerUserState {
    /// No `DOCKER-USER` chain (no dockerd): nothing is needed there.
    NoChain,
    Present,
    /// The chain exists (dockerd runs, its FORWARD policy is DROP) and at
    /// least one of our accepts is not in it.
    Missing,
}

/// The comment on our `DOCKER-USER` rules.
pub fn docker_user_comment(instance: InstanceId, subnet: Ipv4Net) -> String {
    format!("kici-scaler:{instance}:subnet {subnet}")
}

/// The rule specs (after the chain name) we keep in `DOCKER-USER`: traffic
/// from the subnet, and replies to it.
fn rule_specs(instance: InstanceId, subnet: Ipv4Net) -> [Vec<String>; 2] {
    rule_specs_tagged(&docker_user_comment(instance, subnet), subnet)
}

fn rule_specs_tagged(comment: &str, subnet: Ipv4Net) -> [Vec<String>; 2] {
    let comment = comment.to_owned();
    let subnet = subnet.to_string();
    [
        vec![
            "-s".into(),
            subnet.clone(),
            "-m".into(),
            "comment".into(),
            "--comment".into(),
            comment.clone(),
            "-j".into(),
            "ACCEPT".into(),
        ],
        vec![
            "-d".into(),
            subnet,
            "-m".into(),
            "conntrack".into(),
            "--ctstate".into(),
            "RELATED,ESTABLISHED".into(),
            "-m".into(),
            "comment".into(),
            "--comment".into(),
            comment,
            "-j".into(),
            "ACCEPT".into(),
        ],
    ]
}

async fn chain_exists(runner: &Runner) -> Result<bool, NetPolicyError> {
    let (listed, _) = runner
        .run(
            "iptables",
            &["-w", "-t", "filter", "-n", "-L", "DOCKER-USER"],
            None,
        )
        .await?;
    Ok(listed.success)
}

pub(crate) async fn ensure_accepts(
    runner: &Runner,
    instance: InstanceId,
    subnet: Ipv4Net,
) -> Result<DockerUserOutcome, NetPolicyError> {
    ensure_specs(runner, rule_specs(instance, subnet)).await
}

/// [`ensure_accepts`] with a comment of the caller's (host provisioning).
pub(crate) async fn ensure_accepts_tagged(
    runner: &Runner,
    comment: &str,
    subnet: Ipv4Net,
) -> Result<DockerUserOutcome, NetPolicyError> {
    ensure_specs(runner, rule_specs_tagged(comment, subnet)).await
}

/// Whether the accepts tagged `comment` are all in `DOCKER-USER` (`-C`).
pub(crate) async fn check_accepts(
    runner: &Runner,
    comment: &str,
    subnet: Ipv4Net,
) -> Result<DockerUserState, NetPolicyError> {
    if !chain_exists(runner).await? {
        return Ok(DockerUserState::NoChain);
    }
    for spec in rule_specs_tagged(comment, subnet) {
        let check: Vec<&str> = ["-w", "-t", "filter", "-C", "DOCKER-USER"]
            .into_iter()
            .chain(spec.iter().map(String::as_str))
            .collect();
        if !runner.run("iptables", &check, None).await?.0.success {
            return Ok(DockerUserState::Missing);
        }
    }
    Ok(DockerUserState::Present)
}

async fn ensure_specs(
    runner: &Runner,
    specs: [Vec<String>; 2],
) -> Result<DockerUserOutcome, NetPolicyError> {
    if !chain_exists(runner).await? {
        return Ok(DockerUserOutcome::NoChain);
    }
    let mut inserted = false;
    for spec in specs {
        let spec: Vec<&str> = spec.iter().map(String::as_str).collect();
        let check: Vec<&str> = ["-w", "-t", "filter", "-C", "DOCKER-USER"]
            .into_iter()
            .chain(spec.iter().copied())
            .collect();
        let (present, _) = runner.run("iptables", &check, None).await?;
        if present.success {
            continue;
        }
        let insert: Vec<&str> = ["-w", "-t", "filter", "-I", "DOCKER-USER"]
            .into_iter()
            .chain(spec.iter().copied())
            .collect();
        runner.run_ok("iptables", &insert, None).await?;
        inserted = true;
    }
    Ok(if inserted {
        DockerUserOutcome::Inserted
    } else {
        DockerUserOutcome::AlreadyPresent
    })
}

/// Deletes our accepts for `subnet` (each as often as it is present).
/// Returns how many rules went.
pub(crate) async fn remove_accepts(
    runner: &Runner,
    instance: InstanceId,
    subnet: Ipv4Net,
) -> Result<usize, NetPolicyError> {
    remove_specs(runner, rule_specs(instance, subnet)).await
}

/// [`remove_accepts`] for the accepts tagged `comment`.
pub(crate) async fn remove_accepts_tagged(
    runner: &Runner,
    comment: &str,
    subnet: Ipv4Net,
) -> Result<usize, NetPolicyError> {
    remove_specs(runner, rule_specs_tagged(comment, subnet)).await
}

async fn remove_specs(runner: &Runner, specs: [Vec<String>; 2]) -> Result<usize, NetPolicyError> {
    let mut removed = 0;
    for spec in specs {
        let spec: Vec<&str> = spec.iter().map(String::as_str).collect();
        let delete: Vec<&str> = ["-w", "-t", "filter", "-D", "DOCKER-USER"]
            .into_iter()
            .chain(spec.iter().copied())
            .collect();
        // -D fails once no such rule is left (or there is no chain): that ends the loop.
        while runner.run("iptables", &delete, None).await?.0.success {
            removed += 1;
        }
    }
    Ok(removed)
}
