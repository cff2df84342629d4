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

use super::error::{ApiError, ErrorBody, ErrorCode};
use super::wire::IntoApi;
use super::AppState;
use crate::events::{EventLog, Gap, LoggedEvent, Next};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use futures_util::stream::{self, Stream};
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

fn reset_event(gap: Gap, cause: ResetCause) -> Event {
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
    Event::default()
        .id(gap.missed_to.to_string())
        .event(RESET_EVENT)
        .json_data(&data)
        .unwrap_or_else(|_| Event::default().event(RESET_EVENT))
}

fn sse_event(e: &LoggedEvent) -> Event {
    Event::default()
        .id(e.id.to_string())
        .event(e.name.as_str())
        .data(e.json.as_str())
}

/// The engine's events, as SSE (see the module docs for `reset`).
#[utoipa::path(
    get,
    path = "/v1/events",
    tag = "operations",
    params(("Last-Event-ID" = Option<u64>, Header, description = "Resume after this event id")),
    responses(
        (status = 200, description = "An SSE stream: `id:`, `event:` (the type), `data:` (JSON)", content_type = "text/event-stream", body = String),
        (status = 400, description = "Last-Event-ID is not a number", body = ErrorBody),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody)
    )
)]
pub async fn events(
    State(state): State<AppState>,
    headers: HeaderMap,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
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
    Ok(Sse::new(follow(Arc::clone(&state.events), after))
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
}

/// Every event of `log` after `after`, then live ones, until the log closes.
pub fn follow(log: Arc<EventLog>, after: u64) -> impl Stream<Item = Result<Event, Infallible>> {
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
        ));
        newest
    } else {
        after
    };
    let start = (log, after, queued);
    stream::unfold(start, |(log, mut after, mut queued)| async move {
        loop {
            if let Some(event) = queued.pop_front() {
                return Some((Ok(event), (log, after, queued)));
            }
            match log.read_after(after) {
                Next::Events { gap, events } => {
                    if let Some(gap) = gap {
                        queued.push_back(reset_event(gap, ResetCause::Evicted));
                    }
                    for e in &events {
                        queued.push_back(sse_event(e));
                        after = e.id;
                    }
                }
                Next::Wait => log.wait_after(after).await,
                Next::Closed => return None,
            }
        }
    })
}
