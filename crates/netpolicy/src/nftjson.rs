//! The nftables JSON vocabulary this crate speaks (built with the
//! `nftables` crate's typed schema, never as rule text), and reading our
//! tables back: rules with their handles, comments and counters.

use crate::nft::Runner;
use crate::policy::{PlannedRule, Verdict};
use crate::{NetPolicyError, RuleCounters, TABLE_NAME};
use ipnet::Ipv4Net;
use nftables::expr::{
    Expression, Meta, MetaKey, NamedExpression, Payload, PayloadField, Prefix, CT,
};
use nftables::schema::{Chain, NfListObject, Rule};
use nftables::stmt::{AnonymousCounter, Counter, Match, Operator, Statement};
use nftables::types::{NfChainPolicy, NfChainType, NfFamily};
use std::net::Ipv4Addr;

use crate::layout::BaseChain;

/// A rule as listed, reduced to what this crate reads back.
pub(crate) struct ListedRule {
    pub family: NfFamily,
    pub chain: String,
    pub handle: u32,
    pub comment: Option<String>,
    pub expr: Vec<Statement<'static>>,
}

/// Both tables as listed (`None` for a missing table).
pub(crate) struct Listing {
    pub rules: Vec<ListedRule>,
    pub chains: Vec<(NfFamily, String)>,
}

impl Listing {
    pub fn tagged<'a>(&'a self, tag: &'a str) -> impl Iterator<Item = &'a ListedRule> + 'a {
        self.rules
            .iter()
            .filter(move |r| r.comment.as_deref() == Some(tag))
    }
}

pub(crate) fn family_str(family: NfFamily) -> &'static str {
    match family {
        NfFamily::INet => "inet",
        NfFamily::Bridge => "bridge",
        NfFamily::IP => "ip",
        NfFamily::IP6 => "ip6",
        NfFamily::ARP => "arp",
        NfFamily::NetDev => "netdev",
    }
}

pub(crate) fn chain(family: NfFamily, name: &str) -> Chain<'static> {
    Chain {
        family,
        table: TABLE_NAME.into(),
        name: name.to_owned().into(),
        ..Chain::default()
    }
}

pub(crate) fn base_chain(family: NfFamily, b: &BaseChain) -> Chain<'static> {
    Chain {
        _type: Some(NfChainType::Filter),
        hook: Some(b.hook),
        prio: Some(b.prio),
        policy: Some(NfChainPolicy::Accept),
        ..chain(family, b.name)
    }
}

pub(crate) fn rule(
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

pub(crate) fn delete_rule(r: &ListedRule) -> NfListObject<'static> {
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

pub(crate) fn matches(
    left: Expression<'static>,
    op: Operator,
    right: Expression<'static>,
) -> Statement<'static> {
    Statement::Match(Match { left, right, op })
}

pub(crate) fn payload(protocol: &'static str, field: &'static str) -> Expression<'static> {
    Expression::Named(NamedExpression::Payload(Payload::PayloadField(
        PayloadField {
            protocol: protocol.into(),
            field: field.into(),
        },
    )))
}

pub(crate) fn meta(key: MetaKey) -> Expression<'static> {
    Expression::Named(NamedExpression::Meta(Meta { key }))
}

pub(crate) fn counter() -> Statement<'static> {
    Statement::Counter(Counter::Anonymous(Some(AnonymousCounter::default())))
}

pub(crate) fn v4(ip: Ipv4Addr) -> Expression<'static> {
    Expression::String(ip.to_string().into())
}

pub(crate) fn v4net(net: Ipv4Net) -> Expression<'static> {
    if net.prefix_len() == 32 {
        v4(net.addr())
    } else {
        Expression::Named(NamedExpression::Prefix(Prefix {
            addr: Box::new(v4(net.network())),
            len: u32::from(net.prefix_len()),
        }))
    }
}

pub(crate) fn mac_string(mac: [u8; 6]) -> String {
    let [a, b, c, d, e, f] = mac;
    format!("{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{f:02x}")
}

pub(crate) fn verdict(v: Verdict) -> Statement<'static> {
    match v {
        Verdict::Accept => Statement::Accept(None),
        Verdict::Drop => Statement::Drop(None),
    }
}

/// The nft rules (statement lists) one planned rule becomes.
pub(crate) fn statements(planned: &PlannedRule) -> Vec<Vec<Statement<'static>>> {
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
        PlannedRule::GatewayPort { address, port } => vec![address
            .map(|a| matches(payload("ip", "daddr"), Operator::EQ, v4(a)))
            .into_iter()
            .chain([
                matches(
                    payload("tcp", "dport"),
                    Operator::EQ,
                    Expression::Number(u32::from(port)),
                ),
                counter(),
                Statement::Accept(None),
            ])
            .collect()],
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
        PlannedRule::HostService { net, port } => {
            let to = || net.map(|n| matches(payload("ip", "daddr"), Operator::EQ, v4net(n)));
            let accept = |head: Vec<Statement<'static>>| {
                let mut expr = head;
                expr.extend([counter(), Statement::Accept(None)]);
                expr
            };
            match port {
                None => vec![accept(to().into_iter().collect())],
                Some(port) => ["tcp", "udp"]
                    .into_iter()
                    .map(|proto| {
                        accept(
                            to().into_iter()
                                .chain([matches(
                                    payload(proto, "dport"),
                                    Operator::EQ,
                                    Expression::Number(u32::from(port)),
                                )])
                                .collect(),
                        )
                    })
                    .collect(),
            }
        }
        PlannedRule::Destination { net, verdict: v } => vec![vec![
            matches(payload("ip", "daddr"), Operator::EQ, v4net(net)),
            counter(),
            verdict(v),
        ]],
        PlannedRule::Final(v) => vec![vec![counter(), verdict(v)]],
    }
}

/// The source address of a dispatch rule (`ip saddr X ether saddr M jump …`).
pub(crate) fn dispatch_source(r: &ListedRule) -> Option<Ipv4Addr> {
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

pub(crate) fn sum_counters<'a>(rules: impl Iterator<Item = &'a ListedRule>) -> RuleCounters {
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

/// Which listed rules to read in full (parsing every rule of a busy table
/// into the typed schema costs more than nft's listing itself).
#[derive(Debug, Clone)]
pub(crate) enum Keep {
    All,
    /// Rules with exactly this comment.
    Tag(String),
    /// Rules whose comment starts with this.
    Prefix(String),
}

impl Keep {
    fn keeps(&self, comment: Option<&str>) -> bool {
        match self {
            Keep::All => true,
            Keep::Tag(tag) => comment == Some(tag.as_str()),
            Keep::Prefix(prefix) => comment.is_some_and(|c| c.starts_with(prefix.as_str())),
        }
    }
}

/// Lists the given chains of our tables, concurrently (listing single
/// chains keeps the cost independent of how many agents the other chains
/// hold). A missing chain or table lists as absent.
pub(crate) async fn list_chains(
    runner: &Runner,
    chains: &[(NfFamily, String)],
    keep: Keep,
) -> Result<Listing, NetPolicyError> {
    let mut tasks = tokio::task::JoinSet::new();
    for (family, name) in chains {
        let (runner, family, name) = (runner.clone(), *family, name.clone());
        tasks.spawn(async move {
            runner
                .list(&["chain", family_str(family), TABLE_NAME, &name])
                .await
        });
    }
    let mut listing = Listing {
        rules: Vec::new(),
        chains: Vec::new(),
    };
    while let Some(joined) = tasks.join_next().await {
        let listed = joined.map_err(|e| NetPolicyError::Spawn {
            command: "nft -j list chain".to_owned(),
            source: std::io::Error::other(e),
        })??;
        if let Some((json, shown)) = listed {
            listing.absorb(&json, &shown, &keep)?;
        }
    }
    Ok(listing)
}

/// Lists the names of all chains of our tables (no rules: cheap).
pub(crate) async fn list_chain_names(runner: &Runner) -> Result<Listing, NetPolicyError> {
    let mut listing = Listing {
        rules: Vec::new(),
        chains: Vec::new(),
    };
    for family in [NfFamily::INet, NfFamily::Bridge] {
        if let Some((json, shown)) = runner.list(&["chains", family_str(family)]).await? {
            listing.absorb(&json, &shown, &Keep::All)?;
        }
    }
    Ok(listing)
}

/// `nft -j list` output, one level deep: each object stays raw JSON until
/// [`Keep`] wants it.
#[derive(serde::Deserialize)]
struct RawListing {
    nftables: Vec<serde_json::Map<String, serde_json::Value>>,
}

impl Listing {
    fn absorb(&mut self, json: &str, shown: &str, keep: &Keep) -> Result<(), NetPolicyError> {
        let bad = |source| NetPolicyError::Json {
            command: shown.to_owned(),
            source,
        };
        let raw: RawListing = serde_json::from_str(json).map_err(bad)?;
        for object in raw.nftables {
            let ours =
                |o: &serde_json::Value| o.get("table").and_then(|t| t.as_str()) == Some(TABLE_NAME);
            if let Some(r) = object.get("rule").filter(|r| ours(r)) {
                let comment = r.get("comment").and_then(|c| c.as_str());
                if !keep.keeps(comment) {
                    continue;
                }
                let r: Rule<'static> = serde_json::from_value(r.clone()).map_err(bad)?;
                let Some(handle) = r.handle else { continue };
                self.rules.push(ListedRule {
                    family: r.family,
                    chain: r.chain.to_string(),
                    handle,
                    comment: r.comment.as_ref().map(|c| c.to_string()),
                    expr: r.expr.to_vec(),
                });
            } else if let Some(c) = object.get("chain").filter(|c| ours(c)) {
                let c: Chain<'static> = serde_json::from_value(c.clone()).map_err(bad)?;
                self.chains.push((c.family, c.name.to_string()));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    /// Shaped like `nft -j list chain` output (nft 1.0.6).
    const LISTED: &str = r#"{"nftables": [
      {"metainfo": {"version": "1.0.6", "release_name": "Lester Gooch #5", "json_schema_version": 1}},
      {"chain": {"family": "inet", "table": "kici_scaler", "name": "agents_forward", "handle": 3}},
      {"rule": {"family": "inet", "table": "kici_scaler", "chain": "agents_forward", "handle": 20,
        "comment": "kici-scaler:0a1b2c3d:scaler-container-00000001",
        "expr": [{"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}}, "right": "172.29.0.5"}},
                 {"match": {"op": "==", "left": {"payload": {"protocol": "ether", "field": "saddr"}}, "right": "06:00:ac:1d:00:05"}},
                 {"jump": {"target": "ag-0a1b2c3d-scaler-container-00000001"}}]}},
      {"rule": {"family": "inet", "table": "kici_scaler", "chain": "agents_forward", "handle": 21,
        "comment": "kici-scaler:0a1b2c3d:scaler-container-00000001",
        "expr": [{"match": {"op": "==", "left": {"payload": {"protocol": "ether", "field": "saddr"}}, "right": "06:00:ac:1d:00:05"}},
                 {"counter": {"packets": 3, "bytes": 180}}, {"drop": null}]}},
      {"rule": {"family": "inet", "table": "kici_scaler", "chain": "agents_forward", "handle": 22,
        "comment": "kici-scaler:ffffffff:scaler-container-00000002",
        "expr": [{"counter": {"packets": 7, "bytes": 700}}, {"accept": null}]}},
      {"rule": {"family": "inet", "table": "other", "chain": "agents_forward", "handle": 5,
        "comment": "kici-scaler:0a1b2c3d:scaler-container-00000001",
        "expr": [{"counter": {"packets": 100, "bytes": 100}}, {"drop": null}]}}
    ]}"#;

    fn absorbed(keep: Keep) -> Listing {
        let mut listing = Listing {
            rules: Vec::new(),
            chains: Vec::new(),
        };
        listing.absorb(LISTED, "nft -j list chain", &keep).unwrap();
        listing
    }

    #[test]
    fn keep_filters_before_parsing_and_other_tables_are_ignored() {
        assert_eq!(absorbed(Keep::All).rules.len(), 3);
        let mine = absorbed(Keep::Prefix("kici-scaler:0a1b2c3d:".into()));
        assert_eq!(
            mine.rules.iter().map(|r| r.handle).collect::<Vec<_>>(),
            [20, 21]
        );
        assert_eq!(mine.chains, [(NfFamily::INet, "agents_forward".to_owned())]);
        let one = absorbed(Keep::Tag(
            "kici-scaler:ffffffff:scaler-container-00000002".into(),
        ));
        assert_eq!(one.rules.len(), 1);
    }

    #[test]
    fn sources_and_counters_are_read_back() {
        let listing = absorbed(Keep::All);
        let sources: Vec<_> = listing.rules.iter().filter_map(dispatch_source).collect();
        assert_eq!(sources, [Ipv4Addr::new(172, 29, 0, 5)]);
        let mine = sum_counters(listing.tagged("kici-scaler:0a1b2c3d:scaler-container-00000001"));
        assert_eq!(
            mine,
            RuleCounters {
                dropped_packets: 3,
                dropped_bytes: 180,
                accepted_packets: 0,
                accepted_bytes: 0
            }
        );
        let theirs = sum_counters(listing.tagged("kici-scaler:ffffffff:scaler-container-00000002"));
        assert_eq!((theirs.accepted_packets, theirs.dropped_packets), (7, 0));
    }

    #[test]
    fn garbage_names_the_command() {
        let mut listing = Listing {
            rules: Vec::new(),
            chains: Vec::new(),
        };
        let err = listing
            .absorb("{", "nft -j list chain inet kici_scaler x", &Keep::All)
            .unwrap_err();
        assert!(err
            .to_string()
            .contains("nft -j list chain inet kici_scaler x"));
    }
}
