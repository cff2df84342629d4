//! Golden JSON for every message of both directions: the exact wire text
//! each value serializes to, that text parsing back to the same value; an
//! agent's message refusing an unknown field, a gateway's message reading
//! past one (forward compatibility of the agent).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use kici_model::{AgentId, JobId, LabelSet};
use kici_protocol::*;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::num::NonZeroU32;

const TOKEN: &str = "kat_00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

fn agent_id() -> AgentId {
    "scaler-bare-metal-0a1b2c3d".parse().unwrap()
}

fn job_id() -> JobId {
    "job-42".parse().unwrap()
}

fn labels() -> LabelSet {
    LabelSet::parse(["linux", "kici:os:linux", "kici:agent:bare-metal"]).unwrap()
}

fn spec() -> JobSpec {
    JobSpec::new(
        job_id(),
        vec!["sh".into(), "-c".into(), "echo hi".into()],
        BTreeMap::from([("CI".to_string(), "true".to_string())]),
        Some(60),
    )
    .unwrap()
}

fn agent_golden() -> Vec<(AgentMessage, Value)> {
    let mut full = Register::new("register-x-1".into(), agent_id(), labels());
    full.platform = Some("linux".into());
    full.arch = Some("x64".into());
    full.version = Some("kici-agent-lite/0.1.0".into());
    full.max_concurrency = NonZeroU32::new(1);
    full.in_flight_jobs = vec![InFlightJob {
        job_id: "q-1".into(),
        run_id: Some("r-1".into()),
    }];
    full.hostname = Some("builder-1".into());
    full.os_release = Some("6.1.0".into());
    full.os_version = Some("#1 SMP".into());
    full.total_memory_mb = Some(2048);
    full.cpu_count = Some(2);
    full.node_version = Some("v20".into());
    full.running_as_user = Some("ci".into());
    full.running_as_uid = Some(1000);
    full.properties = BTreeMap::from([
        ("gpu".to_string(), PropertyValue::Bool(false)),
        ("slots".to_string(), PropertyValue::Integer(4)),
        ("zone".to_string(), PropertyValue::Text("a".into())),
    ]);
    vec![
        (
            AgentMessage::AuthRequest(AuthRequest {
                token: TOKEN.parse().unwrap(),
                protocol_version: PROTOCOL_VERSION,
            }),
            json!({"type":"auth.request","token":TOKEN,"protocolVersion":1}),
        ),
        (
            AgentMessage::Register(Box::new(Register::new(
                "register-scaler-bare-metal-0a1b2c3d-1700000000000".into(),
                agent_id(),
                labels(),
            ))),
            json!({
                "type":"agent.register",
                "messageId":"register-scaler-bare-metal-0a1b2c3d-1700000000000",
                "agentId":"scaler-bare-metal-0a1b2c3d",
                "labels":["kici:agent:bare-metal","kici:os:linux","linux"]
            }),
        ),
        (
            AgentMessage::Register(Box::new(full)),
            json!({
                "type":"agent.register",
                "messageId":"register-x-1",
                "agentId":"scaler-bare-metal-0a1b2c3d",
                "labels":["kici:agent:bare-metal","kici:os:linux","linux"],
                "platform":"linux","arch":"x64","version":"kici-agent-lite/0.1.0",
                "maxConcurrency":1,
                "inFlightJobs":[{"jobId":"q-1","runId":"r-1"}],
                "hostname":"builder-1","osRelease":"6.1.0","osVersion":"#1 SMP",
                "totalMemoryMb":2048,"cpuCount":2,"nodeVersion":"v20",
                "runningAsUser":"ci","runningAsUid":1000,
                "properties":{"gpu":false,"slots":4,"zone":"a"}
            }),
        ),
        (
            AgentMessage::ConfigAck(ConfigAck {
                message_id: "config-ack-scaler-bare-metal-0a1b2c3d-1700000000001".into(),
                agent_id: agent_id(),
            }),
            json!({
                "type":"config.ack",
                "messageId":"config-ack-scaler-bare-metal-0a1b2c3d-1700000000001",
                "agentId":"scaler-bare-metal-0a1b2c3d"
            }),
        ),
        (
            AgentMessage::Heartbeat(Heartbeat {
                timestamp: UnixMillis(1_700_000_000_002),
            }),
            json!({"type":"heartbeat","timestamp":1_700_000_000_002u64}),
        ),
        (
            AgentMessage::JobAck(JobAck {
                message_id: "m1".into(),
                job_id: job_id(),
                timestamp: UnixMillis(5),
            }),
            json!({"type":"job.ack","messageId":"m1","jobId":"job-42","timestamp":5}),
        ),
        (
            AgentMessage::JobReject(JobReject {
                message_id: "m2".into(),
                job_id: job_id(),
                reason: RejectReason::Busy,
                timestamp: UnixMillis(6),
            }),
            json!({"type":"job.reject","messageId":"m2","jobId":"job-42","reason":"busy","timestamp":6}),
        ),
        (
            AgentMessage::JobReject(JobReject {
                message_id: "m2".into(),
                job_id: job_id(),
                reason: RejectReason::Draining,
                timestamp: UnixMillis(6),
            }),
            json!({"type":"job.reject","messageId":"m2","jobId":"job-42","reason":"draining","timestamp":6}),
        ),
        (
            status(JobProgress::Running),
            json!({"type":"job.status","messageId":"s","jobId":"job-42","state":"running","timestamp":7}),
        ),
        (
            status(JobProgress::Finished(JobEnd::Completed(JobResult::exited(
                0,
            )))),
            json!({"type":"job.status","messageId":"s","jobId":"job-42","state":"success","timestamp":7,
                   "reason":"completed","result":{"exitCode":0,"signal":null}}),
        ),
        (
            status(JobProgress::Finished(JobEnd::Completed(JobResult::exited(
                3,
            )))),
            json!({"type":"job.status","messageId":"s","jobId":"job-42","state":"failed","timestamp":7,
                   "reason":"completed","result":{"exitCode":3,"signal":null}}),
        ),
        (
            status(JobProgress::Finished(JobEnd::Completed(
                JobResult::signalled(9).unwrap(),
            ))),
            json!({"type":"job.status","messageId":"s","jobId":"job-42","state":"failed","timestamp":7,
                   "reason":"completed","result":{"exitCode":null,"signal":9}}),
        ),
        (
            status(JobProgress::Finished(JobEnd::TimedOut(
                JobResult::signalled(15).unwrap(),
            ))),
            json!({"type":"job.status","messageId":"s","jobId":"job-42","state":"failed","timestamp":7,
                   "reason":"timed-out","result":{"exitCode":null,"signal":15}}),
        ),
        (
            status(JobProgress::Finished(JobEnd::Cancelled(JobResult::exited(
                130,
            )))),
            json!({"type":"job.status","messageId":"s","jobId":"job-42","state":"cancelled","timestamp":7,
                   "reason":"cancelled","result":{"exitCode":130,"signal":null}}),
        ),
        (
            status(JobProgress::Finished(JobEnd::SpawnFailed {
                error: "nope: No such file or directory (os error 2)".into(),
            })),
            json!({"type":"job.status","messageId":"s","jobId":"job-42","state":"failed","timestamp":7,
                   "reason":"spawn-failed","error":"nope: No such file or directory (os error 2)"}),
        ),
        (
            AgentMessage::OutputChunk(OutputChunk {
                job_id: job_id(),
                seq: 0,
                stream: OutputStream::Stdout,
                data: ChunkData::new(b"hi\n".to_vec()).unwrap(),
            }),
            json!({"type":"log.chunk","jobId":"job-42","seq":0,"stream":"stdout","data":"aGkK"}),
        ),
        (
            AgentMessage::OutputChunk(OutputChunk {
                job_id: job_id(),
                seq: 1,
                stream: OutputStream::Stderr,
                data: ChunkData::new(vec![0xff, 0x00]).unwrap(),
            }),
            json!({"type":"log.chunk","jobId":"job-42","seq":1,"stream":"stderr","data":"/wA="}),
        ),
    ]
}

fn status(progress: JobProgress) -> AgentMessage {
    AgentMessage::JobStatus(JobStatus {
        message_id: "s".into(),
        job_id: job_id(),
        timestamp: UnixMillis(7),
        progress,
    })
}

fn gateway_golden() -> Vec<(GatewayMessage, Value)> {
    vec![
        (
            GatewayMessage::AuthSuccess(AuthSuccess {
                connection_id: "c0ffee".into(),
            }),
            json!({"type":"auth.success","connectionId":"c0ffee"}),
        ),
        (
            GatewayMessage::AuthFailure(AuthFailure {
                reason: "Invalid or expired token".into(),
            }),
            json!({"type":"auth.failure","reason":"Invalid or expired token"}),
        ),
        (
            GatewayMessage::RegisterAck(RegisterAck {
                agent_id: agent_id(),
                labels: labels(),
                scaler_managed: true,
                capabilities: RegisterAck::capabilities(),
                pending_dispatch: true,
                warm_pool: false,
            }),
            json!({"type":"register.ack","agentId":"scaler-bare-metal-0a1b2c3d",
                   "labels":["kici:agent:bare-metal","kici:os:linux","linux"],
                   "scalerManaged":true,"capabilities":{},"pendingDispatch":true}),
        ),
        (
            GatewayMessage::RegisterAck(RegisterAck {
                agent_id: agent_id(),
                labels: labels(),
                scaler_managed: true,
                capabilities: RegisterAck::capabilities(),
                pending_dispatch: false,
                warm_pool: true,
            }),
            json!({"type":"register.ack","agentId":"scaler-bare-metal-0a1b2c3d",
                   "labels":["kici:agent:bare-metal","kici:os:linux","linux"],
                   "scalerManaged":true,"capabilities":{},"warmPool":true}),
        ),
        (
            GatewayMessage::RegisterAck(RegisterAck {
                agent_id: agent_id(),
                labels: LabelSet::default(),
                scaler_managed: false,
                capabilities: RegisterAck::capabilities(),
                pending_dispatch: false,
                warm_pool: false,
            }),
            json!({"type":"register.ack","agentId":"scaler-bare-metal-0a1b2c3d",
                   "labels":[],"scalerManaged":false,"capabilities":{}}),
        ),
        (
            GatewayMessage::JobDispatch(JobDispatch {
                message_id: "d1".into(),
                job: spec(),
                timestamp: UnixMillis(8),
            }),
            json!({"type":"job.dispatch","messageId":"d1",
                   "job":{"jobId":"job-42","argv":["sh","-c","echo hi"],"env":{"CI":"true"},"timeoutSeconds":60},
                   "timestamp":8}),
        ),
        (
            GatewayMessage::JobDispatch(JobDispatch {
                message_id: "d2".into(),
                job: JobSpec::new(job_id(), vec!["true".into()], BTreeMap::new(), None).unwrap(),
                timestamp: UnixMillis(8),
            }),
            json!({"type":"job.dispatch","messageId":"d2",
                   "job":{"jobId":"job-42","argv":["true"]},"timestamp":8}),
        ),
        (
            GatewayMessage::JobCancel(JobCancel {
                job_id: job_id(),
                reason: "cancelled by operator".into(),
            }),
            json!({"type":"job.cancel","jobId":"job-42","reason":"cancelled by operator"}),
        ),
    ]
}

/// Adds `"bogus": 1` to the outermost object.
fn with_unknown_field(mut v: Value) -> String {
    v.as_object_mut().unwrap().insert("bogus".into(), json!(1));
    v.to_string()
}

#[test]
fn agent_messages_match_their_golden_json_both_ways() {
    let golden = agent_golden();
    let mut seen: Vec<&str> = golden.iter().map(|(m, _)| m.type_name()).collect();
    seen.dedup();
    assert_eq!(
        seen,
        [
            "auth.request",
            "agent.register",
            "config.ack",
            "heartbeat",
            "job.ack",
            "job.reject",
            "job.status",
            "log.chunk"
        ]
    );
    for (msg, want) in golden {
        let got: Value = serde_json::from_str(&msg.to_json()).unwrap();
        assert_eq!(got, want, "{}", msg.type_name());
        assert_eq!(got["type"], msg.type_name());
        let back = AgentMessage::from_json(&want.to_string()).unwrap();
        assert_eq!(back, msg, "{}", msg.type_name());
        let err = AgentMessage::from_json(&with_unknown_field(want.clone()))
            .expect_err(msg.type_name())
            .to_string();
        assert!(
            err.contains("unknown field `bogus`"),
            "{}: {err}",
            msg.type_name()
        );
    }
}

#[test]
fn gateway_messages_match_their_golden_json_both_ways() {
    let golden = gateway_golden();
    let mut seen: Vec<&str> = golden.iter().map(|(m, _)| m.type_name()).collect();
    seen.dedup();
    assert_eq!(
        seen,
        [
            "auth.success",
            "auth.failure",
            "register.ack",
            "job.dispatch",
            "job.cancel"
        ]
    );
    for (msg, want) in golden {
        let got: Value = serde_json::from_str(&msg.to_json()).unwrap();
        assert_eq!(got, want, "{}", msg.type_name());
        let back = GatewayMessage::from_json(&want.to_string()).unwrap();
        assert_eq!(back, msg, "{}", msg.type_name());
        // A newer gateway's extra field is read past, not refused.
        let newer = GatewayMessage::from_json(&with_unknown_field(want.clone()))
            .unwrap_or_else(|e| panic!("{}: {e}", msg.type_name()));
        assert_eq!(newer, msg, "{}", msg.type_name());
    }
}

#[test]
fn nested_objects_of_agent_messages_refuse_unknown_fields_too() {
    for bad in [
        json!({"type":"agent.register","messageId":"m","agentId":"scaler-container-00000000",
               "labels":[],"inFlightJobs":[{"jobId":"q","extra":1}]}),
        json!({"type":"job.status","messageId":"s","jobId":"j","state":"failed","timestamp":1,
               "reason":"completed","result":{"exitCode":1,"signal":null,"core":false}}),
    ] {
        assert!(AgentMessage::from_json(&bad.to_string()).is_err(), "{bad}");
    }
    // The job of a dispatch is the gateway's: an unknown field is read past.
    let newer = json!({"type":"job.dispatch","messageId":"d","timestamp":1,
                       "job":{"jobId":"j","argv":["x"],"cwd":"/tmp"}});
    let GatewayMessage::JobDispatch(d) = GatewayMessage::from_json(&newer.to_string()).unwrap()
    else {
        panic!("not a dispatch");
    };
    assert_eq!(d.job.argv(), ["x"]);
}

#[test]
fn a_kici_agents_registration_with_its_capabilities_parses() {
    let r = json!({"type":"agent.register","messageId":"m","agentId":"scaler-container-00000000",
                   "labels":["linux"],"capabilities":{"artifactCompleteAck":true}});
    let AgentMessage::Register(r) = AgentMessage::from_json(&r.to_string()).unwrap() else {
        panic!("not a registration");
    };
    assert_eq!(
        r.capabilities.unwrap()["artifactCompleteAck"],
        Value::Bool(true)
    );
}

#[test]
fn the_type_of_a_message_is_read_without_knowing_the_message() {
    assert_eq!(
        message_type(r#"{"type":"agent.metrics","metrics":[{"x":1}]}"#).as_deref(),
        Some("agent.metrics")
    );
    assert_eq!(message_type(r#"{"metrics":[]}"#), None);
    assert_eq!(message_type(r#"{"type":7}"#), None);
    assert_eq!(message_type("not json"), None);
    assert!(IGNORED_AGENT_MESSAGES.contains(&"job.heartbeat"));
}

#[test]
fn unknown_types_and_directions_are_refused() {
    let heartbeat = r#"{"type":"heartbeat","timestamp":1}"#;
    assert!(AgentMessage::from_json(heartbeat).is_ok());
    // Each direction only parses its own messages.
    assert!(GatewayMessage::from_json(heartbeat).is_err());
    assert!(AgentMessage::from_json(r#"{"type":"auth.success","connectionId":"c"}"#).is_err());
    let err = AgentMessage::from_json(r#"{"type":"job.heartbeat","jobId":"j","timestamp":1}"#)
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown variant `job.heartbeat`"), "{err}");
    assert!(AgentMessage::from_json(r#"{"timestamp":1}"#).is_err());
}

#[test]
fn job_status_combinations_are_checked() {
    let base = |extra: Value| {
        let mut v = json!({"type":"job.status","messageId":"s","jobId":"j","timestamp":1});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v.to_string()
    };
    for bad in [
        // running carries nothing else
        json!({"state":"running","reason":"completed","result":{"exitCode":0}}),
        // exit 0 is success, anything else failed
        json!({"state":"failed","reason":"completed","result":{"exitCode":0}}),
        json!({"state":"success","reason":"completed","result":{"exitCode":1}}),
        json!({"state":"success","reason":"completed","result":{"signal":9}}),
        // a terminal state needs its reason and result
        json!({"state":"failed"}),
        json!({"state":"failed","reason":"completed"}),
        json!({"state":"failed","reason":"timed-out"}),
        json!({"state":"success","reason":"timed-out","result":{"exitCode":0}}),
        json!({"state":"failed","reason":"cancelled","result":{"exitCode":0}}),
        // a spawn failure has an error and no result
        json!({"state":"failed","reason":"spawn-failed"}),
        json!({"state":"failed","reason":"spawn-failed","error":"x","result":{"exitCode":127}}),
        json!({"state":"failed","reason":"completed","result":{"exitCode":1},"error":"x"}),
        // states outside ours
        json!({"state":"queued"}),
        json!({"state":"timed_out_stale"}),
    ] {
        let text = base(bad.clone());
        assert!(AgentMessage::from_json(&text).is_err(), "{text}");
    }
}

#[test]
fn register_refuses_bad_ids_and_labels() {
    for bad in [
        json!({"type":"agent.register","messageId":"m","agentId":"host-1234","labels":[]}),
        json!({"type":"agent.register","messageId":"m","agentId":"scaler-container-00000000","labels":["a b"]}),
        json!({"type":"agent.register","messageId":"m","agentId":"scaler-container-00000000","labels":[""]}),
        json!({"type":"agent.register","messageId":"m","agentId":"scaler-container-00000000","labels":[],"maxConcurrency":0}),
        json!({"type":"auth.request","token":"secret","protocolVersion":1}),
        json!({"type":"auth.request","token":TOKEN,"protocolVersion":-1}),
        json!({"type":"auth.request","token":TOKEN,"protocolVersion":1.5}),
    ] {
        assert!(AgentMessage::from_json(&bad.to_string()).is_err(), "{bad}");
    }
    // Version 0 is a version (the gateway refuses it as unsupported, with
    // its own close code), not a malformed message.
    let zero = json!({"type":"auth.request","token":TOKEN,"protocolVersion":0});
    let AgentMessage::AuthRequest(a) = AgentMessage::from_json(&zero.to_string()).unwrap() else {
        panic!("not an auth.request");
    };
    assert!(!SUPPORTED_PROTOCOL_VERSIONS.contains(&a.protocol_version));
    // Labels arrive in any case and order and are normalised.
    let ok = json!({"type":"agent.register","messageId":"m","agentId":"scaler-container-00000000",
                    "labels":["Linux","kici:os:linux","linux"]});
    let AgentMessage::Register(r) = AgentMessage::from_json(&ok.to_string()).unwrap() else {
        panic!("not a register");
    };
    assert_eq!(r.labels.key(), "kici:os:linux,linux");
}

#[test]
fn a_token_never_shows_in_debug_output() {
    let msg = AgentMessage::AuthRequest(AuthRequest {
        token: TOKEN.parse().unwrap(),
        protocol_version: 1,
    });
    let debug = format!("{msg:?}");
    assert!(!debug.contains(&TOKEN[4..]), "{debug}");
    assert!(debug.contains("<redacted>"));
}

#[test]
fn the_largest_messages_fit_the_frame_bound() {
    let chunk = AgentMessage::OutputChunk(OutputChunk {
        job_id: JobId::from_str_max(),
        seq: u64::MAX,
        stream: OutputStream::Stderr,
        data: ChunkData::new(vec![0xff; MAX_OUTPUT_CHUNK_BYTES]).unwrap(),
    });
    assert!(chunk.to_json().len() < MAX_FRAME_BYTES);
    // The worst case for a dispatch: every byte of the spec escaped as \u00XX.
    let ctl = "\u{1}".repeat(MAX_JOB_SPEC_BYTES - 1);
    let dispatch = GatewayMessage::JobDispatch(JobDispatch {
        message_id: "d".into(),
        job: JobSpec::new(JobId::from_str_max(), vec![ctl], BTreeMap::new(), Some(1)).unwrap(),
        timestamp: UnixMillis(i64::MAX),
    });
    let text = dispatch.to_json();
    assert!(text.len() > 6 * (MAX_JOB_SPEC_BYTES - 1));
    assert!(
        text.len() < MAX_FRAME_BYTES,
        "{} >= {MAX_FRAME_BYTES}",
        text.len()
    );
}

trait MaxJobId {
    fn from_str_max() -> JobId;
}

impl MaxJobId for JobId {
    fn from_str_max() -> JobId {
        "j".repeat(JobId::MAX_LEN).parse().unwrap()
    }
}
