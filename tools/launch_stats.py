"""Where a test run's multi-process time goes: rank start-up against the test bodies.

Run the tests with ``OVERLAP_LAUNCH_STATS=<file>`` (``overlap.dist.launch`` appends a JSON line
per launch and per rank), then ``python tools/launch_stats.py <file>``. Per launch:

    start-up   launcher start -> the last rank ready (fork, unpickling the test's function and
               importing its module, joining the process group)
    body       the first rank ready -> the last rank done (the test's own work)
    teardown   the last rank done -> the launcher returned (results, joins, clean-up)

A launch whose ranks did not all finish normally counts its whole time as body.
"""

from __future__ import annotations

import argparse
import collections

from overlap.dist import run_stats


def load(path: str) -> list[dict]:
    launches, ranks = {}, collections.defaultdict(list)
    for row in run_stats.read(path):
        if row["kind"] == "launch":
            launches[row["launch"]] = row
        elif row["kind"] == "rank":
            ranks[row["launch"]].append(row)
    out = []
    for lid, row in launches.items():
        rs = ranks.get(lid, [])
        total = row["end"] - row["start"]
        if len(rs) == row["world"]:
            startup = max(r["ready"] for r in rs) - row["start"]
            teardown = row["end"] - max(r["done"] for r in rs)
        else:
            startup = teardown = 0.0
        out.append({"test": row["test"].rsplit(" ", 1)[0], "world": row["world"],
                    "total": total, "startup": startup, "teardown": teardown,
                    "body": total - startup - teardown})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stats", help="the OVERLAP_LAUNCH_STATS file")
    ap.add_argument("--top", type=int, default=15, help="tests listed by start-up time")
    args = ap.parse_args()
    rows = load(args.stats)
    by_world = collections.Counter(r["world"] for r in rows)
    total = sum(r["total"] for r in rows)
    print(f"{len(rows)} launches ({', '.join(f'{n} at world {w}' for w, n in sorted(by_world.items()))}), "
          f"{total:.0f} s in all")
    for part in ("startup", "body", "teardown"):
        t = sum(r[part] for r in rows)
        print(f"  {part:9s} {t:8.0f} s  {100 * t / max(total, 1e-9):5.1f}%  "
              f"median {sorted(r[part] for r in rows)[len(rows) // 2]:.3f} s per launch")
    per_test = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for r in rows:
        e = per_test[r["test"]]
        e[0] += 1
        e[1] += r["startup"] + r["teardown"]
        e[2] += r["total"]
    print(f"\nthe {args.top} tests with the most start-up + teardown:")
    for test, (n, over, tot) in sorted(per_test.items(), key=lambda kv: -kv[1][1])[:args.top]:
        print(f"  {over:6.1f} s of {tot:6.1f} s in {n:3d} launches  {test}")


if __name__ == "__main__":
    main()
