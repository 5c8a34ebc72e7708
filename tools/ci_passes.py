"""What each pass of CI covers, and whether that is what it must cover (``.ci/run``).

``.ci/run`` lists the files of its two extra passes in bash arrays: ``DELAY_PASS`` (again with
the stream twin's random delays) and ``NUMERIC_PASS`` (again with ATen's portable kernels). The
rules, checked here:

- every ``tests/test_*.py`` is in ``DELAY_PASS`` or says why not at module level
  (``own_delays``: it runs its cases with and without delays itself; ``no_delay_pass(reason)``);
- a file that compares floats with a tolerance is in ``NUMERIC_PASS`` or says why not
  (``no_numerics_pass(reason)``); a file without one is not in it unless it says why
  (``numerics(reason)``: exactness that depends on the summation order);
- with ``--stats FILE`` (the main pass run with ``OVERLAP_LAUNCH_STATS=FILE``): every file of
  ``DELAY_PASS`` ran stream twin or ``nccl_twin`` work (where the delays go), and none of the
  files excluded as having no such work ran any.

``python tools/ci_passes.py [--stats FILE]`` prints the passes and exits 1 on a broken rule.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_TWIN_OPS = "no stream or twin op"  # the reason that run statistics can verify
# A comparison of floats with a tolerance: torch's and math's, or one this suite writes (a
# *_TOL constant, an error bound, a "Tolerance" derivation in the docstring).
TOLERANCE = re.compile(r"\b(atol|rtol|assert_close|allclose|isclose|error_bound|\w+_TOL|"
                       r"TOL|[Tt]olerances?)\b")
EXCLUDES = {"DELAY_PASS": ("own_delays", "no_delay_pass"), "NUMERIC_PASS": ("no_numerics_pass",)}


def ci_arrays(text: str) -> dict[str, list[str]]:
    """The bash arrays ``NAME=( ... )`` of a script, comments dropped."""
    out = {}
    for m in re.finditer(r"^(\w+)=\(\n?(.*?)\)", text, re.M | re.S):
        words = shlex.split("\n".join(line.split("#", 1)[0] for line in m.group(2).splitlines()))
        out[m.group(1)] = words
    return out


def module_marks(source: str) -> dict[str, tuple[str, ...]]:
    """The module-level ``pytestmark`` markers of a test file: name -> its string arguments."""
    marks = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark"
                                                for t in node.targets):
            values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [
                node.value]
            for v in values:
                call = v if isinstance(v, ast.Call) else None
                attr = call.func if call else v
                if isinstance(attr, ast.Attribute):
                    args = tuple(a.value for a in (call.args if call else ())
                                 if isinstance(a, ast.Constant) and isinstance(a.value, str))
                    marks[attr.attr] = args
    return marks


def test_files(root: str = ROOT) -> list[str]:
    tests = os.path.join(root, "tests")
    return sorted(f"tests/{n}" for n in os.listdir(tests)
                  if n.startswith("test_") and n.endswith(".py"))


def static_problems(root: str = ROOT) -> list[str]:
    with open(os.path.join(root, ".ci", "run")) as f:
        arrays = ci_arrays(f.read())
    problems = [f".ci/run has no {name} array" for name in EXCLUDES if name not in arrays]
    files = test_files(root)
    for name, listed in arrays.items():
        if name in EXCLUDES:
            problems += [f"{name}: {f} is not a test file" for f in listed if f not in files]
            problems += [f"{name}: {f} is listed twice" for f in set(listed)
                         if listed.count(f) > 1]
    delay, numeric = set(arrays.get("DELAY_PASS", ())), set(arrays.get("NUMERIC_PASS", ()))
    for f in files:
        with open(os.path.join(root, f)) as fh:
            source = fh.read()
        marks = module_marks(source)
        out = [m for m in EXCLUDES["DELAY_PASS"] if m in marks]
        if f in delay and out:
            problems.append(f"{f} is in DELAY_PASS but marked {out[0]} at module level")
        if f not in delay and not out:
            problems.append(f"{f} is in no stream-delay pass: list it in DELAY_PASS of .ci/run "
                            f"or mark it no_delay_pass(\"why\") (or own_delays)")
        if "no_delay_pass" in marks and not marks["no_delay_pass"]:
            problems.append(f"{f}: no_delay_pass at module level needs its reason")
        tolerant = bool(TOLERANCE.search(source))
        if f in numeric and not tolerant and not marks.get("numerics"):
            problems.append(f"{f} is in NUMERIC_PASS but compares nothing with a tolerance "
                            f"(mark it numerics(\"why\") if its exactness depends on the "
                            f"summation order)")
        if f in numeric and "no_numerics_pass" in marks:
            problems.append(f"{f} is in NUMERIC_PASS but marked no_numerics_pass")
        if tolerant and f not in numeric and not marks.get("no_numerics_pass"):
            problems.append(f"{f} compares with a tolerance but is not in NUMERIC_PASS: list it "
                            f"or mark it no_numerics_pass(\"why\")")
    return problems


def twin_files(stats: str) -> set[str]:
    """The test files whose work reached the stream twin's delay point (run_stats lines)."""
    from overlap.dist import run_stats

    rows = run_stats.read(stats)
    launches = {r["launch"]: r.get("test", "") for r in rows if r.get("kind") == "launch"}
    twins = [r for r in rows if r.get("kind") == "twin"]
    out = set()
    for row in twins:
        test = row.get("test") or launches.get(row.get("launch", ""), "")
        if test.startswith("tests/test_"):
            out.add(test.split("::", 1)[0])
    return out


def run_problems(stats: str, root: str = ROOT) -> list[str]:
    with open(os.path.join(root, ".ci", "run")) as f:
        delay = ci_arrays(f.read()).get("DELAY_PASS", [])
    ran = twin_files(stats)
    problems = [f"{f} is in DELAY_PASS but ran no stream twin or nccl_twin work: the delays "
                f"cannot reorder anything there (mark it no_delay_pass(\"{NO_TWIN_OPS}\"))"
                for f in delay if f not in ran]
    for f in test_files(root):
        with open(os.path.join(root, f)) as fh:
            marks = module_marks(fh.read())
        if marks.get("no_delay_pass") == (NO_TWIN_OPS,) and f in ran:
            problems.append(f"{f} is marked no_delay_pass(\"{NO_TWIN_OPS}\") but ran stream "
                            f"twin or nccl_twin work: list it in DELAY_PASS")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stats", help="an OVERLAP_LAUNCH_STATS file of the main pass")
    args = ap.parse_args(argv)
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        arrays = ci_arrays(f.read())
    n = len(test_files())
    print(f"ci-passes: {n} test files in the main pass, {len(arrays.get('DELAY_PASS', []))} in "
          f"the stream-delay pass, {len(arrays.get('NUMERIC_PASS', []))} in the "
          f"portable-kernel pass")
    problems = static_problems()
    if args.stats:
        problems += run_problems(args.stats)
    for p in problems:
        print(f"ci-passes: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
