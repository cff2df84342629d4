//! A small HTTP/1.1 reader/writer over unix sockets: the simulator's API
//! server side (keep-alive, `Content-Length` bodies, Firecracker's payload
//! limit) and a blocking client for tests.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// Default `--http-api-max-payload-size` of Firecracker.
pub const DEFAULT_MAX_PAYLOAD: usize = 51_200;
const MAX_HEADER_BYTES: usize = 16 * 1024;

/// Errors reading or writing HTTP.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    #[error("malformed HTTP message: {0}")]
    Malformed(String),
    #[error("connection closed")]
    Closed,
}

/// A parsed request.
#[derive(Debug, Clone)]
pub struct HttpRequest {
    pub method: String,
    /// Absolute path, without query.
    pub path: String,
    pub headers: Vec<(String, String)>,
    /// `None` when no body was sent (or `Content-Length: 0`), like micro_http.
    pub body: Option<Vec<u8>>,
    /// Set when the declared body exceeded the payload limit (the body was not read).
    pub oversized: Option<usize>,
}

impl HttpRequest {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn wants_close(&self) -> bool {
        self.header("connection")
            .is_some_and(|c| c.eq_ignore_ascii_case("close"))
    }
}

/// A response to write.
#[derive(Debug, Clone)]
pub struct HttpResponse {
    pub status: u16,
    pub content_type: Option<&'static str>,
    pub body: Vec<u8>,
}

impl HttpResponse {
    pub fn no_content() -> Self {
        Self {
            status: 204,
            content_type: None,
            body: Vec::new(),
        }
    }

    pub fn json(status: u16, body: &serde_json::Value) -> Self {
        Self {
            status,
            content_type: Some("application/json"),
            body: body.to_string().into_bytes(),
        }
    }

    /// `{"fault_message": "..."}` with the given status.
    pub fn fault(status: u16, message: &str) -> Self {
        Self::json(status, &serde_json::json!({ "fault_message": message }))
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        204 => "No Content",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        405 => "Method Not Allowed",
        413 => "Payload Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        _ => "",
    }
}

/// Read one request from a buffered stream. `Err(Closed)` on a clean EOF before a request line.
/// `interim` receives the `100 Continue` answer to `Expect: 100-continue`.
pub fn read_request<R: BufRead, W: Write>(
    r: &mut R,
    interim: &mut W,
    max_payload: usize,
) -> Result<HttpRequest, HttpError> {
    let mut line = String::new();
    let mut total = 0usize;
    // Skip stray empty lines between keep-alive requests.
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 {
            return Err(HttpError::Closed);
        }
        if !line.trim().is_empty() {
            break;
        }
    }
    total += line.len();
    let mut parts = line.split_whitespace();
    let method = parts
        .next()
        .ok_or_else(|| HttpError::Malformed("empty request line".into()))?
        .to_string();
    let target = parts
        .next()
        .ok_or_else(|| HttpError::Malformed("no request target".into()))?;
    // Absolute-form targets (`http://localhost/path`) are accepted like micro_http does.
    let path = match target.find("://") {
        Some(i) => {
            let rest = &target[i + 3..];
            rest.find('/')
                .map_or("/".to_string(), |j| rest[j..].to_string())
        }
        None => target.to_string(),
    };
    let path = path.split('?').next().unwrap_or("/").to_string();
    let mut headers = Vec::new();
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 {
            return Err(HttpError::Malformed("headers cut short".into()));
        }
        total += line.len();
        if total > MAX_HEADER_BYTES {
            return Err(HttpError::Malformed("headers too large".into()));
        }
        let l = line.trim_end_matches(['\r', '\n']);
        if l.is_empty() {
            break;
        }
        let (k, v) = l
            .split_once(':')
            .ok_or_else(|| HttpError::Malformed(format!("bad header line {l:?}")))?;
        headers.push((k.trim().to_string(), v.trim().to_string()));
    }
    let mut req = HttpRequest {
        method,
        path,
        headers,
        body: None,
        oversized: None,
    };
    if req
        .header("transfer-encoding")
        .is_some_and(|t| t.eq_ignore_ascii_case("chunked"))
    {
        return Err(HttpError::Malformed(
            "chunked bodies are not supported".into(),
        ));
    }
    let len = match req.header("content-length") {
        Some(v) => v
            .parse::<usize>()
            .map_err(|_| HttpError::Malformed(format!("bad Content-Length {v:?}")))?,
        None => 0,
    };
    if len > max_payload {
        req.oversized = Some(len);
        return Ok(req);
    }
    if len > 0 {
        if req
            .header("expect")
            .is_some_and(|e| e.eq_ignore_ascii_case("100-continue"))
        {
            interim.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")?;
            interim.flush()?;
        }
        let mut body = vec![0u8; len];
        r.read_exact(&mut body)?;
        req.body = Some(body);
    }
    Ok(req)
}

/// Write a response the way Firecracker's API server does.
pub fn write_response<W: Write>(w: &mut W, resp: &HttpResponse) -> Result<(), HttpError> {
    let mut out = format!(
        "HTTP/1.1 {} {}\r\nServer: Firecracker API\r\nConnection: keep-alive\r\n",
        resp.status,
        reason(resp.status)
    );
    if let Some(ct) = resp.content_type {
        out.push_str(&format!("Content-Type: {ct}\r\n"));
    }
    if resp.status != 204 || !resp.body.is_empty() {
        out.push_str(&format!("Content-Length: {}\r\n", resp.body.len()));
    }
    out.push_str("\r\n");
    w.write_all(out.as_bytes())?;
    w.write_all(&resp.body)?;
    w.flush()?;
    Ok(())
}

/// A response as a client sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientResponse {
    pub status: u16,
    pub body: String,
}

impl ClientResponse {
    /// The body parsed as JSON (`Null` when empty or not JSON).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or(serde_json::Value::Null)
    }

    /// The `fault_message` of an error body.
    pub fn fault_message(&self) -> Option<String> {
        self.json()
            .get("fault_message")
            .and_then(|m| m.as_str())
            .map(str::to_string)
    }
}

/// One request over a fresh connection to a unix socket (blocking, with a timeout).
pub fn unix_request(
    socket: &Path,
    method: &str,
    path: &str,
    body: Option<&str>,
    timeout: Duration,
) -> Result<ClientResponse, HttpError> {
    let mut stream = UnixStream::connect(socket)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    if let Some(b) = body {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    req.push_str("\r\n");
    if let Some(b) = body {
        req.push_str(b);
    }
    stream.write_all(req.as_bytes())?;
    let mut reader = BufReader::new(stream);
    let mut status_line = String::new();
    if reader.read_line(&mut status_line)? == 0 {
        return Err(HttpError::Closed);
    }
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| HttpError::Malformed(format!("bad status line {status_line:?}")))?;
    let mut len = 0usize;
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            break;
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            if k.trim().eq_ignore_ascii_case("content-length") {
                len = v.trim().parse().unwrap_or(0);
            }
        }
    }
    let mut body = vec![0u8; len];
    reader.read_exact(&mut body)?;
    Ok(ClientResponse {
        status,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}
