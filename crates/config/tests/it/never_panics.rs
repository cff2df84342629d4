//! `load_documents` never panics: arbitrary bytes, YAML-ish token soup, and
//! random edits of the fixture configs. Every failure is a positioned error.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kici_config::load_documents;
use proptest::prelude::*;

const FIXTURES: [&str; 6] = [
    include_str!("../fixtures/valid/minimal.yaml"),
    include_str!("../fixtures/valid/upstream-0.9.yaml"),
    include_str!("../fixtures/valid/mixed.yaml"),
    include_str!("../fixtures/valid/firecracker.yaml"),
    include_str!("../fixtures/valid/caps.yaml"),
    include_str!("../fixtures/invalid/deviations.yaml"),
];

const TOKENS: [&str; 63] = [
    "version: 1\n",
    "scalers:\n",
    "  - ",
    "    ",
    "name: a\n",
    "type: container\n",
    "type: firecracker\n",
    "maxAgents: 2\n",
    "labelSets:\n",
    "      - labels: [a, b]\n",
    "image: i\n",
    "binaryPath: /b\n",
    "resources: {cpus: 2, memory: 1g}\n",
    "requests:",
    "limits:",
    "warmPool: {enabled: true, size: 9}\n",
    "mandatoryLabels: [a]\n",
    "roles: [all]\n",
    "machinePools:\n",
    "  - name: p\n    cap: {maxCpu: 1}\n",
    "machinePool: p\n",
    "env: {A: b}\n",
    "firecracker: {cidr: 10.0.0.0/30}\n",
    "x-kici-scaler: {backoff: {maxSeconds: 1}}\n",
    "[",
    "]",
    "{",
    "}",
    ": ",
    "- ",
    "\n",
    "  ",
    "\t",
    "'",
    "\"",
    "#",
    "&a ",
    "*a",
    "!!str ",
    "---\n",
    "...\n",
    "|\n",
    ">\n",
    "~",
    "null",
    "1.5",
    "-1",
    "? ",
    // What upstream 0.9 reads differently or newly: tags on any scalar,
    // `<<` as a plain key, the new fields, labels with blanks.
    "!!int ",
    "!!float ",
    "!!null ",
    "!custom ",
    "!!set ",
    "<<: ",
    "%YAML 1.1\n",
    "platform: {os: macos, arch: arm64}\n",
    "maxConcurrentSpawns: 3\n",
    "networkPolicy: {hostAccess: ['*:53', '10.0.0.0/8:*']}\n",
    "type: event\n",
    "\" Linux\"",
    "firecracker: {autoProvisionHost: ~}\n",
    "claimTtlSeconds: 1\n",
    "\"3\"",
];

fn check(docs: &[(&str, &str)]) {
    match load_documents(docs) {
        Ok(l) => {
            // A loaded config always has its files and consistent scalers.
            assert_eq!(l.files.len(), docs.len());
            for s in &l.config.scalers {
                assert!(!s.label_sets.is_empty());
            }
        }
        Err(e) => {
            assert!(!e.is_empty());
            for d in e.iter() {
                assert!(!d.message.is_empty());
                assert!(
                    docs.iter().any(|(name, _)| *name == d.origin.file.as_ref()),
                    "{d}"
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes(main in proptest::collection::vec(any::<u8>(), 0..512), drop_in in proptest::collection::vec(any::<u8>(), 0..128)) {
        let main = String::from_utf8_lossy(&main);
        let drop_in = String::from_utf8_lossy(&drop_in);
        check(&[("scalers.yaml", &main)]);
        check(&[("scalers.yaml", &main), ("scalers.d/a.yaml", &drop_in)]);
    }

    #[test]
    fn yaml_ish_token_soup(tokens in proptest::collection::vec(proptest::sample::select(TOKENS.to_vec()), 0..60)) {
        let text: String = tokens.concat();
        check(&[("scalers.yaml", &text)]);
        check(&[("scalers.yaml", FIXTURES[0]), ("scalers.d/a.yaml", &text)]);
    }

    #[test]
    fn edited_fixtures(
        which in 0..FIXTURES.len(),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), 0usize..8, proptest::sample::select(TOKENS.to_vec())), 1..6),
    ) {
        let mut text = FIXTURES[which].to_owned();
        for (at, delete, insert) in edits {
            let mut i = at.index(text.len() + 1);
            while !text.is_char_boundary(i) {
                i -= 1;
            }
            let mut end = (i + delete).min(text.len());
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            text.replace_range(i..end, insert);
        }
        check(&[("scalers.yaml", &text)]);
    }

    #[test]
    fn scalar_values_anywhere(value in "\\PC{0,12}", tag in proptest::sample::select(vec!["", "!!int ", "!!float ", "!!bool ", "!!null ", "!!str ", "! ", "!x "])) {
        let quoted = format!("{tag}{value:?}");
        let plain = format!("{tag}{value}");
        for v in [plain.as_str(), quoted.as_str()] {
            let text = format!(
                "version: 1\nglobalMaxAgents: {v}\nscalers:\n  - name: {v}\n    type: container\n    maxAgents: {v}\n    labelSets:\n      - labels: [{v}]\n        image: {v}\n        resources: {{cpus: {v}, memory: {v}}}\n"
            );
            check(&[("scalers.yaml", &text)]);
        }
    }
}

#[test]
fn pathological_nesting_is_refused_cleanly() {
    let deep_block = format!("version: 1\nscalers:\n{}x\n", "- ".repeat(5_000));
    let deep_flow = format!(
        "version: 1\nscalers: {}{}\n",
        "[".repeat(5_000),
        "]".repeat(5_000)
    );
    let mut deep_map = String::from("version: 1\n");
    for i in 0..2_000 {
        deep_map.push_str(&" ".repeat(i));
        deep_map.push_str("k:\n");
    }
    for text in [deep_block, deep_flow, deep_map] {
        let h = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || {
                load_documents(&[("scalers.yaml", &text)])
                    .map(|_| ())
                    .unwrap_err()
                    .to_string()
            })
            .unwrap();
        let msg = h.join().unwrap();
        assert!(
            msg.contains("nested too deeply") || msg.contains("recursion limit exceeded"),
            "{msg}"
        );
    }
}

#[test]
fn oversized_input_is_refused() {
    let big = format!("version: 1\nscalers: []\n#{}\n", "x".repeat(9 << 20));
    let e = load_documents(&[("scalers.yaml", &big)]).unwrap_err();
    assert!(
        e.to_string().contains("more than the 8388608 accepted"),
        "{e}"
    );
}
