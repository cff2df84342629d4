//! What changed between two configurations, field by field, for the reload
//! log and `POST /v1/reload`.

use kici_model::Config;
use serde_json::{Map, Value};
use std::fmt;

/// One changed field. `old: None` = added, `new: None` = removed.
#[derive(Debug, Clone, PartialEq)]
pub struct FieldChange {
    /// e.g. `scalers[name=x].maxAgents`, `firecracker.cidr`.
    pub path: String,
    pub old: Option<Value>,
    pub new: Option<Value>,
}

impl fmt::Display for FieldChange {
    /// `scalers[name=x].maxAgents: 5 -> 10`; a missing side shows as `(absent)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let side = |v: &Option<Value>| {
            v.as_ref()
                .map_or_else(|| "(absent)".to_owned(), Value::to_string)
        };
        write!(
            f,
            "{}: {} -> {}",
            self.path,
            side(&self.old),
            side(&self.new)
        )
    }
}

/// Compares two snapshots through their serialised form. Scalers are matched
/// by name (a scaler whose `type` changed is reported as removed and added);
/// other lists by index. Positions (`Origin`s) are not compared.
pub fn diff(old: &Config, new: &Config) -> Vec<FieldChange> {
    // Serialising these types cannot fail: every map key is a string.
    let old = serde_json::to_value(old).unwrap_or(Value::Null);
    let new = serde_json::to_value(new).unwrap_or(Value::Null);
    let mut out = Vec::new();
    match (&old, &new) {
        (Value::Object(o), Value::Object(n)) => objects("", o, n, &mut out, true),
        _ => values("", &old, &new, &mut out),
    }
    out
}

fn join(parent: &str, key: &str) -> String {
    if parent.is_empty() {
        key.to_owned()
    } else {
        format!("{parent}.{key}")
    }
}

fn push(out: &mut Vec<FieldChange>, path: String, old: Option<&Value>, new: Option<&Value>) {
    out.push(FieldChange {
        path,
        old: old.cloned(),
        new: new.cloned(),
    });
}

fn objects(
    parent: &str,
    o: &Map<String, Value>,
    n: &Map<String, Value>,
    out: &mut Vec<FieldChange>,
    top: bool,
) {
    // Sorted explicitly: the map's own order depends on serde_json's
    // `preserve_order` feature, which another crate may switch on.
    let mut keys: Vec<&String> = o.keys().chain(n.keys()).collect();
    keys.sort();
    keys.dedup();
    for key in keys {
        let path = join(parent, key);
        match (o.get(key), n.get(key)) {
            (Some(Value::Array(a)), Some(Value::Array(b))) if top && key == "scalers" => {
                scalers(a, b, out)
            }
            (Some(a), Some(b)) => values(&path, a, b, out),
            (a, b) => push(out, path, a, b),
        }
    }
}

fn values(path: &str, a: &Value, b: &Value, out: &mut Vec<FieldChange>) {
    if a == b {
        return;
    }
    match (a, b) {
        (Value::Object(o), Value::Object(n)) => objects(path, o, n, out, false),
        (Value::Array(x), Value::Array(y)) => {
            for i in 0..x.len().max(y.len()) {
                let p = format!("{path}[{i}]");
                match (x.get(i), y.get(i)) {
                    (Some(l), Some(r)) => values(&p, l, r, out),
                    (l, r) => push(out, p, l, r),
                }
            }
        }
        _ => push(out, path.to_owned(), Some(a), Some(b)),
    }
}

fn name_of(v: &Value) -> Option<&str> {
    v.get("name").and_then(Value::as_str)
}

fn scalers(old: &[Value], new: &[Value], out: &mut Vec<FieldChange>) {
    let find =
        |list: &'_ [Value], name: &str| list.iter().find(|v| name_of(v) == Some(name)).cloned();
    for o in old {
        let name = name_of(o).unwrap_or_default();
        let path = format!("scalers[name={name}]");
        match find(new, name) {
            None => push(out, path, Some(o), None),
            Some(n) if o.get("type") != n.get("type") => {
                push(out, path.clone(), Some(o), None);
                push(out, path, None, Some(&n));
            }
            Some(n) => values(&path, o, &n, out),
        }
    }
    for n in new {
        let name = name_of(n).unwrap_or_default();
        if find(old, name).is_none() {
            push(out, format!("scalers[name={name}]"), None, Some(n));
        }
    }
    // Routing breaks ties by configuration order, so a reordering of the
    // scalers both sides have is a change of its own.
    let common = |a: &[Value], b: &[Value]| -> Vec<Value> {
        a.iter()
            .filter_map(name_of)
            .filter(|n| b.iter().any(|v| name_of(v) == Some(n)))
            .map(|n| Value::String(n.to_owned()))
            .collect()
    };
    let (o, n) = (common(old, new), common(new, old));
    if o != n {
        out.push(FieldChange {
            path: "scalers(order)".into(),
            old: Some(Value::Array(o)),
            new: Some(Value::Array(n)),
        });
    }
}
