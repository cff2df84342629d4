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
from harness import Daemon, percentile, wait_gone  # noqa: E402


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
    args = p.parse_args()
    return {"latency": latency, "throughput": throughput, "failover": failover}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
