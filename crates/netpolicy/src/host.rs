//! Host forwarding for an agent bridge: what a host needs so agents on a
//! bridge (the Firecracker bridge) reach the outside at all, independent of
//! any per-agent rule.
//!
//! [`HostForwarding`] owns, for one bridge and its subnet:
//!
//! * `net.ipv4.ip_forward = 1` (set, never reset: other things on the host
//!   may route too);
//! * NAT: in `inet kici_scaler`, base chain [`HOST_NAT_CHAIN`] (hook
//!   `postrouting`, priority `srcnat`), `ip saddr <subnet>` masqueraded when
//!   leaving through the uplink: the one named, else the default route's
//!   interface, else (no default route) any interface but the bridge;
//! * forward accepts: in `inet kici_scaler`, base chain
//!   [`HOST_FORWARD_CHAIN`] (hook `forward`, priority `filter + 10`): what
//!   comes from the bridge and replies going back to it. A separate base
//!   chain after our per-agent `forward` chain: an accept ends only its own
//!   base chain, so these never bypass a per-agent or default drop (a drop is
//!   final), they only say what this host lets through;
//! * where dockerd's `DOCKER-USER` chain exists, accepts for the subnet and
//!   replies to it there (through `iptables`, see [`crate::docker_user`]),
//!   so dockerd's FORWARD DROP policy does not stop the agents.
//!
//! Every rule carries the comment [`host_comment`]`(bridge)` (plus what it
//! is), so provisioning is idempotent (a rule already there is kept, one
//! that no longer matches the settings is replaced), `teardown` removes
//! exactly these and nothing else (per-agent rules of running VMs live in
//! other chains and are never touched), and `check` reads them back.
//! Everything goes through the `nftables` crate's JSON schema.

use crate::docker_user::{self, DockerUserState};
use crate::nft::Runner;
use crate::nftjson::{
    chain, counter, delete_rule, list_chains, matches, meta, payload, rule, v4net, Keep,
};
use crate::{NetPolicyError, TABLE_NAME};
use ipnet::Ipv4Net;
use nftables::batch::Batch;
use nftables::expr::{Expression, MetaKey, NamedExpression, CT};
use nftables::schema::{NfListObject, Table};
use nftables::stmt::{Operator, Statement};
use nftables::types::{NfChainPolicy, NfChainType, NfFamily, NfHook};
use std::time::Duration;

/// Our NAT base chain (in `inet kici_scaler`).
pub const HOST_NAT_CHAIN: &str = "host_postrouting";
/// Our host forward-accept base chain (in `inet kici_scaler`).
pub const HOST_FORWARD_CHAIN: &str = "host_forward";
/// `srcnat`.
const NAT_PRIORITY: i32 = 100;
/// After our per-agent `forward` chain (priority `filter` = 0).
const FORWARD_PRIORITY: i32 = 10;

/// The comment prefix of every host rule for `bridge`.
pub fn host_comment(bridge: &str) -> String {
    format!("kici-scaler:host:{bridge}")
}

/// Where masqueraded traffic leaves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Uplink {
    /// Only through this interface.
    Interface(String),
    /// Through any interface but the bridge (no uplink named, no default route).
    AnyButBridge,
}

impl std::fmt::Display for Uplink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Uplink::Interface(name) => write!(f, "out {name}"),
            Uplink::AnyButBridge => f.write_str("out any"),
        }
    }
}

/// One bridge's host forwarding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostForwarding {
    pub bridge: String,
    /// The agents' subnet on the bridge.
    pub subnet: Ipv4Net,
    /// The interface to masquerade on; `None`: the default route's, or any
    /// but the bridge when there is no default route.
    pub uplink: Option<String>,
    /// Run `nft`/`iptables`/`sysctl`/`ip` inside this named network
    /// namespace; `None` is the caller's own.
    pub netns: Option<String>,
    pub command_timeout: Duration,
}

/// What is in place for one bridge (read back, not assumed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardingStatus {
    pub ip_forward: bool,
    /// Where masquerading should leave (as resolved now).
    pub uplink: Uplink,
    /// Our masquerade rule for the subnet and that uplink is present.
    pub nat: bool,
    /// Both forward accepts are present.
    pub forward_accepts: bool,
    pub docker_user: DockerUserState,
}

impl ForwardingStatus {
    /// Everything needed is in place (a host without `DOCKER-USER` needs
    /// nothing there).
    pub fn healthy(&self) -> bool {
        self.ip_forward
            && self.nat
            && self.forward_accepts
            && self.docker_user != DockerUserState::Missing
    }

    /// What is missing, one line each, for operators.
    pub fn problems(&self, forwarding: &HostForwarding) -> Vec<String> {
        let mut out = Vec::new();
        if !self.ip_forward {
            out.push("IP forwarding is off (net.ipv4.ip_forward is not 1)".to_owned());
        }
        if !self.nat {
            out.push(format!(
                "NAT missing: no masquerade rule for {} {} in {} {TABLE_NAME} {HOST_NAT_CHAIN}",
                forwarding.subnet, self.uplink, "inet"
            ));
        }
        if !self.forward_accepts {
            out.push(format!(
                "forward accepts missing for {} in inet {TABLE_NAME} {HOST_FORWARD_CHAIN}",
                forwarding.bridge
            ));
        }
        if self.docker_user == DockerUserState::Missing {
            out.push(format!(
                "DOCKER-USER accepts missing for {} (dockerd's FORWARD DROP would stop the VMs)",
                forwarding.subnet
            ));
        }
        out
    }
}

/// One rule we keep: its full comment and statements.
struct Wanted {
    comment: String,
    chain: &'static str,
    expr: Vec<Statement<'static>>,
}

fn counted(mut expr: Vec<Statement<'static>>, last: Statement<'static>) -> Vec<Statement<'static>> {
    expr.push(counter());
    expr.push(last);
    expr
}

fn iface(key: MetaKey, op: Operator, name: &str) -> Statement<'static> {
    matches(meta(key), op, Expression::String(name.to_owned().into()))
}

impl HostForwarding {
    fn runner(&self) -> Runner {
        Runner {
            netns: self.netns.clone(),
            timeout: self.command_timeout,
        }
    }

    /// The uplink as configured, else the default route's interface, else
    /// any but the bridge.
    pub async fn resolve_uplink(&self) -> Result<Uplink, NetPolicyError> {
        if let Some(name) = &self.uplink {
            crate::layout::validate_port_name(name)?;
            return Ok(Uplink::Interface(name.clone()));
        }
        let runner = self.runner();
        let shown = "ip -j -4 route show default";
        let out = runner
            .run_ok("ip", &["-j", "-4", "route", "show", "default"], None)
            .await?;
        let routes: Vec<serde_json::Value> = if out.trim().is_empty() {
            Vec::new()
        } else {
            serde_json::from_str(&out).map_err(|source| NetPolicyError::Json {
                command: shown.to_owned(),
                source,
            })?
        };
        let dev = routes
            .iter()
            .filter_map(|r| r.get("dev").and_then(|d| d.as_str()))
            .find(|d| *d != self.bridge);
        Ok(match dev {
            Some(d) => Uplink::Interface(d.to_owned()),
            None => Uplink::AnyButBridge,
        })
    }

    fn wanted(&self, uplink: &Uplink) -> Vec<Wanted> {
        let tag = host_comment(&self.bridge);
        let out = match uplink {
            Uplink::Interface(name) => iface(MetaKey::Oifname, Operator::EQ, name),
            Uplink::AnyButBridge => iface(MetaKey::Oifname, Operator::NEQ, &self.bridge),
        };
        vec![
            Wanted {
                comment: format!("{tag} nat {} {uplink}", self.subnet),
                chain: HOST_NAT_CHAIN,
                expr: counted(
                    vec![
                        matches(payload("ip", "saddr"), Operator::EQ, v4net(self.subnet)),
                        out,
                    ],
                    Statement::Masquerade(None),
                ),
            },
            Wanted {
                comment: format!("{tag} forward from bridge"),
                chain: HOST_FORWARD_CHAIN,
                expr: counted(
                    vec![iface(MetaKey::Iifname, Operator::EQ, &self.bridge)],
                    Statement::Accept(None),
                ),
            },
            Wanted {
                comment: format!("{tag} forward replies"),
                chain: HOST_FORWARD_CHAIN,
                expr: counted(
                    vec![
                        iface(MetaKey::Oifname, Operator::EQ, &self.bridge),
                        matches(
                            Expression::Named(NamedExpression::CT(CT {
                                key: "state".into(),
                                family: None,
                                dir: None,
                            })),
                            Operator::IN,
                            Expression::List(vec![
                                Expression::String("established".into()),
                                Expression::String("related".into()),
                            ]),
                        ),
                    ],
                    Statement::Accept(None),
                ),
            },
        ]
    }

    fn host_chains() -> Vec<(NfFamily, String)> {
        [HOST_NAT_CHAIN, HOST_FORWARD_CHAIN]
            .into_iter()
            .map(|c| (NfFamily::INet, c.to_owned()))
            .collect()
    }

    /// This bridge's rules in our host chains.
    async fn listing(&self, runner: &Runner) -> Result<crate::nftjson::Listing, NetPolicyError> {
        // The trailing space keeps `br1` from matching `br10`'s rules.
        let prefix = format!("{} ", host_comment(&self.bridge));
        list_chains(runner, &Self::host_chains(), Keep::Prefix(prefix)).await
    }

    async fn ip_forward(runner: &Runner) -> Result<bool, NetPolicyError> {
        let out = runner
            .run_ok("sysctl", &["-n", "net.ipv4.ip_forward"], None)
            .await?;
        Ok(out.trim() == "1")
    }

    /// Reads what is in place; changes nothing.
    pub async fn check(&self) -> Result<ForwardingStatus, NetPolicyError> {
        crate::layout::validate_port_name(&self.bridge)?;
        let runner = self.runner();
        let uplink = self.resolve_uplink().await?;
        let listing = self.listing(&runner).await?;
        let present = |w: &Wanted| {
            listing
                .tagged(&w.comment)
                .any(|r| r.family == NfFamily::INet && r.chain == w.chain)
        };
        let wanted = self.wanted(&uplink);
        let nat = wanted
            .iter()
            .filter(|w| w.chain == HOST_NAT_CHAIN)
            .all(present);
        let forward_accepts = wanted
            .iter()
            .filter(|w| w.chain == HOST_FORWARD_CHAIN)
            .all(present);
        let docker_user =
            docker_user::check_accepts(&runner, &host_comment(&self.bridge), self.subnet).await?;
        Ok(ForwardingStatus {
            ip_forward: Self::ip_forward(&runner).await?,
            uplink,
            nat,
            forward_accepts,
            docker_user,
        })
    }

    /// Puts everything in place; idempotent. Rules of this bridge that no
    /// longer match the settings (another uplink, another subnet) are
    /// replaced in the same nft transaction; nothing else is touched.
    pub async fn provision(&self) -> Result<ForwardingStatus, NetPolicyError> {
        crate::layout::validate_port_name(&self.bridge)?;
        let runner = self.runner();
        if !Self::ip_forward(&runner).await? {
            runner
                .run_ok("sysctl", &["-qw", "net.ipv4.ip_forward=1"], None)
                .await?;
        }
        let uplink = self.resolve_uplink().await?;
        let wanted = self.wanted(&uplink);

        let mut skeleton = Batch::new();
        skeleton.add(NfListObject::Table(Table {
            family: NfFamily::INet,
            name: TABLE_NAME.into(),
            handle: None,
        }));
        for (name, kind, hook, prio) in [
            (
                HOST_NAT_CHAIN,
                NfChainType::NAT,
                NfHook::Postrouting,
                NAT_PRIORITY,
            ),
            (
                HOST_FORWARD_CHAIN,
                NfChainType::Filter,
                NfHook::Forward,
                FORWARD_PRIORITY,
            ),
        ] {
            skeleton.add(NfListObject::Chain(nftables::schema::Chain {
                _type: Some(kind),
                hook: Some(hook),
                prio: Some(prio),
                policy: Some(NfChainPolicy::Accept),
                ..chain(NfFamily::INet, name)
            }));
        }
        runner.apply(&skeleton.to_nftables()).await?;

        let listing = self.listing(&runner).await?;
        let mut batch = Batch::new();
        for old in &listing.rules {
            let still_wanted = wanted.iter().any(|w| {
                old.comment.as_deref() == Some(w.comment.as_str()) && old.chain == w.chain
            });
            if !still_wanted {
                batch.delete(delete_rule(old));
            }
        }
        for w in wanted {
            if !listing.tagged(&w.comment).any(|r| r.chain == w.chain) {
                batch.add(rule(NfFamily::INet, w.chain, w.expr, w.comment));
            }
        }
        let batch = batch.to_nftables();
        if !batch.objects.is_empty() {
            runner.apply(&batch).await?;
        }
        docker_user::ensure_accepts_tagged(&runner, &host_comment(&self.bridge), self.subnet)
            .await?;
        tracing::info!(bridge = %self.bridge, subnet = %self.subnet, %uplink, "host forwarding provisioned");
        self.check().await
    }

    /// Removes this bridge's NAT and forward rules (by handle) and its
    /// `DOCKER-USER` accepts; our host chains go too once no rule is left in
    /// them. Leaves `ip_forward` alone. Returns the rules removed.
    pub async fn teardown(&self) -> Result<usize, NetPolicyError> {
        crate::layout::validate_port_name(&self.bridge)?;
        let runner = self.runner();
        let listing = self.listing(&runner).await?;
        let everything = list_chains(&runner, &Self::host_chains(), Keep::All).await?;
        let mut batch = Batch::new();
        for r in &listing.rules {
            batch.delete(delete_rule(r));
        }
        for (family, name) in &everything.chains {
            let others = everything.rules.iter().any(|r| {
                r.chain == *name && !listing.rules.iter().any(|mine| mine.handle == r.handle)
            });
            if !others {
                batch.delete(NfListObject::Chain(chain(*family, name)));
            }
        }
        let batch = batch.to_nftables();
        if !batch.objects.is_empty() {
            runner.apply(&batch).await?;
        }
        let removed = listing.rules.len()
            + docker_user::remove_accepts_tagged(&runner, &host_comment(&self.bridge), self.subnet)
                .await?;
        tracing::info!(bridge = %self.bridge, removed, "host forwarding torn down");
        Ok(removed)
    }
}
