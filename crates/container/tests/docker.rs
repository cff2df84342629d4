//! The container backend against the real dockerd (`scripts/dockerd.sh
//! start`). Every test owns an instance id, a network and images named after
//! it, and removes them on drop.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use kici_engine::{Adoption, Backend, BackendReport};
use kici_model::{EffectiveResources, JobId, Secret};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// A safety net for waits on the daemon; never what a test measures.
const PATIENCE: Duration = Duration::from_secs(60);
const GRACE: Duration = Duration::from_secs(1);

async fn next_report(rx: &mut mpsc::UnboundedReceiver<BackendReport>) -> BackendReport {
    tokio::time::timeout(PATIENCE, rx.recv())
        .await
        .expect("a report in time")
        .expect("report channel open")
}

/// Forwarded agent lines (`kici_host::agent_output` events), as
/// (agent id, stream, source, line).
mod capture {
    use std::fmt::Write as _;
    use tokio::sync::mpsc;
    use tracing::field::{Field, Visit};
    use tracing_subscriber::layer::{Context, Layer};

    pub type Line = (String, String, String, String);

    pub struct Capture(pub mpsc::UnboundedSender<Line>);

    #[derive(Default)]
    struct Fields {
        agent: String,
        stream: String,
        source: String,
        line: String,
    }

    impl Visit for Fields {
        fn record_str(&mut self, field: &Field, value: &str) {
            match field.name() {
                "stream" => self.stream = value.to_owned(),
                "source" => self.source = value.to_owned(),
                "line" => self.line = value.to_owned(),
                "agent_id" => self.agent = value.to_owned(),
                _ => {}
            }
        }
        fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
            if field.name() == "agent_id" {
                let _ = write!(self.agent, "{value:?}");
            }
        }
    }

    impl<S: tracing::Subscriber> Layer<S> for Capture {
        fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
            if event.metadata().target() != kici_host::logs::TARGET {
                return;
            }
            let mut f = Fields::default();
            event.record(&mut f);
            let _ = self.0.send((f.agent, f.stream, f.source, f.line));
        }
    }
}

#[tokio::test]
async fn serial_spawn_creates_exactly_the_container_asked_for() {
    use tracing_subscriber::layer::SubscriberExt;
    let _serial = SERIAL.lock().await;
    let (lines_tx, mut lines) = mpsc::unbounded_channel();
    // A current-thread test runtime: every task runs on this thread.
    let _log = tracing::subscriber::set_default(
        tracing_subscriber::registry().with(capture::Capture(lines_tx)),
    );
    let fx = Fixture::with(|o| {
        o.ulimits = vec![
            "nofile=20000:20000".parse().unwrap(),
            "nproc=4096:4096".parse().unwrap(),
        ];
        o.forwarded_env = vec![
            ("KICI_AGENT_ENV_EXTRA".into(), "forwarded".into()),
            ("UNRELATED".into(), "never".into()),
        ];
    })
    .await;
    let image = fx.image(
        "sleeper",
        &[
            "sh",
            "-c",
            "echo started-$KICI_AGENT_ID; echo to-stderr >&2; exec sleep 3600",
        ],
    );
    let yaml = scaler_yaml(
        "boxes",
        &image,
        "    roles: [builder]\n    extraHosts: [\"host.docker.internal:host-gateway\"]",
        "        backpressureMode: drop\n        resources: {cpus: 0.5, memory: 64m}\n        env: {FOO: bar}\n        networkPolicy: {allowlist: [\"192.0.2.7/32\"]}\n        x-kici-scaler: {readOnlyRootfs: true}",
    );
    let scaler = scaler_from_yaml(&yaml, "boxes");
    fx.backend.validate(&scaler).await.unwrap();
    let (mut spec, mut reports) = spawn_spec(&scaler, 0);
    spec.token = Some(Secret::new("kat_0123456789abcdef"));
    spec.job = Some("job-42".parse::<JobId>().unwrap());
    spec.idle_timeout_ms = Some(5000);
    spec.resources = EffectiveResources::resolve(&[spec.label_set.resources.as_ref()]);
    let agent = spec.agent;
    let handle = fx.backend.spawn(spec.clone()).await.unwrap();

    let name = format!("kici-{agent}");
    assert_eq!(handle.extra["name"], name);
    let c = inspect("container", &name).expect("container exists");
    assert_eq!(c["Id"], handle.id.as_str());
    assert_eq!(c["Name"], format!("/{name}"));
    assert_eq!(c["State"]["Running"], true);

    // Exactly our owner labels.
    let labels: serde_json::Map<String, serde_json::Value> =
        c["Config"]["Labels"].as_object().unwrap().clone();
    let expected_labels = serde_json::json!({
        "dev.kici.scaler.instance": fx.instance.to_string(),
        "dev.kici.scaler.scaler": "boxes",
        "dev.kici.scaler.agent": agent.to_string(),
        "dev.kici.scaler.job": "job-42",
    });
    assert_eq!(serde_json::Value::Object(labels), expected_labels);

    // Exactly the contract environment (a FROM scratch image adds none;
    // dockerd adds its default PATH when the image has none).
    let env: BTreeSet<String> = c["Config"]["Env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .filter(|e| e != "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        .collect();
    let expected_env: BTreeSet<String> = [
        format!("KICI_ORCHESTRATOR_URL={}", spec.orchestrator_url),
        format!("KICI_AGENT_ID={agent}"),
        format!("KICI_LABELS={}", spec.agent_labels.join(",")),
        "KICI_SCALER_MANAGED=1".into(),
        "KICI_EXECUTION_MODE=bare-metal".into(),
        "KICI_AGENT_TOKEN=kat_0123456789abcdef".into(),
        "KICI_BACKPRESSURE_MODE=drop".into(),
        "KICI_ROLES=builder".into(),
        "KICI_SCALER_IDLE_TIMEOUT=5000".into(),
        "FOO=bar".into(),
        "EXTRA=forwarded".into(),
    ]
    .into_iter()
    .collect();
    assert_eq!(env, expected_env);
    assert!(spec.agent_labels.iter().any(|l| l == "kici:scaler:boxes"));

    // The image's own command; the token nowhere in argv.
    assert_eq!(
        c["Config"]["Cmd"],
        serde_json::json!([
            "sh",
            "-c",
            "echo started-$KICI_AGENT_ID; echo to-stderr >&2; exec sleep 3600"
        ])
    );
    assert!(c["Config"]["Entrypoint"].is_null());
    assert!(!c["Args"].to_string().contains("kat_"));
    assert!(!c["Path"].to_string().contains("kat_"));

    let h = &c["HostConfig"];
    assert_eq!(h["Memory"], 64 * 1024 * 1024);
    assert_eq!(h["MemorySwap"], 64 * 1024 * 1024);
    assert_eq!(h["NanoCpus"], 500_000_000);
    assert_eq!(h["PidsLimit"], 4096);
    assert_eq!(h["CapDrop"], serde_json::json!(["ALL"]));
    assert!(h["CapAdd"].is_null());
    assert_eq!(h["SecurityOpt"], serde_json::json!(["no-new-privileges"]));
    assert_eq!(h["ReadonlyRootfs"], true);
    assert!(h["Tmpfs"]["/tmp"].is_string());
    assert_eq!(
        h["ExtraHosts"],
        serde_json::json!(["host.docker.internal:host-gateway"])
    );
    assert_eq!(
        h["Ulimits"],
        serde_json::json!([
            {"Name": "nofile", "Soft": 20000, "Hard": 20000},
            {"Name": "nproc", "Soft": 4096, "Hard": 4096}
        ])
    );
    assert!(h["Binds"].is_null());
    // The running process really has no capabilities.
    let status = docker_ok(&["exec", &name, "cat", "/proc/1/status"]);
    for cap in ["CapPrm", "CapEff", "CapBnd"] {
        let line = status
            .lines()
            .find(|l| l.starts_with(cap))
            .unwrap()
            .to_owned();
        assert!(line.ends_with("0000000000000000"), "{line}");
    }
    assert!(status.lines().any(|l| l == "NoNewPrivs:\t1"), "{status}");
    let (writable, _) = docker(&["exec", &name, "touch", "/x"]);
    assert!(!writable, "read-only root");

    // The pinned address from the allocator, on our network.
    let held = fx.held().await;
    assert_eq!(held.len(), 1);
    let (ip, lease_agent) = held[0];
    assert_eq!(lease_agent, agent);
    let net = &c["NetworkSettings"]["Networks"][&fx.options.network.name];
    assert_eq!(net["IPAddress"], ip.to_string());
    assert_eq!(handle.extra["ip"], ip.to_string());
    let nets = c["NetworkSettings"]["Networks"].as_object().unwrap();
    assert_eq!(nets.len(), 1, "only the agent network");

    // Rules were installed, with the pinned address, before start.
    let calls = fx.egress.calls.lock().clone();
    assert_eq!(calls, vec![format!("install {agent}")]);
    let (target, policy) = fx.egress.installed.lock()[&agent].clone();
    assert_eq!(target.ip, ip);
    assert_eq!(target.bridge, fx.options.network.bridge);
    assert_eq!(target.gateway, fx.options.network.pool.gateway());
    assert_eq!(
        policy.unwrap().allowlist,
        vec!["192.0.2.7/32".parse().unwrap()]
    );

    // Output forwarded as bare-metal forwards it: one event per line.
    let mut seen = BTreeSet::new();
    while seen.len() < 2 {
        let (a, stream, source, line) = tokio::time::timeout(PATIENCE, lines.recv())
            .await
            .expect("forwarded output in time")
            .unwrap();
        assert_eq!(a, agent.to_string());
        assert_eq!(source, "docker");
        seen.insert((stream, line));
    }
    assert!(seen.contains(&("stdout".to_owned(), format!("started-{agent}"))));
    assert!(seen.contains(&("stderr".to_owned(), "to-stderr".to_owned())));

    let owned = fx.backend.list_owned().await.unwrap();
    assert_eq!(owned.len(), 1);
    assert_eq!(owned[0].agent, Some(agent));
    assert_eq!(owned[0].handle.id, handle.id);

    fx.backend
        .destroy(&agent, Some(&handle), GRACE)
        .await
        .unwrap();
    assert!(inspect("container", &name).is_none());
    assert!(fx.held().await.is_empty());
    assert!(fx.egress.installed.lock().is_empty());
    assert!(fx.backend.list_owned().await.unwrap().is_empty());
    assert!(
        reports.try_recv().is_err(),
        "a destroyed agent's exit is not reported"
    );
}

/// `x-kici-scaler.ulimits` of the scaler replaces the daemon's default of
/// each name it sets; the other defaults stay.
#[tokio::test]
async fn serial_scaler_ulimits_override_the_daemon_defaults_by_name() {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::with(|o| {
        o.ulimits = vec![
            "nofile=1024:2048".parse().unwrap(),
            "nproc=4096:4096".parse().unwrap(),
        ];
    })
    .await;
    let image = fx.image("sleeper", &["sleep", "3600"]);
    let yaml = scaler_yaml(
        "limited",
        &image,
        "    x-kici-scaler:\n      ulimits:\n        nofile: {soft: 10000, hard: 20000}\n        core: 0",
        "",
    );
    let scaler = scaler_from_yaml(&yaml, "limited");
    let (spec, _reports) = spawn_spec(&scaler, 0);
    let agent = spec.agent;
    let handle = fx.backend.spawn(spec).await.unwrap();
    let name = format!("kici-{agent}");
    let c = inspect("container", &name).expect("container exists");
    assert_eq!(
        c["HostConfig"]["Ulimits"],
        serde_json::json!([
            {"Name": "nproc", "Soft": 4096, "Hard": 4096},
            {"Name": "core", "Soft": 0, "Hard": 0},
            {"Name": "nofile", "Soft": 10000, "Hard": 20000}
        ])
    );
    // The process really runs with them.
    assert_eq!(
        docker_ok(&[
            "exec",
            &name,
            "sh",
            "-c",
            "ulimit -Sn; ulimit -Hn; ulimit -c"
        ]),
        "10000\n20000\n0\n"
    );

    // A scaler without its own keeps the daemon's.
    let plain = scaler_from_yaml(&scaler_yaml("plain", &image, "", ""), "plain");
    let (spec, _plain_reports) = spawn_spec(&plain, 0);
    let plain_agent = spec.agent;
    let plain_handle = fx.backend.spawn(spec).await.unwrap();
    let c = inspect("container", &format!("kici-{plain_agent}")).expect("container exists");
    assert_eq!(
        c["HostConfig"]["Ulimits"],
        serde_json::json!([
            {"Name": "nofile", "Soft": 1024, "Hard": 2048},
            {"Name": "nproc", "Soft": 4096, "Hard": 4096}
        ])
    );

    for (agent, handle) in [(agent, handle), (plain_agent, plain_handle)] {
        fx.backend
            .destroy(&agent, Some(&handle), GRACE)
            .await
            .unwrap();
        assert!(inspect("container", &format!("kici-{agent}")).is_none());
    }
}

#[tokio::test]
async fn serial_exit_and_oom_kill_are_reported() {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let quitter = fx.image("quitter", &["sh", "-c", "echo bye; exit 3"]);
    let hog = fx.image(
        "hog",
        &["sh", "-c", "x=0123456789abcdef; while :; do x=$x$x; done"],
    );
    let yaml = format!(
        "{}\n      - labels: [hog]\n        image: \"{hog}\"\n        imagePullPolicy: Never\n        resources: {{memory: 24m}}\n",
        scaler_yaml("boxes", &quitter, "", "").trim_end()
    );
    let scaler = scaler_from_yaml(&yaml, "boxes");
    let (spec, mut reports) = spawn_spec(&scaler, 0);
    let quitter_agent = spec.agent;
    let h1 = fx.backend.spawn(spec).await.unwrap();
    // What it said last comes with the exit (upstream lost it).
    assert_eq!(
        next_report(&mut reports).await,
        BackendReport::Exited {
            agent: quitter_agent,
            detail: "exit status 3\n--- captured output ---\nbye".into()
        }
    );
    let (mut spec, mut reports) = spawn_spec(&scaler, 1);
    spec.resources = EffectiveResources::resolve(&[spec.label_set.resources.as_ref()]);
    let hog_agent = spec.agent;
    let h2 = fx.backend.spawn(spec).await.unwrap();
    match next_report(&mut reports).await {
        BackendReport::Exited { agent, detail } => {
            assert_eq!(agent, hog_agent);
            assert!(detail.contains("out of memory"), "{detail}");
        }
        other => panic!("unexpected {other:?}"),
    }
    let c = inspect("container", &format!("kici-{hog_agent}")).unwrap();
    assert_eq!(c["State"]["OOMKilled"], true);
    fx.backend
        .destroy(&quitter_agent, Some(&h1), GRACE)
        .await
        .unwrap();
    fx.backend
        .destroy(&hog_agent, Some(&h2), GRACE)
        .await
        .unwrap();
    assert!(fx.containers().is_empty());
    assert!(fx.held().await.is_empty());
}

#[tokio::test]
async fn serial_a_failure_at_each_spawn_step_leaves_nothing() {
    let _serial = SERIAL.lock().await;
    let scenario = fail::FailScenario::setup();
    let fx = Fixture::new().await;
    let image = fx.image("sleeper", &["sleep", "3600"]);
    let scaler = scaler_from_yaml(&scaler_yaml("boxes", &image, "", ""), "boxes");
    fx.backend.validate(&scaler).await.unwrap();
    for step in ["lease", "pull", "create", "rules", "start"] {
        let name = format!("kici_container::spawn::{step}");
        assert!(kici_container::FAILPOINTS.contains(&name.as_str()));
        fail::cfg(&name, "return").unwrap();
        let (spec, _rx) = spawn_spec(&scaler, 0);
        let err = fx.backend.spawn(spec).await.unwrap_err();
        fail::remove(&name);
        assert!(err.to_string().contains(&name), "{step}: {err}");
        assert!(fx.containers().is_empty(), "{step}: container left");
        assert!(fx.held().await.is_empty(), "{step}: lease left");
        assert!(fx.egress.installed.lock().is_empty(), "{step}: rules left");
    }
    // A real Engine error (create refuses an unknown bind mode) too.
    let bad = scaler_from_yaml(
        &scaler_yaml(
            "boxes",
            &image,
            "",
            "        volumes: [\"/tmp:/x:notamode\"]",
        ),
        "boxes",
    );
    let (spec, _rx) = spawn_spec(&bad, 0);
    let err = fx.backend.spawn(spec).await.unwrap_err();
    assert!(err.to_string().contains("POST /containers/create"), "{err}");
    assert!(fx.containers().is_empty());
    assert!(fx.held().await.is_empty());
    // The agent network removed behind our back: that spawn fails, cleanly,
    // and the next one re-creates the network.
    docker_ok(&["network", "rm", &fx.options.network.name]);
    let (spec, _rx) = spawn_spec(&scaler, 0);
    let err = fx.backend.spawn(spec).await.unwrap_err();
    assert!(err.to_string().contains("not found"), "{err}");
    assert!(fx.containers().is_empty());
    assert!(fx.held().await.is_empty());
    // Everything works again afterwards.
    let (spec, _rx) = spawn_spec(&scaler, 0);
    let agent = spec.agent;
    let handle = fx.backend.spawn(spec).await.unwrap();
    fx.backend
        .destroy(&agent, Some(&handle), GRACE)
        .await
        .unwrap();
    assert!(fx.containers().is_empty());
    scenario.teardown();
}

#[tokio::test]
async fn serial_a_failed_destroy_step_is_retried_to_completion() {
    let _serial = SERIAL.lock().await;
    let scenario = fail::FailScenario::setup();
    let fx = Fixture::new().await;
    let image = fx.image("sleeper", &["sleep", "3600"]);
    let scaler = scaler_from_yaml(&scaler_yaml("boxes", &image, "", ""), "boxes");
    for step in ["stop", "remove", "rules", "lease"] {
        let (spec, _rx) = spawn_spec(&scaler, 0);
        let agent = spec.agent;
        let handle = fx.backend.spawn(spec).await.unwrap();
        let name = format!("kici_container::destroy::{step}");
        fail::cfg(&name, "return").unwrap();
        let err = fx
            .backend
            .destroy(&agent, Some(&handle), GRACE)
            .await
            .unwrap_err();
        fail::remove(&name);
        assert!(err.to_string().contains(&name), "{err}");
        // The reconciler's retry, from the handle alone.
        fx.backend
            .destroy(&agent, Some(&handle), GRACE)
            .await
            .unwrap();
        assert!(fx.containers().is_empty(), "{step}");
        assert!(fx.held().await.is_empty(), "{step}");
        assert!(fx.egress.installed.lock().is_empty(), "{step}");
    }
    scenario.teardown();
}

#[tokio::test]
async fn serial_destroy_succeeds_when_the_container_is_already_gone() {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let image = fx.image("sleeper", &["sleep", "3600"]);
    let scaler = scaler_from_yaml(&scaler_yaml("boxes", &image, "", ""), "boxes");
    let (spec, mut reports) = spawn_spec(&scaler, 0);
    let agent = spec.agent;
    let handle = fx.backend.spawn(spec).await.unwrap();
    docker_ok(&["rm", "-f", &format!("kici-{agent}")]);
    // Removed behind our back: the watch reports it.
    match next_report(&mut reports).await {
        BackendReport::Exited { agent: a, .. } => assert_eq!(a, agent),
        other => panic!("unexpected {other:?}"),
    }
    fx.backend
        .destroy(&agent, Some(&handle), GRACE)
        .await
        .unwrap();
    assert!(fx.held().await.is_empty());
    assert!(fx.egress.installed.lock().is_empty());
    // Without a handle, after a restart, for an agent that never existed.
    let restarted = fx.restarted();
    restarted.validate(&scaler).await.unwrap();
    restarted.destroy(&agent, None, GRACE).await.unwrap();
    // A spawn cut short (no handle) is found by name.
    let (spec, _rx) = spawn_spec(&scaler, 0);
    let agent = spec.agent;
    fx.backend.spawn(spec).await.unwrap();
    restarted.destroy(&agent, None, GRACE).await.unwrap();
    assert!(fx.containers().is_empty());
}

#[tokio::test]
async fn serial_each_instance_sees_and_touches_only_its_own_containers() {
    let _serial = SERIAL.lock().await;
    let a = Fixture::new().await;
    // Another daemon on the same dockerd and network, sharing the store.
    let b = Fixture::sharing(&a).await;
    let image = a.image("sleeper", &["sleep", "3600"]);
    let scaler = scaler_from_yaml(&scaler_yaml("boxes", &image, "", ""), "boxes");
    let (spec_a, _ra) = spawn_spec(&scaler, 0);
    let (spec_b, _rb) = spawn_spec(&scaler, 0);
    let (agent_a, agent_b) = (spec_a.agent, spec_b.agent);
    let handle_a = a.backend.spawn(spec_a).await.unwrap();
    let handle_b = b.backend.spawn(spec_b).await.unwrap();
    let owned = |f: &Fixture| {
        let backend = f.backend.clone();
        async move {
            backend
                .list_owned()
                .await
                .unwrap()
                .into_iter()
                .map(|o| o.agent)
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(owned(&a).await, vec![Some(agent_a)]);
    assert_eq!(owned(&b).await, vec![Some(agent_b)]);
    // Instance a asked to destroy b's agent (by id, by name): b's container
    // is not a's to remove.
    a.backend
        .destroy(&agent_b, Some(&handle_b), GRACE)
        .await
        .unwrap();
    a.backend.destroy(&agent_b, None, GRACE).await.unwrap();
    let c = inspect("container", &format!("kici-{agent_b}")).unwrap();
    assert_eq!(c["State"]["Running"], true);
    b.backend
        .destroy(&agent_b, Some(&handle_b), GRACE)
        .await
        .unwrap();
    a.backend
        .destroy(&agent_a, Some(&handle_a), GRACE)
        .await
        .unwrap();
    assert!(a.containers().is_empty() && b.containers().is_empty());
}

#[tokio::test]
async fn serial_a_restarted_daemon_adopts_running_agents() {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let image = fx.image("sleeper", &["sleep", "3600"]);
    let scaler = scaler_from_yaml(&scaler_yaml("boxes", &image, "", ""), "boxes");
    let (spec, _old_reports) = spawn_spec(&scaler, 0);
    let agent = spec.agent;
    let handle = fx.backend.spawn(spec).await.unwrap();

    let restarted = fx.restarted();
    restarted.validate(&scaler).await.unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel();
    assert_eq!(
        restarted.adopt(&agent, &handle, tx.clone()).await.unwrap(),
        Adoption::Alive
    );
    docker_ok(&["kill", &format!("kici-{agent}")]);
    match next_report(&mut rx).await {
        BackendReport::Exited { agent: a, detail } => {
            assert_eq!(a, agent);
            assert!(detail.starts_with("exit status 137"), "{detail}");
        }
        other => panic!("unexpected {other:?}"),
    }
    // Stopped: nothing to watch.
    assert_eq!(
        restarted.adopt(&agent, &handle, tx.clone()).await.unwrap(),
        Adoption::Gone
    );
    restarted
        .destroy(&agent, Some(&handle), GRACE)
        .await
        .unwrap();
    assert_eq!(
        restarted.adopt(&agent, &handle, tx).await.unwrap(),
        Adoption::Gone
    );
    assert!(fx.containers().is_empty());
}

#[tokio::test]
async fn serial_validation_reports_bad_images_networks_and_limits() {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    // Someone else's network under our name, with another subnet.
    let other_subnet = "10.99.0.0/24";
    docker_ok(&[
        "network",
        "create",
        "--subnet",
        other_subnet,
        &fx.options.network.name,
    ]);
    let scaler = scaler_from_yaml(
        &scaler_yaml(
            "boxes",
            "busybox:1",
            "",
            "        resources: {cpus: 256, memory: 1024g}",
        ),
        "boxes",
    );
    let mut entry = (*scaler).clone();
    if let kici_model::LabelSetBackend::Container { image, .. } = &mut entry.label_sets[0].backend {
        *image = "Not An/Image".into();
    }
    let errors = fx.backend.validate(&entry).await.unwrap_err().messages();
    let all = errors.join("\n");
    assert!(
        all.contains("labelSets[0].image: invalid image reference"),
        "{all}"
    );
    assert!(all.contains(&format!("subnet is {other_subnet}")), "{all}");
    assert!(all.contains("enable_icc"), "{all}");
    assert!(all.contains("bridge interface is br-"), "{all}");
    docker_ok(&["network", "rm", &fx.options.network.name]);

    // With the network fixed (created by us), the limits are what's wrong.
    let errors = fx.backend.validate(&scaler).await.unwrap_err().messages();
    let all = errors.join("\n");
    assert!(all.contains("memory limit"), "{all}");
    assert!(all.contains("CPUs exceed"), "{all}");
    assert!(!all.contains("image"), "{all}");
    let net = inspect("network", &fx.options.network.name).unwrap();
    assert_eq!(
        net["Options"]["com.docker.network.bridge.enable_icc"],
        "false"
    );
    assert_eq!(
        net["Options"]["com.docker.network.bridge.name"],
        fx.options.network.bridge.as_str()
    );
    assert_eq!(
        net["IPAM"]["Config"][0]["Subnet"],
        fx.options.network.pool.to_string()
    );
    let check = fx.backend.check_host(&scaler).await;
    assert_eq!(check.runtime, Some(kici_container::RuntimeKind::Docker));
    assert_eq!(check.api_version.as_deref(), Some("1.41"));
    assert!(!check.is_ok());
}

/// `runtime: auto` takes dockerd's socket (probed first, and answering);
/// `runtime: podman` pointed at dockerd's socket is refused naming both.
#[tokio::test]
async fn serial_auto_finds_dockerd_and_a_wrong_runtime_is_named() {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let auto = scaler_from_yaml(
        &scaler_yaml("boxes", "busybox:1", "", "").replace("runtime: docker", "runtime: auto"),
        "boxes",
    );
    let check = fx.backend.check_host(&auto).await;
    assert!(check.is_ok(), "{check:?}");
    assert_eq!(
        check.endpoint.as_deref(),
        Some("unix:///var/run/docker.sock")
    );
    assert_eq!(check.runtime, Some(kici_container::RuntimeKind::Docker));
    assert_eq!(check.api_version.as_deref(), Some("1.41"));
    let wrong = scaler_from_yaml(
        &scaler_yaml(
            "boxes",
            "busybox:1",
            "    socketPath: /var/run/docker.sock",
            "",
        )
        .replace("runtime: docker", "runtime: podman"),
        "boxes",
    );
    let errors = fx
        .backend
        .validate(&wrong)
        .await
        .unwrap_err()
        .messages()
        .join("\n");
    assert!(
        errors.contains(
            "unix:///var/run/docker.sock is docker, but the scaler asks for runtime podman"
        ),
        "{errors}"
    );
}

#[tokio::test]
async fn serial_image_pull_policies() {
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    let image = fx.image("sleeper", &["sleep", "3600"]);
    // Never, absent: a clear error, nothing left.
    let absent = format!("kici-test-absent:{}", fx.instance);
    let yaml = scaler_yaml("boxes", &absent, "", "").replace("IfNotPresent", "Never");
    let scaler = scaler_from_yaml(&yaml, "boxes");
    let (spec, _rx) = spawn_spec(&scaler, 0);
    let err = fx.backend.spawn(spec).await.unwrap_err().to_string();
    assert!(
        err.contains("is not present and imagePullPolicy is Never"),
        "{err}"
    );
    assert!(fx.containers().is_empty() && fx.held().await.is_empty());
    // IfNotPresent, present: no pull (the tag exists nowhere else).
    let scaler = scaler_from_yaml(&scaler_yaml("boxes", &image, "", ""), "boxes");
    let (spec, _rx) = spawn_spec(&scaler, 0);
    let agent = spec.agent;
    let handle = fx.backend.spawn(spec).await.unwrap();
    fx.backend
        .destroy(&agent, Some(&handle), GRACE)
        .await
        .unwrap();
    // Always on a local-only tag: the pull is attempted and fails cleanly.
    let yaml = scaler_yaml("boxes", &image, "", "").replace("IfNotPresent", "Always");
    let scaler = scaler_from_yaml(&yaml, "boxes");
    let (spec, _rx) = spawn_spec(&scaler, 0);
    let err = fx.backend.spawn(spec).await.unwrap_err().to_string();
    assert!(err.starts_with(&format!("pull {image}")), "{err}");
    assert!(fx.containers().is_empty() && fx.held().await.is_empty());
}

#[tokio::test]
async fn serial_egress_rules_exist_before_start_and_go_with_the_agent() {
    use kici_netpolicy::{EgressTable, TableOptions};
    let _serial = SERIAL.lock().await;
    let instance = kici_model::InstanceId::random();
    let network = test_network(instance);
    let table = EgressTable::ensure(
        instance,
        network.pool.network(),
        TableOptions {
            agent_bridge: Some(network.bridge.clone()),
            ..TableOptions::default()
        },
    )
    .await
    .unwrap();
    // Whatever happens below, this instance's rules go at the end.
    struct RulesGuard(EgressTable);
    impl Drop for RulesGuard {
        fn drop(&mut self) {
            let table = self.0.clone();
            let _ = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async {
                    let _ = table.sweep_stale(&[]).await;
                    let _ = table.teardown().await;
                });
            })
            .join();
        }
    }
    let _guard = RulesGuard(table.clone());
    let nft = table.clone();
    let fx = Fixture::on(instance, network, |o| o.egress = Arc::new(nft.clone())).await;
    // 10.255.0.1 is RFC1918: blocked by default. The attempt ends the agent.
    let image = fx.image(
        "prober",
        &[
            "sh",
            "-c",
            "cat /sys/class/net/eth0/address; nc -w 2 10.255.0.1 80 </dev/null; echo rc=$?",
        ],
    );
    let scaler = scaler_from_yaml(&scaler_yaml("boxes", &image, "", ""), "boxes");
    let (spec, mut reports) = spawn_spec(&scaler, 0);
    let agent = spec.agent;
    let handle = fx.backend.spawn(spec).await.unwrap();
    let ip: std::net::Ipv4Addr = handle.extra["ip"].parse().unwrap();
    let owned = table.owned().await.unwrap();
    let mine = owned
        .iter()
        .find(|o| o.agent == agent)
        .expect("rules installed");
    assert_eq!(mine.addresses, vec![ip]);
    match next_report(&mut reports).await {
        BackendReport::Exited { agent: a, detail } => {
            assert_eq!(a, agent);
            assert!(detail.starts_with("exit status 0\n"), "{detail}");
            // stdout and stderr are captured as they come: nc's own
            // complaint may follow the echo.
            assert!(detail.lines().any(|l| l == "rc=1"), "nc failed: {detail}");
        }
        other => panic!("unexpected {other:?}"),
    }
    // Our own rule dropped the attempt (not dockerd's, not another table's).
    let counters = table.counters(&agent).await.unwrap();
    assert!(counters.dropped_packets > 0, "{counters:?}");
    // The MAC the rules are keyed on is the container's.
    let output = docker_ok(&["logs", &format!("kici-{agent}")]);
    assert_eq!(
        output.lines().next(),
        Some(kici_container::agent_mac(ip).to_string().as_str()),
        "{output}"
    );
    fx.backend
        .destroy(&agent, Some(&handle), GRACE)
        .await
        .unwrap();
    assert!(table
        .owned()
        .await
        .unwrap()
        .iter()
        .all(|o| o.agent != agent));
    // Stale rules of an agent whose container vanished are swept.
    let ghost = kici_model::AgentId::random(kici_model::ScalerType::Container);
    let ghost_ip = fx.options.network.pool.assignable().nth(7).unwrap();
    table
        .install(
            &ghost,
            &kici_netpolicy::AgentMatch {
                ip: ghost_ip,
                mac: kici_container::agent_mac(ghost_ip).0,
                port: None,
            },
            &kici_netpolicy::EgressPolicy::from_config(None),
        )
        .await
        .unwrap();
    assert_eq!(fx.backend.sweep_stale_rules().await.unwrap(), vec![ghost]);
    assert!(table.owned().await.unwrap().is_empty());
}

#[tokio::test]
async fn serial_the_agent_image_connects_back_from_its_pinned_address() {
    use tokio::io::AsyncReadExt;
    let _serial = SERIAL.lock().await;
    let fx = Fixture::new().await;
    // The FROM scratch image of scripts/build-test-image.sh: the static
    // kici-agent-lite (built here when missing) plus busybox.
    let tag = format!("kici-test-agent:{}", fx.instance);
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../scripts/build-test-image.sh"
    );
    let out = std::process::Command::new(script)
        .arg(&tag)
        .output()
        .unwrap();
    fx.images.lock().push(tag.clone());
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let scaler = scaler_from_yaml(&scaler_yaml("boxes", &tag, "", ""), "boxes");
    // The network (and its gateway address on the host) exists from here.
    fx.backend.validate(&scaler).await.unwrap();
    let gateway = fx.options.network.pool.gateway();
    let listener = tokio::net::TcpListener::bind((gateway, 0)).await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (mut spec, mut reports) = spawn_spec(&scaler, 0);
    spec.orchestrator_url = format!("ws://{gateway}:{port}/ws");
    spec.token = Some(Secret::new(format!("kat_{}", "0f".repeat(32))));
    let agent = spec.agent;
    let handle = fx.backend.spawn(spec).await.unwrap();
    let accepted = tokio::select! {
        accepted = tokio::time::timeout(PATIENCE, listener.accept()) => accepted.ok(),
        report = reports.recv() => {
            let (_, logs) = docker(&["logs", &format!("kici-{agent}")]);
            panic!("the agent ended ({report:?}) instead of connecting; its output:\n{logs}");
        }
    };
    let Some(accepted) = accepted else {
        let (_, logs) = docker(&["logs", &format!("kici-{agent}")]);
        panic!("the agent did not connect; its output:\n{logs}");
    };
    let (mut conn, peer) = accepted.unwrap();
    assert_eq!(peer.ip().to_string(), handle.extra["ip"]);
    let mut request = Vec::new();
    let mut buf = [0u8; 1024];
    while !request.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tokio::time::timeout(PATIENCE, conn.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "connection closed before the request ended");
        request.extend_from_slice(&buf[..n]);
    }
    let request = String::from_utf8_lossy(&request).to_ascii_lowercase();
    assert!(request.starts_with("get /ws http/1.1"), "{request}");
    assert!(request.contains("upgrade: websocket"), "{request}");
    assert!(!request.contains("kat_"), "the token is not in the URL");
    drop(conn);
    fx.backend
        .destroy(&agent, Some(&handle), GRACE)
        .await
        .unwrap();
    assert!(fx.containers().is_empty());
    assert!(fx.held().await.is_empty());
    assert!(reports.try_recv().is_err());
}
