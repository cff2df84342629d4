//! End to end through the Backend trait: real TAP, bridge and ext4 overlay
//! (root, unique names), a fake jailer and Firecracker stand-in. Host-global:
//! every test here is `serial_*`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use kici_engine::{Adoption, Backend, BackendReport};
use kici_firecracker::names::{owner_tag, tap_name};
use kici_firecracker::tap::{self, Netlink};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;
use support::{process_running, random_agent, Harness};

/// The next report; a missing one fails the test instead of hanging it.
async fn recv(rx: &mut tokio::sync::mpsc::UnboundedReceiver<BackendReport>) -> BackendReport {
    tokio::time::timeout(Duration::from_secs(60), rx.recv())
        .await
        .expect("no report within 60 s")
        .expect("report channel closed")
}

fn calls(h: &Harness, agent: &kici_model::AgentId) -> Vec<String> {
    h.api_calls(agent)
        .iter()
        .map(|c| {
            format!(
                "{} {}",
                c["method"].as_str().unwrap(),
                c["path"].as_str().unwrap()
            )
        })
        .filter(|c| c != "GET /")
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serial_firecracker_spawn_configures_over_the_api_and_destroy_leaves_nothing() {
    let h = Harness::new("        env:\n          FOO: bar").await;
    let agent = random_agent();
    let (spec, mut reports) = h.spec(agent);
    let handle = h.backend.spawn(spec).await.unwrap();
    let tap = tap_name(&agent);
    assert_eq!(handle.id, agent.to_string());
    assert_eq!(handle.extra["tap"], tap);

    // The calls, in order, all before InstanceStart.
    assert_eq!(
        calls(&h, &agent),
        [
            "PUT /boot-source",
            "PUT /drives/rootfs",
            "PUT /drives/overlay",
            "PUT /network-interfaces/eth0",
            "PUT /machine-config",
            "PUT /logger",
            "PUT /metrics",
            "PUT /serial",
            "PUT /mmds/config",
            "PUT /mmds",
            "PUT /actions",
        ]
    );
    let api = h.api_calls(&agent);
    let body = |path: &str| api.iter().find(|c| c["path"] == path).unwrap()["body"].clone();
    let ip = h.allocator.leases.lock()[0].ip;
    assert_eq!(
        body("/boot-source")["boot_args"]
            .as_str()
            .unwrap()
            .rsplit(' ')
            .next()
            .unwrap(),
        format!("ip={ip}::{}:255.255.255.0::eth0:off", h.network.gateway)
    );
    assert_eq!(body("/mmds/config")["version"], "V2");
    assert_eq!(
        body("/mmds/config")["network_interfaces"],
        serde_json::json!(["eth0"])
    );
    assert_eq!(
        body("/network-interfaces/eth0")["host_dev_name"],
        tap.as_str()
    );
    assert_eq!(
        body("/machine-config"),
        serde_json::json!({"vcpu_count": 2, "mem_size_mib": 512, "smt": false})
    );
    assert_eq!(
        body("/actions"),
        serde_json::json!({"action_type": "InstanceStart"})
    );
    let meta = body("/mmds")["latest"]["meta-data"].clone();
    assert_eq!(meta["kici-agent-id"], agent.to_string());
    assert_eq!(meta["kici-agent-token"], "kat_test_token");
    assert_eq!(meta["kici-gateway-ip"], h.network.gateway.to_string());
    assert_eq!(
        meta["kici-env"],
        serde_json::json!({"FOO": "bar", "HTTP_PROXY": "http://proxy:3128"})
    );

    // The guest got its bootstrap from MMDS (V2) before it ran.
    let serial = h.serial(&agent);
    assert!(serial.contains("mmds-v2=True"), "{serial}");
    assert!(
        serial.contains(&format!("\"KICI_AGENT_ID\": \"{agent}\"")),
        "{serial}"
    );

    // TAP: owned by the jailer user, isolated port of the bridge, tagged, up.
    let link = Netlink::connect()
        .unwrap()
        .get(&tap)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        link.alias.as_deref(),
        Some(owner_tag(h.instance, &agent).as_str())
    );
    assert_eq!(link.isolated, Some(true));
    assert!(link.up);
    assert_eq!(
        std::fs::read_to_string(format!("/sys/class/net/{tap}/owner"))
            .unwrap()
            .trim(),
        "10000"
    );
    // Rules installed for the VM's IP, MAC and TAP.
    let (vm, _) = h.egress.installed.lock()[&agent].clone();
    assert_eq!((vm.ip, vm.tap.as_str()), (ip, tap.as_str()));
    // Owner marker and the VMM's identity beside the jail.
    assert_eq!(
        std::fs::read_to_string(h.vm_dir(&agent).join(".kici-owner"))
            .unwrap()
            .trim(),
        owner_tag(h.instance, &agent)
    );
    let pid = h.vmm_pid(&agent).unwrap();
    assert!(process_running(pid));
    assert_eq!(h.backend.tracked(), [agent]);

    // config.ack: MMDS cleared through the API and read back.
    h.backend
        .clear_mmds(&agent, Duration::from_secs(5))
        .await
        .unwrap();
    let last = h.api_calls(&agent);
    assert_eq!(
        last[last.len() - 2]["body"],
        serde_json::json!({"latest": {"meta-data": {}}})
    );
    assert_eq!(last[last.len() - 1]["path"], "/mmds");

    // list_owned sees it.
    let owned = h.backend.list_owned().await.unwrap();
    assert!(owned.iter().any(|o| o.agent == Some(agent)));

    h.backend
        .destroy(&agent, Some(&handle), Duration::from_secs(10))
        .await
        .unwrap();
    // Ctrl-Alt-Del was sent and the "guest" powered off by itself.
    assert!(h.serial(&agent).is_empty() || !h.vm_dir(&agent).exists());
    h.assert_nothing_left(&agent).await;
    assert!(h.backend.tracked().is_empty());
    // The exit destroy caused is not reported as an agent exit.
    assert!(reports.try_recv().is_err());
    // Destroying again (or without a handle) is a no-op.
    h.backend
        .destroy(&agent, None, Duration::from_secs(1))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serial_firecracker_exit_and_boot_failure_are_reported_and_adopt_follows_the_vmm() {
    let h = Harness::new("        env:\n          FAKE_GUEST_PANIC: '1'").await;
    let agent = random_agent();
    let (spec, mut reports) = h.spec(agent);
    let handle = h.backend.spawn(spec).await.unwrap();
    match recv(&mut reports).await {
        BackendReport::BootFailure { agent: a, detail } => {
            assert_eq!(a, agent);
            assert!(detail.starts_with("rootfs-mount-failure"), "{detail}");
        }
        other => panic!("{other:?}"),
    }

    // A second backend (a restarted daemon) adopts the running VM by the
    // recorded pid + start time, and sees it exit.
    let (tx, mut adopted_reports) = tokio::sync::mpsc::unbounded_channel();
    let other =
        kici_firecracker::FirecrackerBackend::new(kici_firecracker::FirecrackerOptions::new(
            h.instance,
            h.network.clone(),
            h.allocator.clone(),
            h.egress.clone(),
            vec![],
        ))
        .unwrap();
    assert_eq!(
        other.adopt(&agent, &handle, tx.clone()).await.unwrap(),
        Adoption::Alive
    );
    // A recorded start time that does not match is not our VM.
    let mut stale = handle.clone();
    let pid = h.vmm_pid(&agent).unwrap();
    stale.extra.insert("vmm".into(), format!("pid:{pid}:1"));
    let unknown = random_agent();
    assert_eq!(
        other.adopt(&unknown, &stale, tx).await.unwrap(),
        Adoption::Gone
    );

    std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    // The adopted watch re-reads the serial log from its start
    // (at-least-once), so it may see the boot failure again first.
    let mut next = recv(&mut adopted_reports).await;
    if matches!(next, BackendReport::BootFailure { .. }) {
        next = recv(&mut adopted_reports).await;
    }
    assert!(
        matches!(next, BackendReport::Exited { agent: a, .. } if a == agent),
        "{next:?}"
    );
    assert!(
        matches!(recv(&mut reports).await, BackendReport::Exited { agent: a, .. } if a == agent)
    );

    // Destroy after the VMM is gone still removes everything, and kills
    // nothing (the pid is no longer ours).
    other
        .destroy(&agent, Some(&handle), Duration::from_secs(1))
        .await
        .unwrap();
    h.backend
        .destroy(&agent, Some(&handle), Duration::from_secs(1))
        .await
        .unwrap();
    h.assert_nothing_left(&agent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serial_firecracker_jailer_failure_releases_everything() {
    let h = Harness::new("").await;
    // A jailer that fails after starting nothing.
    std::fs::write(
        h.dir.path().join("bin/jailer"),
        "#!/bin/sh\necho 'jailer: bad uid' >&2\nexit 3\n",
    )
    .unwrap();
    let agent = random_agent();
    let (spec, _rx) = h.spec(agent);
    let err = h.backend.spawn(spec).await.unwrap_err();
    assert!(err.to_string().contains("jailer: bad uid"), "{err}");
    h.assert_nothing_left(&agent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serial_firecracker_sweep_removes_exactly_the_planted_orphans() {
    let h = Harness::new("").await;
    let netlink = Netlink::connect().unwrap();
    let old = std::time::SystemTime::now() - Duration::from_secs(3600);

    // A live VM: never touched.
    let live = random_agent();
    let (spec, _rx) = h.spec(live);
    h.backend.spawn(spec).await.unwrap();

    // An old orphaned VM directory of ours (with a lease).
    let orphan_dir = random_agent();
    let dir = h.vm_dir(&orphan_dir);
    std::fs::create_dir_all(dir.join("root")).unwrap();
    std::fs::write(dir.join(".kici-owner"), owner_tag(h.instance, &orphan_dir)).unwrap();
    std::fs::File::open(dir.join(".kici-owner"))
        .unwrap()
        .set_modified(old)
        .unwrap();
    let pool = kici_store::ipam::Ipv4Pool::new(h.network.cidr).unwrap();
    use kici_store::ipam::IpAllocator;
    h.allocator.allocate(&pool, &orphan_dir).await.unwrap();

    // A young one (an in-flight spawn of another process): kept.
    let young = random_agent();
    let ydir = h.vm_dir(&young);
    std::fs::create_dir_all(&ydir).unwrap();
    std::fs::write(ydir.join(".kici-owner"), owner_tag(h.instance, &young)).unwrap();

    // Another instance's directory, old: kept.
    let foreign = random_agent();
    let fdir = h.vm_dir(&foreign);
    std::fs::create_dir_all(&fdir).unwrap();
    std::fs::write(
        fdir.join(".kici-owner"),
        owner_tag("01234567".parse().unwrap(), &foreign),
    )
    .unwrap();
    std::fs::File::open(fdir.join(".kici-owner"))
        .unwrap()
        .set_modified(old)
        .unwrap();

    // A TAP with our alias, unknown agent, no directory: removed.
    let orphan_tap = random_agent();
    let otap = tap_name(&orphan_tap);
    tap::create_tap(&otap, 10000, 10000).unwrap();
    netlink
        .attach_tap(
            &otap,
            &h.network.bridge_name,
            &owner_tag(h.instance, &orphan_tap),
        )
        .await
        .unwrap();
    // Another instance's TAP: kept.
    let foreign_tap = random_agent();
    let ftap = tap_name(&foreign_tap);
    tap::create_tap(&ftap, 10000, 10000).unwrap();
    netlink
        .attach_tap(
            &ftap,
            &h.network.bridge_name,
            &owner_tag("01234567".parse().unwrap(), &foreign_tap),
        )
        .await
        .unwrap();

    let report = h.backend.sweep(&HashSet::new()).await;
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(report.vms, [orphan_dir]);
    assert_eq!(report.taps, std::slice::from_ref(&otap));
    assert!(!dir.exists());
    assert!(!h.link_exists(&otap).await);
    assert!(!h
        .allocator
        .leases
        .lock()
        .iter()
        .any(|l| l.agent == orphan_dir));

    // Untouched: the live VM, the young dir, the foreign ones, the bridge.
    assert!(h.link_exists(&tap_name(&live)).await);
    assert!(h.vm_dir(&live).exists());
    assert!(ydir.exists() && fdir.exists());
    assert!(h.link_exists(&ftap).await);
    assert!(h.link_exists(&h.network.bridge_name).await);
    assert!(h.egress.installed.lock().contains_key(&live));

    netlink.delete(&ftap).await.unwrap();
    h.backend
        .destroy(&live, None, Duration::from_secs(5))
        .await
        .unwrap();
    h.assert_nothing_left(&live).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serial_firecracker_sweep_removes_a_recorded_vm_whose_process_is_gone() {
    let h = Harness::new("").await;
    let agent = random_agent();
    let (spec, _rx) = h.spec(agent);
    let handle = h.backend.spawn(spec).await.unwrap();
    // The daemon restarts: a new backend that follows nothing; the VM died
    // while no daemon ran; its owner marker is old.
    let pid = h.vmm_pid(&agent).unwrap();
    std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    let fresh = kici_firecracker::FirecrackerBackend::new({
        let mut o = kici_firecracker::FirecrackerOptions::new(
            h.instance,
            h.network.clone(),
            h.allocator.clone(),
            h.egress.clone(),
            vec![],
        );
        o.sweep_min_age = Duration::from_secs(60);
        o
    })
    .unwrap();
    h.backend.register_layout(&h.layout());
    fresh.register_layout(&h.layout());
    let marker = h.vm_dir(&agent).join(".kici-owner");
    std::fs::File::open(&marker)
        .unwrap()
        .set_modified(std::time::SystemTime::now() - Duration::from_secs(3600))
        .unwrap();
    // Until the process is really gone (a zombie counts as gone), a
    // recorded VM is left to adoption.
    let known: HashSet<_> = [agent].into();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while process_running(pid) && std::time::Instant::now() < deadline {
        tokio::task::yield_now().await;
    }
    let report = fresh.sweep(&known).await;
    assert_eq!(report.vms, [agent], "{report:?}");
    h.assert_nothing_left(&agent).await;
    // The old backend's destroy is then a no-op.
    h.backend
        .destroy(&agent, Some(&handle), Duration::from_secs(1))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serial_firecracker_periodic_sweep_skips_ticks_the_store_cannot_answer() {
    let h = Harness::new("").await;
    let agent = random_agent();
    let (spec, _rx) = h.spec(agent);
    h.backend.spawn(spec).await.unwrap();
    // A restart: the fresh backend follows nothing; the VM died meanwhile.
    let pid = h.vmm_pid(&agent).unwrap();
    std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    let fresh = kici_firecracker::FirecrackerBackend::new({
        let mut o = kici_firecracker::FirecrackerOptions::new(
            h.instance,
            h.network.clone(),
            h.allocator.clone(),
            h.egress.clone(),
            vec![],
        );
        o.sweep_min_age = Duration::from_secs(60);
        o
    })
    .unwrap();
    fresh.register_layout(&h.layout());
    std::fs::File::open(h.vm_dir(&agent).join(".kici-owner"))
        .unwrap()
        .set_modified(std::time::SystemTime::now() - Duration::from_secs(3600))
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while process_running(pid) && std::time::Instant::now() < deadline {
        tokio::task::yield_now().await;
    }
    // Three ticks the store cannot answer, then it answers "no agents".
    let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (first_answer_tx, first_answer_rx) = tokio::sync::oneshot::channel::<bool>();
    let first_answer_tx = Arc::new(parking_lot::Mutex::new(Some(first_answer_tx)));
    let dir = h.vm_dir(&agent);
    let task = fresh.spawn_periodic_sweep(Duration::from_millis(20), {
        let asked = asked.clone();
        move || {
            let n = asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if n == 3 {
                // Whether the skipped ticks left the orphan alone.
                if let Some(tx) = first_answer_tx.lock().take() {
                    let _ = tx.send(dir.exists());
                }
            }
            async move { (n >= 3).then(HashSet::new) }
        }
    });
    assert!(
        first_answer_rx.await.unwrap(),
        "a tick without the store's answer swept"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while h.vm_dir(&agent).exists() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    task.abort();
    h.assert_nothing_left(&agent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serial_firecracker_host_network_provisions_checks_and_tears_down_only_its_bridge() {
    let h = Harness::new("").await;
    let host = kici_firecracker::HostNetwork {
        network: &h.network,
    };
    let status = host.check().await.unwrap();
    assert!(status.healthy() && status.tagged, "{status:?}");
    assert!(status.problems(&h.network).is_empty());
    // Idempotent: provisioning again changes nothing and keeps the ports.
    let live = random_agent();
    let (spec, _rx) = h.spec(live);
    let handle = h.backend.spawn(spec).await.unwrap();
    assert!(host.provision().await.unwrap().healthy());
    let port = Netlink::connect()
        .unwrap()
        .get(&tap_name(&live))
        .await
        .unwrap()
        .unwrap();
    assert!(port.controller.is_some());
    h.backend
        .destroy(&live, Some(&handle), Duration::from_secs(5))
        .await
        .unwrap();

    // A bridge of the same name not created by us is never torn down.
    let mut foreign = h.network.clone();
    foreign.bridge_name = format!("kfx{}", &h.network.bridge_name[3..]);
    let other = kici_firecracker::HostNetwork { network: &foreign };
    assert!(!other.check().await.unwrap().exists);
    assert!(other.check().await.unwrap().problems(&foreign)[0].contains("does not exist"));
    std::process::Command::new("ip")
        .args(["link", "add", &foreign.bridge_name, "type", "bridge"])
        .status()
        .unwrap();
    let status = other.check().await.unwrap();
    assert!(status.exists && !status.tagged && !status.gateway_assigned);
    assert!(!other.teardown().await.unwrap());
    assert!(h.link_exists(&foreign.bridge_name).await);
    Netlink::connect()
        .unwrap()
        .delete(&foreign.bridge_name)
        .await
        .unwrap();

    assert!(host.teardown().await.unwrap());
    assert!(!host.check().await.unwrap().exists);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serial_firecracker_validate_names_every_problem() {
    let h = Harness::new("").await;
    h.backend.validate(&h.scaler).await.unwrap();
    // A long chroot base, an unreadable image, a root uid, a missing jailer.
    let mut bad = (*h.scaler).clone();
    let kici_model::BackendSettings::Firecracker(s) = &mut bad.backend else {
        panic!()
    };
    s.chroot_base_dir = std::path::PathBuf::from(format!("/{}", "x".repeat(70)));
    s.uid = 0;
    s.jailer_path = h.dir.path().join("missing-jailer");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&s.kernel_path, std::fs::Permissions::from_mode(0o600)).unwrap();
    let errors = h.backend.validate(&bad).await.unwrap_err().messages();
    let all = errors.join("\n");
    for needle in ["unix socket path", "must not be root", "missing-jailer"] {
        assert!(all.contains(needle), "{needle} not in:\n{all}");
    }
    // The jailer user (10000) cannot read a root-only image, and it is never
    // chmodded for it.
    let errors = h.backend.validate(&h.scaler).await.unwrap_err().messages();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].contains("not readable by the jailer user 10000:10000"),
        "{errors:?}"
    );
}
