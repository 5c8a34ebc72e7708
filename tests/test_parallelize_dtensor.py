"""DTensor state dicts of a parallelized model for torch.distributed.checkpoint: the TP
parameters carry the unsharded global shape, so a DCP checkpoint saved at tp=2 loads into an
unsharded model (tp=1) or a tp=4 one, and one saved unsharded loads into a tp=2 model, bit for
bit, including fused (GPT-2's c_attn, Phi-3's unequal qkv) and uneven (vocabulary 61) parameters.
"""


import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from test_parallelize_plans import hf_model
from overlap.tp.comm import default_comm

ARCHS = ("llama", "phi3", "gpt2")


def _model(arch, seed=0):
    import transformers as T

    if arch == "llama":
        torch.manual_seed(seed)
        return T.LlamaForCausalLM(T.LlamaConfig(
            vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32))
    if arch == "gpt2":
        torch.manual_seed(seed)
        return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=61, n_positions=16, n_embd=16,
                                              n_layer=2, n_head=4, resid_pdrop=0.0,
                                              embd_pdrop=0.0, attn_pdrop=0.0))
    model = hf_model(arch)
    if seed:
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
    return model


def _save_tp(arch, path):
    import torch.distributed.checkpoint as dcp

    from overlap.nn import parallelize
    from overlap.nn.dtensor import dtensor_state_dict
    from overlap.tp import close_default_comms

    model = parallelize(_model(arch), comm=default_comm(dist.group.WORLD, backend="chunked"))
    sd = dtensor_state_dict(model)
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    dcp.save(sd, checkpoint_id=path)
    close_default_comms()
    return shapes


def _load_unsharded(arch, path):
    import torch.distributed.checkpoint as dcp

    model = _model(arch, seed=1)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=path)
    model.load_state_dict(sd)
    want = _model(arch).state_dict()
    return all(torch.equal(model.state_dict()[k], want[k]) for k in want)


def _save_unsharded(arch, path):
    import torch.distributed.checkpoint as dcp

    dcp.save(_model(arch).state_dict(), checkpoint_id=path)


def _load_tp(arch, path):
    import torch.distributed.checkpoint as dcp

    from overlap.nn import gather_state_dict, parallelize
    from overlap.nn.dtensor import dtensor_state_dict, load_dtensor_state_dict
    from overlap.tp import close_default_comms

    model = parallelize(_model(arch, seed=1),
                        comm=default_comm(dist.group.WORLD, backend="chunked"))
    sd = dtensor_state_dict(model)
    dcp.load(sd, checkpoint_id=path)
    load_dtensor_state_dict(model, sd)
    full, want = gather_state_dict(model), _model(arch).state_dict()
    ids = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        same_out = torch.allclose(model(input_ids=ids).logits,
                                  _model(arch)(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    close_default_comms()
    return all(torch.equal(full[k], want[k]) for k in want) and same_out


@pytest.mark.parametrize("arch", ARCHS)
def test_dcp_resharding_tp2_to_tp1_and_back(arch, tmp_path):
    shapes = run_ranks(_save_tp, 2, arch, str(tmp_path / "tp2"), timeout=120)[0]
    want = {k: tuple(v.shape) for k, v in _model(arch).state_dict().items()}
    assert shapes == want  # global shapes, not the shards
    assert run_ranks(_load_unsharded, 1, arch, str(tmp_path / "tp2"), timeout=120) == [True]
    run_ranks(_save_unsharded, 1, arch, str(tmp_path / "tp1"), timeout=120)
    assert run_ranks(_load_tp, 2, arch, str(tmp_path / "tp1"), timeout=120) == [True, True]


def test_dcp_resharding_tp2_to_tp4(tmp_path):
    run_ranks(_save_tp, 2, "llama", str(tmp_path / "tp2"), timeout=120)
    assert run_ranks(_load_tp, 4, "llama", str(tmp_path / "tp2"), timeout=120) == [True] * 4
