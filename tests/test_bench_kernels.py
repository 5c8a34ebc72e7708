"""bench.bench_kernels at CPU sizes, as the GPU check tool calls it (``--device cpu --out``):

- every kernel row is there, its output check passed (exit status 0), and its numbers agree
  with each other: achieved = work / time, ceiling = the ceiling row's rate, ratio =
  ceiling_ms / median_ms with ceiling_ms = work at the ceiling's rate;
- a kernel that writes a wrong output (one value of the INT8 dequantize, one of the fused
  matmul_reduce_scatter, injected by wrapping the kernels) fails its rows, and only those,
  and the run exits 1.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.no_delay_pass("end to end; component files run its async paths delayed"),
    pytest.mark.no_numerics_pass("the bench's own checks are exact or analytic bounds; "
                                 "test_quant_kernels and test_tp_triton cover the kernels"),
]

ROOT = Path(__file__).resolve().parents[1]
GEMMS = ("64x64x64", "128x64x16")
BANDWIDTH = ("copy (ceiling)", "int8 quantize (triton)", "int8 dequantize (triton)",
             "int8 dequant-reduce (triton)", "bf16 quantize (torch cast)",
             "bf16 dequantize (torch cast)", "bf16 dequant-reduce (torch sum)")
FUSED = ("all_gather_matmul (triton, world 1)", "matmul_reduce_scatter (triton, world 1)")


def _expected_rows():
    rows = {(k, None) for k in BANDWIDTH}
    for g in GEMMS:
        rows |= {(f"torch.matmul {g} (ceiling)", g)} | {(k, g) for k in FUSED}
    return rows


def _key(row):
    return row["kernel"], row["shape"] if row["unit"] == "TFLOP/s" else None


def _run(args, tmp_path, timeout=120):
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _rel(a, b):
    return abs(a - b) / max(abs(a), abs(b))


def test_cpu_run_has_every_row_checked_and_consistent(tmp_path):
    out = tmp_path / "kernels"
    res = _run(["-m", "bench.bench_kernels", "--device", "cpu", "--out", str(out)], tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    table = json.loads((out.with_suffix(".json")).read_text())
    rows = table["rows"]
    assert {_key(r) for r in rows} == _expected_rows()
    assert len(rows) == len(_expected_rows())
    rate = {_key(r): r["achieved"] for r in rows}
    for r in rows:
        what = f"{r['kernel']} {r['shape']}"
        assert r["correct"] is True, what
        t = r["median_ms"] / 1e3
        assert t > 0, what
        assert _rel(r["achieved"], r["work"] / t / 1e12) < 1e-9, what
        ceiling = ("copy (ceiling)", None) if r["unit"] == "TB/s" else \
            (f"torch.matmul {r['shape']} (ceiling)", r["shape"])
        assert _rel(r["ceiling"], rate[ceiling]) < 1e-12, what
        assert _rel(r["ceiling_ms"], 1e3 * r["work"] / (r["ceiling"] * 1e12)) < 1e-9, what
        assert _rel(r["ratio"], r["ceiling_ms"] / r["median_ms"]) < 1e-9, what
        assert r["goal"] == ("-" if "(ceiling)" in r["kernel"]
                             else ">= 0.85" if r["unit"] == "TFLOP/s" else ">= 0.7"), what
    assert any("launch rows skipped" in n.lower() for n in table["notes"])
    md = (out.with_suffix(".md")).read_text()
    assert "| ratio |" in md and "| goal |" in md


# Wraps two kernels so each writes one wrong value, then runs the bench's CPU mode.
_INJECT = textwrap.dedent("""
    import sys
    from overlap.kernels.triton import quant as tq, tp_gemm

    real_dequant, real_rs = tq.dequantize_into, tp_gemm.matmul_reduce_scatter

    def dequantize_into(q, s, out, **kw):
        real_dequant(q, s, out, **kw)
        out[7] += 1.0

    def matmul_reduce_scatter(*args, **kw):
        y = real_rs(*args, **kw)
        y[3, 5] += 1.0
        return y

    tq.dequantize_into, tp_gemm.matmul_reduce_scatter = dequantize_into, matmul_reduce_scatter
    from bench import bench_kernels
    sys.exit(bench_kernels.main(["--device", "cpu", "--quick", "--out", sys.argv[1]]))
""")


def test_a_wrong_output_fails_its_row_and_the_run(tmp_path):
    out = tmp_path / "kernels"
    res = _run(["-c", _INJECT, str(out)], tmp_path)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads((out.with_suffix(".json")).read_text())["rows"]
    assert {_key(r) for r in rows} == _expected_rows()
    wrong = {_key(r) for r in rows if r["correct"] is not True}
    assert wrong == {("int8 dequantize (triton)", None)} | {
        ("matmul_reduce_scatter (triton, world 1)", g) for g in GEMMS}
    for r in rows:
        if _key(r) in wrong:
            assert "round 0" in r["error"], r
    assert "differs from the reference at 1 of 65536 places, first [7]" in res.stderr
    assert "exceeds its error bound at 1 of" in res.stderr
