"""Kernels at one rank against ceilings measured in the same run.

    python -m bench.bench_kernels [--device cpu|cuda|auto] [--out PATH] [--quick]

Ceilings: a device copy (bytes read + written per second) and torch.matmul (cuBLAS on a GPU;
TFLOP/s = 2MNK / t). Rows: the fused Triton all_gather_matmul and matmul_reduce_scatter on a
one-rank workspace vs torch.matmul of the same bf16 shape, goal >= 0.85; the INT8 Triton
quantize, dequantize and dequant-reduce, and the torch casts and fp32 row sum of the BF16 path,
vs the copy, goal >= 0.7; the CUDA signal and poison kernels' launch cost vs a torch launch (GPU
only). ratio = ceiling_ms / median_ms, ceiling_ms being the ceiling's time for the row's work.
Every run gets fresh inputs from a pool made before timing and a poisoned output, checked after
the run against a reference; a wrong output marks its row and the exit status is 1. GPU: device
events, the stream held by a sleep kernel so host costs stay out. CPU: wall clock, small sizes,
Triton under TRITON_INTERPRET=1: the code paths run, the ratios mean nothing for speed.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from typing import Any, Callable

BLOCK = 128  # the INT8 block the collectives default to (quant.DEFAULT_BLOCK_SIZE)
COPY, GEMM_GOAL, BW_GOAL = "copy (ceiling)", ">= 0.85", ">= 0.7"
SLEEP_CYCLES = 2_000_000  # ~1 ms of GPU clock: the host enqueues the timed work meanwhile
COLUMNS = ["kernel", "shape", "dtype", "median_ms", "spread", "work", "unit", "achieved",
           "ceiling", "ceiling_ms", "ratio", "goal", "correct"]


@dataclasses.dataclass(kw_only=True, slots=True)
class BenchConfig:
    device: str = "auto"
    out: str = "bench/results/kernels"
    quick: bool = False  # one warm-up and 5 runs on GPU (default 2 and 10), 2 on CPU (1 and 3)


@dataclasses.dataclass(frozen=True)
class Sizes:
    elements: int                          # quant kernels and the copy
    sources: int                           # rows a dequant-reduce sums (one per rank)
    gemms: tuple[tuple[int, int, int], ...]  # (M, N, K): x [M, K], w [K, N]
    warmup: int
    runs: int
    launches: int                          # launches per timed batch (0: not on this device)


GPU = Sizes(1 << 28, 8, ((8192, 8192, 8192), (16384, 8192, 2048)), 2, 10, 500)
# The interpreter takes ~50 ms a Triton call: few runs keep the CPU run a few seconds.
CPU = Sizes(1 << 16, 8, ((64, 64, 64), (128, 64, 16)), 1, 3, 0)


@dataclasses.dataclass
class Case:
    """One row: ``run(inputs)`` is timed (its result goes to ``check``, which returns what is
    wrong or None); ``poison()`` runs before it, untimed."""

    kernel: str
    shape: str
    dtype: str
    work: float                            # bytes read + written, or flops, per run
    unit: str                              # "TB/s" | "TFLOP/s"
    ceiling: str                           # the kernel whose rate is this row's ceiling
    goal: str
    run: Callable[[Any], Any]
    poison: Callable[[], None]
    check: Callable[[Any, Any, dict], str | None]
    samples: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None


def _pick_device(kind: str) -> str:
    """cpu or cuda; exits with status 2 and one line for a device this machine lacks."""
    if kind not in ("cpu", "cuda", "auto"):
        print(f"bench_kernels: error: --device must be cpu, cuda or auto, got {kind!r}",
              file=sys.stderr)
        raise SystemExit(2)
    if kind == "cpu":
        return kind
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if kind == "cuda":
        print("bench_kernels: error: --device cuda, but torch sees no CUDA device here",
              file=sys.stderr)
        raise SystemExit(2)
    return "cpu"


# ---- timing ----------------------------------------------------------------------------------

def _timer(dev):
    import torch

    if dev.type != "cuda":
        def wall(fn):
            t0 = time.perf_counter()
            out = fn()
            return out, time.perf_counter() - t0
        return wall

    def events(fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(dev)
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return out, start.elapsed_time(end) / 1e3
    return events


def _measure(cases: list[Case], pool: list[Any], sizes: Sizes, timer) -> None:
    """Every round runs each case once on the round's pool entry (cases interleaved, so a slow
    stretch hits them alike) and checks its output; warm-up rounds are checked, not kept."""
    for i, inputs in enumerate(pool):
        memo: dict = {}  # references shared by the round's checks
        for c in cases:
            dt = None
            try:
                c.poison()
                out, dt = timer(lambda: c.run(inputs))
                wrong = c.check(inputs, out, memo)
            except Exception as exc:  # a failing kernel fails its row, not the bench
                wrong = _one_line(exc)
            if wrong is not None and c.error is None:
                c.error = f"round {i}: {wrong}"
            if i >= sizes.warmup and dt is not None:
                c.samples.append(dt)


def _one_line(exc: Exception) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _nan_block(shape, dtype, dev) -> Callable[[], None]:
    """Poison for an op that allocates its output: a NaN block of the same size, freed at once,
    which torch's caching allocator hands to the op's next allocation of that size."""
    import torch

    def poison():
        torch.empty(shape, dtype=dtype, device=dev).fill_(float("nan"))
    return poison


# ---- references ------------------------------------------------------------------------------

def _same(name: str, got, want) -> str | None:
    import torch

    if torch.equal(got, want):
        return None
    bad = (got != want).nonzero()
    return f"{name} differs from the reference at {bad.shape[0]} of {got.numel()} places, " \
           f"first {bad[0].tolist()}"


def _within(name: str, got, exact, bound) -> str | None:
    import torch

    err = (got.double() - exact).abs()
    over = ~(err <= bound)  # NaN (poison left in place) counts as over
    if not bool(over.any()):
        return None
    where = over.nonzero()[0].tolist()
    return (f"{name} exceeds its error bound at {int(over.sum())} of {got.numel()} places, "
            f"first {where}: error {err[tuple(where)].item():.3g} > bound "
            f"{bound[tuple(where)].item():.3g}")


def _gemm_reference(x, w, memo: dict):
    """(exact x @ w in fp64, the error bound of a bf16 GEMM with fp32 accumulation).

    bf16 products are exact in fp32 (8 + 8 significant bits); K of them summed in fp32 in any
    order (split-K, tensor-core trees) err by at most (K - 1) u sum_k |x_ik w_kj|, with u =
    2^-23 (not 2^-24: tensor cores may truncate the alignment bits instead of rounding);
    rounding the sum to bf16 adds 2^-8 |result| (8 significant bits, round to nearest). So
    |y - exact| <= 2^-8 |exact| + (1 + 2^-8) (K - 1) 2^-23 (|x| @ |w|); fp64's own error on
    exact is K 2^-53 of the same sum, far below."""
    if "gemm" not in memo:
        xd, wd = x.double(), w.double()
        exact = xd @ wd
        k = x.shape[1]
        bound = 2.0**-8 * exact.abs() + (1 + 2.0**-8) * (k - 1) * 2.0**-23 * (xd.abs() @ wd.abs())
        memo["gemm"] = exact, bound
    return memo["gemm"]


def _bf16_round_ref(x):
    """fp32 -> bf16 by integer arithmetic: round to nearest, ties to even (finite inputs)."""
    import torch

    bits = x.view(torch.int32).long() & 0xFFFFFFFF
    top = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return top.to(torch.int32).to(torch.int16).view(torch.bfloat16)


def _bf16_widen_ref(b):
    """bf16 -> fp32 by integer arithmetic: the 16 bits move to the top of the word."""
    import torch

    return ((b.view(torch.int16).to(torch.int32) & 0xFFFF) << 16).view(torch.float32)


# ---- cases -----------------------------------------------------------------------------------

def _bandwidth_cases(sizes: Sizes, dev, gen) -> tuple[list[Case], list[dict]]:
    """The copy ceiling and the INT8 / BF16 kernels of the quantized collectives on N elements.
    work counts what one pass must move: inputs read once, outputs written once."""
    import torch

    from overlap.comm.quant import kernels as qk
    from overlap.comm.quant.paths import _sum_rows_fp32  # the BF16 reduce, as the path runs it

    N, n = sizes.elements, sizes.sources
    row = N // n
    nan = float("nan")
    pool = []
    for _ in range(sizes.warmup + sizes.runs):
        x = torch.randn(N, generator=gen, device=dev)
        q = torch.randint(-127, 128, (N,), generator=gen, device=dev, dtype=torch.int8)
        s = torch.rand(N // BLOCK, generator=gen, device=dev) * 2.0**-6 + 2.0**-20
        b = torch.randn(N, generator=gen, device=dev).to(torch.bfloat16)
        pool.append(dict(x=x, q=q, s=s, b=b))

    copy_out = torch.empty(N, device=dev)
    q_out = torch.empty(1, N, dtype=torch.int8, device=dev)
    s_out = torch.empty(1, N // BLOCK, device=dev)
    f_out = torch.empty(N, device=dev)
    r_out = torch.empty(row, device=dev)
    b_out = torch.empty(N, dtype=torch.bfloat16, device=dev)

    def poison_quant():
        q_out.fill_(-128)  # never the code of a finite input
        s_out.fill_(nan)

    def check_quant(inp, _, memo):
        qr = torch.empty_like(q_out)
        sr = torch.empty_like(s_out)
        qk.quantize_into(inp["x"], qr, sr, block=BLOCK, impl="torch")
        return _same("codes", q_out, qr) or _same("scales", s_out, sr)

    def check_dequant(inp, _, memo):
        ref = torch.empty(N, device=dev)
        qk.dequantize_into(inp["q"].view(1, N), inp["s"].view(1, -1), ref, block=BLOCK,
                           impl="torch")
        return _same("values", f_out, ref)

    def check_reduce(inp, _, memo):
        ref = torch.empty(row, device=dev)
        qk.dequant_reduce_into(inp["q"].view(n, row), inp["s"].view(n, -1), block=BLOCK,
                               out=ref, impl="torch")
        return _same("sums", r_out, ref)

    def check_bf16_sum(inp, out, memo):
        rows = inp["b"].view(n, row).double()
        # n - 1 fp32 additions in row order, each rounding by at most 2^-24 of its result
        bound = (n - 1) * 2.0**-24 * rows.abs().sum(0)
        return _within("sums", out, rows.sum(0), bound)

    nb = N // BLOCK
    quant_shape = f"{N} elements"
    reduce_shape = f"{n} x {row} elements"
    cases = [
        Case(COPY, quant_shape, "fp32", 8 * N, "TB/s", COPY, "-",
             run=lambda inp: copy_out.copy_(inp["x"]), poison=lambda: copy_out.fill_(nan),
             check=lambda inp, _, m: _same("copy", copy_out, inp["x"])),
        Case("int8 quantize (triton)", quant_shape, "fp32 -> int8", 4 * N + N + 4 * nb, "TB/s",
             COPY, BW_GOAL,
             run=lambda inp: qk.quantize_into(inp["x"], q_out, s_out, block=BLOCK,
                                              impl="triton"),
             poison=poison_quant, check=check_quant),
        Case("int8 dequantize (triton)", quant_shape, "int8 -> fp32", N + 4 * nb + 4 * N, "TB/s",
             COPY, BW_GOAL,
             run=lambda inp: qk.dequantize_into(inp["q"].view(1, N), inp["s"].view(1, -1), f_out,
                                                block=BLOCK, impl="triton"),
             poison=lambda: f_out.fill_(nan), check=check_dequant),
        Case("int8 dequant-reduce (triton)", reduce_shape, "int8 -> fp32", N + 4 * nb + 4 * row,
             "TB/s", COPY, BW_GOAL,
             run=lambda inp: qk.dequant_reduce_into(inp["q"].view(n, row), inp["s"].view(n, -1),
                                                    block=BLOCK, out=r_out, impl="triton"),
             poison=lambda: r_out.fill_(nan), check=check_reduce),
        Case("bf16 quantize (torch cast)", quant_shape, "fp32 -> bf16", 4 * N + 2 * N, "TB/s",
             COPY, BW_GOAL,
             run=lambda inp: b_out.copy_(inp["x"]), poison=lambda: b_out.fill_(nan),
             check=lambda inp, _, m: _same("bf16", b_out.view(torch.int16),
                                           _bf16_round_ref(inp["x"]).view(torch.int16))),
        Case("bf16 dequantize (torch cast)", quant_shape, "bf16 -> fp32", 2 * N + 4 * N, "TB/s",
             COPY, BW_GOAL,
             run=lambda inp: f_out.copy_(inp["b"]), poison=lambda: f_out.fill_(nan),
             check=lambda inp, _, m: _same("fp32", f_out, _bf16_widen_ref(inp["b"]))),
        Case("bf16 dequant-reduce (torch sum)", reduce_shape, "bf16 -> fp32", 2 * N + 4 * row,
             "TB/s", COPY, BW_GOAL,
             run=lambda inp: _sum_rows_fp32(inp["b"].view(n, row), 1.0),
             poison=_nan_block((row,), torch.float32, dev), check=check_bf16_sum),
    ]
    return cases, pool


def _gemm_cases(shape, dev, gen, sizes: Sizes, ws_ag, ws_rs,
                phase: dict[str, int]) -> tuple[list[Case], list[dict]]:
    """torch.matmul (the ceiling) and the two fused GEMMs on x [M, K] @ w [K, N]; ``phase``:
    each workspace's last phase (it grows by one per call, across shapes)."""
    import torch

    from overlap.kernels.triton import tp_gemm

    M, N, K = shape
    bf16 = torch.bfloat16
    pool = [dict(x=torch.randn(M, K, generator=gen, device=dev).to(bf16),
                 w=(torch.randn(K, N, generator=gen, device=dev) / K**0.5).to(bf16))
            for _ in range(sizes.warmup + sizes.runs)]
    y = torch.empty(M, N, dtype=bf16, device=dev)

    def fused(op, ws, key):
        def run(inp):
            phase[key] += 1
            out = getattr(tp_gemm, op)(ws, inp["x"], inp["w"], phase=phase[key], sync=False)
            return out[0] if op == "all_gather_matmul" else out
        return run

    def check(name):
        def chk(inp, out, memo):
            tp_gemm.check_pending(ws_ag)
            tp_gemm.check_pending(ws_rs)
            exact, bound = _gemm_reference(inp["x"], inp["w"], memo)
            if tuple(out.shape) != (M, N):
                return f"{name} output shape {tuple(out.shape)}, want {(M, N)}"
            return _within(name, out, exact, bound)
        return chk

    label, flops = f"{M}x{N}x{K}", 2.0 * M * N * K
    ceiling = f"torch.matmul {label} (ceiling)"
    return [
        Case(ceiling, label, "bf16", flops, "TFLOP/s", ceiling, "-",
             run=lambda inp: torch.matmul(inp["x"], inp["w"], out=y),
             poison=lambda: y.fill_(float("nan")), check=check("torch.matmul")),
        Case("all_gather_matmul (triton, world 1)", label, "bf16", flops, "TFLOP/s", ceiling,
             GEMM_GOAL, run=fused("all_gather_matmul", ws_ag, "ag"),
             poison=_nan_block((M, N), bf16, dev), check=check("all_gather_matmul")),
        Case("matmul_reduce_scatter (triton, world 1)", label, "bf16", flops, "TFLOP/s", ceiling,
             GEMM_GOAL, run=fused("matmul_reduce_scatter", ws_rs, "rs"),
             poison=_nan_block((M, N), bf16, dev), check=check("matmul_reduce_scatter")),
    ], pool


def _launch_rows(sizes: Sizes, dev, ws) -> list[dict]:
    """Microseconds per launch of the CUDA signal and poison kernels through the workspace (what
    the ops call), back to back, vs a one-element torch fill_: host wall clock over a batch
    with a device sync at both ends (launches are host-bound; the clock covers the device)."""
    import torch

    B = sizes.launches
    flag = torch.zeros(1, dtype=torch.int64, device=dev)
    out = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
    counter = {"v": 0}

    def batch_fill():
        base = counter["v"]
        for j in range(B):
            flag.fill_(base + j)
        counter["v"] = base + B
        return base + B - 1

    def batch_set():
        base = counter["v"]
        for j in range(B):
            ws.signal(0, 0, base + j)
        counter["v"] = base + B
        return base + B - 1

    def batch_wait():
        for _ in range(B):
            ws.wait(0, 1)  # already reached: the kernel's fast path
        return None

    def batch_poison():
        for _ in range(B):
            ws.poison_if_error(out)
        return None

    def check_fill(last):
        return None if int(flag.item()) == last else f"flag {int(flag.item())}, want {last}"

    def check_set(last):
        ws.wait(0, last, timeout=5.0, blocking=True)  # raises if the flag never got there
        return None

    def check_clean(_):
        ws.check_errors()
        return None

    pattern = {}

    def poison_out():
        pattern["p"] = torch.randint(0, 255, out.shape, dtype=torch.uint8, device=dev)
        out.copy_(pattern["p"])

    def check_poison(_):
        ws.check_errors()
        return None if torch.equal(out, pattern["p"]) else "an error-free poison changed the output"

    ceiling = "torch fill_ launch (ceiling)"
    kinds = [(ceiling, batch_fill, check_fill, lambda: None),
             ("overlap_signal_set launch", batch_set, check_set, lambda: None),
             ("overlap_signal_wait launch (reached)", batch_wait, check_clean, lambda: None),
             ("overlap_poison_if_error launch (no error)", batch_poison, check_poison, poison_out)]
    samples = {k[0]: [] for k in kinds}
    errors: dict[str, str] = {}
    for i in range(sizes.warmup + sizes.runs):
        for name, fn, chk, poison in kinds:
            try:
                poison()
                torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                res = fn()
                torch.cuda.synchronize(dev)
                dt = (time.perf_counter() - t0) / B
                wrong = chk(res)
            except Exception as exc:  # a failing launch fails its row, not the bench
                dt, wrong = None, _one_line(exc)
            if wrong is not None:
                errors.setdefault(name, f"round {i}: {wrong}")
            if i >= sizes.warmup and dt is not None:
                samples[name].append(dt)
    ceil_s = _median(samples[ceiling])
    rows = []
    for name, *_ in kinds:
        t = _median(samples[name])
        rows.append(_row(name, f"{B} launches", "-", samples[name], 1.0, "us/launch", 1e6 * t,
                         1e6 * ceil_s, ceil_s, "-", errors.get(name)))
    return rows


def _median(samples: list[float]) -> float:
    return statistics.median(samples) if samples else float("nan")


def _row(kernel, shape, dtype, samples, work, unit, achieved, ceiling, ceiling_s, goal,
         error) -> dict:
    t = _median(samples)
    spread = (max(samples) - min(samples)) / t if samples and t > 0 else float("nan")
    return dict(kernel=kernel, shape=shape, dtype=dtype, median_ms=1e3 * t, spread=spread,
                work=work, unit=unit, achieved=achieved, ceiling=ceiling,
                ceiling_ms=1e3 * ceiling_s, ratio=ceiling_s / t if t > 0 else float("nan"),
                goal=goal, correct=error is None, **({} if error is None else {"error": error}))


def _case_rows(cases: list[Case]) -> list[dict]:
    scale = {"TB/s": 1e12, "TFLOP/s": 1e12}
    rate = {c.kernel: c.work / _median(c.samples) for c in cases}
    rows = []
    for c in cases:
        ceil_rate = rate[c.ceiling]
        rows.append(_row(c.kernel, c.shape, c.dtype, c.samples, c.work, c.unit,
                         rate[c.kernel] / scale[c.unit], ceil_rate / scale[c.unit],
                         c.work / ceil_rate, c.goal, c.error))
    return rows


# ---- main ------------------------------------------------------------------------------------

def run(cfg: BenchConfig) -> tuple[Any, bool]:
    """Measure every row; returns (table, whether every output check passed)."""
    import torch
    import torch.distributed as dist

    from bench.runner import Table
    from overlap.kernels.triton import tp_gemm
    from overlap.symm.workspace import create_workspace

    device = _pick_device(cfg.device)
    sizes = GPU if device == "cuda" else CPU
    if cfg.quick:
        sizes = dataclasses.replace(sizes, warmup=1, runs=5 if device == "cuda" else 2)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else \
        torch.device("cpu")
    gen = torch.Generator(device=dev).manual_seed(20261129)
    timer = _timer(dev)
    bf16 = torch.bfloat16

    notes = [
        f"One rank, {'GPU' if device == 'cuda' else 'CPU'}; median of {sizes.runs} runs after "
        f"{sizes.warmup} warm-up; every run on fresh random inputs (a pool made before timing), "
        "its output poisoned before and checked after.",
        "ratio = ceiling_ms / median_ms, ceiling_ms = this row's work at the ceiling's rate: "
        "achieved / ceiling for TB/s and TFLOP/s; ceiling us / ours for launches.",
        "work: bytes one pass must read + write (TB/s rows), 2MNK (TFLOP/s rows). The BF16 "
        "dequant-reduce is n - 1 torch adds over the rows; its work counts one pass.",
        "Checks: INT8 kernels equal impl='torch' byte for byte; BF16 casts equal integer "
        "round-to-nearest-even; sums and GEMMs within their fp32/bf16 error bounds against fp64.",
    ]
    if device == "cuda":
        notes.append("Device events around each call; a sleep kernel holds the stream while the "
                     "host enqueues it, so host launch costs stay out of kernel rows. Launch rows: "
                     "host wall clock per launch over a batch, device synced at both ends.")
    else:
        notes.append("CPU: wall clock; Triton kernels under TRITON_INTERPRET=1 and torch on the "
                     "host: the code paths and checks run, but the ratios mean nothing for speed. "
                     "Launch rows skipped: the signal/poison kernels are CUDA-only (NVRTC).")

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1)
    rows = []
    try:
        cases, pool = _bandwidth_cases(sizes, dev, gen)
        _measure(cases, pool, sizes, timer)
        rows += _case_rows(cases)
        del cases, pool

        ag_bytes = max(tp_gemm.all_gather_matmul_workspace_bytes(m, k, 1, bf16)
                       for m, n, k in sizes.gemms)
        rs_bytes = max(tp_gemm.matmul_reduce_scatter_workspace_bytes(m, n, 1, bf16)
                       for m, n, k in sizes.gemms)
        group = dist.group.WORLD
        with create_workspace(group, ag_bytes, num_signals=tp_gemm.all_gather_matmul_num_signals(1),
                              device=dev, timeout=60) as ws_ag, \
                create_workspace(group, rs_bytes,
                                 num_signals=tp_gemm.matmul_reduce_scatter_num_signals(1),
                                 device=dev, timeout=60) as ws_rs:
            phase = {"ag": 0, "rs": 0}
            for shape in sizes.gemms:
                cases, pool = _gemm_cases(shape, dev, gen, sizes, ws_ag, ws_rs, phase)
                _measure(cases, pool, sizes, timer)
                rows += _case_rows(cases)
                del cases, pool
            if device == "cuda":
                rows += _launches_or_skip(sizes, dev, group)
    finally:
        if own_group:
            dist.destroy_process_group()

    table = Table("Kernels at one rank vs the copy and torch.matmul ceilings", COLUMNS,
                  notes=notes)
    for r in rows:
        table.add(**r)
    return table, all(r["correct"] for r in rows if r["correct"] != "skipped")


def _launches_or_skip(sizes: Sizes, dev, group) -> list[dict]:
    from overlap.symm.workspace import create_workspace

    try:
        import cupy  # noqa: F401  (overlap.kernels.cuda compiles the kernels through it)
    except ImportError:
        return [dict(kernel="signal/poison launches", shape="-", dtype="-", median_ms="-",
                     spread="-", work="-", unit="us/launch", achieved="-", ceiling="-",
                     ceiling_ms="-", ratio="-", goal="-", correct="skipped",
                     error="skipped: cupy is not installed (pip install 'overlap[cuda]')")]
    with create_workspace(group, 4096, num_signals=4, device=dev, timeout=60) as ws:
        return _launch_rows(sizes, dev, ws)


def main(argv: list[str] | None = None) -> int:
    from bench.runner import parse_config

    cfg = parse_config(BenchConfig, __doc__.splitlines()[0], argv)
    if cfg.device == "cpu":
        # Triton fixes interpreter vs compiler when it is first imported (overlap.kernels.triton)
        os.environ["TRITON_INTERPRET"] = "1"
    t0 = time.perf_counter()
    table, ok = run(cfg)
    table.notes.append(f"Whole run {time.perf_counter() - t0:.1f} s.")
    table.publish(cfg.out)
    for r in table.rows:
        if r["correct"] is not True:
            print(f"bench_kernels: {r['kernel']} {r['shape']}: {r.get('error')}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
