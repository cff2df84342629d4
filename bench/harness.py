#!/usr/bin/env python3
"""Scenario harness behind bench/spawn-latency.sh, bench/rss.sh and
bench/container-concurrency.sh (stdlib only).

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
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse

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


CLK_TCK = os.sysconf("SC_CLK_TCK")


def backends(database: str) -> list[int]:
    """Pids of the server's backends connected to `database`, from their
    process titles (`postgres: USER DATABASE ADDR STATE`): no connection
    needed, so it works when the fleet holds every slot."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                title = f.read().decode(errors="replace")
        except OSError:
            continue
        words = title.split()
        if title.startswith("postgres: ") and len(words) > 2 and words[2] == database:
            pids.append(int(d))
    return pids


def cpu_ticks(pid: int) -> int | None:
    """utime + stime of a process (all its threads), in clock ticks."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])


# The API token of every daemon a bench run starts.
API_TOKEN = os.urandom(24).hex()


class Daemon:
    """One `kici-scaler serve` with its own temp state dir, config and marks dir."""

    def __init__(
        self,
        bin_dir: str,
        max_agents: int,
        sleep_secs: int,
        container_image: str | None = None,
        serve_args: list[str] | None = None,
    ) -> None:
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
            if container_image is not None:
                f.write(container_config(container_image, max_agents, sleep_secs))
            else:
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
        # A TCP listener needs an API token (at least 32 bytes); one for
        # every daemon of the run, so that a fleet's hosts share it.
        self.token = API_TOKEN
        env["KICI_SCALER_API_TOKEN"] = self.token
        self.proc = subprocess.Popen(
            [
                os.path.join(bin_dir, "kici-scaler"), "serve",
                "--config", self.config,
                "--state-dir", self.state_dir,
                "--listen", f"127.0.0.1:{self.port}",
                "--gateway-listen", "127.0.0.1:0",
                *(serve_args or []),
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

    def instance(self) -> str | None:
        """The instance id serve logged at start-up."""
        with open(self.log_path, "rb") as f:
            for line in f:
                try:
                    fields = json.loads(line).get("fields", {})
                except ValueError:
                    continue
                if isinstance(fields.get("instance"), str):
                    return fields["instance"]
        return None

    def tail_log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read()[-4000:].decode(errors="replace")

    def request(self, method: str, path: str, body: object | None = None) -> tuple[int, bytes]:
        if self.conn is None:
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        headers = {"Authorization": f"Bearer {self.token}"}
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


def container_config(image: str, max_agents: int, sleep_secs: int) -> str:
    """One container scaler; its agents never register (a plain `sleep`)."""
    return (
        "version: 1\n"
        f"globalMaxAgents: {max_agents}\n"
        "scalers:\n"
        "  - name: bench\n"
        "    type: container\n"
        f"    maxAgents: {max_agents}\n"
        "    runtime: docker\n"
        "    labelSets:\n"
        f"      - labels: [{LABEL}]\n"
        f'        image: "{image}"\n'
        "        imagePullPolicy: IfNotPresent\n"
        "        resources: {cpus: 0.5, memory: 64m}\n"
        "    x-kici-scaler:\n"
        f"      registrationTimeoutSeconds: {sleep_secs + 60}\n"
    )


DOCKER_SOCKET = "/var/run/docker.sock"


def docker(*args: str) -> str:
    return subprocess.run(
        ["docker", *args], check=True, capture_output=True, text=True
    ).stdout


class EngineEvents:
    """dockerd's container `start` / `destroy` events, read as they come.

    `GET /events` over the socket (HTTP/1.0: no chunking, the stream ends
    when the socket closes). A `start` event is sent once the container
    runs, i.e. when `State.Running` turned true; its `timeNano` is dockerd's
    clock, the harness's clock too (same host, CLOCK_REALTIME).
    """

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(DOCKER_SOCKET)
        filters = json.dumps({"type": ["container"], "event": ["start", "destroy"]})
        query = urllib.parse.quote(filters)
        self.sock.sendall(f"GET /events?filters={query} HTTP/1.0\r\nHost: d\r\n\r\n".encode())
        self.buf = b""
        self.head_done = False
        self.seen: dict[tuple[str, str], float] = {}

    def wait(self, name: str, action: str, timeout: float = 120.0) -> float:
        """Unix time (s) of `action` for container `name`; blocks in select()."""
        deadline = time.monotonic() + timeout
        while (name, action) not in self.seen:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"no {action} event for {name} within {timeout} s")
            ready, _, _ = select.select([self.sock], [], [], left)
            if not ready:
                continue
            chunk = self.sock.recv(65536)
            if not chunk:
                raise RuntimeError("dockerd closed the event stream")
            self.buf += chunk
            if not self.head_done:
                if b"\r\n\r\n" not in self.buf:
                    continue
                _, self.buf = self.buf.split(b"\r\n\r\n", 1)
                self.head_done = True
            *lines, self.buf = self.buf.split(b"\n")
            for line in lines:
                if not line.strip():
                    continue
                e = json.loads(line)
                actor = e.get("Actor", {}).get("Attributes", {}).get("name", "")
                self.seen[(actor, e.get("Action", e.get("status", "")))] = e["timeNano"] / 1e9
        return self.seen.pop((name, action))

    def close(self) -> None:
        self.sock.close()


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP/1.1 to dockerd's unix socket (stdlib only)."""

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(DOCKER_SOCKET)


def raw_create_start(conn: UnixHTTPConnection, name: str, image: str, network: str, ip: str) -> None:
    """The baseline: Engine API create + start of the body our backend sends
    (same image, network with a fixed address, limits, caps, pids limit,
    no-new-privileges), over one kept-alive connection."""
    body = {
        "Image": image,
        "Env": ["KICI_AGENT_ID=bench", "KICI_LABELS=bench"],
        "Labels": {"kici-scaler.bench": "raw"},
        "HostConfig": {
            "Memory": 64 * 1024 * 1024,
            "NanoCpus": 500_000_000,
            "PidsLimit": 4096,
            "CapDrop": ["ALL"],
            "SecurityOpt": ["no-new-privileges"],
            "NetworkMode": network,
        },
        "NetworkingConfig": {"EndpointsConfig": {network: {"IPAMConfig": {"IPv4Address": ip}}}},
    }
    for method, path, payload, ok in (
        ("POST", f"/containers/create?name={name}", body, 201),
        ("POST", f"/containers/{name}/start", None, 204),
    ):
        data = json.dumps(payload).encode() if payload is not None else None
        headers = {"Content-Type": "application/json"} if data else {}
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        text = resp.read()
        if resp.status != ok:
            raise RuntimeError(f"{method} {path}: {resp.status} {text[:300]!r}")


def remove_instance_rules(instance: str) -> int:
    """The instance's subnet rules (nftables, DOCKER-USER), which `serve`
    keeps on exit for its next start; the bench removes its network, so
    they go too. Only rules whose comment names this instance."""
    tag = f"kici-scaler:{instance}:"
    removed = 0
    ruleset = json.loads(subprocess.run(
        ["nft", "-j", "-a", "list", "ruleset"], check=True, capture_output=True, text=True,
    ).stdout)
    for item in ruleset.get("nftables", []):
        rule = item.get("rule")
        if rule and rule.get("comment", "").startswith(tag):
            subprocess.run(
                ["nft", "delete", "rule", rule["family"], rule["table"], rule["chain"],
                 "handle", str(rule["handle"])],
                check=True, capture_output=True,
            )
            removed += 1
    listed = subprocess.run(["iptables", "-S", "DOCKER-USER"], capture_output=True, text=True)
    for line in listed.stdout.splitlines():
        if tag in line and line.startswith("-A "):
            subprocess.run(["iptables", *shlex.split("-D " + line[3:])], check=True, capture_output=True)
            removed += 1
    return removed


def build_sleeper_image(tmp: str, tag: str) -> None:
    """FROM scratch: busybox-static as /bin/sleep, `sleep 3600`."""
    ctx = os.path.join(tmp, "image")
    os.mkdir(ctx)
    shutil.copy("/bin/busybox", os.path.join(ctx, "busybox"))
    with open(os.path.join(ctx, "Dockerfile"), "w") as f:
        f.write('FROM scratch\nCOPY busybox /bin/sleep\nCMD ["/bin/sleep", "3600"]\n')
    subprocess.run(
        ["docker", "build", "-q", "-t", tag, ctx],
        check=True, capture_output=True, env={**os.environ, "DOCKER_BUILDKIT": "0"},
    )


def container_concurrency(args: argparse.Namespace) -> int:
    """N spawns one after another (each waited to Running) vs N at once."""
    n = args.n
    tag = f"{os.getpid():x}{int(time.time()) % 65536:04x}"
    image = f"kici-scaler-bench-sleeper:{tag}"
    network = f"kici-scaler-bench-{tag}"
    bridge = f"kb{tag}"[:15]
    subnet = f"10.{200 + os.getpid() % 50}.{int(time.time()) % 256}.0/24"
    scratch = tempfile.mkdtemp(prefix="kici-scaler-bench-image-")
    build_sleeper_image(scratch, image)
    events = EngineEvents()
    d = None
    code = None
    sequential: list[float] = []
    concurrent_post: list[float] = []
    raw: list[float] = []
    raw_names: list[str] = []
    try:
        d = Daemon(
            args.bin_dir, max_agents=2 * n + 8, sleep_secs=600, container_image=image,
            serve_args=[
                "--container-network", network,
                "--container-subnet", subnet,
                "--container-bridge", bridge,
            ],
        )

        def destroy_all(agents: list[str]) -> None:
            for aid in agents:
                d.destroy(aid)
            for aid in agents:
                events.wait(f"kici-{aid}", "destroy")

        # Warm-up: the network exists, the image is in the page cache.
        warm = d.scale("warm-0")
        events.wait(f"kici-{warm}", "start")
        destroy_all([warm])

        # Sequential: each spawn waited to Running before the next POST.
        agents = []
        t_first = time.time()
        for i in range(n):
            t0 = time.time()
            aid = d.scale(f"seq-{i}")
            running = events.wait(f"kici-{aid}", "start")
            sequential.append((running - t0) * 1000)
            agents.append(aid)
        seq_total = running - t_first
        destroy_all(agents)

        # Baseline in the same run: raw Engine API create + start, one after
        # another, each waited to the same start event.
        conn = UnixHTTPConnection("localhost")
        base = subnet.rsplit(".", 1)[0]
        for i in range(n):
            name = f"kici-scaler-bench-raw-{tag}-{i}"
            raw_names.append(name)
            t0 = time.time()
            raw_create_start(conn, name, image, network, f"{base}.{200 + i}")
            raw.append((events.wait(name, "start") - t0) * 1000)
        conn.close()
        for name in raw_names:
            subprocess.run(["docker", "rm", "-f", "-v", name], capture_output=True)
        raw_names.clear()

        # Concurrent: N POSTs back to back (each answers 202 at once), then
        # every container waited to Running.
        agents = []
        t_first = time.time()
        for i in range(n):
            t0 = time.time()
            agents.append(d.scale(f"conc-{i}"))
            concurrent_post.append((time.time() - t0) * 1000)
        conc_running = [events.wait(f"kici-{aid}", "start") for aid in agents]
        conc_total = max(conc_running) - t_first
        conc_latency = [(t - t_first) * 1000 for t in conc_running]
        destroy_all(agents)
    finally:
        for name in raw_names:
            subprocess.run(["docker", "rm", "-f", "-v", name], capture_output=True)
        rules_removed = 0
        if d is not None:
            code = d.stop()
            instance = d.instance()
            if instance:
                rules_removed = remove_instance_rules(instance)
            if not args.keep:
                d.cleanup()
        events.close()
        subprocess.run(["docker", "network", "rm", network], capture_output=True)
        subprocess.run(["docker", "rmi", "-f", image], capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"container spawns, POST /v1/scale -> State.Running (dockerd start event), N={n} (+1 warm-up)")
    print(f"  sequential : total {seq_total:7.2f} s   per spawn p50 {percentile(sequential, 50):7.1f} ms"
          f"  p90 {percentile(sequential, 90):7.1f} ms  mean {statistics.fmean(sequential):7.1f} ms")
    print(f"  raw Engine API create+start, sequential: per spawn p50 {percentile(raw, 50):7.1f} ms"
          f"  p90 {percentile(raw, 90):7.1f} ms")
    print(f"  ratio kici-scaler/raw, p50: {percentile(sequential, 50) / percentile(raw, 50):.3f}"
          f"  (target <= 1.05)")
    print(f"  concurrent : total {conc_total:7.2f} s   (first POST -> last Running; POSTs answered"
          f" p50 {percentile(concurrent_post, 50):.1f} ms, first Running after"
          f" {min(conc_latency):.0f} ms)")
    print(f"  ratio concurrent/sequential total: {conc_total / seq_total:.2f}"
          f"  (speed-up {seq_total / conc_total:.2f}x)")
    print(f"  serve exit code after SIGTERM: {code}; its {rules_removed} subnet rules removed")
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
    c = sub.add_parser("container-concurrency")
    c.add_argument("n", type=int, nargs="?", default=20)
    args = p.parse_args()
    if args.cmd == "container-concurrency":
        return container_concurrency(args)
    return spawn_latency(args) if args.cmd == "spawn-latency" else rss(args)


if __name__ == "__main__":
    sys.exit(main())
