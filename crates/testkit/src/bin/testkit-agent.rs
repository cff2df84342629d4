//! `testkit-agent`: a stand-in guest agent for the simulated guest. It reports
//! what it was started with (environment, uid, working directory) to
//! `agent-report.json` in its working directory (the jail root) and on stdout
//! (the serial console), then blocks until killed, or exits at once with the
//! code in `TESTKIT_AGENT_EXIT` (delivered through MMDS `kici-env`).

use std::collections::BTreeMap;

fn main() {
    let env: BTreeMap<String, String> = std::env::vars().collect();
    let report = serde_json::json!({
        "env": env,
        "uid": nix::unistd::getuid().as_raw(),
        "gid": nix::unistd::getgid().as_raw(),
        "pid": std::process::id(),
        "cwd": std::env::current_dir().map(|d| d.display().to_string()).unwrap_or_default(),
    });
    println!(
        "testkit-agent: started as {}",
        env.get("KICI_AGENT_ID").map(String::as_str).unwrap_or("?")
    );
    if let Err(e) = std::fs::write("agent-report.json", report.to_string()) {
        eprintln!("testkit-agent: cannot write agent-report.json: {e}");
        std::process::exit(2);
    }
    if let Some(code) = env
        .get("TESTKIT_AGENT_EXIT")
        .and_then(|c| c.parse::<i32>().ok())
    {
        std::process::exit(code);
    }
    loop {
        std::thread::park();
    }
}
