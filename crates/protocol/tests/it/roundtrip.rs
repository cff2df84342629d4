//! Property round trips: any valid value survives JSON unchanged.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use kici_model::JobId;
use kici_protocol::*;
use proptest::prelude::*;
use std::collections::BTreeMap;

fn job_id() -> impl Strategy<Value = JobId> {
    "[a-zA-Z0-9._:-]{1,40}".prop_map(|s| s.parse().unwrap())
}

proptest! {
    #[test]
    fn output_chunks_round_trip(
        id in job_id(),
        seq in any::<u64>(),
        stderr in any::<bool>(),
        bytes in proptest::collection::vec(any::<u8>(), 0..2048),
    ) {
        let msg = AgentMessage::OutputChunk(OutputChunk {
            job_id: id,
            seq,
            stream: if stderr { OutputStream::Stderr } else { OutputStream::Stdout },
            data: ChunkData::new(bytes).unwrap(),
        });
        prop_assert_eq!(AgentMessage::from_json(&msg.to_json()).unwrap(), msg);
    }

    #[test]
    fn dispatches_round_trip(
        id in job_id(),
        argv in proptest::collection::vec("[^\u{0}]{0,20}", 1..6),
        env in proptest::collection::btree_map("[A-Za-z_][A-Za-z0-9_]{0,10}", "[^\u{0}]{0,20}", 0..6),
        timeout in proptest::option::of(1u64..100_000),
        ts in 0i64..=i64::MAX,
    ) {
        let msg = GatewayMessage::JobDispatch(JobDispatch {
            message_id: "d".into(),
            job: JobSpec::new(id, argv, env, timeout).unwrap(),
            timestamp: UnixMillis(ts),
        });
        prop_assert_eq!(GatewayMessage::from_json(&msg.to_json()).unwrap(), msg);
    }

    #[test]
    fn job_ends_round_trip(code in any::<i32>(), sig in 1i32..65, which in 0u8..5, error in ".{0,30}") {
        let end = match which {
            0 => JobEnd::Completed(JobResult::exited(code)),
            1 => JobEnd::Completed(JobResult::signalled(sig).unwrap()),
            2 => JobEnd::TimedOut(JobResult::signalled(sig).unwrap()),
            3 => JobEnd::Cancelled(JobResult::exited(code)),
            _ => JobEnd::SpawnFailed { error },
        };
        let msg = AgentMessage::JobStatus(JobStatus {
            message_id: "s".into(),
            job_id: "j".parse().unwrap(),
            timestamp: UnixMillis(1),
            progress: JobProgress::Finished(end),
        });
        prop_assert_eq!(AgentMessage::from_json(&msg.to_json()).unwrap(), msg);
    }

    #[test]
    fn arbitrary_text_never_panics_the_parsers(text in ".{0,200}") {
        let _ = AgentMessage::from_json(&text);
        let _ = GatewayMessage::from_json(&text);
    }
}

#[test]
fn empty_env_is_omitted_and_accepted_either_way() {
    let spec = JobSpec::new(
        "j".parse().unwrap(),
        vec!["true".into()],
        BTreeMap::new(),
        None,
    )
    .unwrap();
    let explicit: JobSpec =
        serde_json::from_str(r#"{"jobId":"j","argv":["true"],"env":{}}"#).unwrap();
    assert_eq!(explicit, spec);
}
