"""Readable text for an Estimate and for a search: what ``overlap-plan`` prints."""

from __future__ import annotations

from overlap.plan.estimate import GIB, Estimate
from overlap.plan.layout import CP_METHODS
from overlap.plan.search import SearchResult

__all__ = ["format_estimate", "format_search", "layout_name"]


def layout_name(e: Estimate) -> str:
    lay = e.layout
    sched = lay.schedule + (f"(v={lay.num_virtual})" if lay.num_virtual > 1 else "")
    cp = [f"cp{lay.cp}({lay.cp_method})"] if lay.cp > 1 else []
    parts = [f"tp{lay.tp}", f"pp{lay.pp}"] + cp + \
        [f"dp{e.dp}"] + ([f"ep{lay.ep}"] if e.model.is_moe else []) + \
        [f"mb{lay.micro_batch}", sched, f"rc-{lay.recompute}",
         f"zero{lay.zero}"] + (["sp"] if lay.sequence_parallel else []) + \
        ([f"off-{lay.offload}"] if lay.offload != "none" else [])
    return " ".join(parts)


def _ms(s: float) -> str:
    return f"{s * 1e3:,.1f} ms" if s < 10 else f"{s:,.2f} s"


def format_estimate(e: Estimate) -> str:
    m, c, lay = e.model, e.cluster, e.layout
    mem = e.peak_memory
    cap = c.device.hbm_bytes
    lines = [
        f"model     {m.name}: L={m.num_layers} h={m.hidden} a={m.num_heads} "
        f"kv={m.kv_heads} F={m.ffn_dim} V={m.vocab} s={m.seq_len} "
        f"({m.total_params() / 1e9:.1f}B parameters)",
        f"cluster   {c.num_gpus} x {c.device.name}, {c.gpus_per_node} per node",
        f"layout    {layout_name(e)}, {e.num_microbatches} micro-batches per pipeline, "
        f"global batch {lay.global_batch}, comm {lay.comm_dtype}, "
        f"overlap {'on' if lay.overlap.tp else 'off'}",
        "",
        f"memory per GPU (pp rank {mem.rank}, the fullest)   {mem.total / GIB:6.1f} GiB of "
        f"{cap / GIB:.1f} ({100 * mem.total / cap:.0f}%)",
        f"  weights {mem.weights / GIB:6.2f}  grads {mem.grads / GIB:6.2f}  "
        f"optimizer {mem.optimizer / GIB:6.2f}  activations {mem.activations / GIB:6.2f} GiB",
        "  per pp rank: " + ", ".join(f"{s.total / GIB:.1f}" for s in e.memory) + " GiB",
        "",
        f"step time         {_ms(e.step_time_s)}   (pipeline {_ms(e.pipeline_s)}, optimizer "
        f"{_ms(e.optimizer_s)}{', CPU-bound' if e.cpu_bound else ''})",
        f"bubble            {100 * e.bubble_fraction:.1f}% simulated "
        f"({100 * e.closed_form_bubble:.1f}% closed form, uniform stages)",
        f"throughput        {e.tokens_per_s:,.0f} tokens/s, {e.model_tflops_per_gpu:.1f} model "
        f"TFLOP/s per GPU",
        f"utilisation       MFU {100 * e.mfu:.1f}%, HFU {100 * e.hfu:.1f}%",
        "",
        "communication per step (busiest pp rank)   raw -> exposed",
    ]
    if m.is_moe:
        cf = "dropless" if lay.capacity_factor is None else f"capacity {lay.capacity_factor:g}"
        lines[1] += (f"\nMoE       {m.num_experts} experts, top-{m.moe_top_k}, "
                     f"{m.num_shared_experts} shared, Fe={m.expert_ffn}, "
                     f"{m.num_moe_layers()} MoE layers ({m.active_params() / 1e9:.1f}B active); "
                     f"ep {lay.ep} x expert-dp {lay.edp(c)}, all-to-all over {e.ep_link}, {cf}"
                     f" (imbalance {lay.moe_imbalance:g}), dispatch {lay.ep_dispatch}")
        # After the weights/grads/optimizer line (lines[6]; lines[1] now holds two lines).
        lines.insert(7, f"  experts {mem.expert_bytes / GIB:6.2f} GiB of the above "
                        f"({mem.expert_params / 1e9:.2f}B expert parameters on this GPU)")
    if lay.cp > 1:  # after the layout line; lines[7] below stays the memory breakdown
        lines[2] += "\n" + _cp_line(e)
    if e.offload:
        lines[2] += "\n" + _offload_line(e)
    for axis in ("tp", "pp", "dp") + (("ep",) if m.is_moe else ()) + \
            (("cp",) if lay.cp > 1 else ()) + (("offload",) if e.offload else ()):
        lines.append(f"  {axis}  {_ms(e.comm_s[axis]):>12} -> {_ms(e.exposed_s[axis]):>10}")
    lines.append(f"  exposed in total {_ms(e.exposed_comm_s)} "
                 f"({100 * e.exposed_comm_s / e.step_time_s:.1f}% of the step)")
    return "\n".join(lines)


def _mib(x: float) -> str:
    return f"{x / 2**20:,.1f}"


def _cp_line(e: Estimate) -> str:
    """The CP terms: method (and the alternatives), link, KV bytes per layer, hidden share."""
    lay = e.layout
    row = e.cp_methods[lay.cp_method]
    kv = row["kv_bytes_per_layer"]
    alts = ", ".join(f"{k} {_ms(e.cp_methods[k]['exposed_s_per_layer'])}" if k in e.cp_methods else
                     f"{k} n/a" for k in CP_METHODS)
    how = "auto" if e.cp_auto else "chosen"
    return (f"CP        cp {lay.cp} over {e.cp_link}, {lay.cp_method} ({how}); KV MiB per layer "
            f"and micro-batch sent: {_mib(kv['nvlink'])} NVLink + {_mib(kv['ib'])} IB; hidden "
            f"{100 * e.cp_hidden:.0f}%; exposed per layer: {alts}; buffers "
            f"{e.peak_memory.cp_buffers / GIB:.2f} GiB")


def _offload_line(e: Estimate) -> str:
    """The offload terms: blocks per chunk, link, bytes per step, exposed, host memory."""
    d = e.offload_dict()
    blocks = ", ".join(sorted({f"{o.offloaded} of {o.layers}" for o in e.offload}))
    cap = d["host_capacity_gib_per_node"]
    return (f"offload   {e.layout.offload}: {blocks} blocks per pipeline chunk, host link "
            f"{d['host_link_gb_s']:.1f} GB/s each way; {d['bytes_to_host_per_step'] / GIB:,.1f}"
            f" GiB to host per step and GPU (and back), copies {_ms(d['copy_s'])} both ways, "
            f"exposed "
            f"{_ms(d['exposed_s'])} ({100 * d['hidden_fraction']:.0f}% hidden); pinned host "
            f"{d['host_gib_per_gpu']:.1f} GiB per GPU, {d['host_gib_per_node']:.1f} GiB per node"
            + (f" of {cap:,.0f}" if cap is not None else ""))


def format_search(res: SearchResult, top: int, capacity_note: str = "") -> str:
    lines = [f"{len(res.ranked)} layouts fit, {len(res.rejected)} rejected "
             f"({', '.join(f'{k}: {v}' for k, v in sorted(res.reasons().items()))})"
             + capacity_note, ""]
    moe = any(e.model.is_moe for e in res.ranked)
    width = max([58] + [len(layout_name(e)) for e in res.ranked[:top]])
    head = f"{'#':>3}  {'layout':<{width}} {'step':>10} {'MFU':>6} {'bubble':>7} {'mem GiB':>8} " \
           f"{'exposed':>9}"
    if moe:
        head += f" {'ep':>3} {'link':>6} {'expert GiB':>10} {'ep comm':>10} {'ep exp':>9}"
    cp = any(e.layout.cp > 1 for e in res.ranked[:top])
    if cp:
        head += f" {'cp':>3} {'link':>6} {'kv MiB nvl':>10} {'kv MiB ib':>9} {'cp exp':>9}"
    off = any(e.offload for e in res.ranked[:top])
    if off:
        head += f" {'offload':>7} {'GiB/step':>8} {'host GiB':>8} {'off exp':>9}"
    lines += [head, "-" * len(head)]
    for i, e in enumerate(res.ranked[:top], 1):
        row = (f"{i:>3}  {layout_name(e):<{width}} {_ms(e.step_time_s):>10} "
               f"{100 * e.mfu:5.1f}% {100 * e.bubble_fraction:6.1f}% "
               f"{e.peak_memory.total / GIB:8.1f} {_ms(e.exposed_comm_s):>9}")
        if moe:
            row += (f" {e.layout.ep:>3} {e.ep_link:>6} {e.peak_memory.expert_bytes / GIB:10.1f}"
                    f" {_ms(e.comm_s['ep']):>10} {_ms(e.exposed_s['ep']):>9}")
        if cp and e.layout.cp > 1:
            kv = e.cp_methods[e.layout.cp_method]["kv_bytes_per_layer"]
            row += (f" {e.layout.cp:>3} {e.cp_link:>6} {_mib(kv['nvlink']):>10} "
                    f"{_mib(kv['ib']):>9} {_ms(e.exposed_s['cp']):>9}")
        elif cp:
            row += f" {1:>3} {'-':>6} {'-':>10} {'-':>9} {'-':>9}"
        if off and e.offload:
            row += (f" {e.layout.offload:>7} {e.offload_bytes_per_step / GIB:8.1f} "
                    f"{max(s.host_bytes for s in e.memory) / GIB:8.1f} "
                    f"{_ms(e.exposed_s['offload']):>9}")
        elif off:
            row += f" {'none':>7} {'-':>8} {'-':>8} {'-':>9}"
        lines.append(row)
    if res.rejected:
        lines += ["", "rejected (first of each reason):"]
        seen = set()
        for lay, why in res.rejected:
            key = why.split(":")[0]
            if key in seen:
                continue
            seen.add(key)
            ep = f" ep{lay.ep}" if lay.ep > 1 else ""
            ep += f" cp{lay.cp}" if lay.cp > 1 else ""
            off = f" off-{lay.offload}" if lay.offload != "none" else ""
            lines.append(f"  tp{lay.tp} pp{lay.pp}{ep} mb{lay.micro_batch} {lay.schedule} "
                         f"rc-{lay.recompute}{off}: {why}")
    return "\n".join(lines)
