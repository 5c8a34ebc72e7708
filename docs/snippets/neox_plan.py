import copy

import torch
import transformers as T

from overlap.dist import ParallelDims
from overlap.dist.launch import launch
from overlap.nn import Style, TPPlan, parallelize
from overlap.tp import close_default_comms


def main():
    torch.manual_seed(0)
    model = T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=32))
    reference = copy.deepcopy(model)
    dims = ParallelDims.build(tp=2)
    cfg = model.config
    plan = TPPlan(name="my-neox", layers={
        "gpt_neox.embed_in": "embedding",
        "gpt_neox.layers.*.attention.query_key_value":
            Style(kind="column", layout="per_head", heads=cfg.num_attention_heads),
        "gpt_neox.layers.*.attention.dense": "row",
        "gpt_neox.layers.*.mlp.dense_h_to_4h": "column",
        "gpt_neox.layers.*.mlp.dense_4h_to_h": "row",
        "lm_head": "head",
    })
    parallelize(model, comm=dims.tp_comm(), plan=plan)   # verified; a mistake raises with its cause
    ids = torch.randint(0, 128, (2, 16))
    want = reference(ids).logits
    err = ((model(ids).logits - want).abs().max() / want.abs().max()).item()
    close_default_comms()
    return err


if __name__ == "__main__":
    out = launch(main, 2)
    print(out)                # relative error ~1e-7: the unsharded logits up to fp32 rounding
    assert all(e < 1e-4 for e in out), out    # parallelize's own fp32 verification tolerance
