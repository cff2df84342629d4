#!/usr/bin/env python3
"""Replays each trace of bench/traces under several warm pool policies with
`kici-scaler simulate`, prints the (wait p90, idle agent-seconds) table,
marks the Pareto frontier and writes one SVG chart per trace.

Called by bench/capacity.sh (which builds the binary); see bench/README.md.
"""

import json
import os
import subprocess
import sys
import tempfile

BIN = sys.argv[1]
OUT = sys.argv[2]
HERE = os.path.dirname(os.path.abspath(__file__))
SPAWN = "container=30"

TRACES = {
    # trace: (maxAgents, schedule periods, forecast bounds)
    # The schedules are written knowing each trace's hours (the generator's
    # rates): the pool of the busiest hours by day, a small one at night.
    "diurnal": (40, [
        ("[mon, tue, wed, thu, fri]", "08:00", "12:00", 5),
        ("[mon, tue, wed, thu, fri]", "12:00", "13:00", 3),
        ("[mon, tue, wed, thu, fri]", "13:00", "17:00", 5),
        ("[mon, tue, wed, thu, fri]", "07:00", "08:00", 3),
        ("[mon, tue, wed, thu, fri]", "17:00", "19:00", 3),
        ("[mon, tue, wed, thu, fri, sat, sun]", "00:00", "24:00", 1),
    ], (0, 40)),
    "fanout": (120, [
        ("[mon, tue, wed, thu, fri]", "07:00", "18:00", 120),
    ], (0, 120)),
}


def config(max_agents, static=None, schedule=None, forecast=None):
    text = ["version: 1", f"globalMaxAgents: {max_agents}", "scalers:", "  - name: ci", "    type: container",
            f"    maxAgents: {max_agents}", "    maxConcurrentSpawns: 40"]
    if static is not None:
        text.append(f"    warmPool: {{enabled: true, size: {static}}}")
    if schedule or forecast:
        text += ["    x-kici-scaler:", "      warmPool:"]
        if schedule:
            text.append("        schedule:")
            for days, frm, to, size in schedule:
                text.append(f"          - {{days: {days}, from: \"{frm}\", to: \"{to}\", timezone: UTC, size: {size}}}")
        if forecast:
            text.append(f"        forecast: {{minSize: {forecast[0]}, maxSize: {forecast[1]}}}")
    text += ["    labelSets:", "      - labels: [linux]", "        image: kici/agent:1", ""]
    return "\n".join(text)


def simulate(tmp, name, text, trace):
    path = os.path.join(tmp, name + ".yaml")
    with open(path, "w") as f:
        f.write(text)
    out = subprocess.run([BIN, "simulate", "--config", path, "--trace", trace,
                          "--spawn-seconds", SPAWN, "--json"],
                         check=True, capture_output=True, text=True).stdout
    o = json.loads(out)["overall"]
    return o["wait"]["p90"], o["idleAgentSeconds"], o["jobs"], o["zeroWait"]


def frontier(rows):
    on = set()
    for i, (_, p, c, *_rest) in enumerate(rows):
        dominated = any((p2 <= p and c2 <= c) and (p2 < p or c2 < c)
                        for j, (_, p2, c2, *_r) in enumerate(rows) if j != i)
        if not dominated:
            on.add(i)
    return on


def svg(path, title, rows, on):
    w, h, m = 720, 440, 60
    ps = [r[1] for r in rows]
    cs = [r[2] / 3600 for r in rows]
    pmax = max(ps) * 1.05 or 1
    cmax = max(cs) * 1.05 or 1
    x = lambda p: m + (w - 2 * m) * p / pmax
    y = lambda c: h - m - (h - 2 * m) * c / cmax
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
             f'<rect width="{w}" height="{h}" fill="white"/>',
             f'<text x="{w/2}" y="20" text-anchor="middle" font-size="14">{title}: wait p90 vs idle agent-hours</text>',
             f'<line x1="{m}" y1="{h-m}" x2="{w-m}" y2="{h-m}" stroke="black"/>',
             f'<line x1="{m}" y1="{m}" x2="{m}" y2="{h-m}" stroke="black"/>',
             f'<text x="{w/2}" y="{h-20}" text-anchor="middle">wait p90 (s)</text>',
             f'<text x="15" y="{h/2}" transform="rotate(-90 15 {h/2})" text-anchor="middle">idle agent-hours</text>']
    for i in range(6):
        pv, cv = pmax * i / 5, cmax * i / 5
        parts.append(f'<text x="{x(pv)}" y="{h-m+15}" text-anchor="middle">{pv:.0f}</text>')
        parts.append(f'<text x="{m-5}" y="{y(cv)+4}" text-anchor="end">{cv:.0f}</text>')
    front = sorted((rows[i] for i in on), key=lambda r: r[1])
    pts = " ".join(f"{x(r[1]):.1f},{y(r[2]/3600):.1f}" for r in front)
    parts.append(f'<polyline points="{pts}" fill="none" stroke="#888" stroke-dasharray="4 3"/>')
    for i, r in enumerate(rows):
        name = r[0]
        color = {"forecast": "#d62728", "schedule": "#2ca02c", "none": "#000"}.get(name, "#1f77b4")
        rad = 6 if name in ("forecast", "schedule", "none") else 3
        fill = color if i in on else "white"
        parts.append(f'<circle cx="{x(r[1]):.1f}" cy="{y(r[2]/3600):.1f}" r="{rad}" stroke="{color}" fill="{fill}"><title>{name}: p90 {r[1]:.1f} s, {r[2]/3600:.1f} idle agent-h</title></circle>')
        if name in ("forecast", "schedule", "none"):
            parts.append(f'<text x="{x(r[1])+8:.1f}" y="{y(r[2]/3600)-6:.1f}" fill="{color}">{name}</text>')
    parts.append(f'<text x="{w-m}" y="{m-10}" text-anchor="end">blue: static pool sizes; filled: Pareto frontier</text>')
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")


def main():
    os.makedirs(OUT, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for trace, (max_agents, schedule, forecast) in TRACES.items():
            path = os.path.join(HERE, "traces", trace + ".jsonl")
            rows = [("none", *simulate(tmp, "none", config(max_agents), path))]
            for n in range(0, max_agents + 1):
                rows.append((f"static {n}", *simulate(tmp, f"s{n}", config(max_agents, static=n), path)))
            rows.append(("schedule", *simulate(tmp, "sched", config(max_agents, schedule=schedule), path)))
            rows.append(("forecast", *simulate(tmp, "fc", config(max_agents, forecast=forecast), path)))
            on = frontier(rows)
            print(f"\n### {trace} ({rows[0][3]} jobs, maxAgents {max_agents}, spawn {SPAWN} s)\n")
            print("| policy | wait p90 (s) | idle agent-s | zero-wait jobs | frontier |")
            print("|---|---:|---:|---:|:---:|")
            for i, (name, p90, idle, jobs, zero) in enumerate(rows):
                print(f"| {name} | {p90:.1f} | {idle:.0f} | {zero} | {'*' if i in on else ''} |")
            fp, fi = rows[-1][1], rows[-1][2]
            better = [r for r in rows if r[0].startswith("static") and r[1] <= fp]
            if better:
                best = min(better, key=lambda r: r[2])
                saving = 100 * (1 - fi / best[2]) if best[2] else 0
                print(f"\nforecast: p90 {fp:.1f} s, {fi:.0f} idle agent-s; the cheapest static pool with the same or better p90 is "
                      f"{best[0]} ({best[1]:.1f} s, {best[2]:.0f} idle agent-s): forecast uses {saving:.0f}% fewer idle agent-seconds; "
                      f"forecast on the frontier: {'yes' if len(rows)-1 in on else 'no'}")
            else:
                print(f"\nforecast: p90 {fp:.1f} s, {fi:.0f} idle agent-s; no static pool reaches its p90")
            svg(os.path.join(OUT, f"capacity-{trace}.svg"), trace, rows, on)


if __name__ == "__main__":
    main()
