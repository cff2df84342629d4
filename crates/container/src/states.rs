//! Container states outside Docker's vocabulary, read anyway.
//!
//! Podman's Docker-compatible API lets its own container states through:
//! `stopped` (the process exited, Podman's cleanup has not run yet),
//! `stopping`, `configured`, `initialized`. Podman 4.3 (Debian 12) does so
//! in `GET /containers/{id}/json` (fixed in later Podman, which maps
//! `stopped` → `exited` and `stopping` → `running`, podman#17728) and in
//! `GET /containers/json` (podman#28359). bollard's models are Docker's
//! closed enums, so such an answer fails to deserialize (bollard#293):
//! before this module, destroying an agent that had just exited on its own
//! failed at its inspect, and the container and its rules were left until
//! the engine's destroy retry (30 s later; `kici-scaler run` had exited by
//! then).
//!
//! Here the answer is read again from the payload bollard keeps in the
//! error (its `json_data_content` feature), with each state mapped as later
//! Podman maps it; `State.Running` and the rest are the runtime's own.

use bollard::errors::Error as DockerError;
use bollard::models::{ContainerInspectResponse, ContainerSummary};
use bollard::query_parameters::{InspectContainerOptions, ListContainersOptions};
use bollard::Docker;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// Docker's container states (`ContainerState.Status`, `ContainerSummary.State`).
const DOCKER_STATES: &[&str] = &[
    "",
    "created",
    "running",
    "paused",
    "restarting",
    "removing",
    "exited",
    "dead",
    "stopping",
];

/// The Docker state for a state string of the runtime: Docker's own as
/// they are, Podman's mapped as Podman ≥ 4.5 maps them, anything else
/// unknown (`""`).
pub fn docker_state(state: &str) -> &str {
    match state {
        s if DOCKER_STATES.contains(&s) => s,
        "stopped" => "exited",
        "configured" | "initialized" => "created",
        _ => "",
    }
}

/// `GET /containers/{id}/json`, also when the runtime answers with a state
/// of its own.
pub async fn inspect_container(
    docker: &Docker,
    container: &str,
) -> Result<ContainerInspectResponse, DockerError> {
    match docker
        .inspect_container(container, None::<InspectContainerOptions>)
        .await
    {
        Err(e @ DockerError::JsonDataError { .. }) => reread(e, |v| {
            if let Some(status) = v.pointer_mut("/State/Status") {
                map_state(status);
            }
        }),
        other => other,
    }
}

/// `GET /containers/json`, also when the runtime answers with states of
/// its own.
pub async fn list_containers(
    docker: &Docker,
    options: ListContainersOptions,
) -> Result<Vec<ContainerSummary>, DockerError> {
    match docker.list_containers(Some(options)).await {
        Err(e @ DockerError::JsonDataError { .. }) => reread(e, |v| {
            if let Some(items) = v.as_array_mut() {
                for item in items {
                    if let Some(state) = item.get_mut("State") {
                        map_state(state);
                    }
                }
            }
        }),
        other => other,
    }
}

fn map_state(state: &mut Value) {
    if let Some(s) = state.as_str() {
        let mapped = docker_state(s);
        if mapped != s {
            *state = Value::String(mapped.to_owned());
        }
    }
}

/// The payload of a deserialization error, with `fix` applied, read as
/// `T`; the original error when that fails too.
fn reread<T: DeserializeOwned>(
    error: DockerError,
    fix: impl FnOnce(&mut Value),
) -> Result<T, DockerError> {
    let DockerError::JsonDataError { contents, .. } = &error else {
        return Err(error);
    };
    let Ok(mut value) = serde_json::from_str::<Value>(contents) else {
        return Err(error);
    };
    fix(&mut value);
    match serde_json::from_value::<T>(value) {
        Ok(t) => {
            tracing::debug!(
                "container state outside Docker's vocabulary read as its Docker equivalent"
            );
            Ok(t)
        }
        Err(_) => Err(error),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bollard::models::{ContainerStateStatusEnum, ContainerSummaryStateEnum};

    #[test]
    fn podman_states_map_to_dockers() {
        assert_eq!(docker_state("stopped"), "exited");
        assert_eq!(docker_state("stopping"), "stopping");
        assert_eq!(docker_state("configured"), "created");
        assert_eq!(docker_state("initialized"), "created");
        assert_eq!(docker_state("running"), "running");
        assert_eq!(docker_state("exited"), "exited");
        assert_eq!(docker_state("something-new"), "");
    }

    /// What Podman 4.3 answers between an agent's exit and its cleanup
    /// (trimmed): bollard refuses it, the reread keeps everything else.
    #[test]
    fn an_inspect_answer_with_podmans_stopped_state_is_read() {
        let body = r#"{"Id":"b8e4","Name":"kici-x","State":{"Status":"stopped","Running":false,"ExitCode":3,"OOMKilled":false},"Config":{"Labels":{"dev.kici.scaler.instance":"44acdf94"}}}"#;
        let refused = serde_json::from_str::<ContainerInspectResponse>(body).unwrap_err();
        assert!(
            refused.to_string().contains("unknown variant `stopped`"),
            "{refused}"
        );
        let error = DockerError::JsonDataError {
            message: refused.to_string(),
            contents: body.to_owned(),
            column: refused.column(),
        };
        let read: ContainerInspectResponse = reread(error, |v| {
            if let Some(status) = v.pointer_mut("/State/Status") {
                map_state(status);
            }
        })
        .unwrap();
        let state = read.state.unwrap();
        assert_eq!(state.status, Some(ContainerStateStatusEnum::EXITED));
        assert_eq!(state.running, Some(false));
        assert_eq!(state.exit_code, Some(3));
        assert_eq!(
            read.config.unwrap().labels.unwrap()["dev.kici.scaler.instance"],
            "44acdf94"
        );
    }

    #[test]
    fn a_list_answer_with_podmans_stopped_state_is_read() {
        let body = r#"[{"Id":"a","State":"running"},{"Id":"b","State":"stopped"}]"#;
        let refused = serde_json::from_str::<Vec<ContainerSummary>>(body).unwrap_err();
        let error = DockerError::JsonDataError {
            message: refused.to_string(),
            contents: body.to_owned(),
            column: refused.column(),
        };
        let read: Vec<ContainerSummary> = reread(error, |v| {
            for item in v.as_array_mut().unwrap() {
                map_state(item.get_mut("State").unwrap());
            }
        })
        .unwrap();
        assert_eq!(read[0].state, Some(ContainerSummaryStateEnum::RUNNING));
        assert_eq!(read[1].state, Some(ContainerSummaryStateEnum::EXITED));
    }

    #[test]
    fn an_answer_that_is_wrong_otherwise_keeps_its_error() {
        let body = r#"{"Id":5}"#;
        let error = DockerError::JsonDataError {
            message: "invalid type".to_owned(),
            contents: body.to_owned(),
            column: 7,
        };
        let read = reread::<ContainerInspectResponse>(error, |_| {});
        assert!(matches!(read, Err(DockerError::JsonDataError { .. })));
    }
}
