//! `GET /v1/events`: the engine's events as Server-Sent Events.
//!
//! Each SSE event carries `id:` (the event's stream id, increasing without
//! gaps, and across restarts when the daemon has a state store), `event:` (the event type: `agent-transition`, `refused`,
//! `pending-ended`, `breaker-changed`, `scaler-cordon`, `reloaded`) and
//! `data:` (the event as JSON). A client without `Last-Event-ID` gets the
//! events from now on; with one, it resumes after that id from the replay
//! buffer. When some of the events it asked for are no longer kept, it first
//! gets an explicit `reset` event (`id:` = the last missed id) and should
//! re-read `GET /v1/agents` and `GET /v1/status`. A `Last-Event-ID` ahead
//! of the newest recorded id (a client resuming against a new or reset
//! state dir) gets that `reset` at once (`missedFrom` 1, `missedTo` the
//! newest id), then the events from there on.
//!
//! In a fleet, a reader without `Last-Event-ID` (and without `?local=true`)
//! gets the fleet's stream instead: this host's events and every other live
//! host's own stream relayed, each event's data naming its `host`, without
//! SSE ids (ids are per host; resuming is per host).

use super::error::{ApiError, ErrorBody, ErrorCode};
use super::wire::IntoApi;
use super::AppState;
use crate::events::{EventLog, Gap, Next};
use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, KeepAliveStream, Sse};
use futures_util::stream::{self, BoxStream, Stream, StreamExt};
use kici_api::{Reset, StampedEvent, RESET_EVENT};
use kici_engine::runtime::SequencedEvent;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// `event` under stream id `id`, as the SSE `data:` carries it (and the
/// store keeps it).
pub fn stamped(id: u64, event: &SequencedEvent) -> StampedEvent {
    let at = event
        .at
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    StampedEvent {
        id,
        at,
        host: None,
        event: event.event.clone().into_api(),
    }
}

/// Why a reader gets a `reset`.
enum ResetCause {
    /// The events it asked for are no longer kept.
    Evicted,
    /// Its `Last-Event-ID` is newer than anything this daemon recorded: it
    /// read another history (a new or reset state dir).
    Ahead { asked: u64 },
}

fn reset_event(gap: Gap, cause: ResetCause, host: Option<&str>) -> Event {
    let reason = match cause {
        ResetCause::Evicted => {
            "these events are no longer in the replay buffer; re-read /v1/agents and /v1/status"
                .to_owned()
        }
        ResetCause::Ahead { asked } => format!(
            "Last-Event-ID {asked} is ahead of this daemon's newest event ({}): its state was \
             reset or is new; re-read /v1/agents and /v1/status",
            gap.missed_to
        ),
    };
    let data = Reset {
        missed_from: gap.missed_from,
        missed_to: gap.missed_to,
        reason,
    };
    // Plain data: encoding cannot fail.
    let json = serde_json::to_string(&data).unwrap_or_default();
    rendered(gap.missed_to, RESET_EVENT, &json, host)
}

/// The engine's events, as SSE (see the module docs for `reset`).
#[utoipa::path(
    get,
    path = "/v1/events",
    tag = "operations",
    params(
        ("Last-Event-ID" = Option<u64>, Header, description = "Resume after this event id (this host's stream)"),
        ("local" = Option<bool>, Query, description = "In a fleet: only this host's events")
    ),
    responses(
        (status = 200, description = "An SSE stream: `id:`, `event:` (the type), `data:` (JSON)", content_type = "text/event-stream", body = String),
        (status = 400, description = "Last-Event-ID is not a number", body = ErrorBody),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
        (status = 422, description = "Unknown or invalid query parameter", body = ErrorBody)
    )
)]
pub async fn events(
    State(state): State<AppState>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
) -> Result<Sse<KeepAliveStream<BoxStream<'static, Result<Event, Infallible>>>>, ApiError> {
    let local = super::query_flags(query.as_deref(), &["local"])?.contains(&"local");
    let keep_alive = KeepAlive::new().interval(Duration::from_secs(15));
    if !local && !headers.contains_key("last-event-id") {
        // From now on: in a fleet, every live host's events.
        return Ok(Sse::new(state.service().events_from_now()).keep_alive(keep_alive));
    }
    let after = match headers.get("last-event-id") {
        None => state.events.newest_id(),
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .ok_or_else(|| {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    ErrorCode::InvalidLastEventId,
                    "Last-Event-ID must be an event id (a number)",
                )
                .field("Last-Event-ID")
            })?,
    };
    Ok(Sse::new(follow(Arc::clone(&state.events), after, None).boxed()).keep_alive(keep_alive))
}

/// An event of host `host` in the fleet-wide stream: its data with `host`,
/// no id.
pub(crate) fn hosted_event(name: &str, json: &str, host: &str) -> Event {
    let data = match serde_json::from_str::<serde_json::Value>(json) {
        Ok(serde_json::Value::Object(mut o)) => {
            o.insert("host".to_owned(), serde_json::Value::from(host));
            serde_json::Value::Object(o).to_string()
        }
        _ => json.to_owned(),
    };
    Event::default().event(name).data(data)
}

/// An event of this host's log as SSE: with its id, or — in the fleet's
/// stream, `host` set — naming the host instead.
fn rendered(id: u64, name: &str, json: &str, host: Option<&str>) -> Event {
    match host {
        Some(host) => hosted_event(name, json, host),
        None => Event::default().id(id.to_string()).event(name).data(json),
    }
}

/// Every event of `log` after `after`, then live ones, until the log
/// closes; with `host`, as the fleet's stream shows them (no ids, each
/// event's data naming the host).
pub fn follow(
    log: Arc<EventLog>,
    after: u64,
    host: Option<String>,
) -> impl Stream<Item = Result<Event, Infallible>> + Send {
    let mut queued = VecDeque::<Event>::new();
    let newest = log.newest_id();
    // Waiting for ids this log will only reach by chance would show the
    // reader nothing, or events unrelated to the ones it saw: it is told at
    // once, and follows from here.
    let after = if after > newest {
        queued.push_back(reset_event(
            Gap {
                missed_from: 1,
                missed_to: newest,
            },
            ResetCause::Ahead { asked: after },
            host.as_deref(),
        ));
        newest
    } else {
        after
    };
    // Events up to `newest` happened before this reader came: replays,
    // which never carry a claim code.
    let start = (log, after, queued, host);
    stream::unfold(
        start,
        move |(log, mut after, mut queued, host)| async move {
            loop {
                if let Some(event) = queued.pop_front() {
                    return Some((Ok(event), (log, after, queued, host)));
                }
                match log.read_after(after) {
                    Next::Events { gap, events } => {
                        if let Some(gap) = gap {
                            queued.push_back(reset_event(
                                gap,
                                ResetCause::Evicted,
                                host.as_deref(),
                            ));
                        }
                        for e in &events {
                            let json = e.json_for(e.id > newest);
                            queued.push_back(rendered(e.id, &e.name, json, host.as_deref()));
                            after = e.id;
                        }
                    }
                    Next::Wait => log.wait_after(after).await,
                    Next::Closed => return None,
                }
            }
        },
    )
}
