//! `resources` (nested or flat), resource specs and caps, and the
//! "can never fit" check of a label set's request against the caps above it.

use crate::cx::{Cx, Keys, Val};
use crate::node::Node;
use crate::yaml::{classify, describe, Scalar};
use kici_model::resources::MAX_CPUS_PER_REQUEST;
use kici_model::{MemoryBytes, MilliCpu, ResourceCap, ResourceRequest, ResourceSpec};

const SPEC_KEYS: [&str; 2] = ["cpus", "memory"];
const NESTED_KEYS: [&str; 2] = ["requests", "limits"];
const RESOURCES_KEYS: [&str; 4] = ["requests", "limits", "cpus", "memory"];
const CAP_KEYS: [&str; 2] = ["maxCpu", "maxMemory"];

fn no_hint(_: &str) -> Option<&'static str> {
    None
}

/// A memory string (`512m`, `1.5g`), parsed at load: upstream only finds a
/// bad one when a job is resolved against it.
pub(crate) fn memory(cx: &mut Cx, v: &Val<'_>) -> Option<MemoryBytes> {
    let text = match v.node {
        Node::Scalar(s) => match classify(s) {
            Scalar::Str(t) => Some(t),
            _ => None,
        },
        _ => None,
    };
    let Some(text) = text else {
        let got = describe(v.node);
        cx.err(
            v,
            format!("expected a memory string such as \"512m\" or \"2g\", got {got}"),
        );
        return None;
    };
    match text.parse::<MemoryBytes>() {
        Ok(m) => Some(m),
        Err(e) => {
            cx.err(v, e.to_string());
            None
        }
    }
}

/// The largest `maxCpu` [`MilliCpu::cap_from_cores`] takes: far beyond any
/// machine, yet exact in milli-CPUs.
const MAX_CAP_CORES: f64 = 1e12;

/// Cores in a request (`cpus`: more than 0, at most 256) or a cap (`maxCpu`:
/// more than 0, no upper bound worth naming).
#[derive(Clone, Copy, PartialEq, Eq)]
enum CoresOf {
    Request,
    Cap,
}

fn cores(cx: &mut Cx, v: &Val<'_>, of: CoresOf) -> Option<MilliCpu> {
    let n = cx.any_number(v, "a number of CPU cores such as 0.5 or 2")?;
    // Say what is wrong with the number itself before any range: a cap has
    // no upper bound, so "at most 256" would be wrong there.
    let problem = if n.is_nan() {
        Some(format!("{n} is not a number of cores"))
    } else if n < 0.0 {
        Some(format!("must be greater than 0: {n} is negative"))
    } else if n == 0.0 {
        Some("must be greater than 0, got 0".to_owned())
    } else if n.is_infinite() {
        Some("must be a finite number of cores, got .inf".to_owned())
    } else if of == CoresOf::Request && n > MAX_CPUS_PER_REQUEST {
        Some(format!(
            "must be at most {MAX_CPUS_PER_REQUEST}, got {n} (the most cores one agent may request)"
        ))
    } else if of == CoresOf::Cap && n > MAX_CAP_CORES {
        Some(format!("must be at most {MAX_CAP_CORES:e} cores, got {n}"))
    } else {
        None
    };
    if let Some(p) = problem {
        let name = if of == CoresOf::Cap { "maxCpu" } else { "cpus" };
        cx.err(v, format!("{name} {p}"));
        return None;
    }
    let parse = match of {
        CoresOf::Request => MilliCpu::from_cores,
        CoresOf::Cap => MilliCpu::cap_from_cores,
    };
    match parse(n) {
        Ok(c) => Some(c),
        Err(e) => {
            cx.err(v, e.to_string());
            None
        }
    }
}

fn spec(cx: &mut Cx, v: &Val<'_>) -> Option<ResourceSpec> {
    let obj = cx.obj(v)?;
    let before = cx.error_count();
    cx.check_keys(&obj, &SPEC_KEYS, Keys::Strict, no_hint);
    let cpus = cx
        .field(&obj, "cpus")
        .and_then(|c| cores(cx, &c, CoresOf::Request));
    let memory = cx.field(&obj, "memory").and_then(|m| memory(cx, &m));
    (cx.error_count() == before).then_some(ResourceSpec { cpus, memory })
}

/// `resources`: `{requests?, limits?}` kept as is, or the flat `{cpus?,
/// memory?}` applied to both sides; mixing the two is refused, and so are
/// requests above limits.
pub(crate) fn request(cx: &mut Cx, v: &Val<'_>) -> Option<ResourceRequest> {
    let obj = cx.obj(v)?;
    let before = cx.error_count();
    cx.check_keys(&obj, &RESOURCES_KEYS, Keys::Strict, no_hint);
    let has = |keys: &[&str]| obj.map.keys().any(|k| keys.contains(&k.as_str()));
    let nested = has(&NESTED_KEYS);
    let flat = has(&SPEC_KEYS);
    if nested && flat {
        cx.err(v, "mixes the nested form (requests/limits) with the flat form (cpus/memory); use one of them",
        );
        return None;
    }
    let req = if nested {
        let requests = cx.field(&obj, "requests").and_then(|s| spec(cx, &s));
        let limits = cx.field(&obj, "limits").and_then(|s| spec(cx, &s));
        ResourceRequest { requests, limits }
    } else {
        let cpus = cx
            .field(&obj, "cpus")
            .and_then(|c| cores(cx, &c, CoresOf::Request));
        let memory = cx.field(&obj, "memory").and_then(|m| memory(cx, &m));
        ResourceRequest::flat(ResourceSpec { cpus, memory })
    };
    if cx.error_count() != before {
        return None;
    }
    if let Err(msg) = req.check_requests_within_limits() {
        cx.err(v, msg);
        return None;
    }
    Some(req)
}

/// A cap `{maxCpu?, maxMemory?}`; an unset dimension is uncapped.
pub(crate) fn cap(cx: &mut Cx, v: &Val<'_>) -> Option<ResourceCap> {
    let obj = cx.obj(v)?;
    let before = cx.error_count();
    cx.check_keys(&obj, &CAP_KEYS, Keys::Strict, no_hint);
    let max_cpu = cx
        .field(&obj, "maxCpu")
        .and_then(|c| cores(cx, &c, CoresOf::Cap));
    let max_memory = cx.field(&obj, "maxMemory").and_then(|m| memory(cx, &m));
    (cx.error_count() == before).then_some(ResourceCap {
        max_cpu,
        max_memory,
    })
}

/// The request side of `r` after mirroring, per dimension.
pub(crate) fn requested(r: Option<&ResourceRequest>) -> (Option<MilliCpu>, Option<MemoryBytes>) {
    let side = r.and_then(|r| r.mirrored().0);
    (side.and_then(|s| s.cpus), side.and_then(|s| s.memory))
}

/// Which caps a request is compared with, named for messages.
pub(crate) struct NamedCap<'a> {
    pub name: String,
    pub cap: &'a ResourceCap,
    /// The global cap: a value inherited from `defaults.resources` is checked
    /// against it once, at `defaults.resources`, not per label set.
    pub global: bool,
}

/// One "can never fit" finding.
pub(crate) struct Misfit {
    pub message: String,
    pub from_defaults: bool,
}

fn cores_text(c: MilliCpu) -> String {
    let cores = c.as_cores();
    format!("{cores}")
}

/// Compares a label set's effective request (its own resources, then
/// `defaults.resources`, per dimension) with each cap.
pub(crate) fn misfits(
    own: Option<&ResourceRequest>,
    defaults: Option<&ResourceRequest>,
    caps: &[NamedCap<'_>],
) -> Vec<Misfit> {
    let (own_cpu, own_mem) = requested(own);
    let (def_cpu, def_mem) = requested(defaults);
    let cpu = own_cpu.map(|c| (c, false)).or(def_cpu.map(|c| (c, true)));
    let mem = own_mem.map(|m| (m, false)).or(def_mem.map(|m| (m, true)));
    let suffix = |from_defaults: bool| {
        if from_defaults {
            " (inherited from defaults.resources)"
        } else {
            ""
        }
    };
    let mut out = Vec::new();
    for c in caps {
        if let (Some((want, d)), Some(max)) = (cpu, c.cap.max_cpu) {
            if want > max && !(d && c.global) {
                out.push(Misfit {
                    message: format!(
                        "a request of {} CPUs{} can never fit: {} maxCpu is {}",
                        cores_text(want),
                        suffix(d),
                        c.name,
                        cores_text(max)
                    ),
                    from_defaults: d,
                });
            }
        }
        if let (Some((want, d)), Some(max)) = (mem, c.cap.max_memory) {
            if want > max && !(d && c.global) {
                out.push(Misfit {
                    message: format!(
                        "a request of {want} memory{} can never fit: {} maxMemory is {max}",
                        suffix(d),
                        c.name
                    ),
                    from_defaults: d,
                });
            }
        }
    }
    out
}
