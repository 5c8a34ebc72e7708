"""Module-name helpers of the transformers plans, shared by the dense plans
(``overlap.models.tp_plans``) and the mixture-of-experts ones (``overlap.models.moe_plans``):
where a model keeps its decoder and head, and the Llama-style attention's styles and check.
"""

from __future__ import annotations

import torch.nn as nn

from overlap.nn.tp_plan import Style

__all__ = ["hf_prefix", "has_head", "llama_attention", "llama_heads_check"]


def hf_prefix(model: nn.Module) -> str:
    # XForCausalLM holds its decoder at model.<base_model_prefix>; the bare XModel is the decoder.
    base = getattr(model, "base_model_prefix", "")
    inner = getattr(model, base, None) if base else None
    return f"{base}." if isinstance(inner, nn.Module) and inner is not model else ""


def has_head(model: nn.Module) -> bool:
    return isinstance(getattr(model, "lm_head", None), nn.Module)


def llama_attention(model: nn.Module, p: str) -> dict[str, str | Style]:
    """The Llama-style attention of ``{p}layers.*.self_attn``: q/k/v column, o row, and the
    per-head ``q_norm``/``k_norm`` (Qwen3, Gemma3-style: replicated, run on this rank's heads)
    as "sum_grads" when the model has them (parallelize would find them on the probe anyway;
    naming them keeps it so with verify=False)."""
    layers: dict[str, str | Style] = {
        f"{p}layers.*.self_attn.q_proj": "column",
        f"{p}layers.*.self_attn.k_proj": "column",
        f"{p}layers.*.self_attn.v_proj": "column",
        f"{p}layers.*.self_attn.o_proj": "row",
    }
    names = {n for n, _ in model.named_modules()}
    for norm in ("q_norm", "k_norm"):
        if any(n.endswith(f"self_attn.{norm}") for n in names):
            layers[f"{p}layers.*.self_attn.{norm}"] = "sum_grads"
    return layers


def llama_heads_check(m: nn.Module, tp: int) -> list[str]:
    """Both head counts divisible by tp (grouped-query attention: whole kv groups per rank)."""
    cfg, problems = m.config, []
    for attr in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(cfg, attr, None)
        if not isinstance(value, int) or value % tp:
            problems.append(f"config.{attr}={value} is not divisible by tp={tp}"
                            + (" (grouped-query attention: each rank needs whole kv "
                               "groups)" if attr == "num_key_value_heads" else ""))
    return problems
