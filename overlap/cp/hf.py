"""Context parallelism for Hugging Face decoders (Llama, Qwen2, Qwen3, Mistral).

``enable_context_parallel(model, comm=cp_comm)`` switches the model's attention to the
transformers attention implementation ``"overlap_cp"``: ring attention (or another
``cp_attention`` method) over the CPComm stored on each attention module (two models with two
communicators never mix). Legend: b batch, S full sequence, s = S / cp this rank's tokens
(zig-zag chunks r and 2cp-1-r), h / h_kv the (TP-local) query / kv heads, d head size, V
vocabulary. ``cp_shard_inputs`` cuts a (b, S) batch into this rank's (b, s) piece with its true
positions and its next-token labels (shifted before sharding); ``cp_gather_logits`` rebuilds
(b, S, V) in natural order (backward: this rank's rows); ``cp_loss`` is the mean over the whole
sequence of every CP rank (its backward gives this rank's share: sum the parameter gradients
over CP). Rotary frequencies that follow the largest position (dynamic, longrope) use the whole
sequence's. Refused, naming op, argument and rank: attention masks, KV caches, dropout, sliding
windows shorter than S, unknown rope types, other families (ALiBi). Guide: docs/parallelize.md.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from overlap.cp.comm import CPComm, Packet
from overlap.cp.ring import ring_attention
from overlap.cp.zigzag import zigzag_shard, zigzag_unshard
from overlap.dist.stamp import pack_sum_tail, sum_tail_bits, unpack_sum_tail
from overlap.tp.collectives import all_gather_single, wait

__all__ = ["ATTN_NAME", "FAMILIES", "CPShard", "enable_context_parallel",
           "check_context_parallel", "cp_shard_inputs", "cp_gather_logits", "cp_loss"]

ATTN_NAME = "overlap_cp"
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
_OP = f"{ATTN_NAME} attention"


def _rank() -> str:
    return f" (rank {dist.get_rank()})" if dist.is_initialized() else ""


class _CPState:
    """What one model's attention modules read: the communicator and the attention op. A
    deep copy of the model shares it (the communicator is the group's, not the weights')."""

    __slots__ = ("comm", "attend", "hooks")

    def __init__(self, comm: CPComm, attend):
        self.comm, self.attend, self.hooks = comm, attend, []

    def __deepcopy__(self, memo):
        return self


# ---------------------------------------------------------------- the attention function

def overlap_cp_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, attention_mask, dropout: float = 0.0,
                         scaling: float | None = None, sliding_window: int | None = None,
                         **kwargs):
    """transformers' attention interface: query (b, h, s, d), key/value (b, h_kv, s, d) of
    this rank's zig-zag tokens -> ((b, s, h, d) attention over the whole sequence, None)."""
    state = getattr(module, "_overlap_cp", None)
    layer = f" in layer {getattr(module, 'layer_idx', '?')} ({type(module).__name__})"
    if state is None:
        raise RuntimeError(f"{_OP}{layer}: this attention module has no CP communicator; "
                           "switch the model with enable_context_parallel(model, comm=...) "
                           f"instead of setting attn_implementation={ATTN_NAME!r} by hand"
                           f"{_rank()}")
    comm = state.comm
    at = f"{layer}{comm.where}"
    if attention_mask is not None:
        raise ValueError(f"{_OP}: attention_mask must be None (the causal mask over the zig-"
                         f"zag sequence is built in), got a {type(attention_mask).__name__} of "
                         f"shape {tuple(getattr(attention_mask, 'shape', ()))}{at}")
    if dropout:
        raise ValueError(f"{_OP}: dropout must be 0, got {dropout} (config.attention_dropout "
                         f"in training mode): attention dropout is not supported{at}")
    full = query.shape[2] * comm.world
    if sliding_window is not None and sliding_window < full:
        raise ValueError(f"{_OP}: sliding_window={sliding_window} is shorter than the "
                         f"sequence ({full} tokens): sliding-window attention is not "
                         f"supported (set config.sliding_window=None or use_sliding_window="
                         f"False){at}")
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{_OP}: {name} is not supported{at}")
    if key.shape[2] != query.shape[2]:
        raise ValueError(f"{_OP}: key has {key.shape[2]} positions, query {query.shape[2]}: "
                         f"a KV cache (generation) is not supported{at}")
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
    # The layer's id rides in every call's stamp: ranks that run the model's layers in other
    # orders (a layer skipped on one rank) raise a Disagreement naming it.
    idx = getattr(module, "layer_idx", None)
    out = state.attend(query, key, value, comm=comm, causal=causal, scale=scaling,
                       layer=idx if isinstance(idx, int) and not isinstance(idx, bool) else -1)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, overlap_cp_attention)


_register()  # a name for a function, not state: the communicator lives on each module


# ---------------------------------------------------------------- switching a model

def _attention_op(method: str, where: str):
    try:
        from overlap.cp.attention import METHODS, cp_attention
    except ImportError:  # only the ring is built
        METHODS, cp_attention = ("ring",), None
    if method not in METHODS:
        raise ValueError(f"enable_context_parallel: method must be one of {METHODS}, got "
                         f"{method!r}{where}")
    if cp_attention is None:
        return ring_attention
    return lambda q, k, v, **kw: cp_attention(q, k, v, method=method, **kw)


def check_context_parallel(model: nn.Module, *, comm: CPComm) -> list[nn.Module]:
    """The model's attention modules, after checking that ``model`` is a supported
    transformers decoder and ``comm`` a CPComm (TypeError/ValueError otherwise)."""
    op = "enable_context_parallel"
    if not isinstance(comm, CPComm):
        raise TypeError(f"{op}: comm must be an overlap.cp.CPComm (CPComm(dims.cp_group)), "
                        f"got {type(comm).__name__}{_rank()}")
    config = getattr(model, "config", None)
    if _alibi(config):
        raise ValueError(f"{op}: model_type {config.model_type!r} ({type(model).__name__}) "
                         "adds ALiBi biases computed from the positions each rank sees to its "
                         f"attention scores: not supported; supported families: "
                         f"{list(FAMILIES)}{comm.where}")
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    if not hasattr(config, "_attn_implementation") or can_set is None or not can_set():
        raise TypeError(f"{op}: model must be a transformers model whose attention goes "
                        f"through transformers' AttentionInterface, got "
                        f"{type(model).__name__}{comm.where}")
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        raise ValueError(f"{op}: model_type {family!r} ({type(model).__name__}) is not "
                         f"supported; supported families: {list(FAMILIES)}{comm.where}")
    attns = [m for m in model.modules()
             if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]
    if not attns:
        raise ValueError(f"{op}: found no attention module (a class named *Attention with a "
                         f"layer_idx) in {type(model).__name__}{comm.where}")
    _length_rotaries(model, comm)
    return attns


# ---------------------------------------------------------------- positions

# transformers' rope types (ROPE_INIT_FUNCTIONS) -> the function it ships for each: the
# frequencies of these come from the config alone, fixed when the module is built ...
_STATIC_ROPE = {"linear": "_compute_linear_scaling_rope_parameters",
                "yarn": "_compute_yarn_parameters", "llama3": "_compute_llama3_parameters",
                "proportional": "_compute_proportional_rope_parameters"}
# ... these are picked on every call from max(position_ids) + 1 (dynamic_rope_update)
_LENGTH_ROPE = {"dynamic": "_compute_dynamic_ntk_parameters",
                "longrope": "_compute_longrope_parameters"}
_KNOWN_ROPE = {**_STATIC_ROPE, **_LENGTH_ROPE}
_FIELD = "config.rope_parameters['rope_type'] (rope_scaling in older configs)"


def _alibi(config) -> bool:
    attn = getattr(config, "attn_config", None)  # MPT
    alibi = attn.get("alibi") if isinstance(attn, dict) else getattr(attn, "alibi", False)
    return getattr(config, "model_type", None) == "bloom" or bool(
        getattr(config, "alibi", False) or alibi)


def _length_rotaries(model: nn.Module, comm: CPComm) -> list[nn.Module]:
    """The model's rotary embeddings whose frequencies depend on the largest position they
    see; ValueError for one that transformers' dynamic_rope_update does not drive or whose
    rope type (or its frequency function) is not one transformers ships."""
    import transformers.modeling_rope_utils as mru

    op, name = "enable_context_parallel", type(model).__name__
    wrapper = mru.dynamic_rope_update(lambda self, x, position_ids: None).__code__
    found = []
    for path, m in model.named_modules():
        if not type(m).__name__.endswith("RotaryEmbedding") and not hasattr(m, "inv_freq"):
            continue
        at = f"{name}.{path} ({type(m).__name__})"
        if getattr(type(m).forward, "__code__", None) is not wrapper:
            raise ValueError(f"{op}: the rotary embedding {at} is not transformers' standard "
                             "one (a forward under dynamic_rope_update): its frequencies may "
                             f"depend on the positions each rank sees{comm.where}")
        rope = getattr(m, "rope_type", None)
        if rope == "default":  # the module's own compute_default_rope_parameters
            continue
        if not isinstance(rope, str) or rope not in _KNOWN_ROPE:
            raise ValueError(f"{op}: the rotary embedding {at} has rope type {rope!r} "
                             f"({_FIELD}), which is not known to be safe "
                             "under context parallelism; supported: "
                             f"{['default', *_KNOWN_ROPE]}{comm.where}")
        if mru.ROPE_INIT_FUNCTIONS.get(rope) is not getattr(mru, _KNOWN_ROPE[rope]):
            raise ValueError(f"{op}: the rotary embedding {at} has rope type {rope!r} "
                             f"({_FIELD}) but transformers' ROPE_INIT_FUNCTIONS[{rope!r}] is "
                             f"not its own {_KNOWN_ROPE[rope]}: its frequencies may depend on the "
                             f"positions each rank sees{comm.where}")
        if rope in _LENGTH_ROPE:
            found.append(m)
    return found


def _largest_position(comm: CPComm):
    """Hooks on a rotary embedding that picks its frequencies from max(position_ids) + 1:
    the pre-hook appends the largest position of the whole sequence (over the CP group) as
    one more column, so every rank picks the unsharded model's frequencies (and keeps its
    cache state in step with it); the forward hook drops that column from cos and sin."""

    def pre(module, args, kwargs):
        key = "position_ids" in kwargs
        pos = kwargs["position_ids"] if key else args[1]
        top = pos.max().reshape(1)
        every = top.new_empty(comm.world)
        wait(all_gather_single(every, top, group=comm.group, async_op=True),
             op="rotary largest position", group=comm.group, timeout=comm.timeout, axis="cp")
        pos = torch.cat([pos, every.max().expand(pos.shape[0], 1)], 1)
        if key:
            return args, {**kwargs, "position_ids": pos}
        return (args[0], pos, *args[2:]), kwargs

    def post(module, args, kwargs, output):
        return tuple(t[..., :-1, :] for t in output)
    return pre, post


def enable_context_parallel(model: nn.Module, *, comm: CPComm, method: str = "ring"
                            ) -> nn.Module:
    """Run ``model``'s attention over ``comm``'s CP group (in place; returns ``model``).
    Call it after ``parallelize(model, comm=tp_comm)`` (or pass ``cp_comm=`` to it): the
    ring then runs over this TP rank's heads. ``method``: ``overlap.cp.cp_attention``'s
    ("ring", "allgather", "ulysses", "auto")."""
    attns = check_context_parallel(model, comm=comm)
    state = _CPState(comm, _attention_op(method, comm.where))
    old = getattr(model, "_overlap_cp", None)
    for handle in old.hooks if old is not None else ():
        handle.remove()
    model._overlap_cp = state
    for m in attns:
        m._overlap_cp = state
        if m.config is not model.config:  # parallelize may give a module its own config copy
            m.config._attn_implementation = ATTN_NAME
    model.config._attn_implementation = ATTN_NAME
    base = getattr(model, "base_model", model)
    state.hooks.append(base.register_forward_pre_hook(_input_check(base, comm),
                                                      with_kwargs=True))
    if base is not model:
        state.hooks.append(model.register_forward_pre_hook(_labels_check(model, comm),
                                                           with_kwargs=True))
    pre, post = _largest_position(comm)
    for rotary in _length_rotaries(model, comm) if comm.world > 1 else ():
        state.hooks += [rotary.register_forward_pre_hook(pre, with_kwargs=True),
                        rotary.register_forward_hook(post, with_kwargs=True)]
    return model


def _getter(module: nn.Module):
    names = list(inspect.signature(module.forward).parameters)

    def get(name: str, args: tuple, kwargs: dict):
        if name in kwargs:
            return kwargs[name]
        i = names.index(name) if name in names else len(args)
        return args[i] if i < len(args) else None
    return get


def _input_check(base: nn.Module, comm: CPComm):
    """A pre-hook on the decoder: what the attention function cannot see (the mask is
    dropped before it for a custom implementation; positions only matter to the rotary)."""
    get, op = _getter(base), f"{type(base).__name__} under context parallelism"

    def hook(module, args, kwargs):
        x = get("input_ids", args, kwargs)
        x = get("inputs_embeds", args, kwargs) if x is None else x
        if get("attention_mask", args, kwargs) is not None:
            raise ValueError(f"{op}: attention_mask must be None: padding masks are not "
                             "supported (right-pad to a multiple of 2 * cp and give the "
                             f"padding the label -100; causal attention never sees it){comm.where}")
        for name in ("cache", "past_key_values"):
            if get(name, args, kwargs) is not None:
                raise ValueError(f"{op}: {name} must be None: a KV cache (generation) is not "
                                 f"supported{comm.where}")
        s = x.shape[1] if isinstance(x, torch.Tensor) and x.dim() >= 2 else None
        if s is None or s == 0 or s % 2:
            raise ValueError(f"{op}: input_ids must be this rank's (b, s) zig-zag piece with an "
                             f"even s (two chunks), got shape "
                             f"{tuple(getattr(x, 'shape', ()))}{comm.where}")
        pos = get("position_ids", args, kwargs)
        if pos is None and comm.world > 1:
            raise ValueError(f"{op}: position_ids must be given at cp={comm.world}: this "
                             "rank's tokens are zig-zag chunks and the rotary embedding needs "
                             f"their true positions (cp_shard_inputs returns them){comm.where}")
        if pos is not None and (pos.dim() != 2 or pos.shape[1] != s):
            raise ValueError(f"{op}: position_ids must be (b or 1, s={s}), got shape "
                             f"{tuple(pos.shape)}{comm.where}")
    return hook


def _labels_check(model: nn.Module, comm: CPComm):
    get = _getter(model)

    def hook(module, args, kwargs):
        if get("labels", args, kwargs) is not None:
            raise ValueError(f"{type(module).__name__} under context parallelism: labels must "
                             "be None: the model's loss shifts labels inside this rank's "
                             "piece; shift and shard them with cp_shard_inputs(labels=...) "
                             f"and compute the loss with cp_loss{comm.where}")
    return hook


# ---------------------------------------------------------------- inputs, logits, loss

class CPShard(NamedTuple):
    """This rank's piece of a batch: (b, s) token ids, (b or 1, s) true positions, and (b, s)
    next-token labels (None without labels)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor | None


def cp_shard_inputs(input_ids: torch.Tensor, *, comm: CPComm, labels: torch.Tensor | None = None,
                    position_ids: torch.Tensor | None = None,
                    ignore_index: int = -100) -> CPShard:
    """This CP rank's zig-zag piece of ``input_ids`` (b, S), the true positions of its
    tokens (default ``arange(S)``) and, with ``labels`` (b, S), each token's label for the
    next-token loss: ``labels`` shifted left by one over the whole sequence, the last
    ``ignore_index``, then sharded like the tokens."""
    op = "cp_shard_inputs"
    if not isinstance(comm, CPComm):
        raise TypeError(f"{op}: comm must be a CPComm, got {type(comm).__name__}"
                        f"{_rank()}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"{op}: input_ids must be a (b, S) tensor, got "
                         f"{tuple(getattr(input_ids, 'shape', ())) or type(input_ids).__name__}"
                         f"{comm.where}")
    b, full = input_ids.shape
    cp = comm.world
    if full == 0 or full % (2 * cp):
        raise ValueError(f"{op}: the sequence length of input_ids must be a positive multiple "
                         f"of 2 * cp = {2 * cp} (zig-zag chunks), got {full}; pad it (labels "
                         f"{ignore_index} on the padding){comm.where}")
    if labels is not None and tuple(labels.shape) != (b, full):
        raise ValueError(f"{op}: labels must have input_ids' shape {(b, full)}, got "
                         f"{tuple(labels.shape)}{comm.where}")
    if position_ids is None:
        position_ids = torch.arange(full, device=input_ids.device).unsqueeze(0)
    elif position_ids.dim() != 2 or position_ids.shape[1] != full or \
            position_ids.shape[0] not in (1, b):
        raise ValueError(f"{op}: position_ids must be (1 or b={b}, S={full}), got "
                         f"{tuple(position_ids.shape)}{comm.where}")
    piece = lambda t: zigzag_shard(t, 1, cp=cp, rank=comm.rank)  # noqa: E731
    shifted = None
    if labels is not None:
        shifted = F.pad(labels[:, 1:], (0, 1), value=ignore_index)
    return CPShard(piece(input_ids), piece(position_ids),
                   None if shifted is None else piece(shifted))


class _GatherSequence(torch.autograd.Function):
    """forward: every rank's (b, s, ...) piece, all-gathered and put in natural order;
    backward: this rank's zig-zag rows of the gradient (no sum: the loss on the gathered
    logits is the same on every rank)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        op = "cp_gather_logits"
        comm.check_usable(op)
        with comm.guard(op):
            # Each row carries this call's stamp (plain gloo: compared alone first, as the
            # sizes follow the call): a skipped call or another V raises on every rank.
            comm.stamp(op, x, _NO_LABELS, False, 0.0)
            comm.stamps_alone(op)
            packet = Packet([(tuple(x.shape), x.dtype)], stamp=True)
            mine, every = packet.empty(1, x.device), packet.empty(comm.world, x.device)
            packet.views(mine)[0][0].copy_(x)
            packet.stamps(mine)[0].copy_(comm.agree.send)
            what = "the logits' all-gather"
            comm.wait_collective(comm.collective("all_gather", every, mine, op=op, what=what),
                                 op=op, what=what)
            comm.verify_rows(op, packet.stamps(every))
            out = zigzag_unshard(list(packet.views(every)[0].unbind(0)), 1)
            comm.agree.poison(out)
            return out

    @staticmethod
    def backward(ctx, dy):
        return zigzag_shard(dy, 1, cp=ctx.comm.world, rank=ctx.comm.rank), None


_NO_LABELS = torch.empty(0, device="meta")  # cp_gather_logits' stamp: no labels


def cp_gather_logits(local_logits: torch.Tensor, *, comm: CPComm) -> torch.Tensor:
    """(b, s, V) on every CP rank -> (b, S, V) in natural order, on every rank; a stamped call
    of ``comm`` (other shapes or dtypes raise a Disagreement on every rank)."""
    if not isinstance(comm, CPComm):
        raise TypeError(f"cp_gather_logits: comm must be a CPComm, got {type(comm).__name__}"
                        f"{_rank()}")
    if not isinstance(local_logits, torch.Tensor) or local_logits.dim() < 2 or \
            local_logits.shape[1] % 2:
        raise ValueError(f"cp_gather_logits: local_logits must be (b, s, ...) with an even s, "
                         f"got {tuple(getattr(local_logits, 'shape', ()))}{comm.where}")
    if comm.world == 1:
        return local_logits
    return _GatherSequence.apply(local_logits, comm)


class _SumOverCP(torch.autograd.Function):
    """forward: the sum of the fp32 pair (loss sum, count) over the CP group, with this
    call's stamp in a SUM tail (every rank's row, exact in fp32); backward: the gradient as
    it is (each rank differentiates its own terms)."""

    @staticmethod
    def forward(ctx, x, comm, logits, labels, ignore_index):
        op = "cp_loss"
        comm.check_usable(op)
        with comm.guard(op):
            comm.stamp(op, logits, labels, False, 0.0, ignore_index=ignore_index)
            bits = sum_tail_bits(x.dtype)
            tail = pack_sum_tail(comm.agree.send, bits)
            n, k = x.numel(), tail.numel()
            buf = x.new_zeros(n + comm.world * k)
            buf[:n] = x
            buf[n + comm.rank * k:n + (comm.rank + 1) * k] = tail
            what = "the loss all-reduce"
            comm.wait_collective(comm.collective("all_reduce_sum", buf, buf, op=op,
                                                 what=what), op=op, what=what)
            comm.verify_rows(op, unpack_sum_tail(buf[n:].view(comm.world, k), bits))
            out = buf[:n].clone()
            comm.agree.poison(out)
            return out

    @staticmethod
    def backward(ctx, dy):
        return dy, None, None, None, None


def cp_loss(local_logits: torch.Tensor, labels: torch.Tensor, *, comm: CPComm,
            ignore_index: int = -100) -> torch.Tensor:
    """The next-token cross-entropy averaged over every non-ignored label of the whole
    sequence (all CP ranks), in fp32, the same value on every rank: (sum of local losses) /
    (global count). ``labels``: this rank's shifted labels from ``cp_shard_inputs``. Its
    backward gives this rank's terms: the sum of the parameter gradients over CP equals the
    unsharded model's. Each call is a stamped call of ``comm`` (shapes, dtype, ignore_index,
    the call number): ranks that disagree, or call it once more or less than the others,
    raise a Disagreement on every rank."""
    if not isinstance(comm, CPComm):
        raise TypeError(f"cp_loss: comm must be a CPComm, got {type(comm).__name__}"
                        f"{_rank()}")
    if local_logits.dim() != 3 or tuple(labels.shape) != tuple(local_logits.shape[:2]):
        raise ValueError(f"cp_loss: local_logits must be (b, s, V) and labels (b, s), got "
                         f"{tuple(local_logits.shape)} and {tuple(labels.shape)}{comm.where}")
    comm.check_usable("cp_loss")
    with comm.guard("cp_loss"):  # an error here (a label out of range) reaches every rank
        total = F.cross_entropy(local_logits.float().flatten(0, 1), labels.flatten(),
                                ignore_index=ignore_index, reduction="sum")
        count = (labels != ignore_index).sum().to(total.dtype)
        both = torch.stack([total, count])
    if comm.world > 1:
        both = _SumOverCP.apply(both, comm, local_logits.detach(), labels, ignore_index)
    return both[0] / both[1]
