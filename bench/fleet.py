#!/usr/bin/env python3
"""Fleet scenarios behind bench/fleet.sh (stdlib only; not run in CI).

Three `kici-scaler serve` on loopback sharing one PostgreSQL database as a
fleet, against one host on the same server in the same run:

- latency: POST /v1/scale -> agent exec'd (the stub's own timestamp, as in
  spawn-latency), through a random entry host of the fleet vs the single
  host (`--no-fleet`), rounds interleaved; p50/p90 and the added latency.
- throughput: N requests (memory backends: the coordination is measured,
  not processes) into a 3-host fleet and into a 1-host fleet, requests/s
  from the first POST until every request is started.
- failover: kill -9 of a host holding started, never-registered agents ->
  the last of its requests started on another host; p50 over R runs.
- scale: 1, 3, 10, 25 and 50 hosts (memory backends, `--database-connections
  2`) on a private PostgreSQL with the stock max_connections of 100, one row
  per fleet size against the 1-host row of the same run: start-up,
  connections idle/peak, idle CPU, throughput, entry latency, commits per
  request, failover of the busiest host, duplicates.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import select
import signal
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from harness import CLK_TCK, Daemon, backends, cpu_ticks, percentile, wait_gone  # noqa: E402


def psql(url: str, sql: str) -> list[str]:
    out = subprocess.run(["psql", url, "-Atq", "-c", sql], check=True, capture_output=True, text=True)
    return [l for l in out.stdout.splitlines() if l]


def fresh_db(admin: str) -> str:
    name = f"kici_bench_{random.randrange(1 << 32):08x}"
    psql(admin, f"CREATE DATABASE {name}")
    return admin.rsplit("/", 1)[0] + "/" + name


def fleet_key_file() -> str:
    """A fresh fleet key in a file only its owner can read (a fleet host
    refuses to start without one)."""
    import tempfile
    fd, path = tempfile.mkstemp(prefix="kici-bench-fleet-key-")
    with os.fdopen(fd, "w") as f:
        f.write(os.urandom(32).hex() + "\n")
    return path


def fleet(bin_dir: str, url: str, hosts: int, max_agents: int, extra: list[str]) -> list[Daemon]:
    name = f"bench-{random.randrange(1 << 32):08x}"
    key = fleet_key_file()
    return [
        Daemon(bin_dir, max_agents=max_agents, sleep_secs=30,
               serve_args=["--state", url, "--fleet", name, "--fleet-lease-seconds", "3",
                           "--fleet-key-file", key, *extra])
        for _ in range(hosts)
    ]


def wait_any(hosts: list[Daemon], agent_id: str, timeout: float = 30.0) -> tuple[float, int]:
    """The stub's (timestamp, pid) from whichever host ran it."""
    deadline = time.monotonic() + timeout
    while True:
        for h in hosts:
            if agent_id in h.marks.seen:
                return h.marks.seen.pop(agent_id)
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"agent {agent_id} never exec'd")
        ready, _, _ = select.select([h.marks.fd for h in hosts], [], [], left)
        for h in hosts:
            if h.marks.fd in ready:
                h.marks.buf += os.read(h.marks.fd, 65536)
                *lines, h.marks.buf = h.marks.buf.split(b"\n")
                for line in lines:
                    aid, stamp, pid = line.decode().split()
                    h.marks.seen[aid] = (float(stamp), int(pid))


def post(h: Daemon, job: str) -> dict:
    status, body = h.request("POST", "/v1/scale", {"jobId": job, "labels": ["bench"]})
    if status not in (200, 202):
        raise RuntimeError(f"POST /v1/scale {job}: {status} {body!r}")
    return json.loads(body)


def agent_of(local_url: str, job: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = psql(local_url, f"SELECT agent_id FROM fleet_requests WHERE job_id = '{job}' AND agent_id IS NOT NULL")
        if rows:
            return rows[0]
        time.sleep(0.002)
    raise RuntimeError(f"{job} never started")


def stop_all(hosts: list[Daemon], keep: bool) -> None:
    for h in hosts:
        h.stop()
        if not keep:
            h.cleanup()


def latency(args: argparse.Namespace) -> int:
    n = args.n
    fleet_url, single_url = fresh_db(args.pg), fresh_db(args.pg)
    hosts = fleet(args.bin_dir, fleet_url, 3, n + 8, [])
    single = Daemon(args.bin_dir, max_agents=n + 8, sleep_secs=30,
                    serve_args=["--state", single_url, "--no-fleet"])
    fleet_ms: list[float] = []
    single_ms: list[float] = []
    try:
        for i in range(3):
            for d, group in ((single, [single]), (hosts[i % 3], hosts)):
                a = post(d, f"warm-{i}")
                aid = a.get("agentId") or agent_of(fleet_url, f"warm-{i}")
                _, pid = wait_any(group, aid)
                d.destroy(aid)
                wait_gone(pid)
        for i in range(n):
            t0 = time.time()
            aid = post(single, f"s-{i}")["agentId"]
            stamp, pid = wait_any([single], aid)
            single_ms.append((stamp - t0) * 1000)
            single.destroy(aid)
            wait_gone(pid)

            entry = random.choice(hosts)
            t0 = time.time()
            a = post(entry, f"f-{i}")
            aid = a.get("agentId") or agent_of(fleet_url, f"f-{i}")
            stamp, pid = wait_any(hosts, aid)
            fleet_ms.append((stamp - t0) * 1000)
            entry.destroy(aid)  # carried to the owner if another host runs it
            wait_gone(pid)
    finally:
        stop_all(hosts + [single], args.keep)
    f50, f90 = percentile(fleet_ms, 50), percentile(fleet_ms, 90)
    s50, s90 = percentile(single_ms, 50), percentile(single_ms, 90)
    print(f"fleet latency, POST /v1/scale -> agent exec'd, N={n} rounds (3 warm-up)")
    print(f"  3-host fleet, random entry: p50 {f50:7.3f} ms  p90 {f90:7.3f} ms")
    print(f"  one host (--no-fleet)     : p50 {s50:7.3f} ms  p90 {s90:7.3f} ms")
    print(f"  added by the fleet at p50: {f50 - s50:.3f} ms (target <= 5 ms: {'met' if f50 - s50 <= 5 else 'MISSED'})")
    print(f"  ratio p50 fleet/single: {f50 / s50:.2f}x   p90: {f90 / s90:.2f}x")
    return 0


def drive(hosts: list[Daemon], url: str, n: int, clients: int) -> float:
    """Seconds from the first POST until all n requests are started."""
    t0 = time.monotonic()
    errors: list[str] = []

    def client(c: int) -> None:
        # A connection per host per thread (http.client is not thread-safe).
        conns = [http.client.HTTPConnection("127.0.0.1", h.port, timeout=30) for h in hosts]
        try:
            for i in range(c, n, clients):
                conn = conns[i % len(hosts)]
                body = json.dumps({"jobId": f"t-{i}", "labels": ["bench"]})
                conn.request("POST", "/v1/scale", body=body,
                             headers={"Content-Type": "application/json",
                                      "Authorization": f"Bearer {hosts[0].token}"})
                resp = conn.getresponse()
                answer = resp.read()
                if resp.status not in (200, 202):
                    raise RuntimeError(f"POST /v1/scale t-{i}: {resp.status} {answer!r}")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(str(e))
        finally:
            for conn in conns:
                conn.close()

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(errors[0])
    while int(psql(url, "SELECT count(*) FROM fleet_requests WHERE state = 'started'")[0]) < n:
        time.sleep(0.01)
    return time.monotonic() - t0


def throughput(args: argparse.Namespace) -> int:
    n = args.n
    results = {}
    for size in (1, 3):
        url = fresh_db(args.pg)
        hosts = fleet(args.bin_dir, url, size, n, ["--memory-backends"])
        try:
            results[size] = drive(hosts, url, n, args.clients)
        finally:
            stop_all(hosts, args.keep)
    print(f"fleet claim throughput, {n} requests ({args.clients} clients, memory backends), until all started")
    for size, secs in results.items():
        print(f"  {size}-host fleet: {secs:6.2f} s  {n / secs:8.1f} requests/s")
    print(f"  ratio 3 hosts / 1 host: {results[1] / results[3]:.2f}x")
    return 0


def failover(args: argparse.Namespace) -> int:
    times: list[float] = []
    for run in range(args.runs):
        url = fresh_db(args.pg)
        hosts = fleet(args.bin_dir, url, 3, 4, ["--memory-backends"])
        try:
            for i in range(6):
                post(hosts[i % 3], f"r{run}-{i}")
            while int(psql(url, "SELECT count(*) FROM fleet_requests WHERE state = 'started'")[0]) < 6:
                time.sleep(0.01)
            victim = hosts[0]
            vid = victim.instance()
            held = psql(url, f"SELECT job_id FROM fleet_requests WHERE claimed_by = '{vid}'")
            t0 = time.monotonic()
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait()
            quoted = ",".join(f"'{j}'" for j in held)
            while True:
                moved = psql(url, f"SELECT count(*) FROM fleet_requests WHERE job_id IN ({quoted}) "
                                  f"AND state = 'started' AND claimed_by <> '{vid}'")
                if int(moved[0]) == len(held):
                    break
                if time.monotonic() - t0 > 60:
                    raise RuntimeError("failover never completed")
                time.sleep(0.01)
            times.append(time.monotonic() - t0)
        finally:
            stop_all(hosts, args.keep)
    print(f"fleet failover, kill -9 -> last orphaned request started elsewhere, lease 3 s, {args.runs} runs")
    print(f"  p50 {statistics.median(times):.2f} s  min {min(times):.2f} s  max {max(times):.2f} s"
          f"  (target <= lease + 1 s = 4 s: {'met' if statistics.median(times) <= 4 else 'MISSED'})")
    return 0


# --- scale -----------------------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pg_script(cmd: str, port: int, max_connections: int | None = None) -> str:
    env = {**os.environ, "KICI_PG_PORT": str(port)}
    if max_connections is not None:
        env["KICI_PG_MAX_CONNECTIONS"] = str(max_connections)
    out = subprocess.run([os.path.join(ROOT, "scripts", "postgres.sh"), cmd], env=env,
                         check=True, capture_output=True, text=True)
    return out.stdout.strip()


class ConnSampler(threading.Thread):
    """Counts the database's backends every 50 ms: current and peak."""

    def __init__(self, database: str) -> None:
        super().__init__(daemon=True)
        self.database = database
        self.current = 0
        self.peak = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            self.current = len(backends(self.database))
            self.peak = max(self.peak, self.current)
            time.sleep(0.05)


def try_psql(url: str, sql: str, patience: float = 5.0) -> list[str] | None:
    """`psql`, retried while the server has no slot free (the fleet may hold
    all of them); None if it never got in."""
    deadline = time.monotonic() + patience
    while True:
        out = subprocess.run(["psql", url, "-Atq", "-c", sql], capture_output=True, text=True)
        if out.returncode == 0:
            return [l for l in out.stdout.splitlines() if l]
        if "too many clients" not in out.stderr and "remaining connection slots" not in out.stderr:
            raise RuntimeError(f"psql: {out.stderr.strip()}")
        if time.monotonic() > deadline:
            return None
        time.sleep(0.1)


def xact_commit(admin: str, database: str) -> int | None:
    rows = try_psql(admin, f"SELECT xact_commit FROM pg_stat_database WHERE datname = '{database}'")
    return int(rows[0]) if rows else None


def get(h: Daemon, path: str) -> tuple[int, bytes]:
    """GET on the host's kept-alive connection; once more on a fresh one
    if the server had closed it (idle keep-alive)."""
    try:
        return h.request("GET", path)
    except (OSError, http.client.HTTPException):
        return h.request("GET", path)


def fleet_view(h: Daemon) -> dict:
    status, body = get(h, "/v1/fleet")
    if status != 200:
        raise RuntimeError(f"GET /v1/fleet: {status} {body[:300]!r}")
    return json.loads(body)


def pool_usage(h: Daemon) -> tuple[int, int] | None:
    """(agents + claimed requests, queue depth) of the `bench` pool; None
    when the host answers 503 (it could not reach the database in time)."""
    status, body = get(h, "/v1/fleet")
    if status == 503:
        return None
    if status != 200:
        raise RuntimeError(f"GET /v1/fleet: {status} {body[:300]!r}")
    for p in json.loads(body)["pools"]:
        if p["name"] == "bench":
            return int(p["agents"]), int(p["queueDepth"])
    return 0, 0


def local_jobs(h: Daemon) -> list[str]:
    """Job ids of the host's own live agents."""
    status, body = get(h, "/v1/agents?local=true")
    if status != 200:
        raise RuntimeError(f"GET /v1/agents?local=true: {status} {body[:300]!r}")
    return [a["jobId"] for a in json.loads(body)["agents"] if a.get("jobId")]


def wait_for(what: str, limit: float, f, every: float = 0.02) -> float:
    """Seconds until f() held, polled `every` s; raises naming `what`."""
    t0 = time.monotonic()
    while not f():
        if time.monotonic() - t0 > limit:
            raise RuntimeError(f"never within {limit:.0f} s: {what}")
        time.sleep(every)
    return time.monotonic() - t0


def drive_timed(hosts: list[Daemon], n: int, clients: int, unavailable: list[int]) -> list[float]:
    """n `POST /v1/scale` from `clients` threads, spread over the hosts;
    each POST's round trip (ms); `unavailable[0]` counts 503 answers."""
    errors: list[str] = []
    lat: list[float] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        conns = [None] * len(hosts)
        mine = []
        try:
            for i in range(c, n, clients):
                k = i % len(hosts)
                if conns[k] is None:
                    conns[k] = http.client.HTTPConnection("127.0.0.1", hosts[k].port, timeout=60)
                body = json.dumps({"jobId": f"t-{i}", "labels": ["bench"]})
                # A 503 (the host could not reach the database in time) is
                # sent again, the same request, after 100 ms: at most 50 times.
                # A kept-alive connection the host closed meanwhile is
                # opened again and the request sent again.
                for attempt in range(50):
                    t0 = time.monotonic()
                    try:
                        conns[k].request("POST", "/v1/scale", body=body,
                                         headers={"Content-Type": "application/json",
                                                  "Authorization": f"Bearer {hosts[0].token}"})
                        resp = conns[k].getresponse()
                        answer = resp.read()
                    except (OSError, http.client.HTTPException):
                        conns[k].close()
                        conns[k] = http.client.HTTPConnection("127.0.0.1", hosts[k].port, timeout=60)
                        continue
                    if resp.status != 503:
                        mine.append((time.monotonic() - t0) * 1000)
                        break
                    with lock:
                        unavailable[0] += 1
                    time.sleep(0.1)
                if resp.status not in (200, 202):
                    raise RuntimeError(f"POST /v1/scale t-{i} to host {k}: {resp.status} {answer[:300]!r}")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(str(e))
        finally:
            for conn in conns:
                if conn is not None:
                    conn.close()
            with lock:
                lat.extend(mine)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} clients failed; first: {errors[0]}")
    return lat


def scale_row(args: argparse.Namespace, admin: str, size: int) -> dict:
    n = args.n
    url = fresh_db(admin)
    database = url.rsplit("/", 1)[1]
    sampler = ConnSampler(database)
    sampler.start()
    row: dict = {"hosts": size}
    hosts: list[Daemon] = []
    try:
        t0 = time.monotonic()
        hosts = fleet(args.bin_dir, url, size, n,
                      ["--memory-backends", "--database-connections", str(args.connections)])
        wait_for(f"{size} hosts up in GET /v1/fleet", 60, lambda: sum(
            1 for h in fleet_view(hosts[0])["hosts"] if h["state"] == "up") == size)
        row["startup"] = time.monotonic() - t0
        log(f"  {size} hosts up in {row['startup']:.1f} s")
        # Idle: let start-up settle, then 5 s of CPU of the daemons and the
        # database's backends (a backend that appears in the window counts
        # from zero; one that ends in it is lost: the window is short).
        time.sleep(args.settle)
        x0 = xact_commit(admin, database)
        pids = [h.proc.pid for h in hosts] + backends(database)
        before = {p: cpu_ticks(p) for p in pids}
        time.sleep(args.idle_window)
        after_pids = [h.proc.pid for h in hosts] + backends(database)
        ticks = 0
        for p in set(pids) | set(after_pids):
            now = cpu_ticks(p)
            if now is not None:
                ticks += now - (before.get(p) or 0)
        row["idle_cpu"] = 100.0 * ticks / CLK_TCK / args.idle_window
        row["conns_idle"] = sampler.current
        x1 = xact_commit(admin, database)
        # The probe that waits for the load (GET /v1/fleet on host 0) runs
        # queries too: its commits per call, measured here and taken off.
        calls = 20
        tc = time.monotonic()
        for _ in range(calls):
            fleet_view(hosts[0])
        time.sleep(2)
        x1c = xact_commit(admin, database)
        calibrated = time.monotonic() - tc
        sampler.peak = sampler.current
        log(f"  idle: {row['idle_cpu']:.1f} % of a core, {row['conns_idle']} connections")
        # Load.
        t0 = time.monotonic()
        unavailable = [0]
        lat = drive_timed(hosts, n, args.clients, unavailable)
        row["503"] = unavailable[0]
        probe = hosts[0]
        probes = [0]

        def all_started() -> bool:
            probes[0] += 1
            return pool_usage(probe) == (n, 0)

        try:
            wait_for(f"all {n} requests started", args.limit, all_started, every=0.05)
        except RuntimeError:
            # Measured as it is: how far the fleet got, and no more steps.
            usage = None
            for _ in range(50):
                usage = pool_usage(probe)
                if usage is not None:
                    break
                time.sleep(0.2)
            agents, depth = usage if usage is not None else (-1, -1)
            row["stalled"] = (agents, depth, time.monotonic() - t0)
            row["p50"], row["p90"] = percentile(lat, 50), percentile(lat, 90)
            row["conns_peak"] = sampler.peak
            log(f"  not all started: {agents} agents or claims, {depth} queued after {args.limit:.0f} s")
            return row
        secs = time.monotonic() - t0
        row["throughput"] = n / secs
        row["p50"], row["p90"] = percentile(lat, 50), percentile(lat, 90)
        row["conns_peak"] = sampler.peak
        log(f"  {n} started in {secs:.1f} s ({unavailable[0]} answers 503, sent again): {row['throughput']:.0f} req/s, "
            f"entry p50 {row['p50']:.1f} ms p90 {row['p90']:.1f} ms, peak {row['conns_peak']} connections")
        # Commits: the load's, less the idle rate over the same time; the
        # server's statistics lag a backend's last second, hence the wait.
        time.sleep(2)
        x2 = xact_commit(admin, database)
        waited = time.monotonic() - t0
        if None not in (x0, x1, x1c, x2):
            rate = (x1 - x0) / args.idle_window
            per_probe = max(0.0, (x1c - x1 - rate * calibrated) / calls)
            row["commits"] = (x2 - x1c - rate * waited - per_probe * probes[0]) / n
            log(f"  commits: {x2 - x1c} in the load, idle {rate:.1f}/s, {per_probe:.1f} per probe × {probes[0]}")
        # Failover of the busiest host.
        if size > 1:
            held = [local_jobs(h) for h in hosts]
            busiest = max(range(size), key=lambda i: len(held[i]))
            victim = hosts[busiest]
            vid = victim.instance()
            jobs = held[busiest]
            quoted = ",".join(f"'{j}'" for j in jobs)
            t0 = time.monotonic()
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait()
            moved = 0
            while time.monotonic() - t0 < args.limit:
                rows = try_psql(url, f"SELECT count(*) FROM fleet_requests WHERE job_id IN ({quoted}) "
                                     f"AND state = 'started' AND claimed_by <> '{vid}'", patience=1)
                if rows is not None:
                    moved = int(rows[0])
                    if moved == len(jobs):
                        break
                time.sleep(0.1)
            took = time.monotonic() - t0
            row["failover"] = (len(jobs), moved, took)
            log(f"  failover: {moved} of {len(jobs)} requests of the busiest host started elsewhere in {took:.1f} s")
            # Duplicates: job ids with two live agents, as the surviving
            # hosts list them and as the database records them.
            seen: dict[str, int] = {}
            for i, h in enumerate(hosts):
                if i != busiest:
                    for j in local_jobs(h):
                        seen[j] = seen.get(j, 0) + 1
            dups = {j for j, c in seen.items() if c > 1}
            rows = try_psql(url, "SELECT job_id FROM fleet_agents WHERE state = 'live' "
                                 "GROUP BY job_id HAVING count(*) > 1")
            dups |= set(rows or [])
            row["dups"] = len(dups)
        else:
            seen = {}
            for j in local_jobs(hosts[0]):
                seen[j] = seen.get(j, 0) + 1
            row["dups"] = sum(1 for c in seen.values() if c > 1)
    finally:
        row["exit_codes"] = stop_parallel(hosts, args.keep)
        deadline = time.monotonic() + 30
        while backends(database) and time.monotonic() < deadline:
            time.sleep(0.1)
        row["left"] = len(backends(database))
        sampler.stopped.set()
        sampler.join()
        try_psql(admin, f"DROP DATABASE IF EXISTS {database}", patience=30)
    return row


def stop_parallel(hosts: list[Daemon], keep: bool) -> list[int | None]:
    """SIGTERM to every host at once (each destroys its agents), then the
    exit codes; a host not gone within 60 s is killed."""
    for h in hosts:
        if h.conn is not None:
            h.conn.close()
        if h.proc.poll() is None:
            h.proc.send_signal(signal.SIGTERM)
    codes = []
    deadline = time.monotonic() + 60
    for h in hosts:
        try:
            codes.append(h.proc.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            h.proc.kill()
            codes.append(h.proc.wait())
        h.log.close()
        if not keep:
            h.cleanup()
    return codes


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def scale(args: argparse.Namespace) -> int:
    sizes = [int(s) for s in args.hosts.split(",")]
    # A server left running by an earlier run may have other settings.
    pg_script("stop", args.pg_port)
    pg_script("start", args.pg_port, max_connections=args.max_connections)
    admin = pg_script("url", args.pg_port)
    rows = []
    try:
        shown = try_psql(admin, "SHOW max_connections")
        log(f"private PostgreSQL on port {args.pg_port}, max_connections {shown[0] if shown else '?'}")
        for size in sizes:
            log(f"{size} hosts:")
            rows.append(scale_row(args, admin, size))
    finally:
        pg_script("stop", args.pg_port)
    base = rows[0]
    print(f"fleet at scale: {args.n} POST /v1/scale from {args.clients} clients per size, memory backends, "
          f"--database-connections {args.connections}, lease 3 s, one PostgreSQL with max_connections "
          f"{args.max_connections}; ratios against the {base['hosts']}-host row")
    print("| hosts | start-up | connections idle / peak | idle CPU (% of a core) | throughput (req/s) | "
          "× | entry p50 / p90 (ms) | p50 × | commits / request | failover of the busiest host | "
          "duplicates | 503 answers | connections left |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        commits = f"{r['commits']:.2f}" if "commits" in r else "no slot free"
        if "stalled" in r:
            agents, depth, took = r["stalled"]
            print(f"| {r['hosts']} | {r['startup']:.1f} s | {r['conns_idle']} / {r['conns_peak']} | "
                  f"{r['idle_cpu']:.1f} | not all started: {agents} of {args.n} started or claimed, {depth} queued "
                  f"after {took:.0f} s | — | {r['p50']:.1f} / {r['p90']:.1f} | {r['p50'] / base['p50']:.2f} | — | — | — | "
                  f"{r['503']} | {r['left']} |")
            continue
        if "failover" in r:
            total, moved, took = r["failover"]
            fo = f"{total} in {took:.1f} s" if moved == total else f"{moved} of {total} after {took:.0f} s"
        else:
            fo = "—"
        print(f"| {r['hosts']} | {r['startup']:.1f} s | {r['conns_idle']} / {r['conns_peak']} | "
              f"{r['idle_cpu']:.1f} | {r['throughput']:.0f} | {r['throughput'] / base['throughput']:.2f} | "
              f"{r['p50']:.1f} / {r['p90']:.1f} | {r['p50'] / base['p50']:.2f} | {commits} | {fo} | "
              f"{r['dups']} | {r['503']} | {r['left']} |")
    for r in rows:
        codes = r.get("exit_codes", [])
        print(f"  {r['hosts']} hosts: serve exit codes after SIGTERM {sorted(set(codes))} "
              f"(-9: the host killed for the failover)")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bin-dir", required=True)
    p.add_argument("--pg", required=True, help="admin URL of the PostgreSQL server")
    p.add_argument("--keep", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("latency")
    s.add_argument("n", type=int, nargs="?", default=100)
    t = sub.add_parser("throughput")
    t.add_argument("n", type=int, nargs="?", default=2000)
    t.add_argument("--clients", type=int, default=8)
    f = sub.add_parser("failover")
    f.add_argument("runs", type=int, nargs="?", default=10)
    c = sub.add_parser("scale")
    c.add_argument("--hosts", default="1,3,10,25,50", help="fleet sizes, comma-separated; the first is the baseline")
    c.add_argument("-n", type=int, default=1000, help="scale requests per fleet size")
    c.add_argument("--clients", type=int, default=16)
    c.add_argument("--connections", type=int, default=2, help="--database-connections of every host")
    c.add_argument("--pg-port", type=int, default=54351, help="the private server's port")
    c.add_argument("--max-connections", type=int, default=100, help="the private server's max_connections")
    c.add_argument("--settle", type=float, default=3.0, help="seconds after start-up before the idle window")
    c.add_argument("--idle-window", type=float, default=5.0)
    c.add_argument("--limit", type=float, default=120.0, help="longest wait for the load or a failover (s)")
    c.add_argument("--quick", action="store_true", help="1 and 3 hosts, 200 requests")
    args = p.parse_args()
    if args.cmd == "scale" and args.quick:
        args.hosts, args.n = "1,3", 200
    return {"latency": latency, "throughput": throughput, "failover": failover,
            "scale": scale}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
