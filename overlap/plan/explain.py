"""``overlap-plan --explain``: the formulas behind an estimate, with the numbers substituted,
so the arithmetic can be checked by hand the way the seeds do it."""

from __future__ import annotations

from overlap.plan.bubble import live_pairs, peak_live
from overlap.plan.comm import axis_placement, bus_bandwidth, collective_time, p2p_time
from overlap.plan.compute import LayerContext, _gemms, ep_exchange_efficiency, gemm_time
from overlap.plan.cp import cp_blocks, cp_bytes, ulysses_repeat
from overlap.plan.estimate import GIB, Estimate
from overlap.plan.layout import WIRE_BYTES
from overlap.plan.memory import layer_activation_bytes, rank_params
from overlap.plan.offload import layer_offload_bytes

__all__ = ["explain"]


def _g(x: float) -> str:
    """Compact number: 1.23e9 -> '1.23e9', 2048 -> '2048'."""
    if x == int(x) and abs(x) < 1e7:
        return str(int(x))
    return f"{x:.4g}"


def explain(e: Estimate) -> str:
    m, c, lay, dev = e.model, e.cluster, e.layout, e.cluster.device
    t, pp, cp, dp, b = lay.tp, lay.pp, lay.cp, e.dp, lay.micro_batch
    h, a, s = m.hidden, m.num_heads, m.seq_len
    mem = e.peak_memory
    r = mem.rank
    out = [f"# {m.name} on {c.num_gpus} x {dev.name}: tp={t} pp={pp} cp={cp} dp={dp} "
           f"(gpus / (tp*pp*cp) = {c.num_gpus}/{t * pp * cp}), micro-batch {b}, "
           f"m = B/(dp*b) = {lay.global_batch}/({dp}*{b}) = {e.num_microbatches}"]

    # -- memory
    sharded, repl = m.layer_params()
    layers = lay.chunk_layers(m)
    n = sum(layers[ch] for ch in lay.rank_chunks(r))
    p_gpu = rank_params(m, lay, r)
    out += ["", f"## memory per GPU on pp rank {r} (the fullest)",
            f"layer parameters: sharded {_g(sharded)} (= {'12h^2+13h' if m.bias and not m.gated_mlp and m.kv_heads == a and m.ffn_dim == 4 * h else 'qkv+out+mlp'}"
            f"), replicated {_g(repl)} (norms, row biases)",
            f"P = {n} layers x ({_g(sharded)}/{t} + {_g(repl)}) + embedding/head share "
            f"= {p_gpu:.4g} parameters ({p_gpu * 2 / 1e9:.3f} GB in bf16)",
            f"weights   = {lay.dtype_bytes} B x P{' / (dp*cp) + 2 gathered layers' if lay.zero >= 3 else ''}"
            f" = {mem.weights / 1e9:.3f} GB = {mem.weights / GIB:.3f} GiB",
            f"grads     = {4 if lay.fp32_main_grads else 2} B x P (fp32 main grads)"
            f"{' / (dp*cp)' if lay.zero >= 2 else ''} = {mem.grads / 1e9:.3f} GB",
            f"optimizer = 12 B x P (fp32 master + Adam m, v){' / (dp*cp) = 12 x P / ' + str(dp * cp) if lay.zero >= 1 else ''}"
            f" = {mem.optimizer / 1e9:.3f} GB"]
    per_layer = layer_activation_bytes(m, lay)
    peaks = peak_live(lay.schedule, pp, e.num_microbatches, lay.num_virtual)
    if lay.recompute == "full":
        form = f"2sbh{'/t' if lay.sequence_parallel else ''}"
    elif lay.sequence_parallel:
        form = "sbh(34 + 5as/h)/t" if lay.recompute == "none" and not lay.flash_attention \
            else "34 sbh/t"
    else:
        form = "sbh(10 + 24/t + 5as/(ht))" if lay.recompute == "none" and \
            not lay.flash_attention else "sbh(10 + 24/t)"
    out += [f"activations per layer and micro-batch (Korthikanti et al. 2022, "
            f"recompute={lay.recompute}, {'SP' if lay.sequence_parallel else 'no SP'}): "
            f"{form} with s={s // cp} b={b} h={h} a={a} t={t} -> {per_layer / 2**20:.1f} MiB"
            f"{' (GPT form; this model derives its own terms)' if m.gated_mlp or m.kv_heads != a else ''}",
            f"live (stage, micro-batch) pairs on pp rank {r} from the {lay.schedule} schedule: "
            f"{peaks[r]}; layers per chunk {max(layers[ch] for ch in lay.rank_chunks(r))}"
            + (f"; interleaving penalty 1 + (p-1)/(p v) = "
               f"{1 + (pp - 1) / (pp * lay.num_virtual):.3f}" if lay.num_virtual > 1 else ""),
            f"activations = {peaks[r]} x {max(layers[ch] for ch in lay.rank_chunks(r))} x "
            f"{per_layer / 2**20:.1f} MiB (+ embedding/output extras) = "
            f"{mem.activations / GIB:.2f} GiB",
            f"total = {mem.total / GIB:.2f} GiB of {dev.hbm_bytes / GIB:.1f} GiB"]

    # -- compute
    gm = _gemms(m, lay)
    out += ["", "## compute per layer and micro-batch, one GPU",
            f"peak {dev.peak_flops / 1e12:.0f} TFLOP/s; GEMM efficiency "
            f"e_max * prod(d/(d + d_half)) with e_max={dev.gemm.e_max:.3f}, "
            f"d_half={dev.gemm.d_half:.3g}"]
    out += _sources(dev, "peak_flops", "gemm", "gemm.overhead_s", "attention", "attention_bwd")
    for name, g in gm.items():
        eff = dev.gemm.efficiency(g.m, g.n, g.k)
        out.append(f"  {name:6} (M,N,K)=({_g(g.m)},{_g(g.n)},{_g(g.k)})"
                   f"{' x' + _g(g.batch) if g.batch > 1 else ''}: {g.flops / 1e9:.2f} GFLOP "
                   f"at {100 * eff:.1f}% -> {gemm_time(dev, g, lay.dtype_bytes) * 1e3:.3f} ms")
    st = e.stage_costs[min(1, len(e.stage_costs) - 1)]
    out.append(f"stage {min(1, len(e.stage_costs) - 1)}: F = {st.F * 1e3:.2f} ms, "
               f"B = {st.B * 1e3:.2f} ms per micro-batch (incl. exposed TP/P2P); first stage "
               f"F = {e.stage_costs[0].F * 1e3:.2f}, last F = {e.stage_costs[-1].F * 1e3:.2f} ms")

    # -- communication
    kw = dict(tp=t, cp=cp, pp=pp, dp=dp)
    tp_place = axis_placement(c, "tp", **kw)
    act = lay.dtype_bytes * b * s / cp * h
    out += ["", "## communication (alpha-beta, ring/tree)"]
    if t > 1:
        kind = "all_gather" if lay.sequence_parallel else "all_reduce"
        ct = collective_time(kind, act, tp_place, dev, tp=True)[0]
        bw = bus_bandwidth(dev, tp_place, tp=True)
        factor = f"({t}-1)/{t}" if kind == "all_gather" else f"2({t}-1)/{t}"
        out += [f"TP {kind}: T*h*{lay.dtype_bytes} = {act / 2**20:.1f} MiB; {factor} x bytes / "
                f"{bw / 1e9:.0f} GB/s + latency = {ct * 1e3:.3f} ms each, "
                f"{'4' if lay.sequence_parallel else '2'} per layer forward and backward",
                f"  fused with its GEMM (g): exposed = max(0, c - g) + min(c, g)/{t}"
                if lay.overlap.tp else "  not overlapped: all exposed",
                f"  per step: {e.comm_s['tp'] * 1e3:.1f} ms raw, {e.exposed_s['tp'] * 1e3:.1f} "
                f"ms exposed"]
        out += _sources(dev, *_link_keys(dev, "tp"))
    if pp > 1:
        msg = act / t if t > 1 else act
        cross = t * cp * pp > c.gpus_per_node
        tx = p2p_time(msg, cross, dev)
        out += [f"PP P2P: T*h*{lay.dtype_bytes}/t = {msg / 2**20:.2f} MiB over "
                f"{'InfiniBand' if cross else 'NVLink'}: {tx * 1e3:.3f} ms per transfer, "
                f"{2 * e.num_microbatches * lay.num_virtual} per stage per step; exposed "
                f"{e.exposed_s['pp'] * 1e3:.1f} ms"
                + (" (each hidden under the compute before it)" if lay.overlap.pp else "")]
        out += _sources(dev, *_link_keys(dev, "inter" if cross else "intra"))
    if dp * cp > 1:
        wire = WIRE_BYTES[lay.comm_dtype]
        kind = "reduce_scatter + all_gather" if lay.zero >= 1 else "all_reduce"
        out += [f"DP {kind}: grads P x {wire:g} B ({lay.comm_dtype}) = "
                f"{p_gpu * wire / 2**20:.0f} MiB over {dp * cp} ranks ({e.dp_algorithm}): "
                f"{e.comm_s['dp'] * 1e3:.1f} ms; exposed {e.exposed_s['dp'] * 1e3:.1f} ms"
                + (" (buckets under the last backward and the pipeline drain)"
                   if lay.overlap.dp else " (after the flush)")]
        out += _sources(dev, *_link_keys(dev, "inter" if dp * cp * t * pp > c.gpus_per_node
                                         else "intra"))
    if m.is_moe and e.comm_s.get("ep", 0.0) > 0:
        dedup, eff = lay.ep_node_dedup, ep_exchange_efficiency(dev, lay)
        out += [f"EP all-to-all ({'once per node, DeepEP-style' if dedup else 'NCCL'}, "
                f"{e.ep_link}): dispatch + combine forward, their gradients backward, at "
                f"{eff:.3g} of the links: {e.comm_s['ep'] * 1e3:.1f} ms raw, "
                f"{e.exposed_s['ep'] * 1e3:.1f} ms exposed per step; expert GEMMs at "
                f"{dev.grouped_gemm_efficiency:.3g} of a dense GEMM"]
        out += _sources(dev, "dedup_a2a_efficiency" if dedup else "a2a_efficiency",
                        *(["dedup_a2a_sm_share"] if dedup else []), "grouped_gemm_efficiency")
    if cp > 1:
        out += _explain_cp(e)
    if e.offload:
        out += _explain_offload(e)

    # -- step
    mf = e.model_flops
    out += ["", "## step",
            f"bubble: closed form {_bubble_form(lay.schedule)} = {100 * e.closed_form_bubble:.2f}%;"
            f" simulated with per-stage costs {100 * e.bubble_fraction:.2f}%",
            f"step = pipeline {e.pipeline_s:.4g} s + exposed DP/gather + optimizer "
            f"{e.optimizer_s:.3g} s = {e.step_time_s:.4g} s"
            + (" (CPU-bound: node CPU work / cores)" if e.cpu_bound else ""),
            f"tokens/s = B*s/step = {lay.global_batch}*{s}/{e.step_time_s:.4g} = "
            f"{e.tokens_per_s:,.0f}",
            f"model FLOPs = 3 x B x (L x fwd/layer + 2shV) = {mf:.4g}; per GPU "
            f"{mf:.4g} / ({e.step_time_s:.4g} x {c.num_gpus}) = "
            f"{e.model_tflops_per_gpu:.1f} TFLOP/s",
            f"MFU = {e.model_tflops_per_gpu:.1f} / {dev.peak_flops / 1e12:.0f} = "
            f"{100 * e.mfu:.1f}%;  HFU (with recomputation) = {100 * e.hfu:.1f}%"]
    out += _sources(dev, "hbm_bandwidth", "mem_efficiency", "optimizer_s")
    return "\n".join(out)


def _link_keys(dev, link: str) -> tuple[str, ...]:
    if link == "tp" and dev.tp_link is not None:
        return ("tp_link.bandwidth", "tp_link.efficiency", "tp_base_latency_s")
    link = "intra" if link == "tp" else link
    return (f"{link}.bandwidth", f"{link}.efficiency", f"{link}.latency_s", "base_latency_s")


def _sources(dev, *keys: str) -> list[str]:
    """Where each term's number comes from (the profile's ``sources``: a datasheet, a table
    the planner was calibrated on, a measurement), one line per term that has one."""
    return [f"    source of {k}: {dev.sources[k]}" for k in keys if k in dev.sources]


def _explain_cp(e: Estimate) -> list[str]:
    m, lay = e.model, e.layout
    cp, meth = lay.cp, lay.cp_method
    bq, bkv, bo = cp_blocks(m, lay)
    f, b = cp_bytes(m, lay, meth)
    form = {"ring": f"fwd (cp-1) Bkv = {_mib(f)}; bwd (cp-1) Bkv + cp Bkv x 4/e = {_mib(b)} "
                    "(fp32 dK/dV accumulators)",
            "allgather": f"fwd two half gathers (cp-1) Bkv = {_mib(f)}; bwd the gathers again "
                         f"+ fp32 dK/dV reduce-scatters (cp-1) Bkv (1 + 4/e) = {_mib(b)}",
            "ulysses": f"(cp-1)/cp of q + kv (x{ulysses_repeat(m, lay)} kv repeat) and o: "
                       f"fwd {_mib(f)}, bwd {_mib(b)}; Bq = {_mib(bq)}, Bo = {_mib(bo)}"}[meth]
    hide = {"ring": "each hop under one ring step (1/cp of the rank's attention); the last "
                    "dK/dV hop exposed",
            "allgather": "the gathers under the own block and piece 0, piece 0's "
                         "reduce-scatter under piece 1; the last reduce-scatter exposed",
            "ulysses": "nothing: the all-to-alls are on the critical path"}[meth]
    row = e.cp_methods[meth]
    return [f"CP {meth}{' (auto: the lowest step time)' if e.cp_auto else ''} over {e.cp_link}, "
            f"cp={cp} (ranks tp={lay.tp} apart): local K+V Bkv = 2 x b x s/cp x kv heads/tp x "
            f"head dim x {lay.dtype_bytes} B = {_mib(bkv)}; per layer and micro-batch: {form}",
            f"  hidden: {hide}; per layer {row['comm_s_per_layer'] * 1e3:.3f} ms raw, "
            f"{row['exposed_s_per_layer'] * 1e3:.3f} ms exposed; per step "
            f"{e.comm_s['cp'] * 1e3:.1f} ms raw, {e.exposed_s['cp'] * 1e3:.1f} ms exposed "
            f"({100 * e.cp_hidden:.0f}% hidden)"]


def _explain_offload(e: Estimate) -> list[str]:
    m, lay, dev = e.model, e.layout, e.cluster.device
    r = e.peak_memory.rank
    ch = lay.rank_chunks(r)[0]
    o = e.offload[ch]
    dense, _ = LayerContext(m, e.cluster, lay, None).layers(lay.cp_method)
    a = layer_offload_bytes(m, lay)
    bw = dev.host_link.effective_bandwidth
    c = a / bw
    split = lay.schedule == "zb-h1"
    b = dense.dgrad + dense.recompute + (0.0 if split else dense.wgrad)
    n, k = o.offloaded, o.layers - o.offloaded
    states = live_pairs(lay.schedule, lay.pp, e.num_microbatches, lay.num_virtual)[r]
    live = max(x + y for x, y in states)
    first = f" + c = {c * 1e3:.3f} ms (k = 0: the first reload hides under nothing)" \
        if k == 0 else ""
    ms = 1e3
    return [
        "", f"## activation offloading (--offload-activations {lay.offload})",
        f"saved per block and micro-batch A = {_mib(a)} (recompute={lay.recompute}"
        f"{', the block input' if lay.recompute == 'full' else ''}); host link B = "
        f"{bw / 1e9:.1f} GB/s each way ({dev.host_link.bandwidth / 1e9:.1f} x "
        f"{dev.host_link.efficiency:g}); a copy c = A/B = {c * ms:.3f} ms",
        f"chunk {ch} on pp rank {r}: n = {n} of L = {o.layers} blocks offload, k = {k} stay; "
        f"dense block f = {dense.fwd * ms:.3f} ms forward, b = {b * ms:.3f} ms backward"
        + (" (the I pass)" if split else ""),
        f"  d2h: copy j queued at the end of block j's forward, D_j = max(D_(j-1), E_j) + c; "
        f"exposed beyond the next action = {o.exposed_f * ms:.3f} ms per micro-batch",
        f"  h2d: block j's backward reloads j-1, max(0, c - b) = {max(0.0, c - b) * ms:.3f} ms "
        f"exposed for each of {n if k else n - 1} reloads{first}; {o.exposed_b * ms:.3f} ms "
        "per micro-batch",
        f"  device: live pairs {live} x k x A + pending copies {_mib(o.staging_bytes)} + "
        f"reloads in flight {_mib(o.inflight_bytes)}; host: live pairs x n x A = "
        f"{e.peak_memory.host_bytes / GIB:.2f} GiB pinned per GPU, "
        f"{e.host_node_bytes / GIB:.1f} GiB per node"
        + (f" of {e.host_capacity / GIB:,.0f}" if e.host_capacity else ""),
        f"  per step (busiest pp rank): {e.offload_bytes_per_step / GIB:,.1f} GiB each way, "
        f"copies {e.comm_s['offload']:.3f} s both ways, exposed {e.exposed_s['offload']:.3f} s"]


def _mib(x: float) -> str:
    return f"{x / 2**20:.1f} MiB"


def _bubble_form(schedule: str) -> str:
    return {"gpipe": "(p-1)/(m+p-1)", "1f1b": "(p-1)/(m+p-1)",
            "interleaved": "(p-1)/(v*m+p-1)", "zb-h1": "(p-1)/(3m+p-1)"}[schedule]
