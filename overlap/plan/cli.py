"""``overlap-plan`` / ``python -m overlap.plan``: estimate a layout, search for one, explain the
arithmetic, or calibrate this machine. A thin layer over :class:`overlap.plan.config.PlanConfig`,
whose ``--help`` ends with examples (``overlap.plan.config.EXAMPLES``).
"""

from __future__ import annotations

import json
import sys

from overlap.plan.config import PlanConfig, parse_args

__all__ = ["main", "run"]


def run(cfg: PlanConfig) -> str:
    """What ``overlap-plan`` prints for ``cfg`` (already validated)."""
    if cfg.calibrate:
        from overlap.plan.calibrate import calibrate, summary

        profile = calibrate(ranks=cfg.ranks, log=lambda msg: print(msg, file=sys.stderr))
        with open(cfg.output, "w") as f:
            f.write(profile.to_json() + "\n")
        return json.dumps({"profile": cfg.output, **summary(profile)}, indent=1)
    model, cluster = cfg.model_spec(), cfg.cluster()
    if cfg.search:
        from overlap.plan.report import format_search
        from overlap.plan.search import Constraints, search

        layout = cfg.layout()
        res = search(model, cluster, layout.global_batch, Constraints(
            comm_dtype=cfg.comm_dtype, flash_attention=cfg.flash_attention,
            overlap=layout.overlap, memory_fraction=cfg.memory_fraction,
            ep=(cfg.ep,) if cfg.ep > 1 else None, capacity_factor=cfg.capacity_factor,
            moe_imbalance=cfg.moe_imbalance, ep_dispatch=cfg.ep_dispatch,
            ep_chunks=cfg.ep_chunks, cp=(cfg.cp,) if cfg.cp > 1 else None,
            cp_method=cfg.cp_method, offload=cfg.search_offload_modes()))
        if cfg.json:
            return json.dumps({"ranked": [e.as_dict() for e in res.ranked[:cfg.top]],
                               "rejected": [{"tp": lay.tp, "pp": lay.pp, "cp": lay.cp,
                                             **({"ep": lay.ep} if model.is_moe else {}),
                                             "micro_batch": lay.micro_batch,
                                             "schedule": lay.schedule,
                                             "recompute": lay.recompute,
                                             "offload": lay.offload, "reason": why}
                                            for lay, why in res.rejected]}, indent=1)
        return format_search(res, cfg.top)
    from overlap.plan.estimate import estimate

    est = estimate(model, cluster, cfg.layout(), memory_fraction=cfg.memory_fraction)
    if cfg.json:
        d = est.as_dict()
        d["fits"] = est.fits(cfg.memory_fraction)
        return json.dumps(d, indent=1)
    if cfg.explain:
        from overlap.plan.explain import explain

        return explain(est)
    from overlap.plan.report import format_estimate

    text = format_estimate(est)
    if not est.fits(cfg.memory_fraction):
        text += (f"\n\nDOES NOT FIT: {est.peak_memory.total / 2**30:.1f} GiB > "
                 f"{cfg.memory_fraction:g} x {cluster.device.hbm_bytes / 2**30:.1f} GiB")
        if not est.host_fits(cfg.memory_fraction):
            text += (f" or pinned host memory {est.host_node_bytes / 2**30:.1f} GiB per node > "
                     f"{cfg.memory_fraction:g} x {est.host_capacity / 2**30:.1f} GiB")
    return text


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    try:
        print(run(cfg))
    except ValueError as exc:  # e.g. a named model whose shape the layout cannot split
        print(f"overlap-plan: error: {exc}", file=sys.stderr)
        return 2
    return 0
