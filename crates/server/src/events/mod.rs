//! The bounded replay buffer behind `GET /v1/events`.
//!
//! The engine publishes every event once, on a broadcast channel, numbered
//! from 1 without gaps; the pump gives each its stream id (the engine's
//! number plus the last id recorded before this start, so ids keep
//! increasing across restarts) and renders it once as a [`LoggedEvent`].
//! [`EventLog`] keeps the most recent `capacity` of them so that an SSE
//! client can resume after a reconnect (`Last-Event-ID`) and a slow client
//! reads at its own pace instead of being dropped. A client whose next event
//! has left the buffer (or was never recorded) is told so with a [`Gap`] and
//! continues from the oldest event still kept. With a state store the buffer
//! starts with the newest recorded events ([`EventLog::restore`]), so a
//! client resumes across a daemon restart too.

pub mod metrics;
pub mod pump;

use kici_engine::runtime::SequencedEvent;
use kici_store::{EventRecord, UnixMillis};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::Arc;
use tokio::sync::watch;

/// One event as the SSE stream sends it: its id, its type (the SSE
/// `event:` name) and its JSON (the `data:`).
///
/// A scale-up event's claim code is a credential: it goes only to readers
/// that were following when the event happened ([`LoggedEvent::json_for`]).
/// Replays — a `Last-Event-ID` from the buffer, the store's copy — get the
/// event without it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoggedEvent {
    pub id: u64,
    pub name: String,
    pub json: String,
    /// The JSON without secrets, when it differs from `json`.
    replay: Option<String>,
}

impl LoggedEvent {
    /// `event` under stream id `id`.
    pub fn render(id: u64, event: &SequencedEvent) -> Self {
        // Converted to the API's event type: the engine's own types are
        // not the wire format.
        let stamped = crate::api::stream::stamped(id, event);
        // Events are plain data (strings, numbers, enums): encoding cannot
        // fail; should it, the event still takes its place.
        let json = serde_json::to_string(&stamped)
            .unwrap_or_else(|e| format!(r#"{{"id":{id},"error":"not encodable: {e}"}}"#));
        let name = stamped.event.name().to_owned();
        let replay = (name == SCALE_UP).then(|| without_claim_code(&json));
        Self {
            id,
            name,
            json,
            replay,
        }
    }

    /// The `data:` for a reader: the whole event if it is `live` (the
    /// reader was following when it happened), else the event without its
    /// secrets.
    pub fn json_for(&self, live: bool) -> &str {
        match &self.replay {
            Some(replay) if !live => replay,
            _ => &self.json,
        }
    }

    /// A recorded event (its type is the JSON's `type`).
    pub fn from_record(r: EventRecord) -> Self {
        let name = serde_json::from_str::<serde_json::Value>(&r.body)
            .ok()
            .and_then(|v| v.get("type").and_then(|t| t.as_str()).map(str::to_owned))
            .unwrap_or_else(|| "unknown".to_owned());
        // The store never holds a secret (see `to_record`).
        Self {
            id: r.seq,
            name,
            json: r.body,
            replay: None,
        }
    }

    /// The store's row for it. A scale-up event's claim code is left out:
    /// the store never holds a redeemable code (the live stream has it; a
    /// replay from the store does not).
    pub fn to_record(&self, at: UnixMillis) -> EventRecord {
        EventRecord {
            seq: self.id,
            at,
            body: self.json_for(false).to_owned(),
        }
    }
}

/// The SSE name of a scale-up event (the one that carries a secret).
const SCALE_UP: &str = "scale-up";

fn without_claim_code(json: &str) -> String {
    match serde_json::from_str::<serde_json::Value>(json) {
        Ok(mut v) => {
            if let Some(o) = v.as_object_mut() {
                o.remove("claimCode");
            }
            v.to_string()
        }
        // Not JSON: keep nothing of it rather than risk the code.
        Err(_) => "{}".to_owned(),
    }
}

/// Events a reader missed: ids `missed_from ..= missed_to` are not available.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gap {
    pub missed_from: u64,
    pub missed_to: u64,
}

/// What a reader gets next.
#[derive(Debug, Clone)]
pub enum Next {
    /// Events after the reader's position, in order (possibly after a gap).
    Events {
        gap: Option<Gap>,
        events: Vec<Arc<LoggedEvent>>,
    },
    /// Nothing new yet.
    Wait,
    /// The log is closed (the daemon is stopping) and fully read.
    Closed,
}

#[derive(Debug)]
struct Buffer {
    events: VecDeque<Arc<LoggedEvent>>,
    closed: bool,
}

/// The replay buffer. Cheap to share (`Arc`).
#[derive(Debug)]
pub struct EventLog {
    capacity: usize,
    buffer: Mutex<Buffer>,
    /// The id of the newest event (0 before the first); readers wait on it.
    newest: watch::Sender<u64>,
}

/// Most events handed to one reader per call, so a far-behind reader does
/// not hold the lock for a copy of the whole buffer.
const BATCH: usize = 256;

impl EventLog {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            buffer: Mutex::new(Buffer {
                events: VecDeque::new(),
                closed: false,
            }),
            newest: watch::channel(0).0,
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Records one event (ids must increase; gaps are allowed and surface to
    /// readers as [`Gap`]s).
    pub fn push(&self, event: Arc<LoggedEvent>) {
        let id = event.id;
        {
            let mut b = self.buffer.lock();
            if b.closed || b.events.back().is_some_and(|last| last.id >= id) {
                return;
            }
            b.events.push_back(event);
            while b.events.len() > self.capacity {
                b.events.pop_front();
            }
        }
        self.newest.send_replace(id);
    }

    /// Fills an empty buffer with recorded events (oldest first), before
    /// the first live one.
    pub fn restore(&self, recorded: impl IntoIterator<Item = LoggedEvent>) {
        for e in recorded {
            self.push(Arc::new(e));
        }
    }

    /// No more events: readers finish once they have read what is kept.
    pub fn close(&self) {
        self.buffer.lock().closed = true;
        // Wake every waiting reader; the value itself is unchanged.
        self.newest.send_modify(|_| {});
    }

    /// The id of the newest recorded event (0 if none).
    pub fn newest_id(&self) -> u64 {
        *self.newest.borrow()
    }

    /// The next events after `after`, a reader's last seen id (a new reader
    /// starts at [`EventLog::newest_id`]; `Last-Event-ID: 0` asks for
    /// everything since the daemon started).
    pub fn read_after(&self, after: u64) -> Next {
        let b = self.buffer.lock();
        let newest = b.events.back().map_or(0, |e| e.id);
        if after >= newest {
            return if b.closed { Next::Closed } else { Next::Wait };
        }
        // Ids are increasing: binary search for the first id > after.
        let start = b.events.partition_point(|e| e.id <= after);
        let events: Vec<_> = b.events.iter().skip(start).take(BATCH).cloned().collect();
        let first = events.first().map_or(after + 1, |e| e.id);
        let gap = (first > after + 1).then(|| Gap {
            missed_from: after + 1,
            missed_to: first - 1,
        });
        Next::Events { gap, events }
    }

    /// Waits until an event newer than `after` is recorded or the log closes.
    pub async fn wait_after(&self, after: u64) {
        let mut rx = self.newest.subscribe();
        loop {
            if *rx.borrow_and_update() > after || self.buffer.lock().closed {
                return;
            }
            if rx.changed().await.is_err() {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use kici_engine::EngineEvent;
    use std::time::SystemTime;

    fn event(id: u64) -> Arc<LoggedEvent> {
        let e = SequencedEvent {
            id: 1,
            at: SystemTime::now(),
            event: EngineEvent::Reloaded {
                added: vec![],
                removed: vec![],
            },
        };
        Arc::new(LoggedEvent::render(id, &e))
    }

    #[test]
    fn an_event_renders_under_its_stream_id_and_comes_back_from_its_row() {
        let e = event(42);
        assert_eq!(e.name, "reloaded");
        let json: serde_json::Value = serde_json::from_str(&e.json).unwrap();
        assert_eq!(json["id"], 42);
        assert_eq!(json["type"], "reloaded");
        let back = LoggedEvent::from_record(e.to_record(UnixMillis(7)));
        assert_eq!(back, *e);
    }

    fn ids(next: &Next) -> (Option<Gap>, Vec<u64>) {
        match next {
            Next::Events { gap, events } => (*gap, events.iter().map(|e| e.id).collect()),
            other => panic!("no events: {other:?}"),
        }
    }

    #[test]
    fn keeps_the_newest_and_resumes_after_an_id() {
        let log = EventLog::new(3);
        for id in 1..=5 {
            log.push(event(id));
        }
        assert_eq!(log.newest_id(), 5);
        assert_eq!(ids(&log.read_after(3)), (None, vec![4, 5]));
        assert!(matches!(log.read_after(5), Next::Wait));
        assert!(matches!(log.read_after(9), Next::Wait));
    }

    #[test]
    fn a_reader_behind_the_buffer_gets_a_gap() {
        let log = EventLog::new(3);
        for id in 1..=5 {
            log.push(event(id));
        }
        assert_eq!(
            ids(&log.read_after(1)),
            (
                Some(Gap {
                    missed_from: 2,
                    missed_to: 2
                }),
                vec![3, 4, 5]
            )
        );
        // Last-Event-ID: 0 missed 1 and 2.
        assert_eq!(
            ids(&log.read_after(0)).0,
            Some(Gap {
                missed_from: 1,
                missed_to: 2
            })
        );
    }

    #[test]
    fn ids_missing_from_the_stream_are_a_gap_too() {
        let log = EventLog::new(10);
        log.push(event(1));
        log.push(event(4));
        assert_eq!(
            ids(&log.read_after(1)),
            (
                Some(Gap {
                    missed_from: 2,
                    missed_to: 3
                }),
                vec![4]
            )
        );
    }

    #[test]
    fn close_ends_readers_after_what_is_kept() {
        let log = EventLog::new(10);
        log.push(event(1));
        log.close();
        log.push(event(2));
        assert_eq!(ids(&log.read_after(0)), (None, vec![1]));
        assert!(matches!(log.read_after(1), Next::Closed));
    }

    #[tokio::test]
    async fn waiters_wake_on_push_and_close() {
        let log = Arc::new(EventLog::new(10));
        let l = log.clone();
        let waiter = tokio::spawn(async move { l.wait_after(0).await });
        log.push(event(1));
        waiter.await.unwrap();
        let l = log.clone();
        let waiter = tokio::spawn(async move { l.wait_after(1).await });
        log.close();
        waiter.await.unwrap();
    }
}
