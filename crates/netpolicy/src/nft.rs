//! Running `nft` and `iptables`: argv only (never a shell), bounded by a
//! timeout, optionally inside a named network namespace (`ip netns exec`).

use crate::NetPolicyError;
use nftables::schema::Nftables;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::process::Command;

/// Where and how long commands run.
#[derive(Debug, Clone)]
pub(crate) struct Runner {
    pub netns: Option<String>,
    pub timeout: Duration,
}

/// What a finished command left.
pub(crate) struct Finished {
    pub success: bool,
    pub status: String,
    pub stdout: String,
    pub stderr: String,
}

impl Runner {
    fn command(&self, program: &str, args: &[&str]) -> (Command, String) {
        let mut argv: Vec<&str> = Vec::new();
        if let Some(ns) = &self.netns {
            argv.extend(["ip", "netns", "exec", ns.as_str()]);
        }
        argv.push(program);
        argv.extend_from_slice(args);
        let shown = argv.join(" ");
        let mut cmd = Command::new(argv[0]);
        cmd.args(&argv[1..])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        (cmd, shown)
    }

    /// Runs `program args…`, feeding `stdin` if given. A non-zero exit is not an
    /// error here: callers decide (iptables `-C` uses the exit code as answer).
    pub async fn run(
        &self,
        program: &str,
        args: &[&str],
        stdin: Option<&[u8]>,
    ) -> Result<(Finished, String), NetPolicyError> {
        let (mut cmd, shown) = self.command(program, args);
        if stdin.is_some() {
            cmd.stdin(Stdio::piped());
        }
        let fut = async {
            let mut child = cmd.spawn().map_err(|source| NetPolicyError::Spawn {
                command: shown.clone(),
                source,
            })?;
            if let (Some(bytes), Some(mut pipe)) = (stdin, child.stdin.take()) {
                pipe.write_all(bytes)
                    .await
                    .map_err(|source| NetPolicyError::Spawn {
                        command: shown.clone(),
                        source,
                    })?;
                // Dropping the pipe closes it: nft reads until EOF (upstream
                // never closed it and nft waited for its timeout).
                drop(pipe);
            }
            child
                .wait_with_output()
                .await
                .map_err(|source| NetPolicyError::Spawn {
                    command: shown.clone(),
                    source,
                })
        };
        let output = tokio::time::timeout(self.timeout, fut)
            .await
            .map_err(|_| NetPolicyError::Timeout {
                command: shown.clone(),
                timeout: self.timeout,
            })??;
        Ok((
            Finished {
                success: output.status.success(),
                status: output.status.to_string(),
                stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
                stderr: first_lines(&String::from_utf8_lossy(&output.stderr)),
            },
            shown,
        ))
    }

    /// Runs a command that must succeed; returns its stdout.
    pub async fn run_ok(
        &self,
        program: &str,
        args: &[&str],
        stdin: Option<&[u8]>,
    ) -> Result<String, NetPolicyError> {
        let (done, shown) = self.run(program, args, stdin).await?;
        if done.success {
            Ok(done.stdout)
        } else {
            Err(NetPolicyError::Failed {
                command: shown,
                status: done.status,
                stderr: done.stderr,
            })
        }
    }

    /// Applies one batch as a single nft transaction (`nft -j -f -`): all of
    /// it or nothing.
    pub async fn apply(&self, batch: &Nftables<'_>) -> Result<(), NetPolicyError> {
        let payload = serde_json::to_vec(batch).map_err(NetPolicyError::Encode)?;
        self.run_ok("nft", &["-j", "-f", "-"], Some(&payload))
            .await
            .map(drop)
    }

    /// `nft -j list <args…>`: its JSON text and the command shown, or `None`
    /// when the object (table or chain) does not exist.
    pub async fn list(&self, args: &[&str]) -> Result<Option<(String, String)>, NetPolicyError> {
        let argv: Vec<&str> = ["-j", "list"]
            .into_iter()
            .chain(args.iter().copied())
            .collect();
        let (done, shown) = self.run("nft", &argv, None).await?;
        if done.success {
            Ok(Some((done.stdout, shown)))
        } else if done.stderr.contains("No such file or directory") {
            Ok(None)
        } else {
            Err(NetPolicyError::Failed {
                command: shown,
                status: done.status,
                stderr: done.stderr,
            })
        }
    }
}

/// nft repeats one error per failed command of a batch: the first few say it.
fn first_lines(stderr: &str) -> String {
    const KEEP: usize = 6;
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    let mut kept = lines
        .iter()
        .take(KEEP)
        .copied()
        .collect::<Vec<_>>()
        .join("\n");
    if lines.len() > KEEP {
        kept.push_str(&format!("\n… ({} more lines)", lines.len() - KEEP));
    }
    kept
}
