"""CI's passes cover exactly their files (tools/ci_passes.py, the lists in .ci/run).

The repository's own lists and markers obey the rules; each rule fails on a tree that breaks
it; and the run statistics that CI checks the stream-delay list with attribute twin work to the
right test file, from a rank and from the test's own process.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))
import ci_passes  # noqa: E402

pytestmark = [
    pytest.mark.no_delay_pass("no stream or twin op"),
    pytest.mark.no_numerics_pass("its tolerance words are test data"),
]


def test_the_repository_lists_every_file_in_its_passes():
    assert ci_passes.static_problems() == []
    with open(os.path.join(ci_passes.ROOT, ".ci", "run")) as f:
        text = f.read()
    arrays = ci_passes.ci_arrays(text)
    # each list is what its pass runs, and the main pass runs the whole tests/ directory
    assert '"${DELAY_PASS[@]}"' in text and '"${NUMERIC_PASS[@]}"' in text
    assert "\npython -m pytest tests -n 3\n" in text
    assert len(arrays["DELAY_PASS"]) >= 40 and len(arrays["NUMERIC_PASS"]) >= 20


def _tree(tmp_path, files: dict[str, str], delay: list[str], numeric: list[str]):
    (tmp_path / "tests").mkdir()
    (tmp_path / ".ci").mkdir()
    for name, body in files.items():
        (tmp_path / "tests" / name).write_text(textwrap.dedent(body))
    (tmp_path / ".ci" / "run").write_text(
        "DELAY_PASS=(\n  " + " ".join(f"tests/{n}" for n in delay) + "  # the delay pass\n)\n"
        "NUMERIC_PASS=(\n" + "\n".join(f"  tests/{n}" for n in numeric) + "\n)\n")
    return str(tmp_path)


PLAIN = "def test_a():\n    assert 1 + 1 == 2\n"
TOLERANT = "import torch\n\ndef test_a():\n    torch.testing.assert_close(1.0, 1.0)\n"
NO_OPS = 'import pytest\npytestmark = pytest.mark.no_delay_pass("no stream or twin op")\n'


@pytest.mark.parametrize("files, delay, numeric, problem", [
    ({"test_new.py": PLAIN}, [], [], "test_new.py is in no stream-delay pass"),
    ({"test_new.py": NO_OPS + TOLERANT}, [], [], "compares with a tolerance but is not in"),
    ({"test_new.py": NO_OPS + PLAIN}, [], ["test_new.py"], "compares nothing with a tolerance"),
    ({"test_new.py": NO_OPS + PLAIN}, ["test_new.py"], [], "marked no_delay_pass at module"),
    ({"test_new.py": "import pytest\npytestmark = pytest.mark.no_delay_pass\n" + PLAIN}, [], [],
     "needs its reason"),
    ({"test_new.py": PLAIN}, ["test_new.py", "test_gone.py"], [], "test_gone.py is not a test"),
])
def test_each_rule_fails_a_tree_that_breaks_it(tmp_path, files, delay, numeric, problem):
    root = _tree(tmp_path, files, delay, numeric)
    problems = ci_passes.static_problems(root)
    assert any(problem in p for p in problems), problems


def test_a_tree_that_keeps_the_rules_passes(tmp_path):
    files = {"test_a.py": PLAIN, "test_b.py": NO_OPS + PLAIN,
             "test_c.py": 'import pytest\npytestmark = pytest.mark.no_numerics_pass("e2e")\n'
                          + TOLERANT, "test_d.py": TOLERANT}
    root = _tree(tmp_path, files, ["test_a.py", "test_c.py", "test_d.py"], ["test_d.py"])
    assert ci_passes.static_problems(root) == []


def _stats(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "twin", "te')


def test_run_statistics_find_a_delay_file_without_twin_work_and_a_mislabelled_one(tmp_path):
    files = {"test_a.py": PLAIN, "test_b.py": PLAIN, "test_c.py": NO_OPS + PLAIN}
    root = _tree(tmp_path, files, ["test_a.py", "test_b.py"], [])
    stats = tmp_path / "stats.jsonl"
    _stats(stats, [{"kind": "launch", "launch": "7-1", "test": "tests/test_a.py::test_a (call)"},
                   {"kind": "twin", "launch": "7-1", "test": "", "pid": 8},
                   {"kind": "twin", "launch": "", "test": "tests/test_c.py::test_a (call)"}])
    assert ci_passes.twin_files(str(stats)) == {"tests/test_a.py", "tests/test_c.py"}
    problems = ci_passes.run_problems(str(stats), root)
    assert len(problems) == 2, problems
    assert "tests/test_b.py is in DELAY_PASS but ran no stream twin" in problems[0]
    assert "tests/test_c.py is marked no_delay_pass" in problems[1]


RANKS = '''
import torch
import torch.distributed as dist
from overlap.dist.launch import launch
from overlap.dist.streams import Stream


def _all_reduce():
    t = torch.ones(2)
    dist.all_reduce(t)
    return float(t[0])


def test_ranks():
    assert launch(_all_reduce, 2, backend="nccl_twin", timeout=60) == [2.0, 2.0]


def test_own_stream():
    s, out = Stream("cpu", name="t"), []
    s.enqueue(lambda: out.append(1))
    s.synchronize()
    s.close()
    assert out == [1]
'''


def test_twin_work_is_attributed_to_its_test_file(tmp_path):
    """A real run: nccl_twin work in launched ranks and stream twin work in the test's own
    process are both found; a file with neither is not."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_twin.py").write_text(RANKS)
    (tests / "test_none.py").write_text(PLAIN)
    stats = tmp_path / "stats.jsonl"
    env = dict(os.environ, OVERLAP_LAUNCH_STATS=str(stats))
    env.pop("OVERLAP_STREAM_DELAY_MS", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/test_twin.py", "tests/test_none.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [json.loads(line) for line in stats.read_text().splitlines()]
    twin = [r for r in rows if r["kind"] == "twin"]
    launches = {r["launch"]: r["test"] for r in rows if r["kind"] == "launch"}
    assert sorted({launches.get(r["launch"]) or r["test"] for r in twin}) == [
        "tests/test_twin.py::test_own_stream (call)", "tests/test_twin.py::test_ranks (call)"]
    assert ci_passes.twin_files(str(stats)) == {"tests/test_twin.py"}
