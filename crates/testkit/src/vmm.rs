//! The simulated VMM: the API's state machine (pre-boot configuration,
//! `InstanceStart`, post-boot operations), every request checked against the
//! spec first and against Firecracker's documented semantic rules second, with
//! the real fault messages. It also records each request for test introspection
//! (`GET /testkit/state`, a path the real API does not have).

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use serde_json::{json, Map, Value};

use crate::guest::{GuestConfig, GuestStatus};
use crate::http::{HttpRequest, HttpResponse};
use crate::logger::{Level, VmmLogger};
use crate::mmds::{DataStoreError, Mmds, MmdsVersion};
use crate::schema::{validate, ValidationOptions};
use crate::spec::{ApiMethod, ApiSpec, BootGate, SPEC_VERSION};

/// The path of the test-only introspection endpoint.
pub const TESTKIT_STATE_PATH: &str = "/testkit/state";

const POST_BOOT: &str = "The requested operation is not supported after starting the microVM.";
const PRE_BOOT: &str = "The requested operation is not supported before starting the microVM.";

/// Static configuration of one simulator process (from its command line).
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub instance_id: String,
    pub mmds_size_limit: usize,
    pub max_payload: usize,
    pub boot_timer: bool,
    pub guest: GuestConfig,
}

/// One API request as received, for introspection.
#[derive(Debug, Clone)]
pub struct RecordedRequest {
    pub method: String,
    pub path: String,
    pub body: Option<Value>,
    pub status: u16,
    pub fault_message: Option<String>,
}

/// A configured network interface, holding its TAP attachment open.
#[derive(Debug)]
struct NetIface {
    id: String,
    config: Value,
    /// The TAP attachment (kept open for the VM's life, like the real net device).
    tap: File,
}

/// Mutable VMM state.
#[derive(Debug)]
pub struct VmmState {
    pub config: SimConfig,
    pub started: bool,
    boot_source: Option<Value>,
    drives: Vec<(String, Value)>,
    net: Vec<NetIface>,
    machine: Value,
    mmds_config: Option<Value>,
    pub mmds: Mmds,
    /// Bumped on every MMDS data change so a waiting guest re-reads.
    pub mmds_generation: u64,
    pub logger: VmmLogger,
    logger_config: Option<Value>,
    metrics: Option<Value>,
    other_devices: BTreeMap<String, Value>,
    pub requests: Vec<RecordedRequest>,
    pub guest: GuestStatus,
    pub ctrl_alt_del_count: u32,
    /// API requests being handled or answered right now.
    pub in_flight: u32,
}

impl VmmState {
    /// Whether MMDS is reachable from the guest (MMDS config names an attached interface).
    pub fn mmds_reachable(&self) -> bool {
        self.mmds_config.is_some()
    }

    /// Boot arguments as the guest kernel sees them (Firecracker appends the root device).
    pub fn kernel_cmdline(&self) -> String {
        let mut args = self
            .boot_source
            .as_ref()
            .and_then(|b| b.get("boot_args"))
            .and_then(Value::as_str)
            .unwrap_or("reboot=k panic=1 pci=off nomodule 8250.nr_uarts=0 i8042.noaux i8042.nomux i8042.nopnp i8042.dumbkbd")
            .to_string();
        if let Some((_, root)) = self
            .drives
            .iter()
            .find(|(_, d)| d.get("is_root_device") == Some(&Value::Bool(true)))
        {
            let ro = root.get("is_read_only") == Some(&Value::Bool(true));
            args.push_str(if ro {
                " root=/dev/vda ro"
            } else {
                " root=/dev/vda rw"
            });
        }
        args
    }

    /// A duplicate of the TAP descriptor behind interface `iface_id` (for the guest network relay).
    pub fn tap_for(&self, iface_id: &str) -> Option<std::io::Result<File>> {
        self.net
            .iter()
            .find(|n| n.id == iface_id)
            .map(|n| n.tap.try_clone())
    }

    /// Whether the guest may reach MMDS through `iface_id` (booted, and named in the MMDS config).
    pub fn mmds_on(&self, iface_id: &str) -> bool {
        self.started
            && self
                .mmds_config
                .as_ref()
                .and_then(|c| c.get("network_interfaces"))
                .and_then(Value::as_array)
                .is_some_and(|a| a.iter().any(|i| i.as_str() == Some(iface_id)))
    }

    /// The `PUT /serial` configuration, if any.
    pub fn serial_config(&self) -> Option<&Value> {
        self.other_devices.get("serial")
    }

    pub fn drive_ids(&self) -> Vec<String> {
        self.drives.iter().map(|(id, _)| id.clone()).collect()
    }

    pub fn machine(&self) -> &Value {
        &self.machine
    }

    /// The full introspection document.
    pub fn snapshot(&self) -> Value {
        json!({
            "instance_id": self.config.instance_id,
            "state": if self.started { "Running" } else { "Not started" },
            "pid": std::process::id(),
            "uid": nix::unistd::getuid().as_raw(),
            "gid": nix::unistd::getgid().as_raw(),
            "requests": self.requests.iter().map(|r| json!({
                "method": r.method,
                "path": r.path,
                "body": r.body,
                "status": r.status,
                "fault_message": r.fault_message,
            })).collect::<Vec<_>>(),
            "boot_source": self.boot_source,
            "drives": self.drives.iter().map(|(_, d)| d.clone()).collect::<Vec<_>>(),
            "network_interfaces": self.net.iter().map(|n| n.config.clone()).collect::<Vec<_>>(),
            "machine_config": self.machine,
            "mmds_config": self.mmds_config,
            "mmds_version": self.mmds.version().as_str(),
            "mmds": self.mmds.value(),
            "mmds_size_limit": self.mmds.limit(),
            "logger": self.logger_config,
            "metrics": self.metrics,
            "ctrl_alt_del_count": self.ctrl_alt_del_count,
            "serial_dropped_bytes": crate::guest::serial_dropped_bytes(),
            "guest": self.guest.to_json(),
        })
    }

    fn full_config(&self) -> Value {
        json!({
            "balloon": self.other_devices.get("balloon"),
            "drives": self.drives.iter().map(|(_, d)| d.clone()).collect::<Vec<_>>(),
            "boot-source": self.boot_source,
            "cpu-config": self.other_devices.get("cpu-config"),
            "logger": self.logger_config,
            "machine-config": self.machine,
            "metrics": self.metrics,
            "mmds-config": self.mmds_config,
            "network-interfaces": self.net.iter().map(|n| n.config.clone()).collect::<Vec<_>>(),
            "vsock": self.other_devices.get("vsock"),
            "entropy": self.other_devices.get("entropy"),
        })
    }
}

/// State shared by the API threads and the guest thread.
#[derive(Debug)]
pub struct Shared {
    pub spec: ApiSpec,
    state: Mutex<VmmState>,
    /// Signalled on MMDS changes, Ctrl+Alt+Del and guest agent exit.
    pub events: Condvar,
}

impl Shared {
    pub fn new(spec: ApiSpec, config: SimConfig, logger: VmmLogger) -> Arc<Self> {
        let mmds = Mmds::new(config.mmds_size_limit);
        Arc::new(Self {
            spec,
            state: Mutex::new(VmmState {
                config,
                started: false,
                boot_source: None,
                drives: Vec::new(),
                net: Vec::new(),
                machine: json!({"vcpu_count": 1, "mem_size_mib": 128, "smt": false, "track_dirty_pages": false, "huge_pages": "None"}),
                mmds_config: None,
                mmds,
                mmds_generation: 0,
                logger,
                logger_config: None,
                metrics: None,
                other_devices: BTreeMap::new(),
                requests: Vec::new(),
                guest: GuestStatus::default(),
                ctrl_alt_del_count: 0,
                in_flight: 0,
            }),
            events: Condvar::new(),
        })
    }

    /// Lock the state; a poisoned lock (a panicked thread) still yields the data,
    /// which is what a test wants to inspect.
    pub fn lock(&self) -> MutexGuard<'_, VmmState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Result of a handler: success (204 or a JSON body) or a fault.
enum Outcome {
    NoContent,
    Json(Value),
    Fault(u16, String),
    /// `InstanceStart` succeeded: answer 204 and start the guest.
    Started,
}

fn fault(msg: impl Into<String>) -> Outcome {
    Outcome::Fault(400, msg.into())
}

fn serde_fault(msg: impl std::fmt::Display) -> Outcome {
    fault(format!(
        "An error occurred when deserializing the json body of a request: {msg}."
    ))
}

/// Handle one API request. Returns the response and whether the guest must be started.
pub fn handle(shared: &Arc<Shared>, req: &HttpRequest) -> (HttpResponse, bool) {
    let mut st = shared.lock();
    if req.method == "GET" && req.path == TESTKIT_STATE_PATH {
        return (HttpResponse::json(200, &st.snapshot()), false);
    }
    let body_json: Option<Value> = req
        .body
        .as_ref()
        .and_then(|b| serde_json::from_slice(b).ok());
    let description = if req.path == "/mmds" || req.body.is_none() {
        format!("{} request on {:?}", req.method, req.path)
    } else {
        format!(
            "{} request on {:?} with body {:?}",
            req.method,
            req.path,
            String::from_utf8_lossy(req.body.as_deref().unwrap_or_default())
        )
    };
    st.logger.log(
        Level::Info,
        "fc_api",
        &format!("The API server received a {description}."),
    );

    let outcome = dispatch(shared, &mut st, req);
    let (resp, start) = match outcome {
        Outcome::NoContent => (HttpResponse::no_content(), false),
        Outcome::Started => (HttpResponse::no_content(), true),
        Outcome::Json(v) => (HttpResponse::json(200, &v), false),
        Outcome::Fault(status, msg) => {
            let label = if status == 413 {
                "413 Payload too large"
            } else {
                "400 Bad Request"
            };
            st.logger.log(
                Level::Error,
                "fc_api",
                &format!("Received Error. Status code: {label}. Message: {msg}"),
            );
            (HttpResponse::fault(status, &msg), false)
        }
    };
    let fault_message = if resp.status >= 400 {
        serde_json::from_slice::<Value>(&resp.body)
            .ok()
            .and_then(|v| {
                v.get("fault_message")
                    .and_then(Value::as_str)
                    .map(str::to_string)
            })
    } else {
        None
    };
    st.requests.push(RecordedRequest {
        method: req.method.clone(),
        path: req.path.clone(),
        body: body_json,
        status: resp.status,
        fault_message,
    });
    (resp, start)
}

fn checked_id(id: &str) -> Result<(), Outcome> {
    if id.is_empty() {
        return Err(fault("The ID cannot be empty."));
    }
    if !id.chars().all(|c| c == '_' || c.is_alphanumeric()) {
        return Err(fault(
            "API Resource IDs can only contain alphanumeric characters and underscores.",
        ));
    }
    Ok(())
}

fn dispatch(shared: &Arc<Shared>, st: &mut VmmState, req: &HttpRequest) -> Outcome {
    if let Some(size) = req.oversized {
        return fault(format!(
            "Request payload with size {size} is larger than the limit of {} allowed by server.",
            st.config.max_payload
        ));
    }
    let segments: Vec<&str> = req
        .path
        .trim_start_matches('/')
        .split('/')
        .filter(|s| !s.is_empty())
        .collect();
    let first = segments.first().copied().unwrap_or("");
    let Some(method) = ApiMethod::parse(&req.method) else {
        return fault(format!(
            "Invalid request method and/or path: {} {first}.",
            req.method
        ));
    };
    match (method, req.body.is_some()) {
        (ApiMethod::Get, true) => return fault("GET request cannot have a body."),
        (ApiMethod::Put, false) => return fault("Empty PUT request."),
        (ApiMethod::Patch, false) if first != "balloon" => return fault("Empty PATCH request."),
        _ => {}
    }
    if matches!(first, "drives" | "network-interfaces" | "pmem") && segments.len() == 1 {
        return fault("The ID cannot be empty.");
    }
    let Some((route, params)) = shared.spec.find(method, &segments) else {
        if method == ApiMethod::Put && first == "mmds" && segments.len() == 2 {
            return fault(format!("Unrecognized PUT request path `{}`.", segments[1]));
        }
        return fault(format!(
            "Invalid request method and/or path: {} {first}.",
            method.as_str()
        ));
    };

    // Body: JSON, then the spec schema.
    let body = match &req.body {
        Some(raw) => match serde_json::from_slice::<Value>(raw) {
            Ok(v) => Some(v),
            Err(e) => return serde_fault(e),
        },
        None => None,
    };
    if let (Some(schema), Some(b)) = (&route.body, &body) {
        let options = ValidationOptions {
            top_level_required_optional: method == ApiMethod::Patch && first == "machine-config",
            case_insensitive_enums: first == "logger",
        };
        if let Err(v) = validate(b, schema, &shared.spec.definitions, options) {
            return serde_fault(v);
        }
    }
    // Path ids must be valid and equal the body's id.
    for (param, body_key) in [
        ("drive_id", "drive_id"),
        ("iface_id", "iface_id"),
        ("id", "id"),
    ] {
        if let Some(id) = params.get(param) {
            if let Err(o) = checked_id(id) {
                return o;
            }
            let body_id = body
                .as_ref()
                .and_then(|b| b.get(body_key))
                .and_then(Value::as_str);
            if body.is_some() && body_id != Some(id.as_str()) {
                return fault("The id from the path does not match the id from the body!");
            }
        }
    }
    if method == ApiMethod::Patch && first == "machine-config" {
        if let Some(Value::Object(m)) = &body {
            if m.is_empty() {
                return fault("Empty PATCH request.");
            }
        }
    }

    // Boot gating: the spec's summaries, plus the resources Firecracker only
    // configures pre-boot although their summary does not say so.
    let hand_pre_boot =
        method == ApiMethod::Put && matches!(first, "logger" | "metrics" | "serial" | "balloon");
    let gate = if hand_pre_boot {
        BootGate::PreBootOnly
    } else {
        route.gate
    };
    match gate {
        BootGate::PreBootOnly if st.started => return fault(POST_BOOT),
        BootGate::PostBootOnly if !st.started => return fault(PRE_BOOT),
        _ => {}
    }

    let body = body.unwrap_or(Value::Null);
    match (method, first) {
        (ApiMethod::Get, "") => Outcome::Json(json!({
            "app_name": "Firecracker",
            "id": st.config.instance_id,
            "state": if st.started { "Running" } else { "Not started" },
            "vmm_version": SPEC_VERSION,
        })),
        (ApiMethod::Get, "version") => Outcome::Json(json!({"firecracker_version": SPEC_VERSION})),
        (ApiMethod::Get, "machine-config") => Outcome::Json(st.machine.clone()),
        (ApiMethod::Get, "vm") => Outcome::Json(st.full_config()),
        (ApiMethod::Get, "mmds") => Outcome::Json(st.mmds.value()),
        (ApiMethod::Put, "actions") => action(st, &body),
        (ApiMethod::Put, "boot-source") => boot_source(st, body),
        (ApiMethod::Put, "drives") => put_drive(st, body),
        (ApiMethod::Patch, "drives") => patch_drive(st, &body),
        (ApiMethod::Put, "network-interfaces") => put_net(st, body),
        (ApiMethod::Patch, "network-interfaces") => {
            let id = body.get("iface_id").and_then(Value::as_str).unwrap_or("");
            if st.net.iter().any(|n| n.id == id) {
                Outcome::NoContent
            } else {
                fault(format!(
                    "Network config error: Could not find interface with id {id}"
                ))
            }
        }
        (ApiMethod::Put, "machine-config") => machine_config(st, body, false),
        (ApiMethod::Patch, "machine-config") => machine_config(st, body, true),
        (ApiMethod::Put, "logger") => logger(st, body),
        (ApiMethod::Put, "metrics") => metrics(st, body),
        (ApiMethod::Put, "mmds") if segments.len() == 2 => mmds_config(st, body),
        (ApiMethod::Put, "mmds") => {
            let r = st.mmds.put(body);
            mmds_result(shared, st, r)
        }
        (ApiMethod::Patch, "mmds") => {
            let r = st.mmds.patch(&body);
            mmds_result(shared, st, r)
        }
        (ApiMethod::Put, "serial") => {
            if let Some(path) = body.get("serial_out_path").and_then(Value::as_str) {
                if let Err(e) = OpenOptions::new().append(true).open(path) {
                    return fault(format!(
                        "Serial device error: Cannot open the serial output file {path}: {e}"
                    ));
                }
            }
            st.other_devices.insert("serial".to_string(), body);
            Outcome::NoContent
        }
        (ApiMethod::Put, dev @ ("vsock" | "entropy" | "balloon" | "cpu-config")) => {
            st.other_devices.insert(dev.to_string(), body);
            Outcome::NoContent
        }
        _ => fault(format!(
            "The requested operation is not supported: {} ({}) is not simulated by kici-testkit.",
            route.operation_id,
            route.summary.trim_end_matches('.')
        )),
    }
}

fn mmds_result(shared: &Arc<Shared>, st: &mut VmmState, r: Result<(), DataStoreError>) -> Outcome {
    match r {
        Ok(()) => {
            st.mmds_generation += 1;
            shared.events.notify_all();
            Outcome::NoContent
        }
        Err(DataStoreError::LimitExceeded) => Outcome::Fault(
            413,
            format!(
                "MMDS limit exceeded error: {}",
                DataStoreError::LimitExceeded
            ),
        ),
        Err(e) => fault(format!("MMDS error: {e}")),
    }
}

fn action(st: &mut VmmState, body: &Value) -> Outcome {
    match body.get("action_type").and_then(Value::as_str) {
        Some("InstanceStart") => {
            if st.started {
                return fault(POST_BOOT);
            }
            let Some(kernel) = st
                .boot_source
                .as_ref()
                .and_then(|b| b.get("kernel_image_path"))
                .and_then(Value::as_str)
                .map(PathBuf::from)
            else {
                return fault(
                    "Start microvm error: Cannot start microvm without kernel configuration.",
                );
            };
            if st.config.guest.vmm == crate::guest::VmmMode::FailInstanceStart {
                return fault("Start microvm error: Cannot create the KVM object: Error creating KVM object: Permission denied (os error 13) Make sure the user launching the firecracker process is configured on the /dev/kvm file's ACL.");
            }
            if let Err(e) = File::open(&kernel) {
                return fault(format!(
                    "Start microvm error: Cannot load kernel due to invalid memory configuration or invalid kernel image: Kernel Loader: failed to load ELF kernel image: {e}"
                ));
            }
            st.started = true;
            st.logger.log(
                Level::Info,
                "main",
                "Successfully started microvm that was configured from API requests",
            );
            if st.config.boot_timer {
                st.logger.log(
                    Level::Info,
                    "fc_vcpu 0",
                    "Guest-boot-time = 1000 us 1 ms, 1000 CPU us 1 CPU ms",
                );
            }
            Outcome::Started
        }
        Some("SendCtrlAltDel") => {
            if !st.started {
                return fault(PRE_BOOT);
            }
            st.ctrl_alt_del_count += 1;
            Outcome::NoContent
        }
        Some("FlushMetrics") => {
            if st.metrics.is_none() {
                return fault("Metrics error: The metrics system was not initialized.");
            }
            Outcome::NoContent
        }
        _ => fault(
            "An error occurred when deserializing the json body of a request: unknown variant.",
        ),
    }
}

fn open_check(path: &str, write: bool) -> Result<(), std::io::Error> {
    OpenOptions::new()
        .read(true)
        .write(write)
        .open(path)
        .map(|_| ())
}

fn boot_source(st: &mut VmmState, body: Value) -> Outcome {
    let kernel = body
        .get("kernel_image_path")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if let Err(e) = File::open(kernel) {
        return fault(format!(
            "Boot source error: The kernel file cannot be opened: {e}"
        ));
    }
    if let Some(initrd) = body.get("initrd_path").and_then(Value::as_str) {
        if let Err(e) = File::open(initrd) {
            return fault(format!(
                "Boot source error: The initrd file cannot be opened due to invalid path or invalid permissions. {e}"
            ));
        }
    }
    st.boot_source = Some(body);
    Outcome::NoContent
}

fn put_drive(st: &mut VmmState, body: Value) -> Outcome {
    let id = body
        .get("drive_id")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    if body.get("socket").is_some() {
        return fault("The requested operation is not supported: vhost-user-block drives are not simulated by kici-testkit.");
    }
    let Some(path) = body.get("path_on_host").and_then(Value::as_str) else {
        return fault("Drive config error: Unable to create the virtio block device: path_on_host is required for a virtio-block drive");
    };
    let Some(read_only) = body.get("is_read_only").and_then(Value::as_bool) else {
        return fault("Drive config error: Unable to create the virtio block device: is_read_only is required for a virtio-block drive");
    };
    if let Err(e) = open_check(path, !read_only) {
        return fault(format!(
            "Drive config error: Unable to create the virtio block device: BackingFile({e}, \"{path}\")"
        ));
    }
    let is_root = body.get("is_root_device") == Some(&Value::Bool(true));
    if is_root
        && st
            .drives
            .iter()
            .any(|(other, d)| other != &id && d.get("is_root_device") == Some(&Value::Bool(true)))
    {
        return fault("Drive config error: A root block device already exists!");
    }
    match st.drives.iter_mut().find(|(other, _)| other == &id) {
        Some(slot) => slot.1 = body,
        None if is_root => st.drives.insert(0, (id, body)),
        None => st.drives.push((id, body)),
    }
    Outcome::NoContent
}

fn patch_drive(st: &mut VmmState, body: &Value) -> Outcome {
    let id = body
        .get("drive_id")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let Some(slot) = st.drives.iter_mut().find(|(other, _)| other == id) else {
        return fault(format!("Drive config error: Invalid block device ID: {id}"));
    };
    if let Some(path) = body.get("path_on_host").and_then(Value::as_str) {
        let ro = slot.1.get("is_read_only") == Some(&Value::Bool(true));
        if let Err(e) = open_check(path, !ro) {
            return fault(format!(
                "Drive config error: Unable to patch the block device: BackingFile({e}, \"{path}\")"
            ));
        }
        if let Value::Object(m) = &mut slot.1 {
            m.insert("path_on_host".into(), Value::String(path.to_string()));
        }
    }
    Outcome::NoContent
}

fn valid_mac(s: &str) -> bool {
    let parts: Vec<&str> = s.split(':').collect();
    parts.len() == 6
        && parts
            .iter()
            .all(|p| p.len() == 2 && p.chars().all(|c| c.is_ascii_hexdigit()))
}

fn put_net(st: &mut VmmState, body: Value) -> Outcome {
    let id = body
        .get("iface_id")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let host_dev = body
        .get("host_dev_name")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    if let Some(mac) = body.get("guest_mac").and_then(Value::as_str) {
        if !valid_mac(mac) {
            return serde_fault(format!("invalid MAC address: {mac}"));
        }
        if st.net.iter().any(|n| {
            n.id != id
                && n.config
                    .get("guest_mac")
                    .and_then(Value::as_str)
                    .is_some_and(|m| m.eq_ignore_ascii_case(mac))
        }) {
            return fault(format!(
                "Network config error: The MAC address is already in use: {mac}"
            ));
        }
    }
    if st.net.iter().any(|n| {
        n.id != id
            && n.config.get("host_dev_name").and_then(Value::as_str) == Some(host_dev.as_str())
    }) {
        return fault(format!(
            "Network config error: The host device name {host_dev} is already in use."
        ));
    }
    // Re-configuring an interface drops its old attachment first.
    st.net.retain(|n| n.id != id);
    match crate::tap::attach(&host_dev) {
        Ok(tap) => {
            st.net.push(NetIface {
                id,
                config: body,
                tap,
            });
            Outcome::NoContent
        }
        Err(e) => fault(format!(
            "Network config error: Could not create the network device: Open tap device failed: Error while creating ifreq structure: {e}. Invalid TUN/TAP Backend provided by {host_dev}. Check our documentation on setting up the network devices."
        )),
    }
}

fn machine_config(st: &mut VmmState, body: Value, partial: bool) -> Outcome {
    let mut next = if partial {
        st.machine.clone()
    } else {
        json!({"smt": false, "track_dirty_pages": false, "huge_pages": "None"})
    };
    if let (Value::Object(dst), Value::Object(src)) = (&mut next, body) {
        for (k, v) in src {
            dst.insert(k, v);
        }
    }
    let vcpu = next.get("vcpu_count").and_then(Value::as_i64).unwrap_or(0);
    let mem = next
        .get("mem_size_mib")
        .and_then(Value::as_i64)
        .unwrap_or(0);
    let smt = next.get("smt") == Some(&Value::Bool(true));
    if !(1..=32).contains(&vcpu) || (smt && vcpu > 1 && vcpu % 2 == 1) {
        return fault("Machine config error: The vCPU number is invalid! The vCPU number can only be 1 or an even number when SMT is enabled.");
    }
    if mem <= 0 {
        return fault("Machine config error: The memory size (MiB) is invalid.");
    }
    if next.get("huge_pages").and_then(Value::as_str) == Some("2M") && mem % 2 != 0 {
        return fault(
            "Machine config error: The memory size (MiB) is invalid for the hugepage size.",
        );
    }
    st.machine = next;
    Outcome::NoContent
}

fn logger(st: &mut VmmState, body: Value) -> Outcome {
    let path = body.get("log_path").and_then(Value::as_str).map(Path::new);
    let level = body
        .get("level")
        .and_then(Value::as_str)
        .and_then(Level::parse);
    let show_level = body.get("show_level").and_then(Value::as_bool);
    let show_origin = body.get("show_log_origin").and_then(Value::as_bool);
    if let Err(e) = st.logger.configure(path, level, show_level, show_origin) {
        return fault(format!("Logger error: Failed to open target file: {e}"));
    }
    st.logger_config = Some(body);
    Outcome::NoContent
}

fn metrics(st: &mut VmmState, body: Value) -> Outcome {
    if st.metrics.is_some() {
        return fault("Metrics error: Reinitialization of metrics not allowed.");
    }
    let path = body
        .get("metrics_path")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if let Err(e) = OpenOptions::new().append(true).open(path) {
        return fault(format!(
            "Metrics error: Cannot initialize the metrics system due to bad user input: {e}"
        ));
    }
    st.metrics = Some(body);
    Outcome::NoContent
}

fn mmds_config(st: &mut VmmState, body: Value) -> Outcome {
    let ifaces: Vec<&str> = body
        .get("network_interfaces")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if ifaces.is_empty() {
        return fault("MMMDS config error: The list of network interface IDs that allow forwarding MMDS requests is empty.");
    }
    if ifaces.iter().any(|i| !st.net.iter().any(|n| n.id == *i)) {
        return fault("MMMDS config error: The list of network interface IDs provided contains at least one ID that does not correspond to any existing network interface.");
    }
    if let Some(addr) = body.get("ipv4_address").and_then(Value::as_str) {
        match addr.parse::<Ipv4Addr>() {
            Ok(a) if a.is_link_local() => {}
            _ => return fault("MMMDS config error: The MMDS IPv4 address is not link local."),
        }
    }
    let version = match body.get("version").and_then(Value::as_str) {
        Some("V2") => MmdsVersion::V2,
        _ => {
            st.logger.log(
                Level::Warning,
                "fc_api",
                "PUT /mmds/config: V1 is deprecated. Use V2 instead.",
            );
            MmdsVersion::V1
        }
    };
    let imds_compat = body.get("imds_compat") == Some(&Value::Bool(true));
    st.mmds.set_version(version, imds_compat);
    let mut stored = Map::new();
    if let Value::Object(m) = body {
        stored = m;
    }
    stored
        .entry("version")
        .or_insert_with(|| Value::String(version.as_str().into()));
    stored
        .entry("ipv4_address")
        .or_insert_with(|| Value::String("169.254.169.254".into()));
    st.mmds_config = Some(Value::Object(stored));
    Outcome::NoContent
}
