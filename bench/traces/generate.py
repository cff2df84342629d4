#!/usr/bin/env python3
"""Generates the job histories `bench/capacity.sh` replays (deterministic:
a fixed seed per trace; re-running rewrites the same files).

- diurnal.jsonl: one weekday (Tuesday 2026-01-06, UTC) of single jobs:
  nightly quiet, a morning ramp, a lunch dip, an afternoon peak, an
  evening tail. Arrivals are Poisson at the hour's rate; durations are
  log-normal (median 4 min, at most 30 min).
- fanout.jsonl: the same day of pipelines, each fanning out into 20-200
  jobs within 5 seconds (Poisson pipeline starts, several an hour in
  working hours, rare at night), plus a trickle of single jobs; fan-out
  jobs run 1-6 minutes.

One job a line: {"at": RFC 3339, "labels": [...], "durationSeconds": n}.

Usage: python3 bench/traces/generate.py [OUT_DIR]   (default: bench/traces)
"""

import json
import math
import os
import random
import sys
from datetime import datetime, timedelta, timezone

DAY = datetime(2026, 1, 6, tzinfo=timezone.utc)  # a Tuesday

# Jobs per minute at each hour of the day (diurnal).
DIURNAL_RATE = [0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.4, 1.5,   # 00-07
                3.5, 5.0, 5.0, 5.0,                       # 08-11
                2.0,                                      # 12 (lunch)
                4.0, 5.5, 5.5, 5.0, 3.0,                  # 13-17
                1.5, 0.8, 0.5, 0.4, 0.3, 0.2]             # 18-23

# Pipelines per hour (fan-out).
PIPELINE_RATE = [0.1] * 7 + [1.0, 2.5, 3.0, 3.0, 2.5, 1.0, 2.5, 3.0, 3.0, 2.5, 1.5, 0.5,
                             0.3, 0.2, 0.1, 0.1, 0.1]


def stamp(seconds):
    t = DAY + timedelta(seconds=seconds)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def poisson_times(rng, rate_per_hour):
    """Arrival times (seconds) of a Poisson process whose rate changes
    every hour."""
    out = []
    for hour, rate in enumerate(rate_per_hour):
        if rate <= 0:
            continue
        t = hour * 3600.0
        while True:
            t += rng.expovariate(rate / 3600.0)
            if t >= (hour + 1) * 3600.0:
                break
            out.append(t)
    return out


def diurnal(rng):
    jobs = []
    for at in poisson_times(rng, [r * 60 for r in DIURNAL_RATE]):
        d = min(1800.0, max(20.0, rng.lognormvariate(math.log(240), 0.6)))
        jobs.append((at, ["linux"], round(d, 1)))
    return jobs


def fanout(rng):
    jobs = []
    for start in poisson_times(rng, PIPELINE_RATE):
        n = rng.randint(20, 200)
        for _ in range(n):
            at = start + rng.uniform(0, 5)
            jobs.append((at, ["linux"], round(rng.uniform(60, 360), 1)))
    # A trickle of single jobs between pipelines.
    for at in poisson_times(rng, [6.0] * 24):
        jobs.append((at, ["linux"], round(rng.uniform(60, 300), 1)))
    return jobs


def write(path, jobs):
    jobs.sort(key=lambda j: j[0])
    with open(path, "w") as f:
        for at, labels, d in jobs:
            f.write(json.dumps({"at": stamp(at), "labels": labels, "durationSeconds": d}) + "\n")
    print(f"{path}: {len(jobs)} jobs")


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    write(os.path.join(out, "diurnal.jsonl"), diurnal(random.Random(26)))
    write(os.path.join(out, "fanout.jsonl"), fanout(random.Random(2026)))


if __name__ == "__main__":
    main()
