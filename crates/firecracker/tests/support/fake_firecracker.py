#!/usr/bin/env python3
"""A minimal Firecracker stand-in for kici-firecracker's own tests, until
crates/testkit's spec-enforcing simulator is wired in.

Serves the API on --api-sock (path inside the jail root given by
FAKE_ROOT, set by the fake jailer), records every request as one JSON line
in <root>/api-calls.jsonl, enforces the ordering rules the backend relies on
(pre-boot-only calls refused after InstanceStart, MMDS config only once its
interface exists, logger/metrics targets must exist, InstanceStart needs a
boot source), and on InstanceStart plays a guest: it reads the MMDS document
and prints what an agent would get to stdout (the serial console).
SendCtrlAltDel powers the "guest" off (exit 0).
"""
import json
import os
import socketserver
import sys
import threading
from http.server import BaseHTTPRequestHandler

args = sys.argv[1:]
root = os.environ["FAKE_ROOT"]
# No real chroot here: jail paths are resolved under the root.
sock = os.path.join(root, args[args.index("--api-sock") + 1].lstrip("/"))
state = {"started": False, "ifaces": set(), "boot": False, "mmds": None, "mmds_config": None}
PRE_BOOT = ("/boot-source", "/drives/", "/network-interfaces/", "/machine-config", "/logger",
            "/metrics", "/mmds/config", "/serial")


def in_jail(path):
    return os.path.join(root, path.lstrip("/"))


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def log_message(self, *a):
        pass

    def answer(self, status, body=None):
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            if data:
                self.wfile.write(data)
            self.wfile.flush()
        except OSError:
            # The client read what it needed and closed: nothing to do.
            pass

    def fault(self, message):
        self.answer(400, {"fault_message": message})

    def do_GET(self):
        record(self.command, self.path, None)
        if self.path == "/":
            self.answer(200, {"app_name": "Firecracker", "id": "fake", "vmm_version": "1.16.1",
                              "state": "Running" if state["started"] else "Not started"})
        elif self.path == "/mmds":
            if state["mmds"] is None:
                self.answer(404, {"fault_message": "The MMDS data store is not initialized."})
            else:
                self.answer(200, state["mmds"])
        else:
            self.fault("Invalid request method and/or path")

    def do_PUT(self):
        length = int(self.headers.get("Content-Length", "0"))
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            return self.fault("bad json")
        record(self.command, self.path, body)
        p = self.path
        if state["started"] and p.startswith(PRE_BOOT) and p != "/serial":
            return self.fault("The requested operation is not supported after starting the microVM.")
        if p == "/boot-source":
            state["boot"] = True
        elif p.startswith("/network-interfaces/"):
            state["ifaces"].add(body["iface_id"])
        elif p == "/logger" or p == "/metrics":
            target = body.get("log_path") or body.get("metrics_path")
            if not os.path.exists(in_jail(target)):
                return self.fault("No such file or directory: %s" % target)
        elif p == "/mmds/config":
            if not all(i in state["ifaces"] for i in body["network_interfaces"]):
                return self.fault("The list of network interface IDs provided contains at least one ID that does not correspond to any existing network interface.")
            state["mmds_config"] = body
        elif p == "/mmds":
            state["mmds"] = body
        elif p == "/actions":
            action = body["action_type"]
            if action == "InstanceStart":
                if not state["boot"]:
                    return self.fault("Cannot start microvm without kernel configuration.")
                state["started"] = True
                # The "guest" prints before the answer, so tests need not wait.
                boot_guest()
                self.answer(204)
                return
            if action == "SendCtrlAltDel":
                self.answer(204)
                print("reboot: Power down", flush=True)
                os._exit(0)
        self.answer(204)


def record(method, path, body):
    with open(in_jail("api-calls.jsonl"), "a") as f:
        f.write(json.dumps({"method": method, "path": path, "body": body}) + "\n")


def boot_guest():
    meta = ((state["mmds"] or {}).get("latest") or {}).get("meta-data") or {}
    v2 = (state["mmds_config"] or {}).get("version") == "V2"
    print("Linux version 6.1.0-fake (kici testkit stand-in)", flush=True)
    env = {"KICI_AGENT_ID": meta.get("kici-agent-id"), "KICI_ORCHESTRATOR_URL": meta.get("kici-orchestrator-url"),
           "KICI_LABELS": meta.get("kici-labels"), "KICI_SCALER_MANAGED": meta.get("kici-scaler-managed")}
    env.update(meta.get("kici-env") or {})
    print("kici-agent-lite: mmds-v2=%s env=%s" % (v2, json.dumps(env, sort_keys=True)), flush=True)
    if meta.get("kici-env", {}).get("FAKE_GUEST_PANIC"):
        print("Kernel panic - not syncing: VFS: Unable to mount root fs on unknown-block(0,0)", flush=True)


class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


os.makedirs(os.path.dirname(sock), exist_ok=True)
server = Server(sock, Handler)
server.serve_forever()
