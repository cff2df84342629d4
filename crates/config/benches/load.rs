//! `load_documents` on a generated 200-scaler configuration (container,
//! bare-metal and Firecracker entries, 3 label sets each, resources, caps,
//! machine pools). Target: ≤ 20 ms.

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use std::fmt::Write;

const SCALERS: usize = 200;

fn generate() -> String {
    let mut s = String::from(
        "version: 1\nglobalMaxAgents: 5000\nglobalResourceCap: { maxCpu: 4096, maxMemory: 16384g }\ndefaults:\n  resources:\n    requests: { cpus: 0.5, memory: 512m }\n    limits: { cpus: 1, memory: 1g }\nmachinePools:\n",
    );
    for p in 0..4 {
        let _ = writeln!(
            s,
            "  - name: pool-{p}\n    cap: {{ maxCpu: 512, maxMemory: 2048g }}"
        );
    }
    s.push_str("firecracker: { cidr: 10.0.0.0/16 }\nscalers:\n");
    for i in 0..SCALERS {
        let _ = write!(
            s,
            "  - name: scaler-{i}\n    maxAgents: {}\n    resourceCap: {{ maxCpu: 64, maxMemory: 256g }}\n    machinePool: pool-{}\n    roles: [builder]\n    warmPool: {{ enabled: true, size: 1, idleTimeoutSeconds: 120 }}\n",
            4 + i % 8,
            i % 4
        );
        match i % 3 {
            0 => s.push_str("    type: container\n    runtime: docker\n    extraHosts: [\"registry.local:10.0.0.1\"]\n"),
            1 => s.push_str("    type: bare-metal\n    enforceCgroups: true\n    mandatoryLabels: [metal]\n"),
            _ => s.push_str("    type: firecracker\n    firecrackerPath: /usr/bin/firecracker\n    jailerPath: /usr/bin/jailer\n    kernelPath: /var/lib/kici/vmlinux\n    uid: 1000\n    gid: 1000\n    x-kici-scaler: { provisionTimeoutSeconds: 120, backoff: { initialSeconds: 2, maxSeconds: 60 } }\n"),
        }
        s.push_str("    labelSets:\n");
        for j in 0..3 {
            let _ = writeln!(
                s,
                "      - labels: [s{i}, set{j}, linux, x64{}]",
                if i % 3 == 1 { ", metal" } else { "" }
            );
            match i % 3 {
                0 => s.push_str("        image: ghcr.io/kici-dev/agent:1.2.3\n        imagePullPolicy: IfNotPresent\n        env: { NODE_OPTIONS: \"--max-old-space-size=2048\", CI: \"true\" }\n        networkPolicy: { allowlist: [10.1.0.0/16, 192.168.0.10] }\n"),
                1 => s.push_str("        binaryPath: /opt/kici/bin/kici-agent\n"),
                _ => s.push_str("        rootfsPath: /var/lib/kici/rootfs.ext4\n        vcpuCount: 2\n        memSizeMib: 2048\n"),
            }
            let _ = write!(
                s,
                "        resources:\n          requests: {{ cpus: {}, memory: {}m }}\n          limits: {{ cpus: 4, memory: 8g }}\n",
                1 + j,
                512 * (j + 1)
            );
        }
    }
    s
}

fn bench(c: &mut Criterion) {
    let text = generate();
    let loaded = kici_config::load_documents(&[("scalers.yaml", &text)]).map_err(|e| e.to_string());
    assert_eq!(
        loaded.map(|l| l.config.scalers.len()),
        Ok(SCALERS),
        "the generated config must load"
    );
    // The returned snapshot is dropped outside the timed region: releasing
    // the previous configuration is not part of loading one.
    c.bench_function("load_documents/200 scalers", |b| {
        b.iter_with_large_drop(|| {
            kici_config::load_documents(black_box(&[("scalers.yaml", text.as_str())]))
        })
    });
    // The floor: the parser's events alone, no tree and no validation.
    c.bench_function("saphyr_parser events/200 scalers (parse only)", |b| {
        b.iter(|| {
            saphyr_parser::Parser::new_from_str(black_box(text.as_str()))
                .take_while(Result::is_ok)
                .count()
        })
    });
    println!("generated config: {} bytes", text.len());
}

criterion_group!(benches, bench);
criterion_main!(benches);
