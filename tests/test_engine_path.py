"""The engine's thin path (docs/design/engine.md): ``tools/engine_path.py`` finds, for every
backend, a path from the nn layers' forward through that backend's class to its launcher,
and none crosses more than 4 files (layers, ops, backends, launcher)."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.no_delay_pass("no stream or twin op")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_backend_is_reached_in_at_most_four_files():
    proc = subprocess.run([sys.executable, "tools/engine_path.py", "--max-files", "4"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "no path" not in out, out
    for layer in ("ColumnParallelLinear.forward", "RowParallelLinear.forward"):
        for backend in ("chunked", "symmetric", "triton", "unfused"):
            assert f"{layer} -> {backend}: " in out, (layer, backend, out)
    counts = [int(line.split(": ")[1].split()[0]) for line in out.splitlines()
              if " files" in line and "->" in line]
    assert len(counts) == 8 and max(counts) <= 4, out
    assert "overlap/kernels/triton/all_gather_matmul.py" in out, out
    assert "overlap/tp/chunked.py" in out, out
