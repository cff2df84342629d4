//! JSON body validation against the spec's `definitions`, producing errors
//! worded like the serde errors Firecracker returns for bad bodies
//! (`missing field`, `unknown field`, `invalid type`, `unknown variant`).

use std::collections::BTreeMap;

use serde_json::Value;

/// A body schema, as far as the Firecracker spec uses swagger.
#[derive(Debug, Clone)]
pub enum Schema {
    Object(ObjectSchema),
    Array(Box<Schema>),
    String {
        allowed: Option<Vec<String>>,
    },
    Integer {
        minimum: Option<i64>,
        maximum: Option<i64>,
    },
    Number,
    Boolean,
    /// A reference to a named definition.
    Ref(String),
    Any,
}

/// An object schema.
#[derive(Debug, Clone)]
pub struct ObjectSchema {
    /// Definition (or operation) name, used in messages.
    pub name: String,
    /// Properties in spec order.
    pub properties: Vec<(String, Schema)>,
    pub required: Vec<String>,
    /// `additionalProperties` allowed (otherwise unknown keys are refused,
    /// like Firecracker's `deny_unknown_fields`).
    pub additional_allowed: bool,
}

/// Options that bend validation where Firecracker's deserializers differ from the letter of the spec.
#[derive(Debug, Clone, Copy, Default)]
pub struct ValidationOptions {
    /// Ignore `required` at the top level (PATCH bodies whose Rust type has all-optional fields).
    pub top_level_required_optional: bool,
    /// Compare enum values case-insensitively (Firecracker's logger `level`).
    pub case_insensitive_enums: bool,
}

/// The first violation found in a body.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Violation {
    #[error("missing field `{field}`{at}")]
    MissingField { field: String, at: Location },
    #[error("unknown field `{field}`, expected {expected}{at}")]
    UnknownField {
        field: String,
        expected: String,
        at: Location,
    },
    #[error("invalid type: {found}, expected {expected}{at}")]
    InvalidType {
        found: String,
        expected: String,
        at: Location,
    },
    #[error("unknown variant `{found}`, expected {expected}{at}")]
    UnknownVariant {
        found: String,
        expected: String,
        at: Location,
    },
    #[error("invalid value: integer `{found}`, expected {expected}{at}")]
    OutOfRange {
        found: String,
        expected: String,
        at: Location,
    },
    #[error("the spec references an unknown definition `{0}`")]
    UnknownDefinition(String),
}

/// Where in the body a violation sits (empty at the top level).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Location(pub Vec<String>);

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_empty() {
            Ok(())
        } else {
            write!(f, " at `{}`", self.0.join("."))
        }
    }
}

/// Validate `value` against `schema`, resolving references in `definitions`.
pub fn validate(
    value: &Value,
    schema: &Schema,
    definitions: &BTreeMap<String, Schema>,
    options: ValidationOptions,
) -> Result<(), Violation> {
    let mut path = Vec::new();
    check(value, schema, definitions, options, &mut path, true)
}

fn describe(value: &Value) -> String {
    match value {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("boolean `{b}`"),
        Value::Number(n) if n.is_f64() => format!("floating point `{n}`"),
        Value::Number(n) => format!("integer `{n}`"),
        Value::String(s) => format!("string {s:?}"),
        Value::Array(_) => "sequence".into(),
        Value::Object(_) => "map".into(),
    }
}

fn one_of(names: &[String]) -> String {
    match names {
        [] => "no fields".into(),
        [one] => format!("`{one}`"),
        [a, b] => format!("`{a}` or `{b}`"),
        many => format!(
            "one of {}",
            many.iter()
                .map(|n| format!("`{n}`"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

fn check(
    value: &Value,
    schema: &Schema,
    defs: &BTreeMap<String, Schema>,
    options: ValidationOptions,
    path: &mut Vec<String>,
    top: bool,
) -> Result<(), Violation> {
    let at = || Location(path.clone());
    match schema {
        Schema::Any => Ok(()),
        Schema::Ref(name) => {
            let target = defs
                .get(name)
                .ok_or_else(|| Violation::UnknownDefinition(name.clone()))?;
            check(value, target, defs, options, path, top)
        }
        Schema::Boolean => match value {
            Value::Bool(_) => Ok(()),
            other => Err(Violation::InvalidType {
                found: describe(other),
                expected: "a boolean".into(),
                at: at(),
            }),
        },
        Schema::Number => match value {
            Value::Number(_) => Ok(()),
            other => Err(Violation::InvalidType {
                found: describe(other),
                expected: "a number".into(),
                at: at(),
            }),
        },
        Schema::Integer { minimum, maximum } => {
            let Some(n) = value.as_i64().or_else(|| value.as_u64().map(|_| i64::MAX)) else {
                return Err(Violation::InvalidType {
                    found: describe(value),
                    expected: "an integer".into(),
                    at: at(),
                });
            };
            let below = minimum.is_some_and(|m| n < m);
            let above = maximum.is_some_and(|m| n > m);
            if below || above {
                let expected = match (minimum, maximum) {
                    (Some(lo), Some(hi)) => format!("an integer between {lo} and {hi}"),
                    (Some(lo), None) => format!("an integer of at least {lo}"),
                    (None, Some(hi)) => format!("an integer of at most {hi}"),
                    (None, None) => "an integer".into(),
                };
                return Err(Violation::OutOfRange {
                    found: value.to_string(),
                    expected,
                    at: at(),
                });
            }
            Ok(())
        }
        Schema::String { allowed } => {
            let Some(s) = value.as_str() else {
                return Err(Violation::InvalidType {
                    found: describe(value),
                    expected: "a string".into(),
                    at: at(),
                });
            };
            if let Some(allowed) = allowed {
                let ok = allowed.iter().any(|a| {
                    if options.case_insensitive_enums {
                        a.eq_ignore_ascii_case(s)
                    } else {
                        a == s
                    }
                });
                if !ok {
                    return Err(Violation::UnknownVariant {
                        found: s.to_string(),
                        expected: one_of(allowed),
                        at: at(),
                    });
                }
            }
            Ok(())
        }
        Schema::Array(items) => {
            let Some(elems) = value.as_array() else {
                return Err(Violation::InvalidType {
                    found: describe(value),
                    expected: "a sequence".into(),
                    at: at(),
                });
            };
            for (i, e) in elems.iter().enumerate() {
                path.push(i.to_string());
                check(e, items, defs, options, path, false)?;
                path.pop();
            }
            Ok(())
        }
        Schema::Object(obj) => {
            let Some(map) = value.as_object() else {
                return Err(Violation::InvalidType {
                    found: describe(value),
                    expected: format!("struct {}", obj.name),
                    at: at(),
                });
            };
            if !obj.additional_allowed {
                for key in map.keys() {
                    if !obj.properties.iter().any(|(k, _)| k == key) {
                        let names: Vec<String> =
                            obj.properties.iter().map(|(k, _)| k.clone()).collect();
                        return Err(Violation::UnknownField {
                            field: key.clone(),
                            expected: one_of(&names),
                            at: at(),
                        });
                    }
                }
            }
            if !(top && options.top_level_required_optional) {
                for req in &obj.required {
                    if !map.contains_key(req) {
                        return Err(Violation::MissingField {
                            field: req.clone(),
                            at: at(),
                        });
                    }
                }
            }
            for (key, prop) in &obj.properties {
                if let Some(v) = map.get(key) {
                    path.push(key.clone());
                    check(v, prop, defs, options, path, false)?;
                    path.pop();
                }
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod firecracker_tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use serde_json::json;

    use super::*;
    use crate::spec::ApiSpec;

    fn check_def(def: &str, v: Value) -> Result<(), Violation> {
        let spec = ApiSpec::load().unwrap();
        validate(
            &v,
            &Schema::Ref(def.into()),
            &spec.definitions,
            ValidationOptions::default(),
        )
    }

    #[test]
    fn serde_like_messages() {
        let e = check_def("BootSource", json!({"boot_args": "x"})).unwrap_err();
        assert_eq!(e.to_string(), "missing field `kernel_image_path`");
        let e = check_def("BootSource", json!({"kernel_image_path": "/k", "foo": 1})).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("unknown field `foo`, expected one of"),
            "{e}"
        );
        let e = check_def("Drive", json!({"drive_id": 1, "is_root_device": true})).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid type: integer `1`, expected a string at `drive_id`"
        );
        let e = check_def(
            "MmdsConfig",
            json!({"network_interfaces": ["eth0"], "version": "V3"}),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "unknown variant `V3`, expected `V1` or `V2` at `version`"
        );
        let e = check_def(
            "MachineConfiguration",
            json!({"vcpu_count": 33, "mem_size_mib": 1}),
        )
        .unwrap_err();
        assert!(matches!(e, Violation::OutOfRange { .. }), "{e}");
        check_def("MmdsContentsObject", json!({"anything": {"goes": 1}})).unwrap();
        let e = check_def(
            "Drive",
            json!({"drive_id": "a", "is_root_device": true, "rate_limiter": {"bandwidth": {"size": 1}}}),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "missing field `refill_time` at `rate_limiter.bandwidth`"
        );
    }
}
