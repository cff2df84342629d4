//! The one error type of this crate: every variant names the command that
//! failed (program and argv) and, where there is one, its stderr.

use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum NetPolicyError {
    #[error("could not run `{command}`: {source}")]
    Spawn {
        command: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{command}` exited with {status}: {stderr}")]
    Failed {
        command: String,
        status: String,
        stderr: String,
    },
    #[error("`{command}` did not finish within {timeout:?}")]
    Timeout { command: String, timeout: Duration },
    #[error("`{command}` printed JSON this crate cannot read: {source}")]
    Json {
        command: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("could not build the nftables JSON payload: {0}")]
    Encode(#[source] serde_json::Error),
    #[error(
        "port name {0:?} is not a valid interface name (1 to 15 bytes, no '/', whitespace or NUL)"
    )]
    InvalidPortName(String),
    #[error("agent address {ip} is not inside the table's subnet {subnet}")]
    AddressOutsideSubnet {
        ip: std::net::Ipv4Addr,
        subnet: ipnet::Ipv4Net,
    },
    #[error("address {ip} already has egress rules of another owner ({owner})")]
    AddressClaimed {
        ip: std::net::Ipv4Addr,
        owner: String,
    },
    #[error("failpoint {0} injected a failure")]
    Injected(&'static str),
    /// This process may not change nftables (it is not root); the reason
    /// says what to do instead.
    #[error("{reason}")]
    NotPermitted { reason: String },
}
