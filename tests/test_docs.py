"""The README and docs/ stay true: the README is short, its file map names every module under
overlap/, every relative link resolves, and every code block runs.

Code blocks are of three kinds, and no other is allowed:

- ``python``: follows a marker ``<!-- snippet: docs/snippets/NAME.py -->`` and is that file
  verbatim; every snippet file is run here as a user would (``python docs/snippets/NAME.py``),
  and each asserts its own numbers against a reference (exit 0 only if they hold);
- ``bash`` (README only): every command line appears verbatim in ``.ci/run``, which CI runs;
- ``text`` / ``json``: program output, shown, not run.
"""

import glob
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.no_delay_pass("end to end; component files run its async paths delayed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
MAX_README_LINES = 250
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
MARKER = re.compile(r"<!-- snippet: (\S+) -->\n```python\n")
LINK = re.compile(r"\]\(([^)#\s]+\.[A-Za-z]+|[^)#\s]+/)(?:#[^)]*)?\)")  # a file or a dir


def _read(path):
    with open(path) as f:
        return f.read()


def _doc_files():
    docs = sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
    return [README, os.path.join(ROOT, "bench", "README.md")] + docs


def _rel(path):
    return os.path.relpath(path, ROOT)


def _snippets():
    return sorted(_rel(p) for p in glob.glob(os.path.join(ROOT, "docs", "snippets", "*.py")))


def test_readme_is_short():
    n = _read(README).count("\n")
    assert n <= MAX_README_LINES, (f"README.md has {n} lines (at most {MAX_README_LINES}): "
                                   "move depth to docs/")


def _file_map():
    readme = _read(README)
    start = readme.index("## File map")
    block = FENCE.search(readme, start)
    assert block, "README: no code block under '## File map'"
    entries, current = {}, None
    for line in block.group(2).splitlines():
        head = line.split()[0] if line.strip() and not line.startswith(" " * 10) else None
        if head and head.endswith("/"):
            indent = len(line) - len(line.lstrip())
            current = head if indent == 0 else "overlap/" + head
            entries[current] = ""
        if current:
            entries[current] += " " + line
    return entries


def test_file_map_names_every_module():
    entries = _file_map()
    missing = []
    for path in sorted(glob.glob(os.path.join(ROOT, "overlap", "**", "*.py"), recursive=True)):
        rel = _rel(path)
        package, name = os.path.dirname(rel) + "/", os.path.basename(rel)[:-3]
        if name in ("__init__", "__main__"):
            continue
        words = set(re.findall(r"[\w.]+", entries.get(package, "").replace(".py", "")))
        if name not in words:
            missing.append(rel)
    packages = {_rel(os.path.dirname(p)) + "/" for p in
                glob.glob(os.path.join(ROOT, "overlap", "**", "*.py"), recursive=True)}
    stale = [k for k in entries if k.startswith("overlap/") and k not in packages
             and not os.path.isdir(os.path.join(ROOT, k))]
    assert not missing, f"README's file map does not name: {missing}"
    assert not stale, f"README's file map names directories that do not exist: {stale}"


def test_module_docstrings_are_short():
    """A module docstring holds the contract and the shape legend (at most 15 lines); the
    narrative lives in docs/design/."""
    import ast

    long = []
    for path in sorted(glob.glob(os.path.join(ROOT, "overlap", "**", "*.py"), recursive=True)):
        with open(path) as f:
            doc = ast.get_docstring(ast.parse(f.read()), clean=False)
        lines = len(doc.strip("\n").split("\n")) if doc else 0
        if lines > 15:
            long.append(f"{_rel(path)}: {lines} lines")
    assert not long, "module docstrings over 15 lines:\n" + "\n".join(long)


def test_every_relative_link_resolves():
    broken = []
    for doc in _doc_files():
        for target in LINK.findall(_read(doc)):
            if "://" in target:
                continue
            if not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(doc), target))):
                broken.append(f"{_rel(doc)} -> {target}")
    assert not broken, f"broken links: {broken}"


def test_every_docs_page_is_reachable_from_the_readme():
    reachable, todo = set(), [README]
    while todo:
        doc = todo.pop()
        if doc in reachable or not doc.endswith(".md"):
            continue
        reachable.add(doc)
        for target in LINK.findall(_read(doc)):
            todo.append(os.path.normpath(os.path.join(os.path.dirname(doc), target)))
    unreachable = [_rel(d) for d in _doc_files() if d not in reachable]
    assert not unreachable, f"not linked from README.md (directly or through a page): {unreachable}"


def test_code_blocks_are_snippets_ci_commands_or_output():
    ci = _read(os.path.join(ROOT, ".ci", "run")).splitlines()
    problems = []
    for doc in _doc_files():
        text = _read(doc)
        for block in FENCE.finditer(text):
            lang, body = block.group(1), block.group(2)
            where = f"{_rel(doc)}:{text.count(chr(10), 0, block.start()) + 1}"
            if lang == "python":
                marker = MARKER.search(text, max(0, block.start() - 200), block.start() + 11)
                if not marker or marker.end() != block.start() + len("```python\n"):
                    problems.append(f"{where}: python block without a snippet marker")
                elif body != _read(os.path.join(ROOT, marker.group(1))):
                    problems.append(f"{where}: differs from {marker.group(1)}")
            elif lang == "bash":
                if doc != README:
                    problems.append(f"{where}: bash block outside the README (use inline code)")
                for line in body.splitlines():
                    if line.strip() and not line.lstrip().startswith("#") and line not in ci:
                        problems.append(f"{where}: {line!r} is not run by .ci/run")
            elif lang not in ("text", "json"):
                problems.append(f"{where}: code block of kind {lang or '(none)'!r}")
    assert not problems, "\n".join(problems)


def test_every_snippet_is_shown_somewhere():
    shown = set()
    for doc in _doc_files():
        shown.update(m.group(1) for m in MARKER.finditer(_read(doc)))
    assert set(_snippets()) <= shown, f"snippets no page shows: {sorted(set(_snippets()) - shown)}"


@pytest.mark.parametrize("snippet", _snippets())
def test_snippet_runs_and_checks_its_numbers(snippet):
    proc = subprocess.run([sys.executable, snippet], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{snippet} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
