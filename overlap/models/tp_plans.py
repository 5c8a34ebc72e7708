"""Tensor-parallel plans for overlap's own GPT and for Hugging Face ``transformers`` models.

Plans: overlap ``GPT`` (also with sequence parallelism), GPT-2, Llama, Qwen2, Mistral, Qwen3,
Gemma, Gemma2, Phi-3, GPT-NeoX and OPT, written against transformers 5.x module names (checked
against 4.46+ too where they agree). Which style each module gets and which config attributes
are divided: docs/design/nn.md.

Contract: Llama-style attention needs both ``num_attention_heads`` and ``num_key_value_heads``
divisible by tp (each rank keeps whole kv groups). The Hugging Face models keep their residual
stream replicated between TP regions, so their plans refuse ``sequence_parallel=True`` with
NotImplementedError. Their ``lm_head`` uses the "head" style (full logits, so the model's own
loss works); pass a plan with "vocab_head" and use ``vocab_parallel_cross_entropy`` to keep
logits sharded.
The narrative: docs/design/nn.md.
"""

from __future__ import annotations

import torch.nn as nn

from overlap.models.gpt import GPT, CausalSelfAttention
from overlap.models.hf_parts import has_head, hf_prefix, llama_attention, llama_heads_check
from overlap.models.moe_plans import MOE_PLANS
from overlap.nn.apply import expert_modules
from overlap.nn.layers import column_parallel_shared
from overlap.nn.tp_plan import Style, TPPlan

__all__ = ["gpt_plan", "gpt2_plan", "llama_plan", "phi3_plan", "gpt_neox_plan", "opt_plan",
           "plan_for", "ParallelCausalSelfAttention"]


class ParallelCausalSelfAttention(CausalSelfAttention):
    """overlap GPT attention once q/k/v/o are TP layers. q, k and v read the same input, so
    they run as one column GEMM (``column_parallel_shared``): one all-gather of the input with
    sequence parallelism, one all-reduce of its gradient without. With sequence parallelism
    the input is a sequence shard (b, t/tp, d) but q/k/v come back full-length (b, t, h*hd),
    and ``CausalSelfAttention.attend`` reads the sequence length from q."""

    def forward(self, x):
        return self.attend(*column_parallel_shared(x, [self.q_proj, self.k_proj, self.v_proj]))


def _parallel_attention(module: nn.Module, *, comm, sequence_parallel: bool) -> nn.Module:
    new = ParallelCausalSelfAttention.__new__(ParallelCausalSelfAttention)
    new.__dict__.update(module.__dict__)  # same submodules and parameters, new forward
    # Own containers, so replacing a projection inside leaves ``module`` as it was (a failed
    # verification restores it).
    for key in ("_parameters", "_buffers", "_modules"):
        new.__dict__[key] = dict(module.__dict__[key])
    return new


def gpt_plan(*, loss_parallel: bool = False, dense_mlp: bool = True,
             sp_moe_blocks: tuple[int, ...] = ()) -> TPPlan:
    """Plan for ``overlap.models.GPT``. ``loss_parallel=True`` leaves the logits sharded over
    the vocabulary (use ``vocab_parallel_cross_entropy``; ``GPT.forward(idx, targets)`` would
    then compute a wrong loss). ``dense_mlp=False``: every block is a MoE block (its experts
    shard over EP, not TP; the MoE parameters stay whole on every TP rank). ``sp_moe_blocks``:
    the MoE blocks of a sequence-parallel run: each TP rank routes its own sequence shard (the
    block's ``token_groups`` divided by tp) and the experts' gradients are summed over TP (the
    router and shared experts are found by the verifier's probe; the experts' weights feed the
    exchange directly)."""
    mlp = {"blocks.*.mlp.fc1": "column", "blocks.*.mlp.fc2": "row"} if dense_mlp else {}
    divide = {"blocks.*.attn": ("num_heads",)}
    for i in sp_moe_blocks:
        mlp[f"blocks.{i}.mlp.moe.experts"] = "sum_grads"
        divide[f"blocks.{i}.mlp"] = ("token_groups",)
    return TPPlan(
        name="overlap-gpt",
        layers={
            "tok_emb": "embedding",
            "pos_emb": "sp_positions",
            "blocks.*.attn": Style(kind="custom", build=_parallel_attention,
                                   accepts=(CausalSelfAttention,)),
            "blocks.*.ln1": "sp_norm",
            "blocks.*.ln2": "sp_norm",
            "blocks.*.attn.q_proj": "column",
            "blocks.*.attn.k_proj": "column",
            "blocks.*.attn.v_proj": "column",
            "blocks.*.attn.o_proj": "row",
            **mlp,
            "ln_f": "sp_norm",
            "lm_head": "vocab_head" if loss_parallel else "head",
        },
        divide=divide,
        sequence_parallel=True,
    )


def gpt2_plan(model: nn.Module) -> TPPlan:
    """Plan for a transformers GPT-2 model (``GPT2LMHeadModel`` or ``GPT2Model``)."""
    p = hf_prefix(model)
    layers = {
        f"{p}wte": "embedding",
        f"{p}h.*.attn.c_attn": "qkv",
        f"{p}h.*.attn.c_proj": "row",
        f"{p}h.*.mlp.c_fc": "column",
        f"{p}h.*.mlp.c_proj": "row",
    }
    if has_head(model):
        layers["lm_head"] = "head"

    def check(m: nn.Module, tp: int) -> list[str]:
        if getattr(m.config, "add_cross_attention", False):
            return ["GPT-2 with add_cross_attention=True is not supported (its crossattention "
                    "c_attn is a fused [k; v] projection of the encoder states)"]
        return []

    return TPPlan(name="hf-gpt2", layers=layers,
                  divide={f"{p}h.*.attn": ("num_heads", "split_size")}, check=check)


def llama_plan(model: nn.Module) -> TPPlan:
    """Plan for transformers Llama, Qwen2, Qwen3, Mistral, Gemma or Gemma2 (same module names; the
    Gemma embedding multiplies by sqrt(d) in its own forward, which parallelize keeps by
    wrapping it, see overlap.nn.wrap)."""
    p = hf_prefix(model)
    layers = {
        f"{p}embed_tokens": "embedding",
        **llama_attention(model, p),
        f"{p}layers.*.mlp.gate_proj": "column",
        f"{p}layers.*.mlp.up_proj": "column",
        f"{p}layers.*.mlp.down_proj": "row",
    }
    if has_head(model):
        layers["lm_head"] = "head"
    return TPPlan(name=f"hf-{model.config.model_type}", layers=layers, check=llama_heads_check)


def _heads_check(*attrs: str, note: str = ""):
    def check(m: nn.Module, tp: int) -> list[str]:
        problems = []
        for attr in attrs:
            value = getattr(m.config, attr, None)
            if not isinstance(value, int) or value % tp:
                problems.append(f"config.{attr}={value} is not divisible by tp={tp}{note}")
        return problems
    return check


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def phi3_plan(model: nn.Module) -> TPPlan:
    """Plan for transformers Phi-3 (``Phi3ForCausalLM`` / ``Phi3Model``): the fused
    ``qkv_proj`` is ``[q: H*d | k: KV*d | v: KV*d]`` (unequal parts under grouped-query
    attention), sharded per part in whole heads; the fused ``gate_up_proj`` ``[gate; up]`` as
    two halves. The attention reads ``config.num_attention_heads`` and
    ``num_key_value_heads`` in its forward: both are divided (each attention gets its own copy
    of the config)."""
    p, cfg = hf_prefix(model), model.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    layers = {
        f"{p}embed_tokens": "embedding",
        f"{p}layers.*.self_attn.qkv_proj": Style(kind="column", parts=(heads, kv, kv),
                                                 head_dim=_head_dim(cfg)),
        f"{p}layers.*.self_attn.o_proj": "row",
        f"{p}layers.*.mlp.gate_up_proj": "gate_up",
        f"{p}layers.*.mlp.down_proj": "row",
    }
    if has_head(model):
        layers["lm_head"] = "head"
    return TPPlan(name="hf-phi3", layers=layers,
                  divide={f"{p}layers.*.self_attn": ("num_key_value_heads",
                                                     "config.num_attention_heads")},
                  check=_heads_check("num_attention_heads", "num_key_value_heads",
                                     note=" (each rank keeps whole kv groups)"))


def gpt_neox_plan(model: nn.Module) -> TPPlan:
    """Plan for transformers GPT-NeoX (Pythia): ``query_key_value`` interleaves q, k, v per
    head (``[h0: q k v | h1: q k v | ...]``), so it is cut at head boundaries
    (``layout="per_head"``); the attention infers its local head count from the width."""
    p, cfg = hf_prefix(model), model.config
    layers = {
        f"{p}embed_in": "embedding",
        f"{p}layers.*.attention.query_key_value": Style(
            kind="column", layout="per_head", heads=cfg.num_attention_heads),
        f"{p}layers.*.attention.dense": "row",
        f"{p}layers.*.mlp.dense_h_to_4h": "column",
        f"{p}layers.*.mlp.dense_4h_to_h": "row",
    }
    if isinstance(getattr(model, "embed_out", None), nn.Module):
        layers["embed_out"] = "head"
    return TPPlan(name="hf-gpt_neox", layers=layers,
                  check=_heads_check("num_attention_heads"))


def opt_plan(model: nn.Module) -> TPPlan:
    """Plan for transformers OPT: q/k/v column, out_proj row, fc1 column, fc2 row; the
    attention's ``num_heads`` is divided (it reshapes with it). The positions, and the
    ``project_in``/``project_out`` of models whose embedding width differs, stay replicated;
    ``lm_head`` stays tied to ``embed_tokens``."""
    p = f"{hf_prefix(model)}decoder."
    layers = {
        f"{p}embed_tokens": "embedding",
        f"{p}layers.*.self_attn.q_proj": "column",
        f"{p}layers.*.self_attn.k_proj": "column",
        f"{p}layers.*.self_attn.v_proj": "column",
        f"{p}layers.*.self_attn.out_proj": "row",
        f"{p}layers.*.fc1": "column",
        f"{p}layers.*.fc2": "row",
    }
    if has_head(model):
        layers["lm_head"] = "head"
    return TPPlan(name="hf-opt", layers=layers,
                  divide={f"{p}layers.*.self_attn": ("num_heads",)},
                  check=_heads_check("num_attention_heads"))


_HF_PLANS = {"gpt2": gpt2_plan, "llama": llama_plan, "qwen2": llama_plan, "qwen3": llama_plan,
             "mistral": llama_plan,
             "gemma": llama_plan, "gemma2": llama_plan, "phi3": phi3_plan,
             "gpt_neox": gpt_neox_plan, "opt": opt_plan}


def plan_for(model: nn.Module) -> TPPlan:
    """The shipped plan for ``model``: overlap GPT, or a transformers model by its
    ``config.model_type`` (gpt2, llama, qwen2, qwen3, mistral, gemma, gemma2, phi3, gpt_neox,
    opt; mixture-of-experts: mixtral, qwen2_moe, qwen3_moe, deepseek_v3, gpt_oss, whose
    experts shard over EP, see overlap.models.moe_plans).
    ValueError for anything else, naming the experts a mixture-of-experts model would leave
    without a plan."""
    if isinstance(model, GPT):
        return gpt_plan()
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in MOE_PLANS:
        return MOE_PLANS[model_type](model)
    experts = expert_modules(model)
    if model_type in _HF_PLANS and not experts:
        return _HF_PLANS[model_type](model)
    if experts:
        listed = ", ".join(f"{n} ({t})" for n, t in experts[:3])
        more = f" and {len(experts) - 3} more" if len(experts) > 3 else ""
        raise ValueError(
            f"parallelize: no shipped plan for {type(model).__name__} (model_type="
            f"{model_type!r}), a mixture-of-experts model: its experts {listed}{more} need an "
            f"expert-parallel plan (a Style(kind='experts') for each sparse block), which "
            f"exists for {sorted(MOE_PLANS)}; replicating the experts on every rank is never "
            "done silently. Write a plan (docs/parallelize.md, 'Mixture-of-experts plans').")
    raise ValueError(f"parallelize: no shipped plan for {type(model).__name__} (model_type="
                     f"{model_type!r}); known: overlap GPT, {sorted(_HF_PLANS)}, "
                     f"mixture-of-experts {sorted(MOE_PLANS)}. Pass plan=TPPlan(...) with your "
                     "module-name patterns.")
