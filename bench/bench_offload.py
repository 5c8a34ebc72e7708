"""Activation offloading vs recomputation on one process: step time, device-resident activation
bytes and the hidden fraction of the copies, for none / selective / full recompute / offload
(every block, and all but the last) / offload + selective, in one run.

    python -m bench.bench_offload                        # CPU: the stream twin's copy threads
    python -m bench.bench_offload --stream-delay-ms 2    # + the offload rows on a slow link
    python -m bench.bench_offload --device cuda --d-model 2048 --n-head 16 --seq-len 2048 \\
        --n-layer 8 --out bench/results/offload_gpu        # one GPU: CUDA streams, pinned pool

A step is a pipeline stage's warm-up and cool-down: the forwards of ``micro_batches``
micro-batches, then their backwards (oldest first), so that many micro-batches' saved tensors
are held at once. The configurations train copies of one model and take turns step by step.
Writes bench/results/offload.json and offload.md (``--out``); the columns: the table's notes.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import statistics
import tempfile
import time

import torch

from bench.runner import TRACE_COLUMN, Table, Timing, command_line, parse_config

MB = 2**20
# name: (recompute mode, blocks kept on the device: "all" offloads nothing, "last" keeps one)
CONFIGS = {"none": ("none", "all"), "selective": ("selective", "all"),
           "full": ("full", "all"), "offload": ("none", 0),
           "offload, last kept": ("none", "last"), "offload + selective": ("selective", 0)}
COPY_RANGES = ("offload.d2h.comm", "offload.h2d.comm")


@dataclasses.dataclass(kw_only=True, slots=True)
class BenchConfig:
    micro_batches: int = 4
    micro_batch_size: int = 1
    seq_len: int = 128
    d_model: int = 256
    n_layer: int = 6
    n_head: int = 8
    vocab_size: int = 256
    dropout: float = 0.1
    dtype: str = "bf16"
    warmup: int = 1
    rounds: int = 15
    traced_steps: int = 3
    stream_delay_ms: float = 0.0
    device: str = "cpu"
    profile: str = ""  # keep the traced steps' traces: DIR/<config>/step<n>/trace_rank0.json
    out: str = "bench/results/offload"


@dataclasses.dataclass(slots=True)
class _Variant:
    name: str
    recompute: str
    kept: int
    model: torch.nn.Module
    off: object  # ActivationOffloader
    delay_ms: float = 0.0  # its streams' injected delay per copy (OVERLAP_STREAM_DELAY_MS)
    samples: list[float] = dataclasses.field(default_factory=list)
    held: list[int] = dataclasses.field(default_factory=list)
    exposed: list[float] = dataclasses.field(default_factory=list)  # per timed step
    resident: int = 0
    stats: dict = dataclasses.field(default_factory=dict)
    grads: list[torch.Tensor] = dataclasses.field(default_factory=list)
    traced: dict = dataclasses.field(default_factory=dict)


def _variants(cfg: BenchConfig, device: torch.device, dtype: torch.dtype) -> list[_Variant]:
    """Every config on a copy of one model; with a stream delay, the offloading configs again
    on streams built with ``OVERLAP_STREAM_DELAY_MS`` set (read when a stream is built)."""
    from overlap.memory import ActivationOffloader
    from overlap.models.gpt import GPT, GPTConfig
    from overlap.train.activations import as_on_gpu
    from overlap.train.recompute import apply_recompute

    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, d_model=cfg.d_model,
                         n_layer=cfg.n_layer, n_head=cfg.n_head, dropout=cfg.dropout)
               ).to(device=device, dtype=dtype)
    runs = [(name, mode, keep, 0.0) for name, (mode, keep) in CONFIGS.items()]
    if cfg.stream_delay_ms > 0:
        runs += [(f"{name}, {cfg.stream_delay_ms:g} ms delay", mode, keep, cfg.stream_delay_ms)
                 for name, (mode, keep) in CONFIGS.items() if keep != "all"]
    out = []
    before = os.environ.get("OVERLAP_STREAM_DELAY_MS")
    try:
        for name, mode, keep, delay in runs:
            kept = {"all": cfg.n_layer, "last": 1}.get(keep, keep)
            model = copy.deepcopy(base)
            as_on_gpu(model)  # save what the GPU kernels (and the formulas) save
            apply_recompute(model, mode)
            os.environ["OVERLAP_STREAM_DELAY_MS"] = f"{delay:g}"
            # every config runs under an offloader, so one census measures them all; with
            # every block kept it offloads nothing
            off = ActivationOffloader(device, census=True, timeout=600)
            off.wrap(list(model.blocks), keep_last=kept)
            out.append(_Variant(name, mode, kept, model, off, delay))
    finally:
        if before is None:
            os.environ.pop("OVERLAP_STREAM_DELAY_MS", None)
        else:
            os.environ["OVERLAP_STREAM_DELAY_MS"] = before
    return out


def _step(v: _Variant, batches, sync, probe=None, keep_grads=False) -> tuple[float, float]:
    """One step (forwards, then backwards; ``sync`` waits for the device at the end); returns
    its seconds and the seconds the training thread waited for reloads. ``probe(v)`` runs
    between forwards and backwards, without a device sync (copies in flight stay so), off the
    clock on CPU, where the host is the device (on CUDA the host runs ahead anyway).
    ``keep_grads``: keep a copy of the gradients in ``v.grads``."""
    from overlap.models.gpt import gpt_loss
    from overlap.profile.timers import exposed_seconds, reset_exposed

    reset_exposed()
    t0 = time.perf_counter()
    losses = [gpt_loss(v.model(x).float(), y) for x, y in batches]
    t1 = time.perf_counter()
    if probe is not None:
        probe(v)
    off_clock = time.perf_counter() - t1 if v.off.device.type == "cpu" else 0.0
    for loss in losses:
        loss.backward()
    del losses, loss
    sync()
    seconds = time.perf_counter() - t0 - off_clock
    if keep_grads:
        v.grads = [p.grad.clone() for p in v.model.parameters()]
    v.model.zero_grad(set_to_none=True)
    return seconds, exposed_seconds("offload")


def _drained(v: _Variant) -> None:
    v.off.d2h.synchronize()  # the measurement's host wait: every copy to host has run
    v.resident = v.off.resident_saved_bytes()


def _formula_bytes(cfg: BenchConfig, mode: str, itemsize: int) -> float:
    """Bytes one block saves for one micro-batch (``expected_bytes``, as_on_gpu's kernels)."""
    from overlap.train.activations import LayerShape, expected_bytes

    shape = LayerShape(s=cfg.seq_len, b=cfg.micro_batch_size, h=cfg.d_model, a=cfg.n_head)
    return sum(expected_bytes(shape, mode, itemsize=itemsize,
                              dropout=cfg.dropout > 0).values())


def _trace(v: _Variant, n: int, batches, sync, where: str) -> None:
    """Step ``n`` of ``v`` under torch.profiler (every thread: the twin's copies run on the
    streams' workers), added to ``v.traced``: the copy time from the ``offload.*.comm``
    ranges (CUDA: the memcpy rows), the wait from ``exposed_seconds("offload")``, and the
    hidden and communication time the analyzer sees."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    from overlap.profile import nvtx

    cuda = v.off.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=acts,
                   experimental_config=_ExperimentalConfig(profile_all_threads=True))
    sync()
    prof.start()
    with nvtx.step(n):
        exposed = _step(v, batches, sync)[1]
    prof.stop()
    path = os.path.join(where, _slug(v.name), f"step{n}")  # one trace per overlap-analyze run
    os.makedirs(path, exist_ok=True)
    trace = os.path.join(path, "trace_rank0.json")
    prof.export_chrome_trace(trace)
    got = dict(zip(("copy_s", "hidden_s", "comm_s"), _copies(trace, cuda)), exposed_s=exposed,
               steps=1)
    v.traced = {k: v.traced.get(k, 0) + x for k, x in got.items()}


def _copies(trace: str, cuda: bool) -> tuple[float, float, float]:
    """Seconds of copies in a trace, and of communication hidden under compute and in all.
    CPU: the copy ranges, and overlap-analyze's hidden and comm time in the step window
    (comm: the copy ranges on the streams' threads and the reload waits); CUDA: the DtoH/HtoD
    memcpy rows, hidden under kernels (the analyzer counts no host-device copy as comm)."""
    from overlap.profile.kineto import load_json

    events = [e for e in load_json(trace)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    if not cuda:
        from overlap.profile.analyze import AnalyzeConfig, analyze

        copy_s = 1e-6 * sum(e["dur"] for e in events if e.get("name") in COPY_RANGES)
        steps = [s for s in analyze(trace, AnalyzeConfig(progress="off"))["ranks"][0]["steps"]
                 if s["step"] is not None]
        return copy_s, sum(s["hidden_s"] for s in steps), sum(s["comm_s"] for s in steps)
    from overlap.profile.spans import intersect, length, merge

    def rows(pred) -> list[tuple[float, float]]:
        return merge((e["ts"], e["ts"] + e["dur"]) for e in events if pred(e))

    copies = rows(lambda e: e.get("cat") == "gpu_memcpy"
                  and str(e.get("name", "")).startswith(("Memcpy DtoH", "Memcpy HtoD")))
    kernels = rows(lambda e: e.get("cat") == "kernel")
    total = 1e-6 * length(copies)
    return total, 1e-6 * length(intersect(copies, kernels)), total


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text).strip("_")


def _run(cfg: BenchConfig) -> tuple[list[_Variant], dict]:
    from overlap.models.gpt import gpt_loss
    from overlap.memory.offload import OffloadStats
    from overlap.train.activations import saved_bytes

    device = torch.device(cfg.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[cfg.dtype]
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (cfg.micro_batches, cfg.micro_batch_size,
                                            cfg.seq_len + 1), generator=gen).to(device)
    batches = [(x[:, :-1], x[:, 1:]) for x in ids]
    variants = _variants(cfg, device, dtype)
    try:
        # the embedding, head and loss save the same in every config (the blocks' own hooks
        # hide their saves from this outer count)
        x, y = batches[0]
        other, loss = saved_bytes(lambda: gpt_loss(variants[0].model(x).float(), y),
                                  exclude=list(variants[0].model.parameters()))
        loss.backward()
        variants[0].model.zero_grad(set_to_none=True)
        for v in variants:
            for _ in range(cfg.warmup):
                _step(v, batches, sync)
            v.off.stats = OffloadStats()  # one step's counters
            torch.manual_seed(1)  # the same dropout masks in every config
            _step(v, batches, sync, probe=_drained, keep_grads=True)
            v.stats = v.off.stats.as_dict()
            if v.stats["reloaded_bytes"] != v.stats["offloaded_bytes"]:
                raise RuntimeError(f"bench_offload: {v.name}: a step offloaded "
                                   f"{v.stats['offloaded_bytes']} bytes but reloaded "
                                   f"{v.stats['reloaded_bytes']}")
        for r in range(cfg.rounds):
            # rotate the order so no config always runs right after the same neighbour
            for v in variants[r % len(variants):] + variants[:r % len(variants)]:
                t, exposed = _step(v, batches, sync,
                                   probe=lambda v: v.held.append(v.off.resident_saved_bytes()))
                v.samples.append(t)
                v.exposed.append(exposed)
        with tempfile.TemporaryDirectory() as tmp:
            for n in range(cfg.traced_steps):  # the configs take turns here too
                for v in variants:
                    if v.kept < cfg.n_layer:
                        _trace(v, n, batches, sync, cfg.profile or tmp)
    finally:
        for v in variants:
            v.off.close()
    return variants, dict(other=other, itemsize=torch.finfo(dtype).bits // 8, device=device)


def main(cfg: BenchConfig) -> None:
    if cfg.dtype not in ("bf16", "fp32"):
        raise SystemExit(f"bench_offload: --dtype must be bf16 or fp32, got {cfg.dtype}")
    if cfg.traced_steps < 1 or cfg.rounds < 1:
        raise SystemExit("bench_offload: --traced-steps and --rounds must be >= 1")
    if cfg.stream_delay_ms < 0 or (cfg.stream_delay_ms > 0 and cfg.device != "cpu"):
        raise SystemExit("bench_offload: --stream-delay-ms must be >= 0, and is the CPU twin's "
                         f"(a slow link), got {cfg.stream_delay_ms:g} on {cfg.device}")
    load0, wall0 = os.getloadavg()[0], time.perf_counter()
    variants, info = _run(cfg)
    wall = time.perf_counter() - wall0
    cuda = info["device"].type == "cuda"
    base = next(v for v in variants if v.name == "none")
    base_t = Timing(base.samples).median
    table = Table("Activation offloading vs recomputation: step time and device-resident "
                  "activations", [
                      "config", "kept", "step_ms", "spread", "vs_none", "held_MB",
                      "resident_MB", "formula_MB", "vs_none_resident", "reload_peak_MB",
                      "to_host_MB", "copy_ms", "exposed_ms", "hidden%", TRACE_COLUMN,
                      "same_grads"])
    # an offloading config against the same recompute mode without offload
    ref = {v.recompute: v for v in variants if v.kept == cfg.n_layer}
    for v in variants:
        t = Timing(v.samples)
        formula = _formula_bytes(cfg, v.recompute, info["itemsize"]) * cfg.micro_batches
        tr = {k: x / v.traced["steps"] for k, x in v.traced.items()} if v.traced else {}
        # the injected delays are link time too; they lie outside the copy ranges, so add
        # their expectation (D/2 per copy)
        copy_s = tr["copy_s"] + v.delay_ms / 2e3 * (v.stats["offloaded"] + v.stats["reloaded"]) \
            if tr else 0.0
        exposed_ms = 1e3 * statistics.median(v.exposed)
        hidden = "-"
        if copy_s > 0 and not cuda:
            hidden = 100.0 * (1 - tr["exposed_s"] / copy_s)
        trace_hidden = 100.0 * tr["hidden_s"] / tr["comm_s"] if tr.get("comm_s") else "-"
        table.add(config=v.name, kept=f"{v.kept}/{cfg.n_layer}", step_ms=t.median_ms,
                  spread=t.spread, vs_none=t.median / base_t,
                  held_MB=statistics.median(v.held) / MB, resident_MB=v.resident / MB,
                  formula_MB=formula * v.kept / MB, vs_none_resident=v.resident / base.resident,
                  reload_peak_MB=v.stats["peak_resident_bytes"] / MB,
                  to_host_MB=v.stats["offloaded_bytes"] / MB, copy_ms=1e3 * copy_s,
                  exposed_ms=exposed_ms, **{
                      "hidden%": hidden,
                      TRACE_COLUMN: trace_hidden},
                  same_grads="-" if v.kept == cfg.n_layer else all(
                      torch.equal(a, b) for a, b in zip(v.grads, ref[v.recompute].grads)))
    load = f"1-min load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after"
    table.notes = [
        f"GPT d_model={cfg.d_model} n_layer={cfg.n_layer} n_head={cfg.n_head} "
        f"vocab={cfg.vocab_size} seq_len={cfg.seq_len}, {cfg.micro_batches} micro-batches of "
        f"{cfg.micro_batch_size} per step (all forwards, then the backwards: a pipeline "
        f"stage's warm-up and cool-down), dropout {cfg.dropout}, {cfg.dtype}, the GPU "
        f"kernels' saves (as_on_gpu); on {cfg.device}, {torch.get_num_threads()} torch "
        f"threads, {os.cpu_count()} cores; "
        f"median of {cfg.rounds} steps per config (configs taking turns) after "
        f"{cfg.warmup} warm-up; {load}; whole run {wall:.0f} s.",
        "step_ms: forwards + backwards (no optimizer step); vs_none: median / none's median, "
        "same run. Bytes are the blocks' saved tensors, measured by the offloader's census "
        "(every config runs under one; kept = blocks that keep theirs on the device): "
        "held_MB after the forwards as the step sees it (copies to host still in flight, "
        "median over the timed steps), resident_MB at the same point once the copies to "
        "host have drained (one extra step), formula_MB = expected_bytes (overlap.train."
        "activations) x micro-batches x kept blocks, vs_none_resident = resident / none's. "
        f"The embedding, head and loss save {info['other'] / MB:.2f} MB per micro-batch in "
        "every config, not counted.",
        "reload_peak_MB: reloads held on the device at once in the backward (the in-flight "
        "prefetch, one layer ahead); to_host_MB: bytes copied to host per step (and back). "
        "copy_ms: time inside the offload.d2h/h2d.comm ranges per step, exposed_ms: the "
        "training thread's wait for reloads (exposed_seconds('offload'), median of the timed "
        f"steps); hidden% = 1 - exposed / copy over {cfg.traced_steps} traced steps per "
        "config (torch.profiler, every thread; after the timed steps, configs taking turns); "
        f"{TRACE_COLUMN}: overlap-analyze's hidden / comm over the same steps (comm: the "
        "copy ranges and the reload waits; hidden: under the training thread's compute). "
        "same_grads: the measured step's "
        "gradients equal, bit for bit, those of the same recompute mode without offload.",
        "On CPU \"device\" and \"host\" are the same memory and the copies are memcpy on the "
        "stream twin's worker threads: offloading frees no real memory here, and its step "
        "time cost is the copy work competing for the same 2 cores, the twin's poison fill "
        "of every reload buffer (NaN, on the training thread; torch.empty on CUDA) and the "
        "hooks' Python work per copied storage (host work a GPU run pays too, ahead of the "
        "device). No GPU speed is claimed; "
        f"on CUDA copy_ms and {TRACE_COLUMN} come from the DtoH/HtoD memcpy rows (hidden: "
        "under kernels), hidden% is '-' (the reload wait is device-side), and held_MB "
        "misses the sources of copies in flight (kept by record_stream, not by Python)."
        + ("" if not cfg.stream_delay_ms else
           f" Rows '..., {cfg.stream_delay_ms:g} ms delay': the same configs on streams that "
           f"start every copy 0..{cfg.stream_delay_ms:g} ms late (OVERLAP_STREAM_DELAY_MS, the"
           " CPU twin's slow link); their copy_ms adds the delays' expectation (copies x "
           f"{cfg.stream_delay_ms / 2:g} ms), which the trace has no range for, so "
           f"{TRACE_COLUMN} does not see them."),
        "Command: " + command_line("bench.bench_offload", cfg),
        "GPU (one GPU): python -m bench.bench_offload --device cuda --d-model 2048 --n-head 16 "
        "--seq-len 2048 --n-layer 8 --out bench/results/offload_gpu",
    ]
    table.publish(cfg.out)


if __name__ == "__main__":
    main(parse_config(BenchConfig, __doc__.splitlines()[0]))
