"""Transformer shapes the planner reasons about: parameter counts and FLOPs, and named models.

Shape legend (used in every formula of ``overlap.plan``): ``L`` layers, ``h`` hidden size,
``a`` attention heads, ``kv`` key/value width (``kv_heads * h / a``), ``F`` MLP width, ``V``
vocabulary, ``s`` sequence length, ``b`` micro-batch size, ``T = b*s`` tokens of a micro-batch.

FLOPs follow Megatron's convention (Narayanan et al. 2021, Appendix; Korthikanti et al. 2022):
a matmul of (m, k) by (k, n) costs 2mkn, attention counts the full s x s score matrix (no causal
halving), and the forward pass of one layer is::

    2T*h*(h + 2kv) + 2T*h*h + n_mlp*2T*h*F + 4*b*s^2*h         (n_mlp = 2, or 3 if gated)

which for a GPT layer (kv = h, F = 4h) is Megatron's ``24*T*h^2 + 4*b*s^2*h``. The logits add
``2*T*h*V``. Backward costs twice the forward. A MoE layer counts only what a token runs:
attention, the router ``2T*h*E`` and ``(k + S) * 3 * 2T*h*Fe`` (docs/planner.md).
"""

from __future__ import annotations

import dataclasses

__all__ = ["ModelSpec", "MODELS", "get_model"]


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class ModelSpec:
    """A decoder-only transformer. ``num_kv_heads``/``ffn`` default to ``num_heads``/``4*hidden``.

    ``gated_mlp`` means SwiGLU (three h x F matrices); ``tied_embeddings`` shares the input
    embedding with the output head (with pp > 1 the last stage still holds a copy, as in
    Megatron); ``dropout`` adds the dropout masks Korthikanti et al. count to activations."""

    name: str = "custom"
    num_layers: int
    hidden: int
    num_heads: int
    vocab: int
    seq_len: int
    num_kv_heads: int | None = None
    ffn: int | None = None
    attn_head_dim: int = 0  # 0: hidden / heads (Qwen3 uses 128 with h = 4096, a = 64)
    gated_mlp: bool = False
    tied_embeddings: bool = True
    learned_positions: bool = True
    bias: bool = True
    dropout: bool = True
    # Mixture of experts (0 experts: dense). Layer i is MoE when i >= first_dense_layers and
    # (i - first_dense_layers) % moe_every == moe_every - 1, as overlap.models.gpt counts blocks.
    num_experts: int = 0
    moe_top_k: int = 2
    moe_ffn: int | None = None
    num_shared_experts: int = 0
    moe_every: int = 1
    first_dense_layers: int = 0
    # Multi-head latent attention (DeepSeek-V2/V3) when kv_lora_rank > 0.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    source: str = ""

    def __post_init__(self) -> None:
        for arg in ("num_layers", "hidden", "num_heads", "vocab", "seq_len"):
            v = getattr(self, arg)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"model: --{arg.replace('_', '-')} must be a positive integer, "
                                 f"got {v!r}")
        if self.hidden % self.num_heads and not self.attn_head_dim:
            raise ValueError(f"model: --hidden {self.hidden} is not divisible by --heads "
                             f"{self.num_heads}")
        if self.num_kv_heads is not None and (self.num_kv_heads < 1
                                              or self.num_heads % self.num_kv_heads):
            raise ValueError(f"model: --kv-heads {self.num_kv_heads} must divide --heads "
                             f"{self.num_heads}")
        if self.ffn is not None and self.ffn < 1:
            raise ValueError(f"model: --ffn must be a positive integer, got {self.ffn}")
        if self.num_experts < 0 or (self.num_experts and not 1 <= self.moe_top_k
                                    <= self.num_experts):
            raise ValueError(f"model: --moe-top-k {self.moe_top_k} must be in [1, experts "
                             f"{self.num_experts}]")
        if self.moe_every < 1 or self.first_dense_layers < 0 or self.num_shared_experts < 0:
            raise ValueError("model: moe_every must be >= 1, first_dense_layers and "
                             "num_shared_experts >= 0")

    # ------------------------------------------------------------------ derived shapes
    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.hidden // self.num_heads

    @property
    def standard_attention(self) -> bool:
        """Heads x head_dim == hidden and no MLA: the original formulas apply unchanged."""
        return not self.is_mla and self.num_heads * self.head_dim == self.hidden

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def ffn_dim(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def num_mlp_mats(self) -> int:
        return 3 if self.gated_mlp else 2

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn or self.ffn_dim

    def is_moe_layer(self, i: int) -> bool:
        j = i - self.first_dense_layers
        return self.is_moe and j >= 0 and j % self.moe_every == self.moe_every - 1

    def num_moe_layers(self, start: int = 0, stop: int | None = None) -> int:
        stop = self.num_layers if stop is None else stop
        return sum(self.is_moe_layer(i) for i in range(start, stop)) if self.is_moe else 0

    # Attention widths: what the projections produce and what flash attention stores.
    @property
    def q_width(self) -> int:
        return self.num_heads * (self.qk_nope_dim + self.qk_rope_dim) if self.is_mla \
            else self.num_heads * self.head_dim

    @property
    def k_width(self) -> int:
        return self.q_width if self.is_mla else self.kv_dim

    @property
    def v_width(self) -> int:
        return self.num_heads * self.v_head_dim if self.is_mla else self.kv_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim if self.is_mla else self.head_dim

    def attn_proj_params(self) -> tuple[int, int]:
        """(input projections, output projection) weights of one attention block. MLA: the
        low-rank query and key/value projections with their up-projections (the decoupled RoPE
        key is shared by the heads), the output from ``a * v_head_dim``."""
        h, a = self.hidden, self.num_heads
        if not self.is_mla:
            q = self.num_heads * self.head_dim
            return h * (q + 2 * self.kv_dim), q * h
        qk = self.qk_nope_dim + self.qk_rope_dim
        q = h * self.q_lora_rank + self.q_lora_rank * a * qk if self.q_lora_rank else h * a * qk
        kv = h * (self.kv_lora_rank + self.qk_rope_dim) + \
            self.kv_lora_rank * a * (self.qk_nope_dim + self.v_head_dim)
        return q + kv, a * self.v_head_dim * h

    # ------------------------------------------------------------------ parameters
    def layer_params(self) -> tuple[int, int]:
        """(parameters tensor parallelism shards, parameters it replicates) of one layer.

        Replicated: the two norms and the biases of the row-parallel layers (out-proj, fc2);
        with MLA also the two latent norms."""
        h, kv, f = self.hidden, self.kv_dim, self.ffn_dim
        if not self.standard_attention:
            sharded = sum(self.attn_proj_params()) + self.num_mlp_mats * h * f
        else:
            sharded = h * (h + 2 * kv) + h * h + self.num_mlp_mats * h * f
        norm = 2 * h if self.bias else h
        replicated = 2 * norm
        if self.is_mla:
            replicated += self.q_lora_rank + self.kv_lora_rank
        if self.bias:
            sharded += (h + 2 * kv) + (self.num_mlp_mats - 1) * f
            replicated += 2 * h
        return sharded, replicated

    def moe_layer_params(self) -> tuple[int, int, int]:
        """(TP-sharded, TP-replicated dense, expert) parameters of one MoE layer. The MoE block
        is left to EP as the runtime's GPT plan does: the router (h x E) and the shared experts
        are replicated over TP and reduced over DP; the E routed experts (SwiGLU, 3 h x Fe each)
        are replicated over TP and sharded over EP."""
        sharded, replicated = self.layer_params()
        h, fe = self.hidden, self.expert_ffn
        sharded -= self.num_mlp_mats * h * self.ffn_dim
        if self.bias:
            sharded -= (self.num_mlp_mats - 1) * self.ffn_dim
        replicated += h * self.num_experts + self.num_shared_experts * 3 * h * fe
        return sharded, replicated, self.num_experts * 3 * h * fe

    def embedding_params(self) -> tuple[int, int]:
        """(vocab-parallel word embedding, replicated position embedding)."""
        return self.vocab * self.hidden, self.seq_len * self.hidden if self.learned_positions else 0

    def head_params(self, pp: int = 1) -> int:
        """Output-projection weights held by the last stage: its own when untied, a copy of the
        word embedding when tied and pp > 1 (nothing extra when tied and pp == 1)."""
        if not self.tied_embeddings or pp > 1:
            return self.vocab * self.hidden
        return 0

    def final_norm_params(self) -> int:
        return 2 * self.hidden if self.bias else self.hidden

    def total_params(self) -> int:
        """Unique parameters (a tied head counts once)."""
        sharded, replicated = self.layer_params()
        word, pos = self.embedding_params()
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        nm = self.num_moe_layers()
        layers = (self.num_layers - nm) * (sharded + replicated) + nm * sum(
            self.moe_layer_params()) if nm else self.num_layers * (sharded + replicated)
        return layers + word + pos + head + self.final_norm_params()

    def active_params(self) -> int:
        """Parameters one token uses: ``total`` with top-k of the E routed experts."""
        nm = self.num_moe_layers()
        idle = self.num_experts - self.moe_top_k
        return self.total_params() - nm * idle * 3 * self.hidden * self.expert_ffn

    # ------------------------------------------------------------------ FLOPs
    def layer_fwd_flops(self, tokens: int, micro_batch: int, moe: bool = False) -> float:
        """Forward FLOPs of one layer for ``tokens = micro_batch * seq_len`` tokens (unsharded);
        ``moe``: a MoE layer (active experts only)."""
        h, kv, f, s = self.hidden, self.kv_dim, self.ffn_dim, self.seq_len
        if not moe and self.standard_attention:
            gemm = 2 * tokens * h * (h + 2 * kv) + 2 * tokens * h * h + \
                self.num_mlp_mats * 2 * tokens * h * f
            return float(gemm + 4 * micro_batch * s * s * h)
        attn = 2 * tokens * sum(self.attn_proj_params()) + \
            2 * micro_batch * s * s * self.num_heads * (self.qk_head_dim + self.v_head_dim
                                                         if self.is_mla else 2 * self.head_dim)
        if not moe:
            return float(attn + self.num_mlp_mats * 2 * tokens * h * f)
        per_expert = 3 * 2 * tokens * h * self.expert_ffn
        return float(attn + 2 * tokens * h * self.num_experts
                     + (self.moe_top_k + self.num_shared_experts) * per_expert)

    def attention_core_fwd_flops(self, micro_batch: int) -> float:
        """QK^T and AV of one layer: what selective recomputation runs again."""
        if not self.standard_attention:
            v = self.v_head_dim if self.is_mla else self.head_dim
            return 2.0 * micro_batch * self.seq_len ** 2 * self.num_heads * (
                self.qk_head_dim + v)
        return 4.0 * micro_batch * self.seq_len ** 2 * self.hidden

    def head_fwd_flops(self, tokens: int) -> float:
        return 2.0 * tokens * self.hidden * self.vocab

    def model_flops_per_sequence(self) -> float:
        """Forward + backward FLOPs of one sequence, no recomputation (the MFU numerator)."""
        s = self.seq_len
        if not self.is_moe:
            return 3.0 * (self.num_layers * self.layer_fwd_flops(s, 1) + self.head_fwd_flops(s))
        nm = self.num_moe_layers()
        return 3.0 * ((self.num_layers - nm) * self.layer_fwd_flops(s, 1)
                      + nm * self.layer_fwd_flops(s, 1, moe=True) + self.head_fwd_flops(s))


def _m(**kw) -> ModelSpec:
    return ModelSpec(**kw)


# Shapes from the papers that introduced the models. GPT-3's vocabulary is 50257 BPE tokens,
# padded to 51200 as in Narayanan et al. 2021 (Table 1 runs use vocab 51200).
MODELS: dict[str, ModelSpec] = {
    "gpt3-175b": _m(name="gpt3-175b", num_layers=96, hidden=12288, num_heads=96, vocab=51200,
                    seq_len=2048, source="Brown et al. 2020 (arXiv 2005.14165) Table 2.1; vocab "
                    "padded to 51200 as in Narayanan et al. 2021"),
    "gpt3-13b": _m(name="gpt3-13b", num_layers=40, hidden=5120, num_heads=40, vocab=51200,
                   seq_len=2048, source="Brown et al. 2020 Table 2.1 lists d_model 5140 with 40 "
                   "heads of 128; 40 x 128 = 5120 is used (5140 does not divide into 40 heads)"),
    "gpt3-6.7b": _m(name="gpt3-6.7b", num_layers=32, hidden=4096, num_heads=32, vocab=51200,
                    seq_len=2048, source="Brown et al. 2020 Table 2.1"),
    "llama3-8b": _m(name="llama3-8b", num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8,
                    ffn=14336, vocab=128256, seq_len=8192, gated_mlp=True,
                    tied_embeddings=False, learned_positions=False, bias=False, dropout=False,
                    source="Llama 3 Herd of Models (arXiv 2407.21783) Table 3; vocab 128256 "
                    "and context 8192 from the released config"),
    "llama3-70b": _m(name="llama3-70b", num_layers=80, hidden=8192, num_heads=64, num_kv_heads=8,
                     ffn=28672, vocab=128256, seq_len=8192, gated_mlp=True,
                     tied_embeddings=False, learned_positions=False, bias=False, dropout=False,
                     source="Llama 3 Herd of Models (arXiv 2407.21783) Table 3"),
    "llama3-405b": _m(name="llama3-405b", num_layers=126, hidden=16384, num_heads=128,
                      num_kv_heads=8, ffn=53248, vocab=128256, seq_len=8192, gated_mlp=True,
                      tied_embeddings=False, learned_positions=False, bias=False, dropout=False,
                      source="Llama 3 Herd of Models (arXiv 2407.21783) Table 3"),
    # Mixture-of-experts models: shapes from the released configs (config.json on Hugging Face)
    # and the papers; RoPE, RMSNorm, SwiGLU experts, no biases, untied heads. The planning
    # sequence length is 4096 (the published Megatron-Core MoE runs use it), not the context
    # window the models were extended to.
    "mixtral-8x7b": _m(name="mixtral-8x7b", num_layers=32, hidden=4096, num_heads=32,
                       num_kv_heads=8, ffn=14336, vocab=32000, seq_len=4096, gated_mlp=True,
                       num_experts=8, moe_top_k=2, tied_embeddings=False,
                       learned_positions=False, bias=False, dropout=False,
                       source="Jiang et al. 2024, Mixtral of Experts (arXiv 2401.04088) Table 1 "
                       "and mistralai/Mixtral-8x7B-v0.1 config.json: 46.7B total, 12.9B "
                       "active"),
    "mixtral-8x22b": _m(name="mixtral-8x22b", num_layers=56, hidden=6144, num_heads=48,
                        num_kv_heads=8, ffn=16384, vocab=32768, seq_len=4096, gated_mlp=True,
                        num_experts=8, moe_top_k=2, tied_embeddings=False,
                        learned_positions=False, bias=False, dropout=False,
                        source="mistralai/Mixtral-8x22B-v0.3 config.json (vocab 32768); Mistral "
                        "AI announcement 'Cheaper, Better, Faster, Stronger' (2024-04-17): 141B "
                        "total, 39B active"),
    "deepseek-v3": _m(name="deepseek-v3", num_layers=61, hidden=7168, num_heads=128,
                      ffn=18432, vocab=129280, seq_len=4096, gated_mlp=True, num_experts=256,
                      moe_top_k=8, moe_ffn=2048, num_shared_experts=1, first_dense_layers=3,
                      q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64,
                      v_head_dim=128, tied_embeddings=False, learned_positions=False,
                      bias=False, dropout=False,
                      source="DeepSeek-AI 2024, DeepSeek-V3 Technical Report (arXiv 2412.19437) "
                      "Sections 2.1 and 4.2 and deepseek-ai/DeepSeek-V3 config.json: 671B "
                      "total, 37B active (the multi-token-prediction module is not modelled)"),
    "qwen3-235b-a22b": _m(name="qwen3-235b-a22b", num_layers=94, hidden=4096, num_heads=64,
                          num_kv_heads=4, attn_head_dim=128, ffn=12288, vocab=151936,
                          seq_len=4096, gated_mlp=True, num_experts=128, moe_top_k=8,
                          moe_ffn=1536, tied_embeddings=False, learned_positions=False,
                          bias=False, dropout=False,
                          source="Qwen Team 2025, Qwen3 Technical Report (arXiv 2505.09388) "
                          "Table 2 and Qwen/Qwen3-235B-A22B config.json: 235B total, 22B active "
                          "(the per-head q/k norms, 256 parameters a layer, are left out)"),
    # The main job's default model (overlap/train/config.py): GPT, untied head, no dropout.
    "overlap-demo": _m(name="overlap-demo", num_layers=4, hidden=64, num_heads=4, vocab=256,
                       seq_len=64, tied_embeddings=False, dropout=False,
                       source="python -m overlap.train defaults"),
}


def get_model(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"--model {name!r} is unknown; expected one of {sorted(MODELS)}") \
            from None
