"""overlap.models.gpt: causality, loss vs a manual cross-entropy, deterministic init, pieces."""

import math

import pytest
import torch
import torch.nn.functional as F

from overlap.models import GPT, GPTConfig, gpt_loss, pipeline_piece_costs

pytestmark = pytest.mark.no_delay_pass("no stream or twin op")

# (vocab, seq_len, d_model, n_layer, n_head): includes odd vocab / heads and head_dim 3.
CONFIGS = [(64, 16, 32, 2, 4), (41, 9, 12, 1, 4), (97, 7, 24, 3, 3)]


def _model(vocab, seq, d, layers, heads, seed=0, bias=True):
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=vocab, seq_len=seq, d_model=d, n_layer=layers, n_head=heads,
                    bias=bias)
    return GPT(cfg).eval()


@pytest.mark.parametrize("shape", CONFIGS)
def test_causal_future_tokens_do_not_change_earlier_logits(shape):
    model = _model(*shape)
    vocab, seq = shape[0], shape[1]
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, vocab, (3, seq), generator=g)
    logits = model(idx)
    assert logits.shape == (3, seq, vocab)
    for pos in (0, seq // 2, seq - 1):
        idx2 = idx.clone()
        idx2[:, pos] = (idx2[:, pos] + 1) % vocab
        logits2 = model(idx2)
        # Exact: the earlier rows see identical inputs through identical ops.
        torch.testing.assert_close(logits2[:, :pos], logits[:, :pos], rtol=0, atol=0)
        assert not torch.allclose(logits2[:, pos:], logits[:, pos:])


@pytest.mark.parametrize("shape", CONFIGS)
@pytest.mark.parametrize("bias", [True, False])
def test_loss_matches_manual_cross_entropy(shape, bias):
    model = _model(*shape, bias=bias)
    vocab, seq = shape[0], shape[1]
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, vocab, (2, seq), generator=g)
    targets = torch.randint(0, vocab, (2, seq), generator=g)
    logits, loss = model(idx, targets)
    logp = logits.double().log_softmax(-1)
    manual = -logp.gather(-1, targets.unsqueeze(-1)).mean()
    torch.testing.assert_close(loss.double(), manual, rtol=1e-5, atol=1e-6)
    # At init the logits are near zero, so the loss is near log(V).
    assert abs(loss.item() - math.log(vocab)) < 0.1 * math.log(vocab)


def test_attention_matches_explicit_masked_softmax():
    model = _model(64, 16, 32, 1, 4)
    attn = model.blocks[0].attn
    x = torch.randn(2, 11, 32, generator=torch.Generator().manual_seed(3))
    q, k, v = (p(x).view(2, 11, 4, 8).transpose(1, 2) for p in (attn.q_proj, attn.k_proj,
                                                                attn.v_proj))
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)
    scores = scores.masked_fill(torch.ones(11, 11).triu(1).bool(), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 11, 32)
    torch.testing.assert_close(attn(x), attn.o_proj(y), rtol=1e-5, atol=1e-6)


def test_num_heads_is_read_at_run_time():
    # A TP plan shards q/k/v by heads and sets the local head count: emulate half the heads.
    model = _model(64, 16, 32, 1, 4)
    attn = model.blocks[0].attn
    x = torch.randn(2, 5, 32)
    full_q = attn.q_proj(x).view(2, 5, 4, 8)
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        proj.weight.data = proj.weight.data[:16].clone()
        proj.bias.data = proj.bias.data[:16].clone()
    attn.o_proj.weight.data = attn.o_proj.weight.data[:, :16].clone()
    attn.num_heads = 2
    q = attn.q_proj(x).view(2, 5, 2, 8)
    torch.testing.assert_close(q, full_q[:, :, :2])
    assert attn(x).shape == (2, 5, 32)


def test_deterministic_init_and_pieces_share_parameters():
    a, b = _model(64, 16, 32, 2, 4, seed=7), _model(64, 16, 32, 2, 4, seed=7)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    names = {n for n, _ in a.named_parameters()}
    assert {"tok_emb.weight", "pos_emb.weight", "blocks.0.attn.q_proj.weight",
            "blocks.1.mlp.fc2.bias", "ln_f.weight", "lm_head.weight"} <= names
    assert a.lm_head.weight.data_ptr() != a.tok_emb.weight.data_ptr()
    pieces = a.pipeline_pieces()
    assert len(pieces) == 2 + 2 == len(pipeline_piece_costs(a.config))
    piece_params = {id(p) for piece in pieces for p in piece.parameters()}
    assert piece_params == {id(p) for p in a.parameters()}
    idx = torch.randint(0, 64, (2, 16))
    x = idx
    for piece in pieces:
        x = piece(x)
    torch.testing.assert_close(x, a(idx), rtol=0, atol=0)


def test_gradients_flow_and_bad_input():
    model = _model(41, 9, 12, 1, 4)
    idx = torch.randint(0, 41, (2, 9))
    _, loss = model(idx, idx)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    torch.testing.assert_close(gpt_loss(model(idx), idx), F.cross_entropy(
        model(idx).reshape(-1, 41), idx.reshape(-1)))
    with pytest.raises(ValueError, match="seq_len=9"):
        model(torch.zeros(1, 10, dtype=torch.long))
    with pytest.raises(ValueError, match="int64"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(vocab_size=8, seq_len=4, d_model=10, n_layer=1, n_head=4)
