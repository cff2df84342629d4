//! How the daemon writes its log lines: tracing's JSON, one event per line,
//! and the choice of shape for forwarded agent output
//! (`--agent-log-format`).
//!
//! Backends forward every line an agent writes as one event of target
//! [`kici_host::logs::TARGET`] with the daemon's fields (`agent_id`,
//! `scaler`, `job_id`, `stream`, `source`) and the agent's text as the
//! string field `line`. [`AgentLogFormat::Wrapped`] writes that event like
//! any other. [`AgentLogFormat::Upstream`] writes KiCI's shape instead: a
//! line that is a JSON object keeps its own fields at the top level, any
//! other line becomes `{"level":"info","message":<line>}`, and the daemon's
//! identifying fields are set over it — `service: "agent"`, `agentId`,
//! `scaler`, `jobId` (when the agent has a job), `logsSource`, `stream`.
//!
//! Both are unforgeable: wrapped never parses the line; upstream removes
//! every field of the agent's that names an agent, a scaler, a job, a run,
//! a request or a source before it sets its own (KiCI's forwarder let an
//! agent's `runId`/`jobId` through when it had none, attributing the line
//! to another run). Both are bounded: a forwarded line is at most
//! [`kici_host::logs::MAX_LINE_BYTES`] (longer ones are cut, and a cut JSON
//! line is no longer an object: it is forwarded as a message), and the
//! upstream shape adds a fixed set of short fields.

use kici_host::logs::TARGET;
use serde_json::{Map, Value};
use std::fmt;
use std::sync::atomic::{AtomicU8, Ordering};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::{Format, Json, JsonFields, Writer};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// The shape of forwarded agent output in the daemon's log.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AgentLogFormat {
    /// The agent's line as the string field `line` of the daemon's own
    /// event; never parsed.
    #[default]
    Wrapped,
    /// KiCI's: the agent's JSON fields at the top level, the daemon's
    /// identifying fields set over them.
    Upstream,
}

impl AgentLogFormat {
    fn to_u8(self) -> u8 {
        match self {
            Self::Wrapped => 0,
            Self::Upstream => 1,
        }
    }

    fn from_u8(v: u8) -> Self {
        if v == 1 {
            Self::Upstream
        } else {
            Self::Wrapped
        }
    }
}

/// The fields of an agent's line the daemon sets in the upstream shape;
/// the agent's own values of them are dropped (attribution is the
/// daemon's).
pub const UPSTREAM_RESERVED: [&str; 8] = [
    "service",
    "agentId",
    "scaler",
    "jobId",
    "runId",
    "requestId",
    "logsSource",
    "stream",
];

/// The format the daemon's logging uses; set once `serve` has resolved
/// its settings (logging starts before they are read).
static DAEMON_AGENT_FORMAT: AtomicU8 = AtomicU8::new(0);

/// Switches the daemon's log to `format` for forwarded agent output.
pub fn set_agent_log_format(format: AgentLogFormat) {
    DAEMON_AGENT_FORMAT.store(format.to_u8(), Ordering::Relaxed);
}

/// The daemon's event format: tracing's JSON, with forwarded agent output
/// in the shape its switch says.
pub struct DaemonFormat {
    inner: Format<Json>,
    agent_format: &'static AtomicU8,
}

impl DaemonFormat {
    /// The format [`set_agent_log_format`] switches.
    pub fn daemon() -> Self {
        Self::with_switch(&DAEMON_AGENT_FORMAT)
    }

    /// A format with a switch of its own (tests).
    pub fn with_switch(agent_format: &'static AtomicU8) -> Self {
        Self {
            inner: Format::default().json().with_current_span(false),
            agent_format,
        }
    }

    /// The field formatter this format expects.
    pub fn fields() -> JsonFields {
        JsonFields::new()
    }

    /// Sets this format's switch (what [`set_agent_log_format`] does for
    /// the daemon's).
    pub fn switch(agent_format: &AtomicU8, format: AgentLogFormat) {
        agent_format.store(format.to_u8(), Ordering::Relaxed);
    }
}

impl<S, N> FormatEvent<S, N> for DaemonFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let upstream = AgentLogFormat::from_u8(self.agent_format.load(Ordering::Relaxed))
            == AgentLogFormat::Upstream;
        if upstream && event.metadata().target() == TARGET {
            let mut fields = AgentLine::default();
            event.record(&mut fields);
            if let Some(line) = fields.upstream() {
                return writeln!(writer, "{line}");
            }
        }
        self.inner.format_event(ctx, writer, event)
    }
}

/// The fields of one forwarded-output event.
#[derive(Debug, Default)]
struct AgentLine {
    agent_id: Option<String>,
    scaler: Option<String>,
    job_id: Option<String>,
    stream: Option<String>,
    source: Option<String>,
    line: Option<String>,
}

impl Visit for AgentLine {
    fn record_str(&mut self, field: &Field, value: &str) {
        let slot = match field.name() {
            "agent_id" => &mut self.agent_id,
            "scaler" => &mut self.scaler,
            "job_id" => &mut self.job_id,
            "stream" => &mut self.stream,
            "source" => &mut self.source,
            "line" => &mut self.line,
            _ => return,
        };
        *slot = Some(value.to_owned());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        // `agent_id` is recorded with its Display form, which reaches a
        // visitor as `fmt::Arguments` (Debug prints it plainly).
        if field.name() == "agent_id" {
            self.agent_id = Some(format!("{value:?}"));
        }
    }
}

impl AgentLine {
    /// The line in the upstream shape; `None` when the event is not a
    /// forwarded line (it then keeps the daemon's own shape).
    fn upstream(self) -> Option<String> {
        let line = self.line?;
        let agent_id = self.agent_id?;
        Some(upstream_line(
            &line,
            &Attribution {
                agent_id: &agent_id,
                scaler: self.scaler.as_deref().unwrap_or_default(),
                job_id: self.job_id.as_deref(),
                source: self.source.as_deref().unwrap_or_default(),
                stream: self.stream.as_deref().unwrap_or_default(),
            },
        ))
    }
}

/// What the daemon knows of a forwarded line.
#[derive(Debug, Clone, Copy)]
pub struct Attribution<'a> {
    pub agent_id: &'a str,
    pub scaler: &'a str,
    pub job_id: Option<&'a str>,
    pub source: &'a str,
    pub stream: &'a str,
}

/// One agent line in KiCI's forwarded shape (see the module docs).
pub fn upstream_line(line: &str, by: &Attribution<'_>) -> String {
    let mut obj = match serde_json::from_str::<Value>(line) {
        Ok(Value::Object(m)) => m,
        _ => {
            let mut m = Map::new();
            m.insert("level".into(), Value::from("info"));
            m.insert("message".into(), Value::from(line));
            m
        }
    };
    for name in UPSTREAM_RESERVED {
        obj.remove(name);
    }
    obj.insert("service".into(), Value::from("agent"));
    obj.insert("agentId".into(), Value::from(by.agent_id));
    obj.insert("scaler".into(), Value::from(by.scaler));
    if let Some(job) = by.job_id {
        obj.insert("jobId".into(), Value::from(job));
    }
    obj.insert("logsSource".into(), Value::from(by.source));
    obj.insert("stream".into(), Value::from(by.stream));
    Value::Object(obj).to_string()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use kici_host::logs::{LogContext, Stream, MAX_LINE_BYTES};
    use kici_model::{AgentId, ScalerName, ScalerType};
    use std::sync::{Arc, Mutex};
    use tracing_subscriber::fmt::MakeWriter;

    /// Everything the subscriber wrote.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Captured {
        type Writer = Captured;
        fn make_writer(&'a self) -> Self::Writer {
            self.clone()
        }
    }

    /// The JSON lines written while `f` runs under a daemon-format
    /// subscriber whose switch says `format`.
    fn written(format: AgentLogFormat, f: impl FnOnce()) -> Vec<Value> {
        let switch: &'static AtomicU8 = Box::leak(Box::new(AtomicU8::new(0)));
        DaemonFormat::switch(switch, format);
        let out = Captured::default();
        let subscriber = tracing_subscriber::fmt()
            .event_format(DaemonFormat::with_switch(switch))
            .fmt_fields(DaemonFormat::fields())
            .with_writer(out.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, f);
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        text.lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect()
    }

    fn ctx(agent: AgentId) -> LogContext {
        LogContext {
            agent,
            scaler: ScalerName::new("metal"),
            job: Some("job-7".parse().unwrap()),
            source: "bare-metal",
        }
    }

    const FORGING: &str = r#"{"level":"warn","msg":"hello","agentId":"scaler-bare-metal-deadbeef","scaler":"other","jobId":"job-x","runId":"run-x","requestId":"r","logsSource":"docker","service":"orchestrator","stream":"stdin","step":3}"#;

    #[test]
    fn upstream_merges_the_agents_fields_and_sets_its_own_attribution_over_them() {
        let agent = AgentId::random(ScalerType::BareMetal);
        let lines = written(AgentLogFormat::Upstream, || {
            ctx(agent).emit(Stream::Stdout, FORGING);
            ctx(agent).emit(Stream::Stderr, "plain text, not JSON");
            ctx(agent).emit(Stream::Stdout, "[1,2]");
            tracing::info!(scaler = "metal", "a daemon line");
        });
        assert_eq!(lines.len(), 4);
        let json = &lines[0];
        // The agent's own fields, at the top level.
        assert_eq!(json["level"], "warn");
        assert_eq!(json["msg"], "hello");
        assert_eq!(json["step"], 3);
        // Attribution is the daemon's, whatever the agent wrote.
        assert_eq!(json["agentId"], agent.to_string());
        assert_eq!(json["scaler"], "metal");
        assert_eq!(json["jobId"], "job-7");
        assert_eq!(json["logsSource"], "bare-metal");
        assert_eq!(json["service"], "agent");
        assert_eq!(json["stream"], "stdout");
        assert!(json.get("runId").is_none() && json.get("requestId").is_none());
        // Anything else is KiCI's `{level: info, message}`.
        for (line, message, stream) in [
            (&lines[1], "plain text, not JSON", "stderr"),
            (&lines[2], "[1,2]", "stdout"),
        ] {
            assert_eq!(line["level"], "info");
            assert_eq!(line["message"], message);
            assert_eq!(line["agentId"], agent.to_string());
            assert_eq!(line["stream"], stream);
        }
        // The daemon's own events keep their shape.
        assert_eq!(lines[3]["fields"]["message"], "a daemon line");
        assert_eq!(lines[3]["level"], "INFO");
    }

    #[test]
    fn wrapped_keeps_the_line_a_string_inside_the_daemons_event() {
        let agent = AgentId::random(ScalerType::BareMetal);
        let lines = written(AgentLogFormat::Wrapped, || {
            ctx(agent).emit(Stream::Stdout, FORGING);
        });
        assert_eq!(lines.len(), 1);
        let fields = &lines[0]["fields"];
        assert_eq!(fields["line"], FORGING);
        assert_eq!(fields["agent_id"], agent.to_string());
        assert_eq!(fields["scaler"], "metal");
        assert_eq!(lines[0]["target"], TARGET);
        assert!(lines[0].get("agentId").is_none());
    }

    #[test]
    fn an_upstream_line_is_bounded_by_the_forwarded_line() {
        let agent = AgentId::random(ScalerType::BareMetal);
        // The longest line a tailer forwards, as one JSON object.
        let pad = "x".repeat(MAX_LINE_BYTES - 20);
        let big = format!(r#"{{"msg":"{pad}"}}"#);
        assert!(big.len() <= MAX_LINE_BYTES);
        let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        let lines = written(AgentLogFormat::Upstream, || {
            ctx(agent).emit(Stream::Stdout, &big);
            // Nesting past the parser's limit is a message, not a crash.
            ctx(agent).emit(Stream::Stdout, &deep);
        });
        let text = lines[0].to_string();
        assert!(text.len() < MAX_LINE_BYTES + 512, "{}", text.len());
        assert_eq!(lines[0]["msg"].as_str().unwrap().len(), pad.len());
        assert_eq!(lines[1]["message"].as_str().unwrap().len(), deep.len());
    }

    #[test]
    fn the_flag_value_is_read_as_written() {
        use clap::ValueEnum;
        assert_eq!(
            AgentLogFormat::from_str("upstream", false).unwrap(),
            AgentLogFormat::Upstream
        );
        assert_eq!(AgentLogFormat::default(), AgentLogFormat::Wrapped);
        let file: AgentLogFormat = serde_json::from_str(r#""wrapped""#).unwrap();
        assert_eq!(file, AgentLogFormat::Wrapped);
    }
}
