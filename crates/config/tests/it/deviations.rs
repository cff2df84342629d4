//! Our deliberate deviations (docs/deviations.md, D-strict-config and
//! D-tie-break) and the rules we add: each rejected
//! with a precise, positioned error; plus warnings, overlaps and the
//! multi-file error report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use common::*;
use kici_config::load_documents;
use kici_model::{AgentUser, ScalerExtension, ScalerType, UlimitName, UlimitValue};
use std::time::Duration;

#[test]
fn three_errors_over_two_files_are_reported_together() {
    let main = "version: 1
globalMaxAgents: many
scalers:
  - name: linux
    type: container
    maxAgents: 2
    labelSets:
      - labels: [linux]
        image: kici/agent:1
        resources: { memory: 4gb }
";
    let drop_in = "scalers:
  - name: gpu
    type: bare-metal
    maxAgents: 1
    labelSets:
      - labels: [gpu]
";
    let err =
        load_documents(&[("scalers.yaml", main), ("scalers.d/01-gpu.yaml", drop_in)]).unwrap_err();
    let lines: Vec<String> = err.iter().map(|d| d.to_string()).collect();
    assert_eq!(
        lines,
        [
            "scalers.yaml:2:18: globalMaxAgents: expected an integer > 0, got \"many\"",
            "scalers.yaml:10:30: scalers[0].labelSets[0].resources.memory: Invalid memory format \"4gb\": expected a number followed by k, m or g (e.g. \"512m\", \"1.5g\")",
            "scalers.d/01-gpu.yaml:6:9: scalers[1].labelSets[0].binaryPath: a bare-metal scaler requires a 'binaryPath' field in every label set",
        ]
    );
    assert_eq!(err.to_string(), lines.join("\n"));
}

#[test]
fn overlap_between_scalers_names_both_files_and_lines() {
    let main = with_scalers(&format!(
        "{}{}",
        container("a", "linux, x64"),
        container("b", "gpu")
    ));
    let drop_in = format!("scalers:\n{}", container("c", "X64, Linux"));
    let err =
        load_documents(&[("scalers.yaml", &main), ("scalers.d/10-c.yaml", &drop_in)]).unwrap_err();
    let lines: Vec<String> = err.iter().map(|d| d.to_string()).collect();
    assert_eq!(
        lines,
        ["scalers.d/10-c.yaml:6:9: scalers[2].labelSets[0].labels: label set [linux,x64] overlaps between scalers \"a\" (scalers.yaml:3) and \"c\" (scalers.d/10-c.yaml:2)"]
    );
    // Three owners of one key: two errors, both naming the first owner.
    let main = with_scalers(&format!(
        "{}{}{}",
        container("a", "k"),
        container("b", "k"),
        container("c", "K")
    ));
    let lines = err_lines(&main);
    assert_eq!(lines.len(), 2);
    assert!(
        lines[0]
            .contains("overlaps between scalers \"a\" (scalers.yaml:3) and \"b\" (scalers.yaml:9)"),
        "{lines:?}"
    );
    assert!(
        lines[1].contains(
            "overlaps between scalers \"a\" (scalers.yaml:3) and \"c\" (scalers.yaml:15)"
        ),
        "{lines:?}"
    );
    // Subsets do not overlap.
    ok(&with_scalers(&format!(
        "{}{}",
        container("a", "linux"),
        container("b", "linux, x64")
    )));
}

#[test]
fn same_scaler_duplicate_label_sets_warn() {
    let text = with_scalers(&format!(
        "{}      - labels: [LINUX]\n        image: other\n",
        container("a", "linux")
    ));
    let l = ok(&text);
    assert_eq!(
        warning_lines(&l),
        ["scalers.yaml:9:9: scalers[0].labelSets[1].labels: label set [linux] repeats labelSets[0] of the same scaler; the first one always wins"]
    );
}

#[test]
fn duplicate_scaler_names_name_both_places() {
    let main = with_scalers(&container("dup", "a"));
    let drop_in = format!("scalers:\n{}", container("dup", "b"));
    let err =
        load_documents(&[("scalers.yaml", &main), ("scalers.d/x.yml", &drop_in)]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "scalers.d/x.yml:2:11: scalers[1].name: duplicate scaler name \"dup\": defined at scalers.yaml:3 (scalers[0]) and scalers.d/x.yml:2 (scalers[1])"
    );
    assert_error(
        &with_scalers(&format!(
            "{}{}",
            container("GPU", "a"),
            container("gpu", "b")
        )),
        &["scalers[1].name", "differs only in case from \"GPU\""],
    );
}

#[test]
fn scaler_names_must_fit_a_label() {
    assert_error(
        &with_scalers(&container("''", "a")),
        &["scalers[0].name", "scaler name \"\" must not be empty"],
    );
    assert_error(
        &with_scalers(&container("'a b'", "a")),
        &["scaler name \"a b\" must not contain whitespace"],
    );
}

#[test]
fn bad_memory_strings_rejected_everywhere() {
    let text = format!(
        "version: 1\ndefaults:\n  resources: {{requests: {{memory: 1x}}}}\nglobalResourceCap: {{maxMemory: big}}\nmachinePools:\n  - name: p\n    cap: {{maxMemory: 12q}}\nscalers:\n{}",
        container("c", "a").replace("    labelSets:", "    resourceCap: {maxMemory: 1 g b}\n    labelSets:")
    );
    let lines = err_lines(&text);
    let expect = [
        ("defaults.resources.requests.memory", "\"1x\""),
        ("globalResourceCap.maxMemory", "\"big\""),
        ("machinePools[0].cap.maxMemory", "\"12q\""),
        ("scalers[0].resourceCap.maxMemory", "\"1 g b\""),
    ];
    assert_eq!(lines.len(), expect.len(), "{lines:#?}");
    for ((path, value), line) in expect.iter().zip(&lines) {
        assert!(
            line.contains(&format!("{path}: Invalid memory format {value}")),
            "{line}"
        );
    }
}

#[test]
fn requests_above_limits_rejected() {
    let text = with_scalers(&format!(
        "{}        resources:\n          requests: {{memory: 2g}}\n          limits: {{memory: 1g}}\n",
        container("c", "a")
    ));
    assert_eq!(
        err_lines(&text),
        ["scalers.yaml:10:11: scalers[0].labelSets[0].resources: requests.memory (2g) exceeds limits.memory (1g)"]
    );
    let text = format!("version: 1\ndefaults:\n  resources: {{requests: {{cpus: 2}}, limits: {{cpus: 1}}}}\nscalers:\n{}", container("c", "a"));
    assert_error(
        &text,
        &[
            "defaults.resources",
            "requests.cpus (2) exceeds limits.cpus (1)",
        ],
    );
}

#[test]
fn requests_that_can_never_fit_are_rejected() {
    let capped = |cap: &str, res: &str| {
        with_scalers(&format!(
            "{}        resources: {res}\n",
            container("c", "a").replace(
                "    labelSets:",
                &format!("    resourceCap: {cap}\n    labelSets:")
            )
        ))
    };
    assert_eq!(
        err_lines(&capped("{maxCpu: 2}", "{cpus: 4}")),
        ["scalers.yaml:10:20: scalers[0].labelSets[0].resources: a request of 4 CPUs can never fit: the scaler's resourceCap maxCpu is 2"]
    );
    assert_error(
        &capped("{maxMemory: 1g}", "{memory: 2g}"),
        &["a request of 2g memory can never fit: the scaler's resourceCap maxMemory is 1g"],
    );
    // Limits-only reserves the limits (mirroring).
    assert_error(
        &capped("{maxCpu: 1}", "{limits: {cpus: 1.5}}"),
        &["a request of 1.5 CPUs can never fit"],
    );
    ok(&capped("{maxCpu: 2}", "{cpus: 2}"));
    // Inherited from defaults: reported at the label set.
    let text = format!(
        "version: 1\ndefaults:\n  resources: {{cpus: 8}}\nscalers:\n{}",
        container("c", "a").replace(
            "    labelSets:",
            "    resourceCap: {maxCpu: 4}\n    labelSets:"
        )
    );
    assert_eq!(
        err_lines(&text),
        ["scalers.yaml:10:9: scalers[0].labelSets[0]: a request of 8 CPUs (inherited from defaults.resources) can never fit: the scaler's resourceCap maxCpu is 4"]
    );
    // Defaults against the global cap: once, at defaults.resources.
    let text = format!(
        "version: 1\nglobalResourceCap: {{maxMemory: 1g}}\ndefaults:\n  resources: {{memory: 2g}}\nscalers:\n{}{}",
        container("c", "a"),
        container("d", "b")
    );
    assert_eq!(
        err_lines(&text),
        ["scalers.yaml:4:14: defaults.resources: a request of 2g memory can never fit: globalResourceCap maxMemory is 1g"]
    );
    // A label set above the global cap or its machine pool's cap.
    let text = format!(
        "version: 1\nglobalResourceCap: {{maxCpu: 16}}\nmachinePools:\n  - name: p\n    cap: {{maxCpu: 2}}\nscalers:\n{}        resources: {{cpus: 32}}\n",
        container("c", "a").replace("    labelSets:", "    machinePool: p\n    labelSets:")
    );
    let lines = err_lines(&text);
    assert_eq!(lines.len(), 2, "{lines:#?}");
    assert!(lines[0].contains("a request of 32 CPUs"), "{lines:?}");
    assert!(lines
        .iter()
        .any(|l| l.contains("machinePool \"p\" cap maxCpu is 2")));
    assert!(lines
        .iter()
        .any(|l| l.contains("globalResourceCap maxCpu is 16")));
}

#[test]
fn firecracker_gateway_and_netmask_checked() {
    let fc = |block: &str| {
        format!(
            "version: 1\nfirecracker: {block}\nscalers:\n{}",
            container("c", "a")
        )
    };
    assert_eq!(
        err_lines(&fc("{cidr: 10.0.0.0/24, gateway: 10.0.1.1}")),
        ["scalers.yaml:2:43: firecracker.gateway: gateway 10.0.1.1 is not a usable host address of cidr 10.0.0.0/24 (cidr at scalers.yaml:2:21)"]
    );
    assert_error(
        &fc("{gateway: 10.0.0.0}"),
        &["gateway 10.0.0.0 is not a usable host address"],
    );
    assert_error(
        &fc("{gateway: 10.0.0.255}"),
        &["gateway 10.0.0.255 is not a usable host address"],
    );
    assert_error(
        &fc("{netmask: 255.255.0.0}"),
        &[
            "firecracker.netmask",
            "netmask 255.255.0.0 does not match cidr 10.0.0.0/24 (expected 255.255.255.0)",
        ],
    );
    assert_error(
        &fc("{cidr: 10.0.0.0}"),
        &[
            "firecracker.cidr",
            "expected an IPv4 CIDR such as \"10.0.0.0/24\", got \"10.0.0.0\"",
        ],
    );
    assert_error(
        &fc("{cidr: 10.0.0.0/31}"),
        &["prefix must be /30 or shorter"],
    );
    assert_error(
        &fc("{gateway: banana}"),
        &["expected an IPv4 address, got \"banana\""],
    );
    let l = ok(&fc("{cidr: 10.0.0.7/24, extra: 1}"));
    let w = warning_lines(&l);
    assert!(
        w.iter()
            .any(|w| w.contains("firecracker.extra: unknown key \"extra\" is ignored")),
        "{w:?}"
    );
    assert!(
        w.iter()
            .any(|w| w.contains("host bits set; the network is 10.0.0.0/24")),
        "{w:?}"
    );
}

#[test]
fn env_names_posix_and_not_reserved() {
    let with = |env: &str| with_scalers(&format!("{}        env: {env}\n", container("c", "a")));
    let l = ok(&with("{FOO_1: bar, _x: '1'}"));
    let env = &l.config.scalers[0].label_sets[0].env;
    let pairs: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    assert_eq!(
        pairs,
        [("FOO_1".into(), "bar".into()), ("_x".into(), "1".into())]
    );
    assert_eq!(
        err_lines(&with("{1X: a, A-B: b}")),
        [
            "scalers.yaml:9:15: scalers[0].labelSets[0].env.1X: environment variable name \"1X\" is not POSIX: expected letters, digits and '_', not starting with a digit",
            "scalers.yaml:9:22: scalers[0].labelSets[0].env.A-B: environment variable name \"A-B\" is not POSIX: expected letters, digits and '_', not starting with a digit",
        ]
    );
    for reserved in [
        "KICI_AGENT_ID",
        "KICI_AGENT_TOKEN",
        "KICI_LABELS",
        "KICI_SCALER_MANAGED",
    ] {
        assert_error(
            &with(&format!("{{{reserved}: x}}")),
            &[&format!("env.{reserved}: {reserved} is set by kici-scaler")],
        );
    }
    assert_error(&with("{A: 1}"), &["env.A: expected a string, got 1"]);
    let l = ok(&with("{KICI_ROLES: builder}"));
    assert!(warning_lines(&l)[0].contains("KICI_ROLES replaces the value kici-scaler derives"));
    // The KiCI agent refuses unknown KICI_* names: so does the loader.
    assert_error(
        &with("{KICI_MADE_UP: x}"),
        &["env.KICI_MADE_UP: KICI_MADE_UP is not a variable the KiCI agent accepts"],
    );
    ok(&with("{KICI_LOG_LEVEL: debug, KICI_E2E_FLAG: '1'}"));
}

#[test]
fn warm_pool_and_max_agents_bounds() {
    let with = |warm: &str| {
        with_scalers(&container("c", "a").replace(
            "    labelSets:",
            &format!("    warmPool: {warm}\n    labelSets:"),
        ))
    };
    assert_eq!(
        err_lines(&with("{enabled: true, size: 3}")),
        ["scalers.yaml:6:37: scalers[0].warmPool.size: warmPool.size (3) exceeds maxAgents (2)"]
    );
    ok(&with("{enabled: true, size: 2}"));
    for bad in ["0", "-5", ".inf", ".nan", "'60'", "1e300"] {
        let text = with(&format!("{{enabled: true, idleTimeoutSeconds: {bad}}}"));
        assert_error(&text, &["warmPool.idleTimeoutSeconds"]);
    }
    let w = ok(&with("{enabled: true, idleTimeoutSeconds: 0.5, typo: 1}"));
    assert_eq!(
        w.config.scalers[0].warm_pool.as_ref().unwrap().idle_timeout,
        Duration::from_millis(500)
    );
    assert!(warning_lines(&w)[0].contains("warmPool.typo: unknown key \"typo\" is ignored"));
    // maxAgents above globalMaxAgents: a warning.
    let text = format!(
        "version: 1\nglobalMaxAgents: 1\nscalers:\n{}",
        container("c", "a")
    );
    assert_eq!(
        warning_lines(&ok(&text)),
        ["scalers.yaml:6:16: scalers[0].maxAgents: maxAgents (2) exceeds globalMaxAgents (1); the global limit applies"]
    );
    assert_error(
        &with_scalers(&container("c", "a").replace("maxAgents: 2", "maxAgents: 1.5")),
        &["maxAgents: expected an integer > 0, got 1.5"],
    );
    ok(&with_scalers(
        &container("c", "a").replace("maxAgents: 2", "maxAgents: 2.0"),
    ));
}

#[test]
fn machine_pool_names_are_file_safe() {
    for bad in ["'.hidden'", "'a/b'", "''", "'a b'"] {
        let text = format!(
            "version: 1\nmachinePools:\n  - name: {bad}\n    cap: {{}}\nscalers:\n{}",
            container("c", "a")
        );
        assert_error(&text, &["machinePools[0].name", "must be letters, digits"]);
    }
    let text = format!(
        "version: 1\nmachinePools:\n  - name: a.b_c-1\n    cap: {{}}\n    extra: 1\nscalers:\n{}",
        container("c", "a")
    );
    assert_error(
        &text,
        &[
            "machinePools[0].extra",
            "unrecognized key \"extra\"; accepted keys: name, cap",
        ],
    );
    let text = format!(
        "version: 1\nmachinePools:\n  - name: p\nscalers:\n{}",
        container("c", "a")
    );
    assert_error(
        &text,
        &["machinePools[0].cap", "missing required key `cap`"],
    );
}

#[test]
fn strict_objects_name_the_key_and_list_accepted_ones() {
    let text = format!(
        "version: 1\nglobalResourceCap: {{maxCpus: 4}}\nscalers:\n{}",
        container("c", "a")
    );
    assert_eq!(
        err_lines(&text),
        ["scalers.yaml:2:21: globalResourceCap.maxCpus: unrecognized key \"maxCpus\"; accepted keys: maxCpu, maxMemory"]
    );
    let text = with_scalers(&format!(
        "{}        imagePullpolicy: Never\n",
        container("c", "a")
    ));
    assert_error(&text, &["scalers[0].labelSets[0].imagePullpolicy: unrecognized key \"imagePullpolicy\"; accepted keys: labels, image, imagePullPolicy"]);
}

#[test]
fn unknown_top_level_keys_and_lenient_objects_warn() {
    let text = format!(
        "version: 1\nscalerz: []\ndefaults: {{resource: {{}}}}\nscalers:\n{}",
        container("c", "a")
    );
    let l = ok(&text);
    assert_eq!(
        warning_lines(&l),
        [
            "scalers.yaml:2:1: scalerz: unknown key \"scalerz\" is ignored; known keys: version, globalMaxAgents, defaults, globalResourceCap, machinePools, scalers, firecracker",
            "scalers.yaml:3:12: defaults.resource: unknown key \"resource\" is ignored; known keys: resources",
        ]
    );
}

#[test]
fn fields_of_other_types_are_accepted_with_a_warning() {
    let text = with_scalers(&format!(
        "{}        binaryPath: /x\n        rootfsPath: /r\n",
        container("c", "a").replace(
            "    labelSets:",
            "    enforceCgroups: true\n    uid: 0\n    labelSets:"
        )
    ));
    let l = ok(&text);
    let w = warning_lines(&l);
    assert_eq!(w.len(), 4, "{w:#?}");
    assert!(w[0].contains("scalers[0].enforceCgroups: `enforceCgroups` only applies to bare-metal scalers; ignored for this container scaler"));
    assert!(w[3].contains(
        "scalers[0].labelSets[0].rootfsPath: `rootfsPath` only applies to firecracker scalers"
    ));
    // They are still type-checked, as upstream's flat schema does.
    let text = with_scalers(&format!("{}        binaryPath: 5\n", container("c", "a")));
    assert_error(
        &text,
        &["scalers[0].labelSets[0].binaryPath: expected a string, got 5"],
    );
}

#[test]
fn scaler_extension() {
    let with = |ext: &str| {
        with_scalers(&container("c", "a").replace(
            "    labelSets:",
            &format!("    x-kici-scaler: {ext}\n    labelSets:"),
        ))
    };
    let l = ok(&with_scalers(&container("c", "a")));
    assert_eq!(
        l.config.scalers[0].ext,
        ScalerExtension::defaults_for(ScalerType::Container)
    );
    let l = ok(&with(
        "{provisionTimeoutSeconds: 600, registrationTimeoutSeconds: 60, pendingDispatchTimeoutSeconds: 30, maxLifetimeSeconds: 3600, destroyGraceSeconds: 2.5, apiCallTimeoutSeconds: 10, idleGraceSeconds: 15, backoff: {initialSeconds: 0.5, maxSeconds: 60, breakerThreshold: 3, breakerOpenSeconds: 20}}",
    ));
    let e = &l.config.scalers[0].ext;
    assert_eq!(e.deadlines.provision, Duration::from_secs(600));
    assert_eq!(e.deadlines.registration, Duration::from_secs(60));
    assert_eq!(e.deadlines.pending_dispatch, Duration::from_secs(30));
    assert_eq!(e.deadlines.max_lifetime, Duration::from_secs(3600));
    assert_eq!(e.deadlines.destroy_grace, Duration::from_millis(2500));
    assert_eq!(e.deadlines.api_call, Duration::from_secs(10));
    assert_eq!(e.deadlines.idle_grace, Duration::from_secs(15));
    assert_eq!(e.backoff.initial, Duration::from_millis(500));
    assert_eq!(e.backoff.max, Duration::from_secs(60));
    assert_eq!(e.backoff.breaker_threshold, 3);
    assert_eq!(e.backoff.breaker_open, Duration::from_secs(20));
    // Partial: the rest keeps the per-type defaults.
    let fc_default = ScalerExtension::defaults_for(ScalerType::BareMetal)
        .deadlines
        .destroy_grace;
    assert_eq!(fc_default, Duration::from_secs(5));
    assert_eq!(
        ok(&with("{provisionTimeoutSeconds: 9}")).config.scalers[0]
            .ext
            .deadlines
            .destroy_grace,
        Duration::from_secs(10)
    );

    assert_error(
        &with("{provisionTimeout: 9}"),
        &[
            "x-kici-scaler.provisionTimeout",
            "unrecognized key",
            "accepted keys: provisionTimeoutSeconds",
        ],
    );
    assert_error(
        &with("{apiCallTimeoutSeconds: 0}"),
        &["x-kici-scaler.apiCallTimeoutSeconds: expected a number > 0, got 0"],
    );
    assert_error(
        &with("{backoff: {breakerThreshold: 0}}"),
        &["backoff.breakerThreshold: expected an integer >= 1, got 0"],
    );
    assert_error(
        &with("{backoff: {breakerThreshold: 2.5}}"),
        &["expected an integer >= 1, got 2.5"],
    );
    assert_error(
        &with("{backoff: {initialSeconds: 10, maxSeconds: 5}}"),
        &["x-kici-scaler.backoff: initialSeconds (10) must not exceed maxSeconds (5)"],
    );
    // Default max is 300 s.
    assert_error(
        &with("{backoff: {initialSeconds: 301}}"),
        &["initialSeconds (301) must not exceed maxSeconds (300)"],
    );
    assert_error(
        &with("{backoff: {jitter: 1}}"),
        &["backoff.jitter", "unrecognized key"],
    );
}

/// `x-kici-scaler.ulimits`, compose's shape: a mapping `{soft, hard}` or a
/// bare integer for both.
#[test]
fn scaler_extension_ulimits() {
    let with = |ulimits: &str| {
        with_scalers(&container("c", "a").replace(
            "    labelSets:",
            &format!("    x-kici-scaler:\n      ulimits:\n{ulimits}    labelSets:"),
        ))
    };
    assert!(ok(&with_scalers(&container("c", "a"))).config.scalers[0]
        .ext
        .ulimits
        .is_empty());
    let l = ok(&with(
        "        nofile: {soft: 20000, hard: 40000}\n        nproc: 4096\n        memlock:\n          soft: 0\n          hard: 0\n",
    ));
    let u = &l.config.scalers[0].ext.ulimits;
    assert_eq!(u.len(), 3);
    assert_eq!(
        u[&UlimitName::Nofile],
        UlimitValue::new(20000, 40000).unwrap()
    );
    assert_eq!(u[&UlimitName::Nproc], UlimitValue::new(4096, 4096).unwrap());
    assert_eq!(u[&UlimitName::Memlock], UlimitValue::new(0, 0).unwrap());

    // Every problem at its own file:line:col, all of them reported.
    let lines = err_lines(&with(
        "        nofile: {soft: 40000, hard: 20000}\n        nprocs: 4096\n        core: -1\n        stack: {soft: 1}\n        rss: 1.5\n        cpu: {soft: 1, hard: 2, max: 3}\n",
    ));
    assert_eq!(
        lines,
        [
            "scalers.yaml:8:17: scalers[0].x-kici-scaler.ulimits.nofile: ulimit nofile: soft (40000) must not exceed hard (20000)",
            "scalers.yaml:9:9: scalers[0].x-kici-scaler.ulimits.nprocs: unknown ulimit \"nprocs\"; known: as, core, cpu, data, fsize, locks, memlock, msgqueue, nice, nofile, nproc, rss, rtprio, rttime, sigpending, stack",
            "scalers.yaml:10:15: scalers[0].x-kici-scaler.ulimits.core: a ulimit must not be negative, got -1",
            "scalers.yaml:11:16: scalers[0].x-kici-scaler.ulimits.stack.hard: missing required key `hard`",
            "scalers.yaml:12:14: scalers[0].x-kici-scaler.ulimits.rss: expected an integer between 0 and 9007199254740992, got 1.5",
            "scalers.yaml:13:33: scalers[0].x-kici-scaler.ulimits.cpu.max: unrecognized key \"max\"; accepted keys: soft, hard",
        ],
        "{lines:#?}"
    );
    assert_error(
        &with("        nofile: many\n"),
        &["ulimits.nofile: expected an integer >= 0 (or a mapping {soft, hard} of them), got \"many\""],
    );
    assert_error(
        &with("        - nofile=1:2\n"),
        &["ulimits: expected a mapping"],
    );
    // Only containers have them.
    let bare_metal = with_scalers(
        "  - name: b\n    type: bare-metal\n    maxAgents: 1\n    x-kici-scaler:\n      ulimits: {nofile: 10}\n    labelSets:\n      - labels: [b]\n        binaryPath: /bin/true\n",
    );
    assert_eq!(
        err_lines(&bare_metal),
        ["scalers.yaml:7:16: scalers[0].x-kici-scaler.ulimits: ulimits apply to container scalers only, not to type \"bare-metal\""]
    );
}

/// `x-kici-scaler.user` / `.group`: who a bare-metal scaler's agents run
/// as, by name; upstream's numeric `uid`/`gid` stay Firecracker's.
#[test]
fn scaler_extension_agent_user() {
    let metal = |ext: &str| {
        with_scalers(&format!(
            "  - name: b\n    type: bare-metal\n    maxAgents: 1\n    x-kici-scaler: {ext}\n    labelSets:\n      - labels: [b]\n        binaryPath: /bin/true\n"
        ))
    };
    let l = ok(&metal("{user: kici-agent}"));
    assert_eq!(
        l.config.scalers[0].ext.agent_user,
        Some(AgentUser {
            user: "kici-agent".into(),
            group: None
        })
    );
    let l = ok(&metal("{user: kici-agent, group: ci}"));
    assert_eq!(
        l.config.scalers[0].ext.agent_user,
        Some(AgentUser {
            user: "kici-agent".into(),
            group: Some("ci".into())
        })
    );
    assert_eq!(ok(&metal("{}")).config.scalers[0].ext.agent_user, None);

    assert_eq!(
        err_lines(&metal("{group: ci}")),
        ["scalers.yaml:6:28: scalers[0].x-kici-scaler.group: group needs user: name the user the agents run as too"]
    );
    assert_eq!(
        err_lines(&metal("{user: 1001}")),
        ["scalers.yaml:6:27: scalers[0].x-kici-scaler.user: expected a string, got 1001 (quote it to use it as a string)"]
    );
    assert_error(
        &metal("{user: \"1001\"}"),
        &["x-kici-scaler.user: expected a user name; \"1001\" must be a name, not a number"],
    );
    assert_error(
        &metal("{user: \"\"}"),
        &["x-kici-scaler.user: expected a user name; \"\" must not be empty"],
    );
    assert_error(
        &metal("{user: \"ci:ci\"}"),
        &["x-kici-scaler.user: expected a user name; \"ci:ci\" must not contain ':'"],
    );
    assert_error(
        &metal("{user: ci, group: \"-x\"}"),
        &["x-kici-scaler.group: expected a group name; \"-x\" must not start with '-'"],
    );
    assert_error(
        &metal("{username: ci}"),
        &["x-kici-scaler.username", "unrecognized key"],
    );
    // Other types' agents do not run as a host user.
    let container = with_scalers(&container("c", "a").replace(
        "    labelSets:",
        "    x-kici-scaler: {user: ci}\n    labelSets:",
    ));
    assert_error(
        &container,
        &["scalers[0].x-kici-scaler.user: user applies to bare-metal scalers only, not to type \"container\""],
    );
    // Upstream's uid/gid belong to Firecracker (the jailer's ids) and are
    // ignored, with a warning, on a bare-metal scaler: a config written for
    // upstream keeps running its agents as before.
    let l = ok(&with_scalers(
        "  - name: b\n    type: bare-metal\n    maxAgents: 1\n    uid: 1000\n    labelSets:\n      - labels: [b]\n        binaryPath: /bin/true\n",
    ));
    assert_eq!(l.config.scalers[0].ext.agent_user, None);
    let warnings: Vec<String> = l.warnings.iter().map(ToString::to_string).collect();
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("`uid` only applies to firecracker scalers")),
        "{warnings:?}"
    );
}

#[test]
fn label_set_extension() {
    let with = |ext: &str| {
        with_scalers(&format!(
            "{}        x-kici-scaler: {ext}\n",
            container("c", "a")
        ))
    };
    assert!(
        ok(&with("{readOnlyRootfs: true}")).config.scalers[0].label_sets[0]
            .ext
            .read_only_rootfs
    );
    assert!(
        !ok(&with_scalers(&container("c", "a"))).config.scalers[0].label_sets[0]
            .ext
            .read_only_rootfs
    );
    assert_error(
        &with("{readOnlyRootFs: true}"),
        &[
            "labelSets[0].x-kici-scaler.readOnlyRootFs",
            "unrecognized key",
            "accepted keys: readOnlyRootfs",
        ],
    );
    assert_error(
        &with("{readOnlyRootfs: 'yes'}"),
        &["expected true or false, got \"yes\""],
    );
}

#[test]
fn labels_are_parsed_as_user_labels() {
    assert_error(
        &with_scalers(&container("c", "'a,b'")),
        &["labels[0]", "label \"a,b\" contains whitespace, a comma"],
    );
    assert_error(
        &with_scalers(&container("c", "''")),
        &["labels[0]: a label must not be empty"],
    );
    assert_error(
        &with_scalers(&container("c", "")),
        &["labels: expected at least one label, got an empty list"],
    );
    let l = ok(&with_scalers(&container("c", "Linux, X64, linux")));
    let ls = &l.config.scalers[0].label_sets[0];
    assert_eq!(ls.labels.key(), "linux,x64");
    assert_eq!(ls.raw_labels, ["Linux", "X64", "linux"]);
}

#[test]
fn network_policy_allowlist_must_be_cidrs() {
    let text = with_scalers(&format!(
        "{}        networkPolicy: {{allowlist: [10.0.0.0/33, fe80::/10, 8.8.8.8]}}\n",
        container("c", "a")
    ));
    assert_eq!(
        err_lines(&text),
        ["scalers.yaml:9:37: scalers[0].labelSets[0].networkPolicy.allowlist[0]: expected a CIDR such as \"10.1.0.0/16\" or an IP address, got \"10.0.0.0/33\""]
    );
}

#[test]
fn scalers_key_required_but_may_be_empty() {
    assert_eq!(
        err_lines("version: 1\n"),
        ["scalers.yaml:1:1: scalers: missing required key `scalers` (a list of scaler entries)"]
    );
    let l = ok("version: 1\nscalers: []\n");
    assert!(l.config.scalers.is_empty());
    assert!(warning_lines(&l)[0].contains("no scalers are configured"));
    // A drop-in may supply them all.
    let l = load_documents(&[
        ("m.yaml", "version: 1\n"),
        ("d/a.yaml", &format!("scalers:\n{}", container("c", "a"))),
    ])
    .unwrap();
    assert_eq!(l.config.scalers.len(), 1);
    assert_error(
        "version: 1\nscalers: {a: 1}\n",
        &["scalers: expected a list, got a mapping"],
    );
}

#[test]
fn empty_and_malformed_files() {
    assert_eq!(
        err_lines(""),
        ["scalers.yaml:1:1: the file is empty: expected a mapping with at least `version: 1` and `scalers`"]
    );
    assert_eq!(err_lines("# just a comment\n\n"), err_lines(""));
    assert_eq!(err_lines("- a\n- b\n"), ["scalers.yaml:1:1: the top level must be a mapping (version, globalMaxAgents, scalers, ...)"]);
    assert_eq!(
        err_lines("version: 1\nscalers: []\n---\nversion: 1\n"),
        ["scalers.yaml:3:1: a second YAML document starts here; a configuration file holds exactly one"]
    );
    assert_eq!(
        err_lines("version: 1\nversion: 1\nscalers: []\n"),
        ["scalers.yaml:2:1: duplicate key \"version\" (first at line 1, column 1)"]
    );
    assert_eq!(err_lines("version: 1\nscalers: [\n"), ["scalers.yaml:3:1: YAML syntax error: while parsing a node, did not find expected node content"]);
    // Anchors and aliases are accepted (tests/anchors.rs): only the schema
    // has something to say here.
    assert_eq!(
        err_lines("a: &x 1\nb: *x\nversion: *x\n"),
        ["scalers.yaml:1:1: scalers: missing required key `scalers` (a list of scaler entries)"]
    );
    // A tag the core schema does not define leaves a string, with a warning,
    // as upstream's parser does (it used to be refused).
    let l = ok(&with_scalers(&container("c", "a")).replace("image: kici", "image: !foo kici"));
    assert_eq!(
        warning_lines(&l),
        ["scalers.yaml:8:21: the tag `!foo` is not a YAML core-schema tag: the value is read as a string, as upstream's parser reads it"]
    );
    // Core-schema tags are honoured as upstream's parser does: `!!str` makes
    // a string.
    assert_error(
        &with_scalers(&container("c", "a")).replace("maxAgents: 2", "maxAgents: !!str 2"),
        &["maxAgents: expected an integer"],
    );
    // A syntax error in one file does not hide errors in another.
    let err = load_documents(&[
        (
            "m.yaml",
            &with_scalers(&container("c", "a")).replace("maxAgents: 2", "maxAgents: 0"),
        ),
        ("d.yaml", "scalers: ["),
    ])
    .unwrap_err();
    assert_eq!(err.len(), 2, "{err}");
    assert!(err.0[0]
        .to_string()
        .starts_with("m.yaml:5:16: scalers[0].maxAgents"));
    assert!(err.0[1]
        .to_string()
        .starts_with("d.yaml:2:1: YAML syntax error"));
}

#[test]
fn drop_in_only_contributes_scalers() {
    let drop_in = format!(
        "globalMaxAgents: 1\nmachinePools: []\nscalers:\n{}",
        container("d", "b")
    );
    let l = load_documents(&[
        ("scalers.yaml", &with_scalers(&container("c", "a"))),
        ("scalers.d/a.yaml", &drop_in),
    ])
    .unwrap();
    assert_eq!(l.config.global_max_agents, 50);
    assert_eq!(l.config.scalers.len(), 2);
    assert_eq!(
        warning_lines(&l),
        [
            "scalers.d/a.yaml:1:1: globalMaxAgents: \"globalMaxAgents\" is ignored in a drop-in file: only `scalers` is read from scalers.d (set it in the main file)",
            "scalers.d/a.yaml:2:1: machinePools: \"machinePools\" is ignored in a drop-in file: only `scalers` is read from scalers.d (set it in the main file)",
        ]
    );
    // Upstream ignores drop-ins that are empty, a list, or whose scalers is not a list.
    for ignored in [
        "",
        "- a\n",
        "scalers: {a: 1}\n",
        "scalers:\n",
        "scalers: []\n",
    ] {
        let l = load_documents(&[
            ("m.yaml", &with_scalers(&container("c", "a"))),
            ("d.yaml", ignored),
        ])
        .unwrap();
        assert_eq!(l.config.scalers.len(), 1, "{ignored:?}");
    }
}

#[test]
fn type_errors_say_what_was_expected() {
    let cases = [
        (
            "maxAgents: 2",
            "maxAgents: abc",
            "maxAgents: expected an integer > 0, got \"abc\"",
        ),
        (
            "maxAgents: 2",
            "maxAgents: '2'",
            "maxAgents: expected an integer > 0, got \"2\"",
        ),
        (
            "type: container",
            "type: [container]",
            "type: expected a string, got a list",
        ),
        (
            "image: kici/agent:1",
            "image: {a: 1}",
            "image: expected a string, got a mapping",
        ),
        (
            "labels: [a]",
            "labels: a",
            "labels: expected a list, got \"a\"",
        ),
    ];
    for (from, to, expected) in cases {
        let text = with_scalers(&container("c", "a").replace(from, to));
        assert_error(&text, &[expected]);
    }
    let text = with_scalers(&container("c", "a").replace(
        "    labelSets:",
        "    networkIsolation: 'false'\n    labelSets:",
    ));
    assert_error(
        &text,
        &["networkIsolation: expected true or false, got \"false\""],
    );
    let text =
        with_scalers(&container("c", "a").replace("    labelSets:", "    uid: -1\n    labelSets:"));
    assert_error(&text, &["uid: expected an integer >= 0, got -1"]);
}

#[test]
fn explicit_nulls_are_errors_as_upstream() {
    // Upstream's schema refuses an explicit null (`~`, `null`, or a key with
    // no value) for every field it types; leaving the key out is the only
    // way to get a default. These used to read as absent.
    let text = with_scalers(&format!(
        "{}        env:\n        resources: ~\n",
        container("c", "a").replace(
            "    labelSets:",
            "    warmPool:\n    roles: null\n    labelSets:"
        )
    ));
    let hint = "(an explicit null is not \"unset\": remove the key to use the default)";
    assert_eq!(
        err_lines(&text),
        [
            format!("scalers.yaml:6:5: scalers[0].warmPool: expected a mapping, got null {hint}"),
            format!("scalers.yaml:7:12: scalers[0].roles: expected a list, got null {hint}"),
            format!("scalers.yaml:11:9: scalers[0].labelSets[0].env: expected a mapping, got null {hint}"),
            format!("scalers.yaml:12:20: scalers[0].labelSets[0].resources: expected a mapping, got null {hint}"),
        ]
    );
}

#[test]
fn crlf_line_endings_load() {
    let text = with_scalers(&container("c", "a")).replace('\n', "\r\n");
    let l = ok(&text);
    assert_eq!(
        l.config.scalers[0].label_sets[0].backend,
        ok(&with_scalers(&container("c", "a"))).config.scalers[0].label_sets[0].backend
    );
    assert_eq!(
        err_lines(&text.replace("maxAgents: 2", "maxAgents: 0")),
        ["scalers.yaml:5:16: scalers[0].maxAgents: expected an integer > 0, got 0"]
    );
}

#[test]
fn origins_point_at_entries() {
    let l = ok(&with_scalers(&format!(
        "{}{}",
        container("a", "x"),
        container("b", "y")
    )));
    let s = &l.config.scalers[1];
    assert_eq!(s.origin.to_string(), "scalers.yaml:9:5");
    assert_eq!(s.label_sets[0].origin.to_string(), "scalers.yaml:13:9");
}

/// `x-kici-scaler.warmPool`: a schedule of periods and a forecast's bounds,
/// each size bounded by `maxAgents`, every mistake named where it is.
#[test]
fn warm_pool_schedule_and_forecast() {
    use kici_model::{TimeOfDay, Weekday};
    let with = |warm: &str| {
        with_scalers(&container("c", "a").replace(
            "    labelSets:",
            &format!("    x-kici-scaler:\n      warmPool:\n{warm}    labelSets:"),
        ))
    };
    let l = ok(&with(concat!(
        "        schedule:\n",
        "          - {days: [mon, tue, wed, thu, fri], from: \"08:00\", to: \"18:00\", timezone: Europe/Paris, size: 2}\n",
        "          - {days: [sat], from: \"22:00\", to: \"02:00\", timezone: UTC, size: 0}\n",
        "        forecast: {minSize: 1, maxSize: 2}\n",
    )));
    let policy = l.config.scalers[0].ext.warm_pool.clone().unwrap();
    assert_eq!(policy.schedule.len(), 2);
    let p = &policy.schedule[0];
    assert_eq!(
        p.days,
        [
            Weekday::Mon,
            Weekday::Tue,
            Weekday::Wed,
            Weekday::Thu,
            Weekday::Fri
        ]
    );
    assert_eq!(
        (p.from, p.to),
        (
            TimeOfDay::parse("08:00").unwrap(),
            TimeOfDay::parse("18:00").unwrap()
        )
    );
    assert_eq!(p.timezone.name(), "Europe/Paris");
    assert_eq!(p.size, 2);
    let f = policy.forecast.unwrap();
    assert_eq!((f.min_size, f.max_size), (1, 2));
    // Without `warmPool` under the extension: none.
    assert!(ok(&with_scalers(&container("c", "a"))).config.scalers[0]
        .ext
        .warm_pool
        .is_none());

    // Every error at once, each at its line and column with its path.
    let lines = err_lines(&with(concat!(
        "        schedule:\n",
        "          - {days: [mon, funday], from: \"8:00\", to: \"25:00\", timezone: Mars/Olympus, size: 3}\n",
        "          - {days: [], from: \"10:00\", to: \"10:00\", timezone: UTC, size: 1, every: 2}\n",
        "          - {from: \"10:00\", to: \"11:00\", timezone: UTC, size: 1}\n",
        "        forecast: {minSize: 2, maxSize: 1}\n",
        "        typo: 1\n",
    )));
    let expect = [
        "scalers.yaml:9:26: scalers[0].x-kici-scaler.warmPool.schedule[0].days[1]: expected one of \"mon\", \"tue\", \"wed\", \"thu\", \"fri\", \"sat\", \"sun\", got \"funday\"",
        "scalers.yaml:9:41: scalers[0].x-kici-scaler.warmPool.schedule[0].from: expected a time of day \"HH:MM\" from \"00:00\" to \"24:00\", got \"8:00\"",
        "scalers.yaml:9:53: scalers[0].x-kici-scaler.warmPool.schedule[0].to: expected a time of day \"HH:MM\" from \"00:00\" to \"24:00\", got \"25:00\"",
        "scalers.yaml:9:72: scalers[0].x-kici-scaler.warmPool.schedule[0].timezone: expected an IANA time zone name such as \"Europe/Paris\" or \"UTC\", got \"Mars/Olympus\" (not in this host's time zone database)",
        "scalers.yaml:9:92: scalers[0].x-kici-scaler.warmPool.schedule[0].size: expected a size of at most maxAgents (2), got 3",
        "scalers.yaml:10:20: scalers[0].x-kici-scaler.warmPool.schedule[1].days: expected at least one day, got an empty list",
        "scalers.yaml:10:43: scalers[0].x-kici-scaler.warmPool.schedule[1].to: expected a `to` other than `from` (10:00); a whole day is from \"00:00\" to \"24:00\"",
        "scalers.yaml:11:13: scalers[0].x-kici-scaler.warmPool.schedule[2].days: missing required key `days`",
        "scalers.yaml:12:19: scalers[0].x-kici-scaler.warmPool.forecast: minSize (2) must not exceed maxSize (1)",
    ];
    for e in expect {
        assert!(
            lines.iter().any(|l| l == e),
            "missing {e}; got:\n{}",
            lines.join("\n")
        );
    }
    assert!(
        lines
            .iter()
            .any(|l| l.contains("warmPool.schedule[1].every") && l.contains("unrecognized key")),
        "{lines:?}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("x-kici-scaler.warmPool.typo")
                && l.contains("accepted keys: schedule, forecast")),
        "{lines:?}"
    );
    assert_error(
        &with("        forecast: {minSize: 1, maxSize: 3}\n"),
        &["warmPool.forecast.maxSize: expected a size of at most maxAgents (2), got 3"],
    );
    assert_error(
        &with("        forecast: {minSize: 1}\n"),
        &["warmPool.forecast.maxSize: missing required key `maxSize`"],
    );
}
