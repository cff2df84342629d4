//! Each failpoint fires right after its step's side effect: the error comes
//! back, exactly that side effect is left, and the caller's cleanup
//! (`remove`, `teardown`) releases it. Run with `--features failpoints`.
#![cfg(feature = "failpoints")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::lab;

use kici_model::ids::{AgentId, InstanceId, ScalerType};
use kici_netpolicy::{
    AgentMatch, DockerUserMode, EgressPolicy, EgressTable, NetPolicyError, TableOptions, FAILPOINTS,
};
use lab::Lab;

fn injected(result: Result<impl std::fmt::Debug, NetPolicyError>, name: &str) {
    match result {
        Err(NetPolicyError::Injected(n)) => assert_eq!(n, name),
        other => panic!("{name}: expected the injected failure, got {other:?}"),
    }
}

// One test: the failpoint registry is process-global.
#[tokio::test]
async fn every_failpoint_leaves_exactly_its_side_effect() {
    let scenario = fail::FailScenario::setup();
    let mut lab = Lab::new();
    let a = lab.agent(5);
    let opts = TableOptions {
        gateway_port: Some(9000),
        netns: Some(lab.host.clone()),
        docker_user: DockerUserMode::AcceptSubnet,
        ..TableOptions::default()
    };
    let subnet = lab::SUBNET.parse().unwrap();
    let instance = InstanceId::random();
    let nft_list = || lab::output(&["ip", "netns", "exec", &lab.host, "nft", "list", "ruleset"]);
    assert_eq!(FAILPOINTS.len(), 5);

    fail::cfg("kici_netpolicy::ensure::table", "return").unwrap();
    injected(
        EgressTable::ensure(instance, subnet, opts.clone()).await,
        "kici_netpolicy::ensure::table",
    );
    assert!(
        nft_list().contains(&format!("kici-scaler:{instance}:subnet")),
        "tables were made"
    );
    fail::remove("kici_netpolicy::ensure::table");

    lab::run(&[
        "ip",
        "netns",
        "exec",
        &lab.host,
        "iptables",
        "-w",
        "-N",
        "DOCKER-USER",
    ]);
    fail::cfg("kici_netpolicy::ensure::docker_user", "return").unwrap();
    injected(
        EgressTable::ensure(instance, subnet, opts.clone()).await,
        "kici_netpolicy::ensure::docker_user",
    );
    let docker_user = || {
        lab::output(&[
            "ip",
            "netns",
            "exec",
            &lab.host,
            "iptables",
            "-w",
            "-S",
            "DOCKER-USER",
        ])
    };
    assert!(
        docker_user().contains("kici-scaler"),
        "accepts were inserted"
    );
    fail::remove("kici_netpolicy::ensure::docker_user");

    let table = EgressTable::ensure(instance, subnet, opts).await.unwrap();
    let id = AgentId::random(ScalerType::Container);
    let key = AgentMatch {
        ip: a.ip,
        mac: a.mac,
        port: Some(a.port.clone()),
    };
    fail::cfg("kici_netpolicy::install::applied", "return").unwrap();
    injected(
        table.install(&id, &key, &EgressPolicy::default()).await,
        "kici_netpolicy::install::applied",
    );
    fail::remove("kici_netpolicy::install::applied");
    let owned = table.owned().await.unwrap();
    assert_eq!(owned.len(), 1, "the rules were applied");
    assert!(
        table.remove(&id).await.unwrap() > 0,
        "and the caller's cleanup releases them"
    );
    assert!(table.owned().await.unwrap().is_empty());

    table
        .install(&id, &key, &EgressPolicy::default())
        .await
        .unwrap();
    fail::cfg("kici_netpolicy::remove::deleted", "return").unwrap();
    injected(table.remove(&id).await, "kici_netpolicy::remove::deleted");
    fail::remove("kici_netpolicy::remove::deleted");
    assert!(
        table.owned().await.unwrap().is_empty(),
        "the rules were deleted"
    );
    assert_eq!(table.remove(&id).await.unwrap(), 0);

    table
        .install(&id, &key, &EgressPolicy::default())
        .await
        .unwrap();
    fail::cfg("kici_netpolicy::sweep::deleted", "return").unwrap();
    injected(
        table.sweep_stale(&[]).await,
        "kici_netpolicy::sweep::deleted",
    );
    fail::remove("kici_netpolicy::sweep::deleted");
    assert!(
        table.owned().await.unwrap().is_empty(),
        "the stale rules were deleted"
    );
    assert!(table.sweep_stale(&[]).await.unwrap().is_empty());

    assert_eq!(table.teardown().await.unwrap(), 5);
    assert!(!nft_list().contains(&instance.to_string()));
    assert!(!docker_user().contains("kici-scaler"));
    scenario.teardown();
}
