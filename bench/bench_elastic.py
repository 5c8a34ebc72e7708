"""Time from a fault to resumed training, for the three ways the main job recovers, in one run:

- restart: one rank SIGKILLed; every rank restarts on the same layout (the baseline);
- shrink: an emulated node (``--ranks-per-node 2``) lost for good; the job continues on the
  survivors with the planner's layout, its checkpoint resharded;
- grow: the lost node comes back while the shrunk job runs; the job stops at a checkpoint and
  resumes on every node.

    python -m bench.bench_elastic                    # default job: tp2 x pp2 x dp2, 8 ranks
    python -m bench.bench_elastic --repeats 5 --out bench/results/elastic

Each case runs ``python -m overlap.train`` with ``--log-json`` and reads the ``resumed``
event's ``fault_to_resumed_s`` (the fault time is written by the dying rank; for a grow, when
the node's return was seen). Cases take turns, ``--repeats`` rounds; the table gives medians
and the spread, and the ratio to the restart case of the same round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench.runner import apply_sharing_flag, sharing_flag
from overlap.train.shrink import describe_layout

CASES = ("restart", "shrink", "grow")
JOB = ["--steps", "14", "--save-every", "2", "--max-restarts", "1", "--ranks-per-node", "2",
       "--min-nodes", "1", "--kill-at-step", "5"]
FAULT = {"restart": ["--kill-rank", "3"], "shrink": ["--kill-node", "1"],
         "grow": ["--kill-node", "1", "--grow-back"]}


def _events(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def run_case(case: str, extra: list[str], timeout: float = 900.0) -> dict:
    """One job with one fault; the resumed events and the step times per layout."""
    with tempfile.TemporaryDirectory(prefix="bench_elastic_") as tmp:
        log, save = os.path.join(tmp, "log.jsonl"), os.path.join(tmp, "ck")
        args = [*JOB, *FAULT[case], *extra, "--save", save, "--log-json", log]
        proc = subprocess.Popen([sys.executable, "-m", "overlap.train", *args],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + timeout
        while case == "grow" and proc.poll() is None and time.monotonic() < deadline:
            # the node returns once the job resumed without it
            if any(e["event"] == "resumed" for e in _events(log)):
                nodes = os.path.join(save, ".nodes")
                for name in os.listdir(nodes):
                    os.unlink(os.path.join(nodes, name))
                break
            time.sleep(0.05)
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        if proc.returncode != 0:
            raise RuntimeError(f"{case}: overlap.train failed:\n{(out + err)[-3000:]}")
        events = _events(log)
    resumed = [e for e in events if e["event"] == "resumed"]
    steps: dict[int, list[float]] = {}
    for e in events:
        if e["event"] == "step":
            steps.setdefault(e["layout"]["ranks"], []).append(e["step_s"])
    return {"resumed": [r["fault_to_resumed_s"] for r in resumed],
            "layouts": [r["layout"] for r in resumed],
            "step_s": {k: statistics.median(v[1:] or v) for k, v in steps.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench/results/elastic")
    p.add_argument("extra", nargs="*", help="more overlap.train flags (after --)")
    sharing_flag(p)
    a = p.parse_args(argv)
    apply_sharing_flag(p, vars(a))  # the jobs' ranks read it from the environment
    rounds = []
    for r in range(a.repeats):
        row = {}
        for case in CASES:
            row[case] = run_case(case, a.extra)
            print(f"round {r + 1}/{a.repeats} {case}: fault -> resumed "
                  f"{', '.join(f'{s:.2f} s' for s in row[case]['resumed'])}", flush=True)
        rounds.append(row)
    # the time each case measures: restart/shrink: its one resume; grow: the return (2nd)
    pick = {"restart": 0, "shrink": 0, "grow": 1}
    times = {c: [row[c]["resumed"][pick[c]] for row in rounds] for c in CASES}
    ratio = {c: statistics.median(row[c]["resumed"][pick[c]] / row["restart"]["resumed"][0]
                                  for row in rounds) for c in CASES}
    first = rounds[0]
    what = {"restart": "rank 3 killed; same layout, 8 ranks",
            "shrink": "node 1 (ranks 2-3) lost for good; "
                      f"{describe_layout(first['shrink']['layouts'][0])} chosen by the planner",
            "grow": "node 1 back while the shrunk job runs; back to 8 ranks at a fresh "
                    "checkpoint (time from the node's return)"}
    lines = [f"# Fault to resumed training (`python -m bench.bench_elastic "
             f"--repeats {a.repeats}`)", "",
             f"Default job (tp2 x pp2 x dp2, 8 local ranks on nccl_twin, 2 ranks per emulated "
             f"node), {' '.join(JOB)}; medians of {a.repeats} rounds, cases taking turns. "
             "Measured on 2 shared CPU cores: the time is process start-up, imports, process "
             "groups, model build and the checkpoint load; no GPU time is claimed.", "",
             "| case | what happens | fault -> resumed, median (min-max) | vs restart |",
             "|---|---|---|---|"]
    for c in CASES:
        ts = times[c]
        lines.append(f"| {c} | {what[c]} | {statistics.median(ts):.2f} s ({min(ts):.2f}-"
                     f"{max(ts):.2f}) | {ratio[c]:.2f}x |")
    steps = first["shrink"]["step_s"]
    lines += ["", "Step time before and after the shrink (median, first round): "
              + ", ".join(f"{k} ranks {1e3 * v:.0f} ms" for k, v in sorted(steps.items())), ""]
    text = "\n".join(lines)
    print("\n" + text)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out + ".md", "w") as f:
        f.write(text)
    with open(a.out + ".json", "w") as f:
        json.dump({"job": JOB, "rounds": rounds}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
