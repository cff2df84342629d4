//! A Server-Sent Events parser for the daemon's streams
//! (`GET /v1/events`, `GET /v1/jobs/{id}/logs`).

/// One Server-Sent Event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// `id:`, when it is a number.
    pub id: Option<u64>,
    /// `event:` (`message` when absent).
    pub event: String,
    /// Every `data:` line, joined by newlines.
    pub data: String,
}

/// Splits an SSE byte stream into events, across reads of any size.
/// Comments (keep-alives) and events without data are skipped.
#[derive(Debug, Default)]
pub struct SseParser {
    buffer: Vec<u8>,
}

impl SseParser {
    /// Adds `bytes` and returns every event they complete.
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<SseEvent> {
        self.buffer.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some(end) = find_blank_line(&self.buffer) {
            let block: Vec<u8> = self.buffer.drain(..end.1).collect();
            let text = String::from_utf8_lossy(&block[..end.0]);
            let mut id = None;
            let mut event = String::from("message");
            let mut data = String::new();
            let mut has_data = false;
            for line in text.lines() {
                if let Some(v) = line.strip_prefix("id:") {
                    id = v.trim().parse().ok();
                } else if let Some(v) = line.strip_prefix("event:") {
                    event = v.trim().to_owned();
                } else if let Some(v) = line.strip_prefix("data:") {
                    if has_data {
                        data.push('\n');
                    }
                    has_data = true;
                    data.push_str(v.strip_prefix(' ').unwrap_or(v));
                }
            }
            if has_data && !data.is_empty() {
                events.push(SseEvent { id, event, data });
            }
        }
        events
    }
}

/// `(end of the block, end of its terminator)` of the first event block.
fn find_blank_line(buffer: &[u8]) -> Option<(usize, usize)> {
    let lf = buffer
        .windows(2)
        .position(|w| w == b"\n\n")
        .map(|i| (i, i + 2));
    let crlf = buffer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| (i, i + 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn sse_events_are_split_across_reads() {
        let mut p = SseParser::default();
        assert!(p.feed(b"id: 0\nevent: output\ndata: {\"a\"").is_empty());
        let events = p.feed(b":1}\n\n: keep-alive\n\nevent: end\ndata: {}\n\n");
        assert_eq!(
            events,
            [
                SseEvent {
                    id: Some(0),
                    event: "output".into(),
                    data: "{\"a\":1}".into()
                },
                SseEvent {
                    id: None,
                    event: "end".into(),
                    data: "{}".into()
                }
            ]
        );
    }
}
