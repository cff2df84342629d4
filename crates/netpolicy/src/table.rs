//! [`EgressTable`]: kici-scaler's tables on one host (or network namespace),
//! seen by one daemon instance for one agent subnet.

use crate::docker_user::{self, DockerUserOutcome};
use crate::layout::{
    agent_chain_name, agent_chains, agent_comment, agent_input_chain_name, agent_rules,
    base_chains, bridge_comment, dispatch_chains, subnet_comment, validate_port_name, BRIDGE_BASES,
    CHAIN_PREFIX, COMMENT_PREFIX, DISPATCH_COMMENT, INET_BASES, INET_FORWARD, INPUT_SUFFIX,
};
use crate::nft::Runner;
use crate::nftjson::{
    base_chain, chain, counter, delete_rule, dispatch_source, family_str, list_chain_names,
    list_chains, matches, meta, payload, rule, sum_counters, v4net, Keep, ListedRule, Listing,
};
use crate::{EgressPolicy, NetPolicyError, TABLE_NAME};
use ipnet::Ipv4Net;
use kici_model::ids::{AgentId, InstanceId};
use nftables::batch::Batch;
use nftables::expr::{Expression, MetaKey};
use nftables::schema::{FlushObject, NfCmd, NfListObject, Table};
use nftables::stmt::{JumpTarget, Operator, Statement};
use nftables::types::{NfFamily, NfHook};
use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

pub(crate) const FP_ENSURE_TABLE: &str = "kici_netpolicy::ensure::table";
pub(crate) const FP_ENSURE_DOCKER_USER: &str = "kici_netpolicy::ensure::docker_user";
pub(crate) const FP_INSTALL_APPLIED: &str = "kici_netpolicy::install::applied";
pub(crate) const FP_REMOVE_DELETED: &str = "kici_netpolicy::remove::deleted";
pub(crate) const FP_SWEEP_DELETED: &str = "kici_netpolicy::sweep::deleted";

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
    /// The agent gateway's address on the host (the network's gateway). With
    /// it the gateway port is open on that address only; without it, on
    /// every host address.
    pub gateway_address: Option<Ipv4Addr>,
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
            gateway_address: None,
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

/// What one [`EgressTable::install`] created.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstalledRules {
    pub agent: AgentId,
    /// `(family, chain)` of every per-agent chain.
    pub chains: Vec<(String, String)>,
    /// Rules added, in all chains (dispatch and link rules included); what a
    /// later [`EgressTable::remove`] returns.
    pub rules: usize,
}

/// An agent of this instance that has rules in the tables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnedRules {
    pub agent: AgentId,
    /// Source addresses its dispatch rules match.
    pub addresses: Vec<Ipv4Addr>,
    /// Its rules in the shared dispatch chains (its own chains hold the rest;
    /// listing those for every agent would cost a command per chain).
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

/// kici-scaler's tables as one instance uses them for one agent subnet.
#[derive(Debug, Clone)]
pub struct EgressTable {
    instance: InstanceId,
    subnet: Ipv4Net,
    options: TableOptions,
    runner: Runner,
    docker_user: DockerUserOutcome,
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
        // Two backends of one daemon ensuring at once would both see a
        // dispatch jump missing and both insert it (harmless, but untidy).
        static ENSURING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
        let _one_at_a_time = ENSURING.lock().await;
        // `add table` / `add chain` are no-ops for what exists (an existing
        // table must not skip its chains: docs/deviations.md, D-nftables).
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

        let listing = list_chains(&runner, &base_chains(), Keep::All).await?;
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
                    let mut exprs = Vec::with_capacity(4);
                    if b.hook == NfHook::Input {
                        // The host's own connections to its gateway address
                        // leave with that address as source (a health check,
                        // `curl` of the agent gateway) and come back on `lo`,
                        // where no agent can inject a packet.
                        exprs.push(matches(
                            meta(MetaKey::Iifname),
                            Operator::NEQ,
                            Expression::String("lo".into()),
                        ));
                    }
                    exprs.extend([
                        matches(payload("ip", "saddr"), Operator::EQ, v4net(subnet)),
                        counter(),
                        Statement::Drop(None),
                    ]);
                    missing.add(rule(family, b.name, exprs, subnet_tag.clone()));
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
        agent_comment(self.instance, agent)
    }

    /// Installs (or replaces) one agent's rules in one nft transaction. Call
    /// before the agent starts: until then its traffic hits the default drop.
    ///
    /// Rules of another agent of this instance on the same address are stale
    /// (its address was released) and go in the same transaction; on another
    /// instance's address this fails with [`NetPolicyError::AddressClaimed`].
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
        // Every agent has its jumps in inet `agents_forward`: that one chain
        // says who holds the address and whether this is a re-install.
        let mut listing = list_chains(
            &self.runner,
            &[(NfFamily::INet, INET_FORWARD.dispatch.to_owned())],
            Keep::Prefix(COMMENT_PREFIX.to_owned()),
        )
        .await?;
        if listing.tagged(&tag).next().is_some() {
            let rest: Vec<_> = dispatch_chains()
                .into_iter()
                .filter(|(f, c)| !(*f == NfFamily::INet && c == INET_FORWARD.dispatch))
                .collect();
            let more = list_chains(&self.runner, &rest, Keep::Tag(tag.clone())).await?;
            listing.rules.extend(more.rules);
        }
        let mut batch = Batch::new();

        let own_prefix = format!("{COMMENT_PREFIX}{}:", self.instance);
        let holders: std::collections::BTreeSet<&str> = listing
            .rules
            .iter()
            .filter(|r| dispatch_source(r) == Some(key.ip))
            .filter_map(|r| r.comment.as_deref())
            .filter(|c| *c != tag)
            .collect();
        for holder in holders {
            let stale = holder
                .strip_prefix(&own_prefix)
                .and_then(|a| a.parse::<AgentId>().ok());
            match stale {
                Some(stale) => {
                    tracing::warn!(%agent, %stale, ip = %key.ip, "replacing stale egress rules on a reused address");
                    let own = list_chains(
                        &self.runner,
                        &self.chains_of(&stale),
                        Keep::Tag(agent_comment(self.instance, &stale)),
                    )
                    .await?;
                    removal(&own, self.instance, &stale, &mut batch);
                }
                None => {
                    return Err(NetPolicyError::AddressClaimed {
                        ip: key.ip,
                        owner: holder.to_owned(),
                    })
                }
            }
        }

        // Replace: the previous dispatch and link rules go by handle, the
        // agent chains are (re)made and flushed, all in one transaction.
        let (chains, rules) = agent_rules(
            self.instance,
            agent,
            key,
            policy,
            &self.options,
            self.subnet,
        );
        for old in listing.tagged(&tag) {
            if !chains
                .iter()
                .any(|(f, c)| *f == old.family && *c == old.chain)
            {
                batch.delete(delete_rule(old));
            }
        }
        for (family, name) in &chains {
            batch.add(NfListObject::Chain(chain(*family, name)));
            batch.add_cmd(NfCmd::Flush(FlushObject::Chain(chain(*family, name))));
        }
        let count = rules.len();
        for (family, name, expr) in rules {
            batch.add(rule(family, &name, expr, tag.clone()));
        }
        self.runner.apply(&batch.to_nftables()).await?;
        fail::fail_point!(FP_INSTALL_APPLIED, |_| Err(NetPolicyError::Injected(
            FP_INSTALL_APPLIED
        )));
        tracing::debug!(%agent, ip = %key.ip, rules = count, "egress rules installed");
        Ok(InstalledRules {
            agent: *agent,
            chains: chains
                .into_iter()
                .map(|(family, name)| (family_str(family).to_owned(), name))
                .collect(),
            rules: count,
        })
    }

    /// Removes every rule tagged with this instance and `agent` (by handle)
    /// and the agent's chains, in one transaction. Idempotent: returns 0 when
    /// nothing was left.
    pub async fn remove(&self, agent: &AgentId) -> Result<usize, NetPolicyError> {
        let listing = list_chains(
            &self.runner,
            &self.chains_of(agent),
            Keep::Tag(self.agent_comment(agent)),
        )
        .await?;
        let mut batch = Batch::new();
        let removed = removal(&listing, self.instance, agent, &mut batch);
        let batch = batch.to_nftables();
        if !batch.objects.is_empty() {
            self.runner.apply(&batch).await?;
            tracing::debug!(%agent, removed, "egress rules removed");
        }
        fail::fail_point!(FP_REMOVE_DELETED, |_| Err(NetPolicyError::Injected(
            FP_REMOVE_DELETED
        )));
        Ok(removed)
    }

    /// The dispatch chains and `agent`'s own chains: everything its rules are in.
    fn chains_of(&self, agent: &AgentId) -> Vec<(NfFamily, String)> {
        let mut chains = dispatch_chains();
        chains.extend(agent_chains(self.instance, agent));
        chains
    }

    /// Agents of THIS instance with rules in the tables (any subnet).
    pub async fn owned(&self) -> Result<Vec<OwnedRules>, NetPolicyError> {
        Ok(self.owned_in(&self.owned_listing().await?))
    }

    /// This instance's rules in the dispatch chains, and every chain name.
    async fn owned_listing(&self) -> Result<Listing, NetPolicyError> {
        let own_prefix = format!("{COMMENT_PREFIX}{}:", self.instance);
        let mut listing =
            list_chains(&self.runner, &dispatch_chains(), Keep::Prefix(own_prefix)).await?;
        listing
            .chains
            .extend(list_chain_names(&self.runner).await?.chains);
        Ok(listing)
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
        let listing = self.owned_listing().await?;
        let stale: Vec<AgentId> = self
            .owned_in(&listing)
            .into_iter()
            .filter(|owned| {
                let in_subnet = owned.addresses.is_empty()
                    || owned.addresses.iter().any(|a| self.subnet.contains(a));
                in_subnet && !live.contains(&owned.agent)
            })
            .map(|owned| owned.agent)
            .collect();
        if stale.is_empty() {
            return Ok(stale);
        }
        // One transaction for all of them: dispatch rules by handle, then the
        // agents' chains (deleting a chain takes its rules along).
        let mut batch = Batch::new();
        for agent in &stale {
            removal(&listing, self.instance, agent, &mut batch);
        }
        self.runner.apply(&batch.to_nftables()).await?;
        fail::fail_point!(FP_SWEEP_DELETED, |_| Err(NetPolicyError::Injected(
            FP_SWEEP_DELETED
        )));
        tracing::info!(swept = stale.len(), subnet = %self.subnet, "stale egress rules swept");
        Ok(stale)
    }

    /// Counters of `agent`'s rules (this instance's).
    pub async fn counters(&self, agent: &AgentId) -> Result<RuleCounters, NetPolicyError> {
        let listing = list_chains(
            &self.runner,
            &self.chains_of(agent),
            Keep::Tag(self.agent_comment(agent)),
        )
        .await?;
        Ok(sum_counters(listing.tagged(&self.agent_comment(agent))))
    }

    /// Counters of this instance's default drop for the subnet (sources
    /// matching no installed agent).
    pub async fn unmatched_counters(&self) -> Result<RuleCounters, NetPolicyError> {
        let listing = list_chains(&self.runner, &base_chains(), Keep::All).await?;
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
        let listing = list_chains(&self.runner, &base_chains(), Keep::All).await?;
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

/// Adds to `batch` the deletion of every rule of `agent` (by handle) and of
/// its chains (after their rules and the jumps into them: a referenced or
/// non-empty chain cannot go). Returns the number of rules.
fn removal(
    listing: &Listing,
    instance: InstanceId,
    agent: &AgentId,
    batch: &mut Batch<'static>,
) -> usize {
    let mut removed = 0;
    for r in listing.tagged(&agent_comment(instance, agent)) {
        batch.delete(delete_rule(r));
        removed += 1;
    }
    let names = [
        agent_chain_name(instance, agent),
        agent_input_chain_name(instance, agent),
    ];
    for (family, name) in &listing.chains {
        if names.contains(name) {
            batch.delete(NfListObject::Chain(chain(*family, name)));
        }
    }
    removed
}
