#!/usr/bin/env python3
"""Scenario harness behind bench/spawn-latency.sh and bench/rss.sh (stdlib only).

Not a test and never run in CI: it starts a real `kici-scaler serve` on
loopback with a throw-away state dir and config, drives it over HTTP and
prints numbers against a baseline measured in the same run.

"Exec'd" is observed the same way for the daemon and for the baseline: the
agent is a bash stub whose first statement writes bash's `$EPOCHREALTIME`
(a builtin, so no extra fork), its agent id and its pid as one line to a FIFO
(`<tmp>/marks`, one `write` below PIPE_BUF, so lines never interleave), then
`exec`s `/bin/sleep`. The harness blocks reading the FIFO instead of polling:
on a 2-core host a polling harness steals CPU from the very path it measures. The latency is that timestamp minus the harness's
wall clock taken just before it sends `POST /v1/scale` (or, for the
baseline, just before it spawns the same stub itself). Both sides include
the same bash start-up (~1 ms), so the difference is the daemon's own cost.
"""

from __future__ import annotations

import argparse
import http.client
import select
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

LABEL = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile: an observed value, no interpolation."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * p // 100))  # ceil without floats
    return ordered[int(rank) - 1]


def vm_field(pid: int, field: str) -> int:
    """A `VmRSS`-style field of /proc/<pid>/status, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/{pid}/status")


class Daemon:
    """One `kici-scaler serve` with its own temp state dir, config and marks dir."""

    def __init__(self, bin_dir: str, max_agents: int, sleep_secs: int) -> None:
        self.tmp = tempfile.mkdtemp(prefix="kici-scaler-bench-")
        self.state_dir = os.path.join(self.tmp, "state")
        os.mkdir(self.state_dir)
        self.marks = Marks(os.path.join(self.tmp, "marks"))
        self.stub = os.path.join(self.tmp, "stub-agent")
        with open(self.stub, "w") as f:
            # Runs with the daemon's allowlisted environment only, so every
            # path is absolute. `$$` is the pid the sleep will keep.
            f.write(
                "#!/bin/bash\n"
                f'echo "$KICI_AGENT_ID $EPOCHREALTIME $$" > "{self.marks.path}"\n'
                f"exec /bin/sleep {sleep_secs}\n"
            )
        os.chmod(self.stub, 0o755)
        self.config = os.path.join(self.tmp, "scalers.yaml")
        with open(self.config, "w") as f:
            f.write(
                "version: 1\n"
                f"globalMaxAgents: {max_agents}\n"
                "scalers:\n"
                "  - name: bench\n"
                "    type: bare-metal\n"
                f"    maxAgents: {max_agents}\n"
                "    labelSets:\n"
                f"      - labels: [{LABEL}]\n"
                f"        binaryPath: {self.stub}\n"
                "    x-kici-scaler:\n"
                f"      registrationTimeoutSeconds: {sleep_secs + 60}\n"
            )
        self.port = free_port()
        self.log_path = os.path.join(self.tmp, "serve.log")
        self.log = open(self.log_path, "wb")
        env = {k: v for k, v in os.environ.items() if not k.startswith("KICI_SCALER_")}
        self.proc = subprocess.Popen(
            [
                os.path.join(bin_dir, "kici-scaler"), "serve",
                "--config", self.config,
                "--state-dir", self.state_dir,
                "--listen", f"127.0.0.1:{self.port}",
                "--gateway-listen", "127.0.0.1:0",
            ],
            stdout=self.log, stderr=subprocess.STDOUT, env=env,
        )
        self.conn: http.client.HTTPConnection | None = None
        self.wait_ready()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited {self.proc.returncode}:\n{self.tail_log()}")
            try:
                status, _ = self.request("GET", "/v1/status")
                if status == 200:
                    return
            except OSError:
                self.conn = None
            time.sleep(0.05)
        raise RuntimeError(f"serve not ready within 30 s:\n{self.tail_log()}")

    def tail_log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read()[-4000:].decode(errors="replace")

    def request(self, method: str, path: str, body: object | None = None) -> tuple[int, bytes]:
        if self.conn is None:
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        headers = {}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            self.conn.request(method, path, body=data, headers=headers)
            resp = self.conn.getresponse()
            return resp.status, resp.read()
        except (OSError, http.client.HTTPException):
            self.conn.close()
            self.conn = None
            raise

    def scale(self, job_id: str) -> str:
        status, body = self.request("POST", "/v1/scale", {"jobId": job_id, "labels": [LABEL]})
        answer = json.loads(body or b"{}")
        if status != 202 or answer.get("result") != "spawning":
            raise RuntimeError(f"POST /v1/scale {job_id}: {status} {body!r}")
        return answer["agentId"]

    def destroy(self, agent_id: str) -> None:
        status, body = self.request("DELETE", f"/v1/agents/{agent_id}")
        if status != 202:
            raise RuntimeError(f"DELETE /v1/agents/{agent_id}: {status} {body!r}")

    def stop(self) -> int | None:
        if self.conn is not None:
            self.conn.close()
        code = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                code = self.proc.wait()
        else:
            code = self.proc.returncode
        self.log.close()
        return code

    def cleanup(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


class Marks:
    """The FIFO the stubs report to, held open read-write by the harness.

    Read-write, so a stub's open never blocks waiting for a reader and the
    harness never sees EOF between stubs. Lines of agents other than the one
    waited for are kept for later.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        os.mkfifo(path, 0o600)
        self.fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        self.buf = b""
        self.seen: dict[str, tuple[float, int]] = {}

    def wait(self, agent_id: str, timeout: float = 30.0) -> tuple[float, int]:
        """(exec timestamp, pid) the agent's stub wrote; blocks in select()."""
        deadline = time.monotonic() + timeout
        while agent_id not in self.seen:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"agent {agent_id} never exec'd within {timeout} s")
            ready, _, _ = select.select([self.fd], [], [], left)
            if not ready:
                continue
            self.buf += os.read(self.fd, 65536)
            *lines, self.buf = self.buf.split(b"\n")
            for line in lines:
                aid, stamp, pid = line.decode().split()
                self.seen[aid] = (float(stamp), int(pid))
        return self.seen.pop(agent_id)

    def close(self) -> None:
        os.close(self.fd)


def wait_gone(pid: int, timeout: float = 30.0) -> None:
    """Until the pid is reaped (the daemon reaps its own children)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                # A zombie is dead for our purpose; its parent reaps it.
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.0005)
    raise RuntimeError(f"pid {pid} still alive {timeout} s after destroy")


def spawn_latency(args: argparse.Namespace) -> int:
    n = args.n
    d = Daemon(args.bin_dir, max_agents=n + 8, sleep_secs=30)
    daemon_ms: list[float] = []
    direct_ms: list[float] = []
    post_ms: list[float] = []
    code = None
    try:
        # Warm-up (first exec of the stub, page cache, the daemon's first spawn).
        for i in range(3):
            aid = d.scale(f"warm-{i}")
            _, pid = d.marks.wait(aid)
            d.destroy(aid)
            wait_gone(pid)
        # Interleaved so drift on a shared machine hits both sides alike.
        for i in range(n):
            base_id = f"direct-{i}"
            t0 = time.time()
            child = subprocess.Popen(
                [d.stub], env={"KICI_AGENT_ID": base_id}, start_new_session=True,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            stamp, _ = d.marks.wait(base_id)
            direct_ms.append((stamp - t0) * 1000)
            child.terminate()
            child.wait()

            t0 = time.time()
            aid = d.scale(f"job-{i}")
            t_post = time.time()
            stamp, pid = d.marks.wait(aid)
            daemon_ms.append((stamp - t0) * 1000)
            post_ms.append((t_post - t0) * 1000)
            d.destroy(aid)
            wait_gone(pid)
    finally:
        code = d.stop()
        if not args.keep:
            d.cleanup()
    dp50, dp90 = percentile(daemon_ms, 50), percentile(daemon_ms, 90)
    bp50, bp90 = percentile(direct_ms, 50), percentile(direct_ms, 90)
    added = dp50 - bp50
    print(f"spawn latency, POST /v1/scale -> agent exec'd, N={n} (+3 warm-up, not counted)")
    print(f"  via kici-scaler : p50 {dp50:7.3f} ms  p90 {dp90:7.3f} ms  mean {statistics.fmean(daemon_ms):7.3f} ms")
    print(f"  direct (baseline): p50 {bp50:7.3f} ms  p90 {bp90:7.3f} ms  mean {statistics.fmean(direct_ms):7.3f} ms")
    print(f"  POST answered    : p50 {percentile(post_ms, 50):7.3f} ms  p90 {percentile(post_ms, 90):7.3f} ms")
    print(f"  added latency at p50: {added:.3f} ms (target <= 5 ms: {'met' if added <= 5 else 'MISSED'})")
    print(f"  ratio p50 daemon/direct: {dp50 / bp50:.2f}x   p90: {dp90 / bp90:.2f}x")
    print(f"  serve exit code after SIGTERM: {code}")
    return 0


def rss(args: argparse.Namespace) -> int:
    n = args.agents
    d = Daemon(args.bin_dir, max_agents=n + 8, sleep_secs=args.sleep)
    pids: list[int] = []
    code = None
    try:
        time.sleep(args.settle)
        idle_rss = vm_field(d.proc.pid, "VmRSS")
        idle_hwm = vm_field(d.proc.pid, "VmHWM")
        agent_ids = [d.scale(f"rss-{i}") for i in range(n)]
        for aid in agent_ids:
            pids.append(d.marks.wait(aid, timeout=120)[1])
        time.sleep(args.settle)
        alive = sum(1 for p in pids if os.path.exists(f"/proc/{p}"))
        busy_rss = vm_field(d.proc.pid, "VmRSS")
        busy_hwm = vm_field(d.proc.pid, "VmHWM")
    finally:
        code = d.stop()
        # The daemon destroys its agents on SIGTERM; anything left of ours is killed.
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not args.keep:
            d.cleanup()
    mib = lambda kib: kib / 1024  # noqa: E731
    print(f"kici-scaler serve RSS (VmRSS of /proc/<pid>/status), settle {args.settle} s")
    print(f"  idle after start : {mib(idle_rss):6.1f} MiB (peak VmHWM {mib(idle_hwm):.1f} MiB)"
          f"  target <= 20 MiB: {'met' if idle_rss <= 20 * 1024 else 'MISSED'}")
    print(f"  {alive} live agents : {mib(busy_rss):6.1f} MiB (peak VmHWM {mib(busy_hwm):.1f} MiB)"
          f"  = +{(busy_rss - idle_rss) / max(alive, 1):.1f} KiB per agent")
    print(f"  serve exit code after SIGTERM: {code}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bin-dir", required=True, help="directory holding the release kici-scaler")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (serve.log) for a look")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("spawn-latency")
    s.add_argument("n", type=int, nargs="?", default=200)
    r = sub.add_parser("rss")
    r.add_argument("agents", type=int, nargs="?", default=200)
    r.add_argument("--settle", type=float, default=2.0)
    r.add_argument("--sleep", type=int, default=600)
    args = p.parse_args()
    return spawn_latency(args) if args.cmd == "spawn-latency" else rss(args)


if __name__ == "__main__":
    sys.exit(main())
