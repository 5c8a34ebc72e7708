"""Plans for Hugging Face mixture-of-experts models: attention over TP, experts over EP, in one
``parallelize(model, comm=tp_comm, ep_comm=ep_comm)`` call.

Plans: Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 (multi-head latent attention) and GPT-OSS,
written against transformers 5.x module names. Each sparse block becomes an
``overlap.moe.hf.ExpertParallelBlock`` (style ``"experts"``) that reproduces the family's
routing (``MoEFamily``); dense MLP layers are column/row; shared experts and routers stay
replicated inside the block. Contract: tp divides the head counts, ep divides the expert
count; the EP group lies inside the TP group (same tokens) or meets it in this rank only.
The narrative: docs/design/nn.md ("Mixture-of-experts plans").
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from overlap.models.hf_parts import has_head, hf_prefix, llama_attention, llama_heads_check
from overlap.moe.hf import (ExpertParallelBlock, MoEFamily, deepseek_v3_route, deepseek_v3_shared,
                            gpt_oss_experts, gpt_oss_route, mixtral_route, qwen2_moe_shared,
                            qwen_route, swiglu_experts)
from overlap.nn.layers import TPModule
from overlap.nn.regions import copy_to_tp
from overlap.nn.sharding import ShardSpec, shard
from overlap.nn.tp_plan import Style, TPPlan

__all__ = ["MIXTRAL", "QWEN2_MOE", "QWEN3_MOE", "DEEPSEEK_V3", "GPT_OSS", "MOE_PLANS",
           "experts_style", "mixtral_plan", "qwen2_moe_plan", "qwen3_moe_plan",
           "deepseek_v3_plan", "gpt_oss_plan"]


def _swiglu(experts: nn.Module):
    return swiglu_experts(experts.act_fn)


MIXTRAL = MoEFamily(name="mixtral", route=mixtral_route, experts=_swiglu, jitter=True)
QWEN2_MOE = MoEFamily(name="qwen2_moe", route=qwen_route, experts=_swiglu,
                      shared=qwen2_moe_shared)
QWEN3_MOE = MoEFamily(name="qwen3_moe", route=qwen_route, experts=_swiglu)
DEEPSEEK_V3 = MoEFamily(name="deepseek_v3", route=deepseek_v3_route, experts=_swiglu,
                        shared=deepseek_v3_shared)
GPT_OSS = MoEFamily(name="gpt_oss", route=gpt_oss_route,
                    experts=lambda e: gpt_oss_experts(e.alpha, e.limit), pack="biased",
                    router="router", returns_scores=True)


def _build_block(module: nn.Module, *, ep_comm, tokens: str, family: MoEFamily) -> nn.Module:
    return ExpertParallelBlock(module, family, ep_comm, tokens=tokens)


def experts_style(family: MoEFamily, block_type: type) -> Style:
    """The style that shards one sparse block of ``block_type`` over EP as ``family``."""
    return Style(kind="experts", build=functools.partial(_build_block, family=family),
                 accepts=(block_type,))


def _blocks(model: nn.Module, class_name: str) -> dict[str, type]:
    return {n: type(m) for n, m in model.named_modules() if type(m).__name__ == class_name}


def _experts(model: nn.Module, family: MoEFamily, class_name: str) -> dict[str, Style]:
    return {n: experts_style(family, t) for n, t in _blocks(model, class_name).items()}


def _dense_mlps(model: nn.Module, p: str, class_name: str) -> dict[str, str]:
    """Column/row for the dense MLP layers (``{p}layers.<i>.mlp`` of ``class_name``); shared
    experts of the same class inside a sparse block are not matched."""
    layers = {}
    for n in _blocks(model, class_name):
        head, _, leaf = n.rpartition(".")
        if leaf == "mlp" and head.startswith(f"{p}layers.") and head.count(".") == p.count(".") + 1:
            layers.update({f"{n}.gate_proj": "column", f"{n}.up_proj": "column",
                           f"{n}.down_proj": "row"})
    return layers


def _ends(model: nn.Module, p: str) -> dict[str, str]:
    return {f"{p}embed_tokens": "embedding", **({"lm_head": "head"} if has_head(model) else {})}


def mixtral_plan(model: nn.Module) -> TPPlan:
    """Mixtral: Llama-style attention over TP, every ``MixtralSparseMoeBlock`` over EP."""
    p = hf_prefix(model)
    return TPPlan(name="hf-mixtral", check=llama_heads_check, layers={
        **_ends(model, p), **llama_attention(model, p),
        **_experts(model, MIXTRAL, "MixtralSparseMoeBlock")})


def qwen2_moe_plan(model: nn.Module) -> TPPlan:
    """Qwen2-MoE: attention over TP, sparse blocks (shared expert with its sigmoid gate
    inside) over EP, dense MLP layers column/row."""
    p = hf_prefix(model)
    return TPPlan(name="hf-qwen2_moe", check=llama_heads_check, layers={
        **_ends(model, p), **llama_attention(model, p), **_dense_mlps(model, p, "Qwen2MoeMLP"),
        **_experts(model, QWEN2_MOE, "Qwen2MoeSparseMoeBlock")})


def qwen3_moe_plan(model: nn.Module) -> TPPlan:
    """Qwen3-MoE: attention over TP with the per-head q/k norms summing their gradients over
    TP, sparse blocks over EP, dense MLP layers column/row."""
    p = hf_prefix(model)
    return TPPlan(name="hf-qwen3_moe", check=llama_heads_check, layers={
        **_ends(model, p), **llama_attention(model, p), **_dense_mlps(model, p, "Qwen3MoeMLP"),
        **_experts(model, QWEN3_MOE, "Qwen3MoeSparseMoeBlock")})


class _LatentKV(nn.Linear):
    """DeepSeek's ``kv_a_proj_with_mqa`` under TP: ``[kv latent | k_rope]``. The latent feeds
    the column-parallel ``kv_b_proj`` (its input gradient is all-reduced there); ``k_rope`` is
    shared by every head, so with the heads sharded its gradient is summed over TP here."""

    def forward(self, x):
        y = super().forward(x)
        latent, rope = y.split([y.shape[-1] - self.rope_dim, self.rope_dim], dim=-1)
        return torch.cat([latent, copy_to_tp(rope, comm=self.tp_comm)], dim=-1)


def _latent_kv(module: nn.Module, *, comm, sequence_parallel: bool, rope_dim: int) -> nn.Module:
    new = _LatentKV.__new__(_LatentKV)
    new.__dict__.update(module.__dict__)
    for key in ("_parameters", "_buffers", "_modules"):
        new.__dict__[key] = dict(module.__dict__[key])
    new.rope_dim, new.tp_comm = rope_dim, comm
    return new


def deepseek_v3_plan(model: nn.Module) -> TPPlan:
    """DeepSeek-V3: multi-head latent attention with its heads over TP (``q_b_proj`` or
    ``q_proj`` and ``kv_b_proj`` column, whole heads per rank; ``o_proj`` row; the low-rank
    ``q_a``/``kv_a`` projections and their norms replicated, the shared rope key's gradient
    summed over TP); the ``first_k_dense_replace`` dense layers column/row; every
    ``DeepseekV3MoE`` over EP (group-limited routing, shared experts inside)."""
    p, cfg = hf_prefix(model), model.config
    attn = f"{p}layers.*.self_attn"
    q = "q_proj" if cfg.q_lora_rank is None else "q_b_proj"
    return TPPlan(name="hf-deepseek_v3", check=_deepseek_check, layers={
        **_ends(model, p),
        f"{attn}.{q}": "column", f"{attn}.kv_b_proj": "column", f"{attn}.o_proj": "row",
        f"{attn}.kv_a_proj_with_mqa": Style(
            kind="custom", accepts=(nn.Linear,),
            build=functools.partial(_latent_kv, rope_dim=cfg.qk_rope_head_dim)),
        **_dense_mlps(model, p, "DeepseekV3MLP"),
        **_experts(model, DEEPSEEK_V3, "DeepseekV3MoE")})


def _deepseek_check(m: nn.Module, tp: int) -> list[str]:
    cfg = m.config
    problems = [] if cfg.num_attention_heads % tp == 0 else [
        f"config.num_attention_heads={cfg.num_attention_heads} is not divisible by tp={tp}"]
    if tp > 1 and cfg.num_key_value_heads != cfg.num_attention_heads:
        problems.append(f"config.num_key_value_heads={cfg.num_key_value_heads} differs from "
                        f"num_attention_heads={cfg.num_attention_heads}: the latent attention "
                        "expands one k/v per query head, so its heads shard only when they agree")
    return problems


def _sinks_attention(module: nn.Module, *, comm, sequence_parallel: bool) -> nn.Module:
    """GPT-OSS attention with its per-head ``sinks`` cut to this rank's heads (a TP module, so
    the state dict and gradients gather back to the unsharded layout)."""
    cls = _sinks_class(type(module))
    new = cls.__new__(cls)
    new.__dict__.update(module.__dict__)
    for key in ("_parameters", "_buffers", "_modules"):
        new.__dict__[key] = dict(module.__dict__[key])
    new._init_comm("GPT-OSS attention", comm)
    new.shard_specs = {"sinks": ShardSpec(dim=0)}
    new._parameters["sinks"] = nn.Parameter(shard(module.sinks, new.shard_specs["sinks"],
                                                  new.tp_rank, new.tp_size))
    return new


@functools.cache
def _sinks_class(base: type) -> type:
    return type(f"Parallel{base.__name__}", (base, TPModule), {})


def gpt_oss_plan(model: nn.Module) -> TPPlan:
    """GPT-OSS: attention over TP (q/k/v column, o row, biases sharded with them, the sinks
    cut per head), every ``GptOssMLP`` over EP (router with bias, softmax over the chosen k,
    interleaved gate/up with biases, clamped SwiGLU)."""
    p = hf_prefix(model)
    blocks = _blocks(model, "GptOssAttention")
    return TPPlan(name="hf-gpt_oss", check=llama_heads_check, layers={
        **_ends(model, p),
        **{n: Style(kind="custom", build=_sinks_attention, accepts=(t,))
           for n, t in blocks.items()},
        **llama_attention(model, p),
        **_experts(model, GPT_OSS, "GptOssMLP")})


MOE_PLANS = {"mixtral": mixtral_plan, "qwen2_moe": qwen2_moe_plan, "qwen3_moe": qwen3_moe_plan,
             "deepseek_v3": deepseek_v3_plan, "gpt_oss": gpt_oss_plan}
