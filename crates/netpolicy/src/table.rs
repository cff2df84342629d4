//! [`EgressTable`]: kici-scaler's tables on one host (or network namespace),
//! seen by one daemon instance for one agent subnet.

use crate::docker_user::{self, DockerUserOutcome};
use crate::nft::Runner;
use crate::policy::{plan, Hook, PlannedRule, Verdict};
use crate::{EgressPolicy, NetPolicyError, TABLE_NAME};
use ipnet::Ipv4Net;
use kici_model::ids::{AgentId, InstanceId};
use nftables::batch::Batch;
use nftables::expr::{
    Expression, Meta, MetaKey, NamedExpression, Payload, PayloadField, Prefix, CT,
};
use nftables::schema::{Chain, FlushObject, NfCmd, NfListObject, NfObject, Rule, Table};
use nftables::stmt::{AnonymousCounter, Counter, JumpTarget, Match, Operator, Statement};
use nftables::types::{NfChainPolicy, NfChainType, NfFamily, NfHook};
use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

pub(crate) const FP_ENSURE_TABLE: &str = "netpolicy::ensure::table";
pub(crate) const FP_ENSURE_DOCKER_USER: &str = "netpolicy::ensure::docker_user";
pub(crate) const FP_INSTALL_APPLIED: &str = "netpolicy::install::applied";
pub(crate) const FP_REMOVE_DELETED: &str = "netpolicy::remove::deleted";

/// Whether [`EgressTable::ensure`] adds accepts for the subnet to dockerd's
/// `DOCKER-USER` chain (see [`crate::docker_user`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DockerUserMode {
    /// Leave `DOCKER-USER` alone (the container backend: dockerd already
    /// accepts its own network's egress, and its `enable_icc=false` drop is one
    /// more wall between agents).
    #[default]
    Leave,
    /// Accept the subnet's traffic and its replies where dockerd's FORWARD
    /// DROP would otherwise apply (a Firecracker bridge on a host running
    /// dockerd). A no-op ([`DockerUserOutcome::NoChain`]) without dockerd.
    AcceptSubnet,
}

/// Table-wide settings of one instance's subnet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableOptions {
    /// The agent gateway's TCP port on the host: the one thing on the host an
    /// agent may reach (also under `denyAll`).
    pub gateway_port: Option<u16>,
    /// DNS resolvers agents use. One at a private address gets a udp/tcp 53
    /// exception; one on the host itself is reachable through the input hook.
    pub resolvers: Vec<IpAddr>,
    /// Filter traffic from agents to the host's own addresses (input hook).
    /// Off only for hosts whose services must all be reachable from agents.
    pub protect_host: bool,
    pub docker_user: DockerUserMode,
    /// The bridge the agents hang off (`kici-scaler-net`'s, the Firecracker
    /// bridge). When set, routed traffic arriving from it that matches no
    /// installed agent drops too, whatever its source address: an agent that
    /// changed both its MAC and its address to something outside the subnet
    /// still fails closed. (Bridged port-to-port frames cannot be matched by
    /// bridge name on every kernel; a [`AgentMatch::port`] binding covers
    /// those.)
    pub agent_bridge: Option<String>,
    /// Run `nft`/`iptables` inside this named network namespace
    /// (`ip netns exec <name> …`); `None` is the daemon's own namespace.
    pub netns: Option<String>,
    /// Bound on every `nft`/`iptables` command.
    pub command_timeout: Duration,
}

impl Default for TableOptions {
    fn default() -> Self {
        Self {
            gateway_port: None,
            resolvers: Vec::new(),
            protect_host: true,
            docker_user: DockerUserMode::Leave,
            agent_bridge: None,
            netns: None,
            command_timeout: Duration::from_secs(10),
        }
    }
}

/// How an agent's packets are recognised. The pair `ip` + `mac` keys every
/// dispatch rule, so a packet with the agent's MAC but another source
/// address, or the agent's address from another MAC, drops. `port` (a
/// Firecracker TAP) additionally binds both to that bridge port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentMatch {
    pub ip: Ipv4Addr,
    /// The agent's MAC (`kici_store::ipam::MacAddress::for_ip(ip).0`).
    pub mac: [u8; 6],
    /// The host-side interface the agent's frames arrive on, when it is known
    /// before the agent starts (a TAP; a container's veth is not).
    pub port: Option<String>,
}

/// Chains and handles one [`EgressTable::install`] created.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstalledRules {
    pub agent: AgentId,
    /// `(family, chain)` of every per-agent chain.
    pub chains: Vec<(String, String)>,
    /// Rules added, in all chains (dispatch rules included).
    pub rules: usize,
}

/// An agent of this instance that has rules in the tables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnedRules {
    pub agent: AgentId,
    /// Source addresses its dispatch rules match.
    pub addresses: Vec<Ipv4Addr>,
    /// Tagged rules (per-agent chains and dispatch).
    pub rules: usize,
}

/// Packets and bytes that went through kici-scaler's own rules of one agent
/// (or of the subnet's default drop), summed over both tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RuleCounters {
    pub dropped_packets: u64,
    pub dropped_bytes: u64,
    pub accepted_packets: u64,
    pub accepted_bytes: u64,
}

/// The per-agent chain name: `ag-<instance>-<agent id>` (the input-hook chain
/// adds `-in`). Unique across instances sharing the tables.
pub fn agent_chain_name(instance: InstanceId, agent: &AgentId) -> String {
    format!("ag-{instance}-{agent}")
}

/// kici-scaler's tables as one instance uses them for one agent subnet.
#[derive(Debug, Clone)]
pub struct EgressTable {
    instance: InstanceId,
    subnet: Ipv4Net,
    options: TableOptions,
    runner: Runner,
    docker_user: DockerUserOutcome,
}

/// A rule as listed, reduced to what this crate reads back.
struct ListedRule {
    family: NfFamily,
    chain: String,
    handle: u32,
    comment: Option<String>,
    expr: Vec<Statement<'static>>,
}

/// Both tables as listed (`None` for a missing table).
struct Listing {
    rules: Vec<ListedRule>,
    chains: Vec<(NfFamily, String)>,
}

impl Listing {
    fn tagged<'a>(&'a self, tag: &'a str) -> impl Iterator<Item = &'a ListedRule> + 'a {
        self.rules
            .iter()
            .filter(move |r| r.comment.as_deref() == Some(tag))
    }
}

impl EgressTable {
    /// Creates (idempotently) both tables, their base chains and dispatch
    /// chains, and the subnet's default drop; then handles `DOCKER-USER` as
    /// [`TableOptions::docker_user`] says.
    pub async fn ensure(
        instance: InstanceId,
        subnet: Ipv4Net,
        options: TableOptions,
    ) -> Result<Self, NetPolicyError> {
        let subnet = subnet.trunc();
        if let Some(bridge) = &options.agent_bridge {
            validate_port_name(bridge)?;
        }
        let runner = Runner {
            netns: options.netns.clone(),
            timeout: options.command_timeout,
        };
        // `add table` / `add chain` are no-ops for what exists (upstream B20:
        // an existing table must not skip its chains).
        let mut skeleton = Batch::new();
        for (family, base) in [
            (NfFamily::INet, INET_BASES),
            (NfFamily::Bridge, BRIDGE_BASES),
        ] {
            skeleton.add(NfListObject::Table(Table {
                family,
                name: TABLE_NAME.into(),
                handle: None,
            }));
            for b in base {
                skeleton.add(NfListObject::Chain(base_chain(family, b)));
                skeleton.add(NfListObject::Chain(chain(family, b.dispatch)));
            }
        }
        runner.apply(&skeleton.to_nftables()).await?;

        let listing = list(&runner).await?;
        let subnet_tag = subnet_comment(instance, subnet);
        let mut missing = Batch::new();
        for (family, base) in [
            (NfFamily::INet, INET_BASES),
            (NfFamily::Bridge, BRIDGE_BASES),
        ] {
            for b in base {
                let in_base = |tag: &str| {
                    listing
                        .tagged(tag)
                        .any(|r| r.family == family && r.chain == b.name)
                };
                if !in_base(DISPATCH_COMMENT) {
                    // Head of the chain: the jump must precede every default drop.
                    missing.add_cmd(NfCmd::Insert(rule(
                        family,
                        b.name,
                        vec![Statement::Jump(JumpTarget {
                            target: b.dispatch.into(),
                        })],
                        DISPATCH_COMMENT.to_owned(),
                    )));
                }
                if b.subnet_drop && !in_base(&subnet_tag) {
                    missing.add(rule(
                        family,
                        b.name,
                        vec![
                            matches(payload("ip", "saddr"), Operator::EQ, v4net(subnet)),
                            counter(),
                            Statement::Drop(None),
                        ],
                        subnet_tag.clone(),
                    ));
                }
                let bridge = options
                    .agent_bridge
                    .as_ref()
                    .filter(|_| family == NfFamily::INet);
                if let Some(bridge) = bridge {
                    let tag = bridge_comment(instance, subnet, bridge);
                    if !in_base(&tag) {
                        missing.add(rule(
                            family,
                            b.name,
                            vec![
                                matches(
                                    meta(MetaKey::Iifname),
                                    Operator::EQ,
                                    Expression::String(bridge.clone().into()),
                                ),
                                counter(),
                                Statement::Drop(None),
                            ],
                            tag,
                        ));
                    }
                }
            }
        }
        let missing = missing.to_nftables();
        if !missing.objects.is_empty() {
            runner.apply(&missing).await?;
        }
        fail::fail_point!(FP_ENSURE_TABLE, |_| Err(NetPolicyError::Injected(
            FP_ENSURE_TABLE
        )));

        let docker_user = match options.docker_user {
            DockerUserMode::Leave => DockerUserOutcome::NotRequested,
            DockerUserMode::AcceptSubnet => {
                docker_user::ensure_accepts(&runner, instance, subnet).await?
            }
        };
        fail::fail_point!(FP_ENSURE_DOCKER_USER, |_| Err(NetPolicyError::Injected(
            FP_ENSURE_DOCKER_USER
        )));
        tracing::debug!(%instance, %subnet, ?docker_user, "egress tables ensured");
        Ok(Self {
            instance,
            subnet,
            options,
            runner,
            docker_user,
        })
    }

    pub fn instance(&self) -> InstanceId {
        self.instance
    }

    pub fn subnet(&self) -> Ipv4Net {
        self.subnet
    }

    pub fn options(&self) -> &TableOptions {
        &self.options
    }

    /// What `ensure` did about `DOCKER-USER`.
    pub fn docker_user(&self) -> DockerUserOutcome {
        self.docker_user
    }

    /// The comment every rule of `agent` carries: `kici-scaler:<instance>:<agent id>`.
    pub fn agent_comment(&self, agent: &AgentId) -> String {
        format!("{COMMENT_PREFIX}{}:{agent}", self.instance)
    }

    /// Installs (or replaces) one agent's rules in one nft transaction. Call
    /// before the agent starts: until then its traffic hits the default drop.
    pub async fn install(
        &self,
        agent: &AgentId,
        key: &AgentMatch,
        policy: &EgressPolicy,
    ) -> Result<InstalledRules, NetPolicyError> {
        if !self.subnet.contains(&key.ip) {
            return Err(NetPolicyError::AddressOutsideSubnet {
                ip: key.ip,
                subnet: self.subnet,
            });
        }
        if let Some(port) = &key.port {
            validate_port_name(port)?;
        }
        let tag = self.agent_comment(agent);
        let forward_chain = agent_chain_name(self.instance, agent);
        let input_chain = format!("{forward_chain}{INPUT_SUFFIX}");
        let listing = list(&self.runner).await?;

        let mut batch = Batch::new();
        // Replace: the previous dispatch and port rules go by handle, the
        // agent chains are flushed, all in the same transaction.
        let own_chains = [forward_chain.as_str(), input_chain.as_str()];
        for old in listing.tagged(&tag) {
            if !own_chains.contains(&old.chain.as_str()) {
                batch.delete(delete_rule(old));
            }
        }
        let agent_chains = [
            (NfFamily::INet, forward_chain.as_str(), Hook::Forward),
            (NfFamily::INet, input_chain.as_str(), Hook::Input),
            (
                NfFamily::Bridge,
                forward_chain.as_str(),
                Hook::BridgeForward,
            ),
        ];
        let mut rules = 0;
        for (family, name, hook) in agent_chains {
            batch.add(NfListObject::Chain(chain(family, name)));
            batch.add_cmd(NfCmd::Flush(FlushObject::Chain(chain(family, name))));
            let planned = plan(
                policy,
                hook,
                self.options.gateway_port,
                &self.options.resolvers,
                self.options.protect_host,
            );
            for expr in planned.iter().flat_map(statements) {
                batch.add(rule(family, name, expr, tag.clone()));
                rules += 1;
            }
        }
        let ip = || v4(key.ip);
        let mac = || Expression::String(mac_string(key.mac).into());
        let dispatch = [
            (
                NfFamily::INet,
                INET_FORWARD.dispatch,
                forward_chain.as_str(),
            ),
            (NfFamily::INet, INET_INPUT.dispatch, input_chain.as_str()),
            (
                NfFamily::Bridge,
                BRIDGE_FORWARD.dispatch,
                forward_chain.as_str(),
            ),
        ];
        for (family, dispatch_chain, target) in dispatch {
            let mut own_mac_other_ip =
                vec![matches(payload("ether", "saddr"), Operator::EQ, mac())];
            if family == NfFamily::Bridge {
                // ARP between bridge ports is how an allowlisted neighbour is reached.
                own_mac_other_ip.push(matches(
                    payload("ether", "type"),
                    Operator::NEQ,
                    Expression::String("arp".into()),
                ));
            }
            own_mac_other_ip.extend([counter(), Statement::Drop(None)]);
            for expr in [
                vec![
                    matches(payload("ip", "saddr"), Operator::EQ, ip()),
                    matches(payload("ether", "saddr"), Operator::EQ, mac()),
                    Statement::Jump(JumpTarget {
                        target: target.to_owned().into(),
                    }),
                ],
                own_mac_other_ip,
                vec![
                    matches(payload("ip", "saddr"), Operator::EQ, ip()),
                    counter(),
                    Statement::Drop(None),
                ],
            ] {
                batch.add(rule(family, dispatch_chain, expr, tag.clone()));
                rules += 1;
            }
        }
        // ARP binding, port or not: nobody else may claim the agent's
        // address, and the agent may claim no other (0.0.0.0 is a probe).
        for expr in [
            vec![
                matches(payload("arp", "saddr ip"), Operator::EQ, ip()),
                matches(payload("ether", "saddr"), Operator::NEQ, mac()),
                counter(),
                Statement::Drop(None),
            ],
            vec![
                matches(payload("ether", "saddr"), Operator::EQ, mac()),
                matches(payload("arp", "saddr ip"), Operator::NEQ, ip()),
                matches(
                    payload("arp", "saddr ip"),
                    Operator::NEQ,
                    v4(Ipv4Addr::UNSPECIFIED),
                ),
                counter(),
                Statement::Drop(None),
            ],
        ] {
            batch.add(rule(
                NfFamily::Bridge,
                BRIDGE_PREROUTING.dispatch,
                expr,
                tag.clone(),
            ));
            rules += 1;
        }
        if let Some(port) = &key.port {
            let on_port = |op| {
                matches(
                    meta(MetaKey::Iifname),
                    op,
                    Expression::String(port.clone().into()),
                )
            };
            let drop = |mut expr: Vec<Statement<'static>>| {
                expr.extend([counter(), Statement::Drop(None)]);
                expr
            };
            for expr in [
                // The port speaks only as the agent...
                drop(vec![
                    on_port(Operator::EQ),
                    matches(payload("ether", "saddr"), Operator::NEQ, mac()),
                ]),
                drop(vec![
                    on_port(Operator::EQ),
                    matches(payload("ip", "saddr"), Operator::NEQ, ip()),
                ]),
                drop(vec![
                    on_port(Operator::EQ),
                    matches(payload("arp", "saddr ip"), Operator::NEQ, ip()),
                ]),
                drop(vec![
                    on_port(Operator::EQ),
                    matches(
                        meta(MetaKey::Protocol),
                        Operator::NEQ,
                        Expression::String("ip".into()),
                    ),
                    matches(
                        meta(MetaKey::Protocol),
                        Operator::NEQ,
                        Expression::String("arp".into()),
                    ),
                ]),
                // ...and the agent speaks only on its port.
                drop(vec![
                    on_port(Operator::NEQ),
                    matches(payload("ether", "saddr"), Operator::EQ, mac()),
                ]),
                drop(vec![
                    on_port(Operator::NEQ),
                    matches(payload("ip", "saddr"), Operator::EQ, ip()),
                ]),
                drop(vec![
                    on_port(Operator::NEQ),
                    matches(payload("arp", "saddr ip"), Operator::EQ, ip()),
                ]),
            ] {
                batch.add(rule(
                    NfFamily::Bridge,
                    BRIDGE_PREROUTING.dispatch,
                    expr,
                    tag.clone(),
                ));
                rules += 1;
            }
        }
        self.runner.apply(&batch.to_nftables()).await?;
        fail::fail_point!(FP_INSTALL_APPLIED, |_| Err(NetPolicyError::Injected(
            FP_INSTALL_APPLIED
        )));
        tracing::debug!(%agent, ip = %key.ip, rules, "egress rules installed");
        Ok(InstalledRules {
            agent: *agent,
            chains: agent_chains
                .iter()
                .map(|(family, name, _)| (family_str(*family).to_owned(), (*name).to_owned()))
                .collect(),
            rules,
        })
    }

    /// Removes every rule tagged with this instance and `agent` (by handle)
    /// and the agent's chains, in one transaction. Idempotent: returns 0 when
    /// nothing was left.
    pub async fn remove(&self, agent: &AgentId) -> Result<usize, NetPolicyError> {
        let listing = list(&self.runner).await?;
        let removed = self.remove_listed(&listing, agent).await?;
        fail::fail_point!(FP_REMOVE_DELETED, |_| Err(NetPolicyError::Injected(
            FP_REMOVE_DELETED
        )));
        Ok(removed)
    }

    async fn remove_listed(
        &self,
        listing: &Listing,
        agent: &AgentId,
    ) -> Result<usize, NetPolicyError> {
        let tag = self.agent_comment(agent);
        let forward_chain = agent_chain_name(self.instance, agent);
        let input_chain = format!("{forward_chain}{INPUT_SUFFIX}");
        let mut batch = Batch::new();
        let mut removed = 0;
        for r in listing.tagged(&tag) {
            batch.delete(delete_rule(r));
            removed += 1;
        }
        // Chains after their rules (and after the jumps into them): a chain
        // that is referenced or not empty cannot go.
        for (family, name) in &listing.chains {
            if *name == forward_chain || *name == input_chain {
                batch.delete(NfListObject::Chain(chain(*family, name)));
            }
        }
        let batch = batch.to_nftables();
        if !batch.objects.is_empty() {
            self.runner.apply(&batch).await?;
            tracing::debug!(%agent, removed, "egress rules removed");
        }
        Ok(removed)
    }

    /// Agents of THIS instance with rules in the tables (any subnet).
    pub async fn owned(&self) -> Result<Vec<OwnedRules>, NetPolicyError> {
        let listing = list(&self.runner).await?;
        Ok(self.owned_in(&listing))
    }

    fn owned_in(&self, listing: &Listing) -> Vec<OwnedRules> {
        let mut by_agent: BTreeMap<AgentId, OwnedRules> = BTreeMap::new();
        let own_prefix = format!("{COMMENT_PREFIX}{}:", self.instance);
        for r in &listing.rules {
            let Some(agent) = r
                .comment
                .as_deref()
                .and_then(|c| c.strip_prefix(&own_prefix))
                .and_then(|a| a.parse::<AgentId>().ok())
            else {
                continue;
            };
            let owned = by_agent.entry(agent).or_insert_with(|| OwnedRules {
                agent,
                addresses: Vec::new(),
                rules: 0,
            });
            owned.rules += 1;
            if let Some(ip) = dispatch_source(r) {
                if !owned.addresses.contains(&ip) {
                    owned.addresses.push(ip);
                }
            }
        }
        // An agent chain without tagged rules (emptied by hand) is ours too.
        let chain_prefix = format!("{CHAIN_PREFIX}{}-", self.instance);
        for (_, name) in &listing.chains {
            let Some(agent) = name
                .strip_prefix(&chain_prefix)
                .map(|a| a.strip_suffix(INPUT_SUFFIX).unwrap_or(a))
                .and_then(|a| a.parse::<AgentId>().ok())
            else {
                continue;
            };
            by_agent.entry(agent).or_insert_with(|| OwnedRules {
                agent,
                addresses: Vec::new(),
                rules: 0,
            });
        }
        by_agent.into_values().collect()
    }

    /// Removes the rules of this instance's agents in this subnet that are
    /// not in `live`, so a reused address never inherits an old allowlist.
    /// Never touches another instance's rules. Returns the agents swept.
    pub async fn sweep_stale(&self, live: &[AgentId]) -> Result<Vec<AgentId>, NetPolicyError> {
        let listing = list(&self.runner).await?;
        let mut swept = Vec::new();
        for owned in self.owned_in(&listing) {
            let in_subnet = owned.addresses.is_empty()
                || owned.addresses.iter().any(|a| self.subnet.contains(a));
            if live.contains(&owned.agent) || !in_subnet {
                continue;
            }
            self.remove_listed(&listing, &owned.agent).await?;
            swept.push(owned.agent);
        }
        if !swept.is_empty() {
            tracing::info!(swept = swept.len(), subnet = %self.subnet, "stale egress rules swept");
        }
        Ok(swept)
    }

    /// Counters of `agent`'s rules (this instance's).
    pub async fn counters(&self, agent: &AgentId) -> Result<RuleCounters, NetPolicyError> {
        let listing = list(&self.runner).await?;
        Ok(sum_counters(listing.tagged(&self.agent_comment(agent))))
    }

    /// Counters of this instance's default drop for the subnet (sources
    /// matching no installed agent).
    pub async fn unmatched_counters(&self) -> Result<RuleCounters, NetPolicyError> {
        let listing = list(&self.runner).await?;
        Ok(sum_counters(self.subnet_rules(&listing)))
    }

    /// This instance's subnet-level rules (default drops).
    fn subnet_rules<'a>(&self, listing: &'a Listing) -> impl Iterator<Item = &'a ListedRule> + 'a {
        let subnet = subnet_comment(self.instance, self.subnet);
        let bridge = self
            .options
            .agent_bridge
            .as_ref()
            .map(|b| bridge_comment(self.instance, self.subnet, b));
        listing.rules.iter().filter(move |r| {
            r.comment
                .as_deref()
                .is_some_and(|c| c == subnet || Some(c) == bridge.as_deref())
        })
    }

    /// Removes this instance's subnet-level rules (default drops, and its
    /// `DOCKER-USER` accepts when [`DockerUserMode::AcceptSubnet`]). Agent
    /// rules are left to [`Self::remove`] and [`Self::sweep_stale`]; after
    /// this the subnet no longer fails closed. Returns the rules removed.
    pub async fn teardown(&self) -> Result<usize, NetPolicyError> {
        let listing = list(&self.runner).await?;
        let mut batch = Batch::new();
        let mut removed = 0;
        for r in self.subnet_rules(&listing) {
            batch.delete(delete_rule(r));
            removed += 1;
        }
        let batch = batch.to_nftables();
        if !batch.objects.is_empty() {
            self.runner.apply(&batch).await?;
        }
        if self.options.docker_user == DockerUserMode::AcceptSubnet {
            removed +=
                docker_user::remove_accepts(&self.runner, self.instance, self.subnet).await?;
        }
        Ok(removed)
    }
}

const COMMENT_PREFIX: &str = "kici-scaler:";
const DISPATCH_COMMENT: &str = "kici-scaler:dispatch";
const CHAIN_PREFIX: &str = "ag-";
const INPUT_SUFFIX: &str = "-in";

fn subnet_comment(instance: InstanceId, subnet: Ipv4Net) -> String {
    format!("{COMMENT_PREFIX}{instance}:subnet {subnet}")
}

fn bridge_comment(instance: InstanceId, subnet: Ipv4Net, bridge: &str) -> String {
    format!("{COMMENT_PREFIX}{instance}:subnet {subnet} bridge {bridge}")
}

/// A base chain of ours and the regular chain it jumps to first.
struct BaseChain {
    name: &'static str,
    hook: NfHook,
    prio: i32,
    dispatch: &'static str,
    /// Whether the base chain ends with the subnet's default drop.
    subnet_drop: bool,
}

// Priority 0 is `filter` for inet, -200 is `filter` for bridge.
const INET_FORWARD: BaseChain = BaseChain {
    name: "forward",
    hook: NfHook::Forward,
    prio: 0,
    dispatch: "agents_forward",
    subnet_drop: true,
};
const INET_INPUT: BaseChain = BaseChain {
    name: "input",
    hook: NfHook::Input,
    prio: 0,
    dispatch: "agents_input",
    subnet_drop: true,
};
const BRIDGE_PREROUTING: BaseChain = BaseChain {
    name: "prerouting",
    hook: NfHook::Prerouting,
    prio: -200,
    dispatch: "agents_link",
    subnet_drop: false,
};
const BRIDGE_FORWARD: BaseChain = BaseChain {
    name: "forward",
    hook: NfHook::Forward,
    prio: -200,
    dispatch: "agents_forward",
    subnet_drop: true,
};
const INET_BASES: &[BaseChain] = &[INET_FORWARD, INET_INPUT];
const BRIDGE_BASES: &[BaseChain] = &[BRIDGE_PREROUTING, BRIDGE_FORWARD];

fn family_str(family: NfFamily) -> &'static str {
    match family {
        NfFamily::INet => "inet",
        NfFamily::Bridge => "bridge",
        NfFamily::IP => "ip",
        NfFamily::IP6 => "ip6",
        NfFamily::ARP => "arp",
        NfFamily::NetDev => "netdev",
    }
}

fn chain(family: NfFamily, name: &str) -> Chain<'static> {
    Chain {
        family,
        table: TABLE_NAME.into(),
        name: name.to_owned().into(),
        ..Chain::default()
    }
}

fn base_chain(family: NfFamily, b: &BaseChain) -> Chain<'static> {
    Chain {
        _type: Some(NfChainType::Filter),
        hook: Some(b.hook),
        prio: Some(b.prio),
        policy: Some(NfChainPolicy::Accept),
        ..chain(family, b.name)
    }
}

fn rule(
    family: NfFamily,
    chain: &str,
    expr: Vec<Statement<'static>>,
    comment: String,
) -> NfListObject<'static> {
    NfListObject::Rule(Rule {
        family,
        table: TABLE_NAME.into(),
        chain: chain.to_owned().into(),
        expr: expr.into(),
        handle: None,
        index: None,
        comment: Some(comment.into()),
    })
}

fn delete_rule(r: &ListedRule) -> NfListObject<'static> {
    NfListObject::Rule(Rule {
        family: r.family,
        table: TABLE_NAME.into(),
        chain: r.chain.clone().into(),
        expr: Vec::new().into(),
        handle: Some(r.handle),
        index: None,
        comment: None,
    })
}

fn matches(
    left: Expression<'static>,
    op: Operator,
    right: Expression<'static>,
) -> Statement<'static> {
    Statement::Match(Match { left, right, op })
}

fn payload(protocol: &'static str, field: &'static str) -> Expression<'static> {
    Expression::Named(NamedExpression::Payload(Payload::PayloadField(
        PayloadField {
            protocol: protocol.into(),
            field: field.into(),
        },
    )))
}

fn meta(key: MetaKey) -> Expression<'static> {
    Expression::Named(NamedExpression::Meta(Meta { key }))
}

fn counter() -> Statement<'static> {
    Statement::Counter(Counter::Anonymous(Some(AnonymousCounter::default())))
}

fn v4(ip: Ipv4Addr) -> Expression<'static> {
    Expression::String(ip.to_string().into())
}

fn v4net(net: Ipv4Net) -> Expression<'static> {
    if net.prefix_len() == 32 {
        v4(net.addr())
    } else {
        Expression::Named(NamedExpression::Prefix(Prefix {
            addr: Box::new(v4(net.network())),
            len: u32::from(net.prefix_len()),
        }))
    }
}

fn mac_string(mac: [u8; 6]) -> String {
    let [a, b, c, d, e, f] = mac;
    format!("{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{f:02x}")
}

fn verdict(v: Verdict) -> Statement<'static> {
    match v {
        Verdict::Accept => Statement::Accept(None),
        Verdict::Drop => Statement::Drop(None),
    }
}

/// The nft rules (statement lists) one planned rule becomes.
fn statements(planned: &PlannedRule) -> Vec<Vec<Statement<'static>>> {
    match *planned {
        PlannedRule::Dns { resolver } => ["udp", "tcp"]
            .into_iter()
            .map(|proto| {
                vec![
                    matches(payload("ip", "daddr"), Operator::EQ, v4(resolver)),
                    matches(
                        payload(proto, "dport"),
                        Operator::EQ,
                        Expression::Number(53),
                    ),
                    counter(),
                    Statement::Accept(None),
                ]
            })
            .collect(),
        PlannedRule::GatewayPort { port } => vec![vec![
            matches(
                payload("tcp", "dport"),
                Operator::EQ,
                Expression::Number(u32::from(port)),
            ),
            counter(),
            Statement::Accept(None),
        ]],
        PlannedRule::Established => vec![vec![
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
            counter(),
            Statement::Accept(None),
        ]],
        PlannedRule::Destination { net, verdict: v } => vec![vec![
            matches(payload("ip", "daddr"), Operator::EQ, v4net(net)),
            counter(),
            verdict(v),
        ]],
        PlannedRule::Final(v) => vec![vec![counter(), verdict(v)]],
    }
}

/// Linux interface names: 1 to 15 bytes, no '/', whitespace or NUL.
fn validate_port_name(name: &str) -> Result<(), NetPolicyError> {
    let ok = !name.is_empty()
        && name.len() <= 15
        && name != "."
        && name != ".."
        && !name
            .bytes()
            .any(|b| b == b'/' || b == 0 || b.is_ascii_whitespace() || b == b'*');
    if ok {
        Ok(())
    } else {
        Err(NetPolicyError::InvalidPortName(name.to_owned()))
    }
}

/// The source address of a dispatch rule (`ip saddr X ether saddr M jump …`).
fn dispatch_source(r: &ListedRule) -> Option<Ipv4Addr> {
    if !r.expr.iter().any(|s| matches!(s, Statement::Jump(_))) {
        return None;
    }
    r.expr.iter().find_map(|s| match s {
        Statement::Match(Match {
            left: Expression::Named(NamedExpression::Payload(Payload::PayloadField(f))),
            right: Expression::String(addr),
            op: Operator::EQ,
        }) if f.protocol == "ip" && f.field == "saddr" => addr.parse().ok(),
        _ => None,
    })
}

fn sum_counters<'a>(rules: impl Iterator<Item = &'a ListedRule>) -> RuleCounters {
    let mut sum = RuleCounters::default();
    for r in rules {
        let (packets, bytes) = r
            .expr
            .iter()
            .find_map(|s| match s {
                Statement::Counter(Counter::Anonymous(Some(c))) => {
                    Some((c.packets.unwrap_or(0) as u64, c.bytes.unwrap_or(0) as u64))
                }
                _ => None,
            })
            .unwrap_or((0, 0));
        if r.expr.iter().any(|s| matches!(s, Statement::Drop(_))) {
            sum.dropped_packets += packets;
            sum.dropped_bytes += bytes;
        } else if r.expr.iter().any(|s| matches!(s, Statement::Accept(_))) {
            sum.accepted_packets += packets;
            sum.accepted_bytes += bytes;
        }
    }
    sum
}

/// Lists both tables (a missing one lists as empty).
async fn list(runner: &Runner) -> Result<Listing, NetPolicyError> {
    let mut listing = Listing {
        rules: Vec::new(),
        chains: Vec::new(),
    };
    for family in [NfFamily::INet, NfFamily::Bridge] {
        let Some(tables) = runner.list_table(family_str(family), TABLE_NAME).await? else {
            continue;
        };
        for object in tables.objects.iter() {
            match object {
                NfObject::ListObject(NfListObject::Rule(r)) => {
                    let Some(handle) = r.handle else { continue };
                    listing.rules.push(ListedRule {
                        family: r.family,
                        chain: r.chain.to_string(),
                        handle,
                        comment: r.comment.as_ref().map(|c| c.to_string()),
                        expr: r.expr.to_vec(),
                    });
                }
                NfObject::ListObject(NfListObject::Chain(c)) => {
                    listing.chains.push((c.family, c.name.to_string()));
                }
                _ => {}
            }
        }
    }
    Ok(listing)
}
