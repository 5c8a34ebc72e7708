"""Transformer shapes the planner reasons about: parameter counts and FLOPs, and named models.

Shape legend (used in every formula of ``overlap.plan``): ``L`` layers, ``h`` hidden size,
``a`` attention heads, ``kv`` key/value width (``kv_heads * h / a``), ``F`` MLP width, ``V``
vocabulary, ``s`` sequence length, ``b`` micro-batch size, ``T = b*s`` tokens of a micro-batch.

FLOPs follow Megatron's convention (Narayanan et al. 2021, Appendix; Korthikanti et al. 2022):
a matmul of (m, k) by (k, n) costs 2mkn, attention counts the full s x s score matrix (no causal
halving), and the forward pass of one layer is::

    2T*h*(h + 2kv) + 2T*h*h + n_mlp*2T*h*F + 4*b*s^2*h         (n_mlp = 2, or 3 if gated)

which for a GPT layer (kv = h, F = 4h) is Megatron's ``24*T*h^2 + 4*b*s^2*h``. The logits add
``2*T*h*V``. Backward costs twice the forward.
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
    gated_mlp: bool = False
    tied_embeddings: bool = True
    learned_positions: bool = True
    bias: bool = True
    dropout: bool = True
    source: str = ""

    def __post_init__(self) -> None:
        for arg in ("num_layers", "hidden", "num_heads", "vocab", "seq_len"):
            v = getattr(self, arg)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"model: --{arg.replace('_', '-')} must be a positive integer, "
                                 f"got {v!r}")
        if self.hidden % self.num_heads:
            raise ValueError(f"model: --hidden {self.hidden} is not divisible by --heads "
                             f"{self.num_heads}")
        if self.num_kv_heads is not None and (self.num_kv_heads < 1
                                              or self.num_heads % self.num_kv_heads):
            raise ValueError(f"model: --kv-heads {self.num_kv_heads} must divide --heads "
                             f"{self.num_heads}")
        if self.ffn is not None and self.ffn < 1:
            raise ValueError(f"model: --ffn must be a positive integer, got {self.ffn}")

    # ------------------------------------------------------------------ derived shapes
    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def ffn_dim(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def num_mlp_mats(self) -> int:
        return 3 if self.gated_mlp else 2

    # ------------------------------------------------------------------ parameters
    def layer_params(self) -> tuple[int, int]:
        """(parameters tensor parallelism shards, parameters it replicates) of one layer.

        Replicated: the two norms and the biases of the row-parallel layers (out-proj, fc2)."""
        h, kv, f = self.hidden, self.kv_dim, self.ffn_dim
        sharded = h * (h + 2 * kv) + h * h + self.num_mlp_mats * h * f
        norm = 2 * h if self.bias else h
        replicated = 2 * norm
        if self.bias:
            sharded += (h + 2 * kv) + (self.num_mlp_mats - 1) * f
            replicated += 2 * h
        return sharded, replicated

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
        return self.num_layers * (sharded + replicated) + word + pos + head + \
            self.final_norm_params()

    # ------------------------------------------------------------------ FLOPs
    def layer_fwd_flops(self, tokens: int, micro_batch: int) -> float:
        """Forward FLOPs of one layer for ``tokens = micro_batch * seq_len`` tokens (unsharded)."""
        h, kv, f, s = self.hidden, self.kv_dim, self.ffn_dim, self.seq_len
        gemm = 2 * tokens * h * (h + 2 * kv) + 2 * tokens * h * h + \
            self.num_mlp_mats * 2 * tokens * h * f
        return float(gemm + 4 * micro_batch * s * s * h)

    def attention_core_fwd_flops(self, micro_batch: int) -> float:
        """QK^T and AV of one layer: what selective recomputation runs again."""
        return 4.0 * micro_batch * self.seq_len ** 2 * self.hidden

    def head_fwd_flops(self, tokens: int) -> float:
        return 2.0 * tokens * self.hidden * self.vocab

    def model_flops_per_sequence(self) -> float:
        """Forward + backward FLOPs of one sequence, no recomputation (the MFU numerator)."""
        s = self.seq_len
        return 3.0 * (self.num_layers * self.layer_fwd_flops(s, 1) + self.head_fwd_flops(s))


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
