"""A small nanoGPT-style decoder in plain PyTorch, shared by the demo, TP plans and pipelining.

Shape legend: ``b`` batch, ``t`` sequence length (<= ``seq_len``), ``d`` d_model, ``h`` heads
(``attn.num_heads``, the *local* count once tensor parallelism shards the projections),
``hd`` head dim, ``V`` vocab size.

Module names are a contract other parts of the project rely on (TP plans match them):
``tok_emb``, ``pos_emb``, ``blocks[i].{ln1, attn.{q,k,v,o}_proj, ln2, mlp.{fc1, fc2}}``,
``ln_f``, ``lm_head`` (untied from ``tok_emb``). With ``moe_experts > 0`` every
``moe_every``-th block's ``mlp`` is a ``MoEMLP`` (``mlp.moe``: overlap.moe.MoE).

``GPT.pipeline_pieces()`` expresses the model as a sequence ``[embedding, block_0, ...,
block_{L-1}, head]`` whose composition is exactly ``GPT.forward`` (same ops, same order), so a
pipeline split into any contiguous groups of pieces computes the same numbers as the whole.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from overlap.defaults import positive_int

__all__ = ["GPTConfig", "GPT", "Block", "CausalSelfAttention", "MLP", "MoEMLP", "GPTEmbedding",
           "GPTHead", "gpt_loss", "pipeline_piece_costs"]


@dataclasses.dataclass(kw_only=True, slots=True)
class GPTConfig:
    vocab_size: int
    seq_len: int
    d_model: int
    n_layer: int
    n_head: int
    mlp_ratio: int = 4
    dropout: float = 0.0
    bias: bool = True
    # Mixture of experts (0 experts: a dense model). Block i is MoE when i % moe_every ==
    # moe_every - 1; experts are SwiGLU of moe_d_ff (default mlp_ratio * d_model);
    # moe_shared shared experts of the same size run on every token; capacity_factor None is
    # dropless. moe_token_groups: tokens are routed (and capacity applied) in that many
    # contiguous groups along the sequence, so one process routes like tp sequence-parallel
    # ranks. moe_aux_coef / moe_z_coef: weights of the load-balancing and z losses.
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_every: int = 1
    moe_d_ff: int | None = None
    moe_shared: int = 0
    capacity_factor: float | None = None
    moe_token_groups: int = 1
    moe_aux_coef: float = 0.01
    moe_z_coef: float = 0.0
    # moe_token_zigzag = cp > 1: the sequence is put in the zig-zag order of cp context-
    # parallel ranks before it is cut into the token groups (and restored after), so one
    # process routes the groups a cp x tp job routes (its ranks hold zig-zag chunks).
    moe_token_zigzag: int = 1

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layer", "n_head", "mlp_ratio",
                     "moe_top_k", "moe_every", "moe_token_groups", "moe_token_zigzag"):
            value = getattr(self, name)
            positive_int(value, f"GPTConfig: {name}")
        if isinstance(self.moe_experts, bool) or not isinstance(self.moe_experts, int) \
                or self.moe_experts < 0:
            raise ValueError(f"GPTConfig: moe_experts must be an int >= 0, got "
                             f"{self.moe_experts!r}")
        if self.moe_experts and self.moe_top_k > self.moe_experts:
            raise ValueError(f"GPTConfig: moe_top_k={self.moe_top_k} is larger than "
                             f"moe_experts={self.moe_experts}")
        if self.moe_experts and self.seq_len % self.moe_token_groups:
            raise ValueError(f"GPTConfig: seq_len={self.seq_len} must be divisible by "
                             f"moe_token_groups={self.moe_token_groups}")
        if self.moe_experts and self.seq_len % (2 * self.moe_token_zigzag):
            raise ValueError(f"GPTConfig: seq_len={self.seq_len} must be divisible by 2 x "
                             f"moe_token_zigzag={self.moe_token_zigzag}")
        if self.moe_shared < 0 or self.moe_aux_coef < 0 or self.moe_z_coef < 0:
            raise ValueError("GPTConfig: moe_shared, moe_aux_coef and moe_z_coef must be >= 0")
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig: d_model={self.d_model} must be divisible by "
                             f"n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout must be in [0, 1), got {self.dropout}")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q/k/v/o projections.

    ``num_heads`` is read in forward and the head dim is derived at run time as
    ``q_proj.out_features_local / num_heads``, so a TP plan can shard the projections by heads
    and set ``num_heads`` to the local head count without touching this code.

    forward: x (b, t, d) -> q, k, v (b, h, t, hd) -> sdpa(is_causal) (b, h, t, hd)
             -> (b, t, h*hd) -> o_proj -> (b, t, d)
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        d = config.d_model
        self.q_proj = nn.Linear(d, d, bias=config.bias)
        self.k_proj = nn.Linear(d, d, bias=config.bias)
        self.v_proj = nn.Linear(d, d, bias=config.bias)
        self.o_proj = nn.Linear(d, d, bias=config.bias)
        self.num_heads = config.n_head
        self.dropout = config.dropout
        self.resid_drop = nn.Dropout(config.dropout)
        # Context parallelism (GPT.context_parallel): q/k/v hold this rank's zig-zag rows and
        # the core attends them over the whole sequence with overlap.cp's cp_attention.
        self.cp_comm, self.cp_method = None, "ring"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attend(self.q_proj(x), self.k_proj(x), self.v_proj(x))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Heads, causal attention and the output projection from projected q, k, v
        (b, t, h*hd). The sequence length is read from q, so a TP subclass may hand in q/k/v
        gathered to full length from a sequence shard."""
        return self.resid_drop(self.o_proj(self.core(q, k, v)))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention core (b, t, h*hd) x3 -> (b, t, h*hd): scores, softmax, dropout and
        the weighted sum of v. A separate method so training code can recompute it (selective
        activation recomputation) or run it under a per-TP-rank RNG, by wrapping it."""
        b, t, _ = q.shape
        head_dim = q.shape[-1] // self.num_heads
        q, k, v = (z.view(b, t, self.num_heads, head_dim).transpose(1, 2) for z in (q, k, v))
        if self.cp_comm is not None:
            from overlap.cp import cp_attention

            y = cp_attention(q, k, v, comm=self.cp_comm, causal=True, method=self.cp_method)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        return y.transpose(1, 2).reshape(b, t, self.num_heads * head_dim)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.fc1 = nn.Linear(config.d_model, hidden, bias=config.bias)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, config.d_model, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.act(self.fc1(x))))


class _AuxLoss(torch.autograd.Function):
    """Identity on ``y`` whose backward also feeds ``scale`` into ``aux`` (the auxiliary
    losses): their gradients reach the router without the loss being returned, so a pipeline
    stage in the middle trains them too (Megatron's auxiliary-loss scaler)."""

    @staticmethod
    def forward(ctx, y, aux, scale: float):
        ctx.scale = scale
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        return g, torch.full((), ctx.scale, dtype=torch.float32, device=g.device), None


class MoEMLP(nn.Module):
    """The MoE feed-forward of a block: (b, t, d) -> (b, t, d), routed in ``token_groups``
    contiguous groups along t (1 where sequence parallelism already gives each rank one group).
    ``aux_scale`` multiplies the auxiliary losses' gradient: set it to the main loss's scale
    (1/micro-batches in a pipeline; 1/n for n micro-batches summed on one process)."""

    def __init__(self, config: GPTConfig, ep_comm=None):
        from overlap.moe import MoE

        super().__init__()
        d_ff = config.moe_d_ff or config.mlp_ratio * config.d_model
        self.moe = MoE(config.d_model, d_ff, config.moe_experts, config.moe_top_k,
                       comm=ep_comm, capacity_factor=config.capacity_factor,
                       shared_d_ff=d_ff * config.moe_shared if config.moe_shared else None)
        self.token_groups = config.moe_token_groups
        self.groups_total = config.moe_token_groups  # what the aux losses are averaged over
        self.zigzag = config.moe_token_zigzag
        self.coefs = (config.moe_aux_coef, config.moe_z_coef)
        self.aux_scale = 1.0
        self.last_aux: tuple[torch.Tensor, torch.Tensor] | None = None  # (lb, z) group means
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts, lb, z = [], 0.0, 0.0
        if self.zigzag > 1:  # route in the cp ranks' zig-zag order (GPTConfig)
            order = zigzag_order(x.shape[1], self.zigzag, x.device)
            x = x[:, order]
        for chunk in x.chunk(self.token_groups, dim=1) if self.token_groups > 1 else (x,):
            parts.append(self.moe(chunk))
            lb, z = lb + self.moe.aux.load_balancing, z + self.moe.aux.z
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        if self.zigzag > 1:
            y = y[:, torch.argsort(order)]
        self.last_aux = (lb / self.groups_total, z / self.groups_total)
        if self.training and torch.is_grad_enabled() and (self.coefs[0] or self.coefs[1]):
            aux = self.coefs[0] * self.last_aux[0] + self.coefs[1] * self.last_aux[1]
            y = _AuxLoss.apply(y, aux, self.aux_scale)
        return self.drop(y)


def zigzag_order(t: int, cp: int, device=None) -> torch.Tensor:
    """Positions 0..t-1 in the order of cp context-parallel ranks' zig-zag pieces, rank 0's
    first: rank r holds chunks r and 2cp-1-r of the 2cp chunks."""
    from overlap.cp.zigzag import zigzag_shard

    pos = torch.arange(t, device=device)
    return torch.cat([zigzag_shard(pos, 0, cp=cp, rank=r) for r in range(cp)])


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then + mlp(ln2(x)). (b, t, d) -> (b, t, d).
    ``moe``: its ``mlp`` is a MoEMLP (experts sharded over ``ep_comm``'s group, if given)."""

    def __init__(self, config: GPTConfig, *, moe: bool = False, ep_comm=None):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = MoEMLP(config, ep_comm) if moe else MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPTEmbedding(nn.Module):
    """First pipeline piece: token ids (b, t) int64 -> hidden (b, t, d). Shares the GPT's
    ``tok_emb``/``pos_emb`` modules (no copy)."""

    def __init__(self, tok_emb: nn.Embedding, pos_emb: nn.Embedding, drop: nn.Dropout,
                 positions: torch.Tensor | None = None):
        super().__init__()
        self.tok_emb, self.pos_emb, self.drop = tok_emb, pos_emb, drop
        self.positions = positions  # a context-parallel rank's true positions (else 0..t-1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if self.positions is not None:
            if t != self.positions.numel():
                raise ValueError(f"GPT: a context-parallel rank takes its {self.positions.numel()}"
                                 f" tokens of each sequence (zig-zag), got {t}")
            if self.positions.device != idx.device:  # moved once, not per forward
                self.positions = self.positions.to(idx.device)
            pos = self.positions
        elif t > self.pos_emb.num_embeddings:
            raise ValueError(f"GPT: sequence length {t} exceeds seq_len="
                             f"{self.pos_emb.num_embeddings}")
        else:
            pos = torch.arange(t, device=idx.device)
        return self.drop(self.tok_emb(idx) + self.pos_emb(pos))


class GPTHead(nn.Module):
    """Last pipeline piece: hidden (b, t, d) -> logits (b, t, V). Shares ``ln_f``/``lm_head``."""

    def __init__(self, ln_f: nn.LayerNorm, lm_head: nn.Linear):
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy: logits (b, t, V), targets (b, t) int64 -> scalar."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class GPT(nn.Module):
    """``ep_comm``: an EPComm over which the MoE blocks shard their experts (None: every
    expert here). The same seed gives the same model at any EP size. After
    ``context_parallel(cp_comm)`` the model takes a CP rank's zig-zag tokens of each sequence
    (``zigzag_shard`` of the ids, dim 1), embeds them at their true positions and attends over
    the whole sequence with ``cp_attention``."""

    def __init__(self, config: GPTConfig, *, ep_comm=None):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPT: config must be a GPTConfig, got {type(config).__name__}")
        self.config = config
        self.positions = None
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        every = config.moe_every
        self.blocks = nn.ModuleList(
            Block(config, moe=config.moe_experts > 0 and i % every == every - 1,
                  ep_comm=ep_comm) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model, bias=config.bias)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self._init_weights()

    def context_parallel(self, cp_comm, *, method: str = "ring") -> None:
        """Make this model a CP rank's (``cp_comm``; class docstring). Call it after
        ``parallelize`` (whose probe runs the whole model on one rank's full sequence) and
        before ``pipeline_pieces``."""
        from overlap.cp.zigzag import zigzag_shard

        self.positions = zigzag_shard(torch.arange(self.config.seq_len), 0, cp=cp_comm.world,
                                      rank=cp_comm.rank)
        for block in self.blocks:
            block.attn.cp_comm, block.attn.cp_method = cp_comm, method

    def _init_weights(self) -> None:
        # GPT-2 init; residual output projections are scaled down so the residual stream's
        # variance does not grow with depth. Order is fixed by named_modules: deterministic.
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = resid_std if name.endswith(("o_proj", "fc2")) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def pipeline_pieces(self) -> list[nn.Module]:
        """``[GPTEmbedding, *blocks, GPTHead]``: applying them in order equals ``forward``
        without targets. The pieces share this model's parameters."""
        return [GPTEmbedding(self.tok_emb, self.pos_emb, self.drop, self.positions),
                *self.blocks,
                GPTHead(self.ln_f, self.lm_head)]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx (b, t) int64 -> logits (b, t, V); with targets (b, t): (logits, loss)."""
        if idx.dim() != 2 or idx.dtype != torch.long:
            raise ValueError(f"GPT.forward: idx must be (batch, seq) int64, got "
                             f"{tuple(idx.shape)} {idx.dtype}")
        x = idx
        for piece in self.pipeline_pieces():
            x = piece(x)
        if targets is None:
            return x
        return x, gpt_loss(x, targets)


def pipeline_piece_costs(config: GPTConfig) -> list[float]:
    """Forward FLOPs per token of each pipeline piece (for balancing a split):
    embedding ~ 0 (a lookup), block = 2*(4 d^2 + 2 r d^2) + 4 t d (projections, MLP,
    attention at full length t), head = 2 d V. A MoE block's feed-forward counts the top-k
    experts and the shared ones a token runs (SwiGLU: 3 matrices of d x f) and the router."""
    d, t = config.d_model, config.seq_len
    attn = 2.0 * 4 * d * d + 4.0 * t * d
    dense = attn + 2.0 * 2 * config.mlp_ratio * d * d
    f = config.moe_d_ff or config.mlp_ratio * d
    moe = attn + 2.0 * 3 * d * f * (config.moe_top_k + config.moe_shared) \
        + 2.0 * d * config.moe_experts
    every = config.moe_every
    blocks = [moe if config.moe_experts and i % every == every - 1 else dense
              for i in range(config.n_layer)]
    return [float(d), *blocks, 2.0 * d * config.vocab_size]
