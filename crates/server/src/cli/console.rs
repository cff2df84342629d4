//! `kici-scaler ui`: the link to a running daemon's web console; and
//! `kici-scaler schema`: the JSON Schema of `scalers.yaml`.

use crate::cli::client::{self, ClientError};
use crate::cli::{CliError, ClientArgs, Outcome};
use serde::Serialize;
use std::io::Write;

/// The JSON Schema (draft 2020-12) of `scalers.yaml` and its drop-ins, as
/// the package ships it.
pub const CONFIG_SCHEMA: &str = include_str!("../../../../packaging/scalers.schema.json");

/// `schema`: prints [`CONFIG_SCHEMA`].
pub fn schema(out: &mut dyn Write) -> Result<Outcome, CliError> {
    out.write_all(CONFIG_SCHEMA.as_bytes())?;
    Ok(Outcome::Ok)
}

/// The port `ui` suggests for a tunnel to a unix socket.
const TUNNEL_PORT: u16 = 7878;

/// `ui --json`.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct UiLink {
    /// What to open in a browser.
    url: String,
    /// For a unix socket: the SSH command that makes `url` reach it.
    #[serde(skip_serializing_if = "Option::is_none")]
    tunnel: Option<String>,
}

/// `ui`: checks that the daemon answers (with the token, when it needs
/// one), then prints the console's link. Over TCP the link carries the
/// token in its fragment (`#token=…`), which the browser never sends to
/// any server and the page removes from the address bar; a unix socket
/// needs no token, and is reached through an SSH tunnel.
pub fn ui(args: &ClientArgs, out: &mut dyn Write) -> Result<Outcome, CliError> {
    let token = client::token_from_env();
    let client = client::connect(&args.server, args.ca_cert.as_deref(), token.clone())?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(CliError::Runtime)?;
    runtime
        .block_on(client.status())
        .map_err(|e| CliError::Client(ClientError::Api(e)))?;
    let link = match args.server.strip_prefix("unix:") {
        Some(socket) => UiLink {
            url: format!("http://localhost:{TUNNEL_PORT}{}", crate::api::ui::PATH),
            tunnel: Some(format!("ssh -N -L {TUNNEL_PORT}:{socket} THIS-HOST")),
        },
        None => {
            let base = args.server.trim_end_matches('/');
            let fragment = token
                .map(|t| format!("#token={}", fragment_encode(t.expose())))
                .unwrap_or_default();
            UiLink {
                url: format!("{base}{}{fragment}", crate::api::ui::PATH),
                tunnel: None,
            }
        }
    };
    if args.json {
        serde_json::to_writer_pretty(&mut *out, &link)?;
        writeln!(out)?;
    } else if let Some(tunnel) = &link.tunnel {
        writeln!(
            out,
            "The control API is the unix socket {}; a browser reaches it through an SSH tunnel \
             (no token needed). From your machine run\n\n    {tunnel}\n\nthen open\n\n    {}",
            args.server.trim_start_matches("unix:"),
            link.url
        )?;
    } else {
        writeln!(out, "{}", link.url)?;
    }
    Ok(Outcome::Ok)
}

/// Percent-encodes everything but RFC 3986's unreserved characters (the
/// page decodes with `decodeURIComponent`).
fn fragment_encode(raw: &str) -> String {
    let mut s = String::with_capacity(raw.len());
    for b in raw.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            s.push(char::from(b));
        } else {
            s.push_str(&format!("%{b:02X}"));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fragments_are_encoded() {
        assert_eq!(fragment_encode("kat_AZ-09.~"), "kat_AZ-09.~");
        assert_eq!(fragment_encode("a b&c=#é"), "a%20b%26c%3D%23%C3%A9");
    }

    #[test]
    fn the_schema_is_json() {
        let v: serde_json::Value = serde_json::from_str(CONFIG_SCHEMA).unwrap_or_default();
        assert_eq!(
            v["$schema"], "https://json-schema.org/draft/2020-12/schema",
            "{CONFIG_SCHEMA}"
        );
    }
}
