//! The MMDS document a guest boots with (KiCI's MMDS keys).
//!
//! Built from [`kici_host::agent_env`] — the one agent environment every
//! backend shares — so precedence and reserved names are decided there, not
//! here. The scaler's own values go to dedicated keys under
//! `latest/meta-data/`; every other variable goes into the `kici-env`
//! object, which the guest `/init` exports as is:
//!
//! | env | MMDS key |
//! |---|---|
//! | `KICI_ORCHESTRATOR_URL` | `kici-orchestrator-url` |
//! | `KICI_AGENT_ID` | `kici-agent-id` |
//! | `KICI_LABELS` | `kici-labels` |
//! | `KICI_SCALER_MANAGED` | `kici-scaler-managed` |
//! | `KICI_AGENT_TOKEN` | `kici-agent-token` |
//! | `KICI_BACKPRESSURE_MODE` | `kici-backpressure-mode` |
//! | (the bridge gateway) | `kici-gateway-ip` |
//! | anything else | `kici-env/<NAME>` |
//!
//! `kici-env` keys must be POSIX names; its serialised size is held within
//! [`ENV_BUDGET_BYTES`] first-fit (a large entry is skipped, later small
//! ones still fit), measured on the JSON as sent — escapes included
//! (upstream measured raw bytes and could overflow Firecracker's store; see
//! docs/deviations.md, D-mmds-budget).
//! Every skipped entry is warned about.

use serde_json::{Map, Value};
use std::net::Ipv4Addr;

/// Budget of the serialised `kici-env` object.
pub const ENV_BUDGET_BYTES: usize = 32 * 1024;

/// Env names carried as dedicated MMDS keys.
const DEDICATED: [(&str, &str); 6] = [
    ("KICI_ORCHESTRATOR_URL", "kici-orchestrator-url"),
    ("KICI_AGENT_ID", "kici-agent-id"),
    ("KICI_LABELS", "kici-labels"),
    ("KICI_SCALER_MANAGED", "kici-scaler-managed"),
    ("KICI_AGENT_TOKEN", "kici-agent-token"),
    ("KICI_BACKPRESSURE_MODE", "kici-backpressure-mode"),
];

/// Why an env entry did not reach the guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Skipped {
    NotPosix { name: String },
    OverBudget { name: String, bytes: usize },
}

/// The document and what was left out of it.
#[derive(Debug, Clone, PartialEq)]
pub struct MmdsDocument {
    pub value: Value,
    pub skipped: Vec<Skipped>,
}

/// The cleared store: the same shape, no keys.
pub fn cleared() -> Value {
    serde_json::json!({"latest": {"meta-data": {}}})
}

/// Does `name` match `^[A-Za-z_][A-Za-z0-9_]*$`?
pub fn is_posix_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// Builds the document from the agent's environment (as `agent_env`
/// returns it) and the bridge gateway.
pub fn build(env: &[(String, String)], gateway: Ipv4Addr) -> MmdsDocument {
    let mut meta = Map::new();
    let mut kici_env = Map::new();
    let mut skipped = Vec::new();
    // `{}`: the braces count from the start.
    let mut used = 2usize;
    for (name, value) in env {
        if let Some((_, key)) = DEDICATED.iter().find(|(n, _)| n == name) {
            meta.insert((*key).to_owned(), Value::String(value.clone()));
            continue;
        }
        if !is_posix_name(name) {
            tracing::warn!(variable = %name, "not forwarded to the VM: not a POSIX-safe variable name");
            skipped.push(Skipped::NotPosix { name: name.clone() });
            continue;
        }
        let bytes = entry_bytes(name, value) + usize::from(!kici_env.is_empty());
        if used + bytes > ENV_BUDGET_BYTES {
            tracing::warn!(
                variable = %name,
                bytes,
                budget = ENV_BUDGET_BYTES,
                "not forwarded to the VM: it would exceed the {ENV_BUDGET_BYTES}-byte MMDS env budget"
            );
            skipped.push(Skipped::OverBudget {
                name: name.clone(),
                bytes,
            });
            continue;
        }
        used += bytes;
        kici_env.insert(name.clone(), Value::String(value.clone()));
    }
    meta.insert("kici-gateway-ip".into(), Value::String(gateway.to_string()));
    if !kici_env.is_empty() {
        meta.insert("kici-env".into(), Value::Object(kici_env));
    }
    MmdsDocument {
        value: serde_json::json!({"latest": {"meta-data": Value::Object(meta)}}),
        skipped,
    }
}

/// Bytes of `"name":"value"` as serialised (escapes included).
fn entry_bytes(name: &str, value: &str) -> usize {
    json_string_len(name) + 1 + json_string_len(value)
}

fn json_string_len(s: &str) -> usize {
    // Serialising a &str cannot fail; 0 would only under-count one entry.
    serde_json::to_string(s).map_or(0, |j| j.len())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).into(), (*v).into()))
            .collect()
    }

    #[test]
    fn firecracker_mmds_dedicated_keys_and_kici_env() {
        let doc = build(
            &env(&[
                ("HTTP_PROXY", "http://proxy:3128"),
                ("KICI_AGENT_ID", "scaler-firecracker-01020304"),
                ("KICI_AGENT_TOKEN", "kat_x"),
                ("KICI_LABELS", "linux,firecracker,kici:agent:firecracker"),
                ("KICI_ORCHESTRATOR_URL", "ws://10.0.0.1:7879/ws"),
                ("KICI_ROLES", "builder"),
                ("KICI_SCALER_MANAGED", "1"),
            ]),
            Ipv4Addr::new(10, 0, 0, 1),
        );
        assert!(doc.skipped.is_empty());
        assert_eq!(
            doc.value,
            serde_json::json!({"latest": {"meta-data": {
                "kici-orchestrator-url": "ws://10.0.0.1:7879/ws",
                "kici-agent-id": "scaler-firecracker-01020304",
                "kici-labels": "linux,firecracker,kici:agent:firecracker",
                "kici-scaler-managed": "1",
                "kici-agent-token": "kat_x",
                "kici-gateway-ip": "10.0.0.1",
                "kici-env": {"HTTP_PROXY": "http://proxy:3128", "KICI_ROLES": "builder"}
            }}})
        );
    }

    #[test]
    fn firecracker_mmds_kici_env_absent_when_empty() {
        let doc = build(&env(&[("KICI_SCALER_MANAGED", "1")]), Ipv4Addr::LOCALHOST);
        let meta = &doc.value["latest"]["meta-data"];
        assert!(meta.get("kici-env").is_none());
        assert_eq!(meta["kici-scaler-managed"], "1");
    }

    #[test]
    fn firecracker_mmds_budget_is_first_fit_on_the_serialised_json() {
        let big = "x".repeat(40 * 1024);
        let doc = build(
            &env(&[
                ("A_BIG", &big),
                ("BAD/KEY", "1"),
                ("SMALL", "fits"),
                ("0BAD", "1"),
                ("GOOD_KEY", "1"),
            ]),
            Ipv4Addr::LOCALHOST,
        );
        let kici_env = doc.value["latest"]["meta-data"]["kici-env"]
            .as_object()
            .unwrap();
        let names: Vec<&str> = kici_env.keys().map(String::as_str).collect();
        assert_eq!(names, ["GOOD_KEY", "SMALL"]);
        assert_eq!(doc.skipped.len(), 3);
        assert!(matches!(&doc.skipped[0], Skipped::OverBudget { name, .. } if name == "A_BIG"));

        // Quotes and control characters count escaped: 2 × 8 KiB of `"`
        // serialise to 32 KiB + overhead, so the second one no longer fits.
        let quotes = "\"".repeat(8 * 1024);
        let doc = build(
            &env(&[("Q1", &quotes), ("Q2", &quotes)]),
            Ipv4Addr::LOCALHOST,
        );
        assert_eq!(doc.skipped.len(), 1);
        let serialised =
            serde_json::to_string(&doc.value["latest"]["meta-data"]["kici-env"]).unwrap();
        assert!(serialised.len() <= ENV_BUDGET_BYTES);

        // Exactly filling the budget is allowed.
        let fill = "v".repeat(ENV_BUDGET_BYTES - 2 - entry_bytes("F", ""));
        let doc = build(&env(&[("F", &fill)]), Ipv4Addr::LOCALHOST);
        assert!(doc.skipped.is_empty());
        let serialised =
            serde_json::to_string(&doc.value["latest"]["meta-data"]["kici-env"]).unwrap();
        assert_eq!(serialised.len(), ENV_BUDGET_BYTES);
    }
}
