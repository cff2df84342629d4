//! Upstream KiCI's configuration test suite (`config.test.ts`), item by item; adapted where we
//! deliberately deviate (noted per test).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use common::*;
use kici_model::{
    BackendSettings, BackpressureMode, ContainerRuntime, FirecrackerNetwork, ImagePullPolicy,
    LabelSet, LabelSetBackend, MemoryBytes, MilliCpu, ResourceRequest, ResourceSpec, Role, Roles,
};
use std::net::Ipv4Addr;
use std::path::Path;
use std::time::Duration;

const GIB: u64 = 1 << 30;

fn spec(cpu_millis: Option<u64>, mem: Option<u64>) -> ResourceSpec {
    ResourceSpec {
        cpus: cpu_millis.map(MilliCpu::from_millis),
        memory: mem.map(MemoryBytes::from_bytes),
    }
}

#[test]
fn minimal_container_config_parses_with_defaults() {
    let l = ok(&with_scalers(&container("c", "linux")));
    assert_eq!(l.config.global_max_agents, 50);
    let s = &l.config.scalers[0];
    assert_eq!(s.name.as_str(), "c");
    assert_eq!(s.max_agents, 2);
    assert_eq!(s.roles, Roles::All);
    assert!(s.mandatory_labels.is_empty());
    assert_eq!(s.vcpu_count, 2);
    assert_eq!(s.mem_size_mib, 512);
    match &s.label_sets[0].backend {
        LabelSetBackend::Container {
            image,
            image_pull_policy,
            container_socket,
            volumes,
        } => {
            assert_eq!(image, "kici/agent:1");
            // Upstream's default since 0.9 (it was Always before).
            assert_eq!(*image_pull_policy, ImagePullPolicy::IfNotPresent);
            assert!(!container_socket);
            assert!(volumes.is_empty());
        }
        other => panic!("{other:?}"),
    }
    match &s.backend {
        BackendSettings::Container(c) => {
            assert_eq!(c.runtime, ContainerRuntime::Auto);
            assert!(c.network_isolation);
            assert!(c.host.is_none() && c.socket_path.is_none());
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(l.config.firecracker, FirecrackerNetwork::default());
    assert!(l.warnings.is_empty(), "{:?}", l.warnings);
}

#[test]
fn container_and_bare_metal_with_defaults_and_resources() {
    let l = ok(r#"
version: 1
globalMaxAgents: 20
defaults:
  resources: { cpus: 1, memory: 1g }
scalers:
  - name: c
    type: container
    maxAgents: 3
    labelSets:
      - labels: [linux]
        image: img
        resources:
          requests: { cpus: 0.5, memory: 512m }
          limits: { cpus: 2, memory: 2g }
  - name: b
    type: bare-metal
    maxAgents: 1
    labelSets:
      - labels: [macos]
        binaryPath: /usr/local/bin/kici-agent
"#);
    assert_eq!(l.config.global_max_agents, 20);
    assert_eq!(
        l.config.defaults,
        Some(ResourceRequest::flat(spec(Some(1000), Some(GIB))))
    );
    let ls = &l.config.scalers[0].label_sets[0];
    assert_eq!(
        ls.resources,
        Some(ResourceRequest {
            requests: Some(spec(Some(500), Some(512 << 20))),
            limits: Some(spec(Some(2000), Some(2 * GIB))),
        })
    );
    match &l.config.scalers[1].label_sets[0].backend {
        LabelSetBackend::BareMetal { binary_path } => {
            assert_eq!(binary_path, Path::new("/usr/local/bin/kici-agent"))
        }
        other => panic!("{other:?}"),
    }
    assert!(
        matches!(&l.config.scalers[1].backend, BackendSettings::BareMetal(b) if !b.enforce_cgroups)
    );
}

#[test]
fn removed_entry_keys_are_unrecognized() {
    for key in ["cleanable: true", "cleanupScript: /bin/true"] {
        let text = with_scalers(&format!("{}    {key}\n", container("c", "a")));
        let name = key.split(':').next().unwrap();
        assert_error(
            &text,
            &[
                "scalers[0].",
                "unrecognized key",
                name,
                "accepted keys: name, type",
            ],
        );
    }
}

#[test]
fn missing_version_rejected() {
    let text = format!("scalers:\n{}", container("c", "a"));
    assert_eq!(
        err_lines(&text),
        ["scalers.yaml:1:1: version: missing required key `version` (must be 1)"]
    );
}

#[test]
fn container_label_set_requires_image() {
    let text = with_scalers(
        "  - name: c\n    type: container\n    maxAgents: 1\n    labelSets:\n      - labels: [a]\n",
    );
    assert_eq!(
        err_lines(&text),
        ["scalers.yaml:7:9: scalers[0].labelSets[0].image: a container scaler requires an 'image' field in every label set"]
    );
    // Upstream checks truthiness: an empty image is missing too.
    let text = with_scalers(&container("c", "a").replace("kici/agent:1", "''"));
    assert_error(&text, &["requires an 'image' field"]);
}

#[test]
fn bare_metal_label_set_requires_binary_path() {
    let text = with_scalers(
        "  - name: b\n    type: bare-metal\n    maxAgents: 1\n    labelSets:\n      - labels: [a]\n",
    );
    assert_error(
        &text,
        &[
            "scalers[0].labelSets[0].binaryPath",
            "requires a 'binaryPath' field",
        ],
    );
    // An `image` in its place is upstream's container mode for bare metal,
    // which kici-scaler refuses with its own error (it used to be ignored).
    let text = with_scalers(
        "  - name: b\n    type: bare-metal\n    maxAgents: 1\n    labelSets:\n      - labels: [a]\n        image: ignored\n",
    );
    assert_error(
        &text,
        &[
            "scalers[0].labelSets[0].image",
            "a bare-metal label set with an `image` and no `binaryPath`",
        ],
    );
}

#[test]
fn global_max_agents_zero_rejected() {
    let text = format!(
        "version: 1\nglobalMaxAgents: 0\nscalers:\n{}",
        container("c", "a")
    );
    assert_eq!(
        err_lines(&text),
        ["scalers.yaml:2:18: globalMaxAgents: expected an integer > 0, got 0"]
    );
}

#[test]
fn backpressure_mode() {
    let with = |mode: &str| {
        with_scalers(&format!(
            "{}        backpressureMode: {mode}\n",
            container("c", "a")
        ))
    };
    let mode = |mode: &str| ok(&with(mode)).config.scalers[0].label_sets[0].backpressure_mode;
    assert_eq!(mode("drop"), Some(BackpressureMode::Drop));
    assert_eq!(mode("pause"), Some(BackpressureMode::Pause));
    assert_eq!(
        ok(&with_scalers(&container("c", "a"))).config.scalers[0].label_sets[0].backpressure_mode,
        None
    );
    assert_error(
        &with("block"),
        &[
            "backpressureMode",
            "expected one of \"pause\", \"drop\", got \"block\"",
        ],
    );
}

#[test]
fn warm_pool_defaults() {
    let text = with_scalers(&container("c", "a").replace(
        "    labelSets:",
        "    warmPool: { enabled: true }\n    labelSets:",
    ));
    let w = ok(&text).config.scalers[0].warm_pool.clone().unwrap();
    assert!(w.enabled);
    assert_eq!(w.size, 0);
    assert_eq!(w.idle_timeout, Duration::from_secs(300));
    assert_eq!(
        ok(&with_scalers(&container("c", "a"))).config.scalers[0].warm_pool,
        None
    );
}

const FC_ENTRY: &str = "  - name: fc
    type: firecracker
    maxAgents: 2
    firecrackerPath: /usr/bin/firecracker
    jailerPath: /usr/bin/jailer
    kernelPath: /var/lib/kici/vmlinux
    uid: 1000
    gid: 1000
    labelSets:
      - labels: [linux, firecracker]
        rootfsPath: /var/lib/kici/rootfs.ext4
";

#[test]
fn valid_firecracker_config_with_defaults() {
    let text = format!("version: 1\nfirecracker:\n  cidr: 10.0.0.0/24\nscalers:\n{FC_ENTRY}");
    let l = ok(&text);
    let s = &l.config.scalers[0];
    match &s.backend {
        BackendSettings::Firecracker(f) => {
            assert_eq!(f.chroot_base_dir, Path::new("/srv/jailer"));
            assert_eq!((f.uid, f.gid), (1000, 1000));
            assert!(!f.require_sudo);
            assert_eq!(f.kernel_path, Path::new("/var/lib/kici/vmlinux"));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!((s.vcpu_count, s.mem_size_mib), (2, 512));
    assert_eq!(l.config.firecracker.cidr.to_string(), "10.0.0.0/24");
}

#[test]
fn firecracker_required_fields_each_reported() {
    let text =
        with_scalers(&FC_ENTRY.replace("        rootfsPath: /var/lib/kici/rootfs.ext4\n", ""));
    assert_error(
        &text,
        &[
            "scalers[0].labelSets[0].rootfsPath",
            "requires a 'rootfsPath' field",
        ],
    );
    for key in ["firecrackerPath", "jailerPath", "kernelPath"] {
        let text: String = FC_ENTRY
            .lines()
            .filter(|l| !l.contains(key))
            .map(|l| format!("{l}\n"))
            .collect();
        assert_eq!(
            err_lines(&with_scalers(&text)),
            [format!(
                "scalers.yaml:3:5: scalers[0].{key}: a firecracker scaler requires a '{key}' field"
            )]
        );
    }
    let text: String = FC_ENTRY
        .lines()
        .filter(|l| !l.contains("uid") && !l.contains("gid"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(
        err_lines(&with_scalers(&text)),
        [
            "scalers.yaml:3:5: scalers[0].uid: a firecracker scaler requires a 'uid' field",
            "scalers.yaml:3:5: scalers[0].gid: a firecracker scaler requires a 'gid' field",
        ]
    );
    // uid/gid 0 are fine.
    ok(&with_scalers(&FC_ENTRY.replace("1000", "0")));
}

#[test]
fn firecracker_network_defaults_and_custom_values() {
    let l = ok(&format!(
        "version: 1\nfirecracker: {{}}\nscalers:\n{FC_ENTRY}"
    ));
    let n = &l.config.firecracker;
    assert_eq!(n.cidr.to_string(), "10.0.0.0/24");
    assert_eq!(n.bridge_name, "kici-br0");
    assert_eq!(n.gateway, Ipv4Addr::new(10, 0, 0, 1));
    assert_eq!(n.netmask, Ipv4Addr::new(255, 255, 255, 0));
    assert_eq!(n.table, "kici");
    let l = ok(&format!(
        "version: 1\nfirecracker: {{cidr: 172.16.4.0/22, bridgeName: br9, gateway: 172.16.4.1, netmask: 255.255.252.0, table: t9}}\nscalers:\n{FC_ENTRY}"
    ));
    let n = &l.config.firecracker;
    assert_eq!(n.cidr.to_string(), "172.16.4.0/22");
    assert_eq!(n.bridge_name, "br9");
    // The gateway must be the first host address: the bridge's, which the
    // allocator never hands out (corpus 48 shows the refusal).
    assert_eq!(n.gateway, Ipv4Addr::new(172, 16, 4, 1));
    assert_eq!(n.netmask, Ipv4Addr::new(255, 255, 252, 0));
    assert_eq!(n.table, "t9");
    // Adapted: with only a CIDR, gateway and netmask follow it (upstream's
    // literal defaults would contradict it, which we reject).
    let l = ok(&format!(
        "version: 1\nfirecracker: {{cidr: 192.168.8.0/21}}\nscalers:\n{FC_ENTRY}"
    ));
    assert_eq!(l.config.firecracker.gateway, Ipv4Addr::new(192, 168, 8, 1));
    assert_eq!(
        l.config.firecracker.netmask,
        Ipv4Addr::new(255, 255, 248, 0)
    );
}

#[test]
fn legacy_docker_type_and_keys_rejected() {
    let text = with_scalers(&container("c", "a").replace("type: container", "type: docker"));
    assert_eq!(
        err_lines(&text),
        ["scalers.yaml:4:11: scalers[0].type: expected \"container\", \"bare-metal\", \"firecracker\" or \"event\", got \"docker\" (the legacy type \"docker\" was removed; use \"container\")"]
    );
    assert_error(
        &with_scalers(&container("c", "a").replace("type: container", "type: kubernetes")),
        &["got \"kubernetes\""],
    );
    let text = with_scalers(&format!(
        "{}    dockerHost: tcp://h:2376\n",
        container("c", "a")
    ));
    assert_error(
        &text,
        &["scalers[0].dockerHost", "unrecognized key \"dockerHost\""],
    );
    let text = with_scalers(&format!(
        "{}        dockerSocket: true\n",
        container("c", "a")
    ));
    assert_error(
        &text,
        &[
            "scalers[0].labelSets[0].dockerSocket",
            "unrecognized key \"dockerSocket\"",
        ],
    );
}

#[test]
fn dual_arch_firecracker_overrides() {
    let l = kici_config::load(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/valid/firecracker.yaml"),
        None,
    )
    .unwrap();
    assert_eq!(l.config.firecracker.cidr.to_string(), "10.0.0.0/22");
    let s = &l.config.scalers[0];
    assert_eq!(s.vcpu_count, 2);
    assert_eq!(s.mem_size_mib, 1024);
    let fc = |i: usize| match &s.label_sets[i].backend {
        LabelSetBackend::Firecracker(f) => f.clone(),
        other => panic!("{other:?}"),
    };
    assert_eq!(
        fc(0).rootfs_path,
        Path::new("/var/lib/kici/rootfs-x64.ext4")
    );
    assert_eq!(fc(0).kernel_path, None);
    assert_eq!(fc(0).vcpu_count, None);
    assert_eq!(
        fc(1).rootfs_path,
        Path::new("/var/lib/kici/rootfs-arm64.ext4")
    );
    assert_eq!(
        fc(1).kernel_path.as_deref(),
        Some(Path::new("/var/lib/kici/vmlinux-arm64"))
    );
    assert_eq!(fc(1).vcpu_count, Some(4));
    assert_eq!(fc(1).mem_size_mib, Some(2048));
    assert_eq!(fc(1).overlay_drive_size_mib, Some(4096));
}

#[test]
fn network_policy_shapes() {
    let with = |np: &str| {
        with_scalers(&format!(
            "{}        networkPolicy: {np}\n",
            container("c", "a")
        ))
    };
    let policy = |np: &str| {
        ok(&with(np)).config.scalers[0].label_sets[0]
            .network_policy
            .clone()
    };
    assert_eq!(
        ok(&with_scalers(&container("c", "a"))).config.scalers[0].label_sets[0].network_policy,
        None
    );
    let p = policy("{allowlist: [10.1.0.0/16]}").unwrap();
    assert_eq!(p.allowlist.len(), 1);
    assert!(!p.deny_all);
    let p = policy("{denyAll: true}").unwrap();
    assert!(p.allowlist.is_empty());
    assert!(p.deny_all);
    let p = policy("{allowlist: [10.1.0.0/16, '192.168.1.1', 'fd00::/8', '::1'], denyAll: true}")
        .unwrap();
    let nets: Vec<String> = p.allowlist.iter().map(|n| n.to_string()).collect();
    assert_eq!(
        nets,
        ["10.1.0.0/16", "192.168.1.1/32", "fd00::/8", "::1/128"]
    );
    assert!(p.deny_all);
}

#[test]
fn roles_normalisation() {
    let with = |roles: &str| {
        with_scalers(&container("c", "a").replace(
            "    labelSets:",
            &format!("    roles: {roles}\n    labelSets:"),
        ))
    };
    let roles = |r: &str| ok(&with(r)).config.scalers[0].roles.clone();
    assert_eq!(
        ok(&with_scalers(&container("c", "a"))).config.scalers[0].roles,
        Roles::All
    );
    assert_eq!(roles("[builder]"), Roles::Only(vec![Role::Builder]));
    assert_eq!(roles("[]"), Roles::Only(vec![]));
    assert_eq!(roles("[builder, all]"), Roles::All);
    assert_eq!(roles("[all]"), Roles::All);
    assert_eq!(
        roles("[init-runner, builder, init-runner]"),
        Roles::Only(vec![Role::InitRunner, Role::Builder])
    );
    assert_error(
        &with("[unknown]"),
        &[
            "scalers[0].roles[0]",
            "expected one of \"builder\", \"init-runner\", \"all\", got \"unknown\"",
        ],
    );
}

#[test]
fn kici_prefixed_label_rejected() {
    assert_eq!(
        err_lines(&with_scalers(&container("c", "linux, KICI:os:linux"))),
        ["scalers.yaml:7:25: scalers[0].labelSets[0].labels[1]: label \"KICI:os:linux\" uses the 'kici:' prefix, which is reserved for labels kici-scaler injects"]
    );
}

const GATED: &str = "  - name: gpu
    type: container
    maxAgents: 1
    mandatoryLabels: [GATE]
    labelSets:
      - labels: [gpu, a]
        image: i
      - labels: [GPU, b]
        image: i
      - labels: [c]
        image: i
";

#[test]
fn mandatory_labels() {
    assert!(ok(&with_scalers(&container("c", "a"))).config.scalers[0]
        .mandatory_labels
        .is_empty());
    // Present in every label set, compared case-insensitively.
    let l = ok(&with_scalers(
        &GATED.replace("GATE", "gpu").replace("[c]", "[c, Gpu]"),
    ));
    assert_eq!(
        l.config.scalers[0].mandatory_labels,
        LabelSet::parse(["gpu"]).unwrap()
    );
    assert_error(
        &with_scalers(
            &GATED
                .replace("GATE", "'kici:gpu'")
                .replace("[c]", "[c, gpu]"),
        ),
        &["scalers[0].mandatoryLabels[0]", "kici:"],
    );
    // Missing from labelSets[2]: one error naming the label and the index.
    let lines = err_lines(&with_scalers(&GATED.replace("GATE", "GPU")));
    assert_eq!(
        lines,
        ["scalers.yaml:12:9: scalers[0].labelSets[2].labels: mandatoryLabel \"gpu\" is missing from labelSets[2]: every label set must contain every mandatory label"]
    );
    // One error per (label set, mandatory label).
    let lines = err_lines(&with_scalers(&GATED.replace("GATE", "gpu, z")));
    assert_eq!(lines.len(), 4, "{lines:#?}");
}

#[test]
fn load_reads_files_merges_drop_ins_and_rejects_version_2() {
    let dir = tempfile::tempdir().unwrap();
    let main = dir.path().join("scalers.yaml");
    let d = dir.path().join("scalers.d");
    std::fs::create_dir(&d).unwrap();
    std::fs::write(&main, with_scalers(&container("container-linux", "linux"))).unwrap();
    std::fs::write(
        d.join("02-arm.yml"),
        format!("scalers:\n{}", container("container-arm", "arm")),
    )
    .unwrap();
    std::fs::write(
        d.join("01-gpu.yaml"),
        "scalers:\n  - name: bare-metal-gpu\n    type: bare-metal\n    maxAgents: 1\n    labelSets:\n      - labels: [gpu]\n        binaryPath: /a\n",
    )
    .unwrap();
    std::fs::write(d.join("README.md"), "not yaml: [").unwrap();
    std::fs::write(d.join("03-off.yaml.disabled"), "not yaml: [").unwrap();
    std::fs::write(d.join("04-UPPER.YAML"), "not yaml: [").unwrap();
    let l = kici_config::load(&main, Some(&d)).unwrap();
    let names: Vec<&str> = l.config.scalers.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        ["container-linux", "bare-metal-gpu", "container-arm"]
    );
    assert_eq!(
        l.files,
        [main.clone(), d.join("01-gpu.yaml"), d.join("02-arm.yml")]
    );
    assert_eq!(
        l.config.scalers[1].origin.file.as_ref(),
        d.join("01-gpu.yaml").display().to_string()
    );
    assert_eq!(l.config.scalers[1].origin.line, 2);

    std::fs::write(
        &main,
        with_scalers(&container("c", "x")).replace("version: 1", "version: 2"),
    )
    .unwrap();
    let e = kici_config::load(&main, None).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{}:1:10: version: unsupported version: expected 1, got 2",
            main.display()
        )
    );
}

#[test]
fn caps_and_machine_pools_parse() {
    let l = kici_config::load(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/valid/caps.yaml"),
        None,
    )
    .unwrap();
    let c = &l.config;
    let g = c.global_resource_cap.unwrap();
    assert_eq!(g.max_cpu, Some(MilliCpu::from_millis(64_000)));
    assert_eq!(g.max_memory, Some(MemoryBytes::from_bytes(128 * GIB)));
    assert_eq!(c.machine_pools.len(), 2);
    let pool = c.machine_pool("host-a").unwrap();
    assert_eq!(pool.cap.max_memory, Some(MemoryBytes::from_bytes(64 * GIB)));
    assert_eq!(c.machine_pool("host_b.2").unwrap().cap.max_cpu, None);
    let s = c.scaler("pooled").unwrap();
    assert_eq!(s.machine_pool.as_deref(), Some("host-a"));
    let cap = s.resource_cap.unwrap();
    assert_eq!(
        (cap.max_cpu, cap.max_memory),
        (
            Some(MilliCpu::from_millis(8000)),
            Some(MemoryBytes::from_bytes(16 * GIB))
        )
    );
}

#[test]
fn machine_pool_references_and_duplicates() {
    let text = format!(
        "version: 1\nmachinePools:\n  - name: p\n    cap: {{maxCpu: 4}}\nscalers:\n{}",
        container("c", "a").replace("    labelSets:", "    machinePool: q\n    labelSets:")
    );
    assert_eq!(
        err_lines(&text),
        ["scalers.yaml:9:18: scalers[0].machinePool: unknown machinePool \"q\" (defined: \"p\")"]
    );
    let text = with_scalers(
        &container("c", "a").replace("    labelSets:", "    machinePool: q\n    labelSets:"),
    );
    assert_error(
        &text,
        &["unknown machinePool \"q\" (no machinePools are defined)"],
    );
    let text = format!(
        "version: 1\nmachinePools:\n  - name: p\n    cap: {{maxCpu: 4}}\n  - name: p\n    cap: {{maxCpu: 8}}\nscalers:\n{}",
        container("c", "a")
    );
    assert_eq!(
        err_lines(&text),
        ["scalers.yaml:5:11: machinePools[1].name: Duplicate machinePool name \"p\" (first defined at scalers.yaml:3:5)"]
    );
}

#[test]
fn flat_resources_apply_to_both_sides_nested_kept() {
    let with = |r: &str| with_scalers(&format!("{}        resources: {r}\n", container("c", "a")));
    let res = |r: &str| ok(&with(r)).config.scalers[0].label_sets[0].resources;
    let four = spec(Some(2000), Some(4 * GIB));
    assert_eq!(
        res("{cpus: 2, memory: 4g}"),
        Some(ResourceRequest {
            requests: Some(four),
            limits: Some(four)
        })
    );
    assert_eq!(
        res("{requests: {cpus: 1}, limits: {memory: 4g}}"),
        Some(ResourceRequest {
            requests: Some(spec(Some(1000), None)),
            limits: Some(spec(None, Some(4 * GIB)))
        })
    );
    assert_eq!(res("{}"), Some(ResourceRequest::default()));
    assert_error(
        &with("{cpus: 2, limits: {cpus: 2}}"),
        &["scalers[0].labelSets[0].resources", "mixes the nested form"],
    );
    assert_error(
        &with("{requests: {cpus: 1, gpus: 1}}"),
        &[
            "resources.requests.gpus",
            "unrecognized key \"gpus\"; accepted keys: cpus, memory",
        ],
    );
    assert_error(
        &with("{cpus: 300}"),
        &["resources.cpus", "at most 256, got 300"],
    );
}

#[test]
fn memory_strings_checked_at_load() {
    // Adapted: upstream only fails when a job is resolved; we fail at load,
    // with the parser's message quoting the value.
    let with = |m: &str| {
        with_scalers(&format!(
            "{}        resources: {{memory: {m}}}\n",
            container("c", "a")
        ))
    };
    let mem = |m: &str| {
        ok(&with(m)).config.scalers[0].label_sets[0]
            .resources
            .unwrap()
            .requests
            .unwrap()
            .memory
            .unwrap()
            .bytes()
    };
    assert_eq!(mem("512m"), 536_870_912);
    assert_eq!(mem("512M"), 536_870_912);
    assert_eq!(mem("2g"), 2_147_483_648);
    assert_eq!(mem("2G"), 2_147_483_648);
    assert_eq!(mem("1024k"), 1_048_576);
    assert_eq!(mem("1024K"), 1_048_576);
    for bad in ["'512'", "abc", "''", "512b"] {
        let shown = bad.trim_matches('\'');
        assert_error(
            &with(bad),
            &[
                "resources.memory",
                &format!("Invalid memory format \"{shown}\""),
            ],
        );
    }
    assert_error(
        &with("512"),
        &[
            "resources.memory",
            "expected a memory string such as \"512m\" or \"2g\", got 512",
        ],
    );
}

#[test]
fn upstream_0_9_fixture_reads_as_written() {
    use kici_model::{HostAccess, PlatformArch, PlatformOs, ScalerPlatform};
    let l = ok(include_str!("../fixtures/valid/upstream-0.9.yaml"));
    let c = &l.config;
    assert_eq!(c.global_max_agents, 12);
    assert!(!c.firecracker.auto_provision_host);
    let linux = &c.scalers[0];
    assert_eq!(linux.max_concurrent_spawns, 4);
    assert_eq!(linux.platform, None);
    assert_eq!(linux.label_sets[0].labels.key(), "linux,x64");
    // What agents get: the spelling as written, minus the blank.
    assert_eq!(linux.label_sets[0].raw_labels, ["Linux", "x64"]);
    let policy = linux.label_sets[0].network_policy.as_ref().unwrap();
    let access: Vec<String> = policy
        .host_access
        .as_ref()
        .unwrap()
        .iter()
        .map(HostAccess::to_string)
        .collect();
    assert_eq!(access, ["10.30.0.1:53", "*:7879"]);
    let mac = &c.scalers[1];
    assert_eq!(mac.max_concurrent_spawns, 8);
    assert_eq!(
        mac.platform,
        Some(ScalerPlatform {
            os: PlatformOs::Macos,
            arch: PlatformArch::Arm64
        })
    );
}
