import copy

import torch

from overlap.dist import ParallelDims
from overlap.dist.launch import launch
from overlap.models import GPT, GPTConfig, gpt_loss
from overlap.nn import parallelize
from overlap.tp import TPComm, all_gather_matmul


def main():
    dims = ParallelDims.build(tp=2)                 # every process group, built once
    torch.manual_seed(0)                            # the same model and data on every rank
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=2, n_head=4))
    ids = torch.randint(0, 64, (4, 17))
    want = gpt_loss(copy.deepcopy(model)(ids[:, :-1]), ids[:, 1:])
    with TPComm(dims.tp_group, backend="chunked") as comm:    # or "symmetric", "triton", ...
        parallelize(model, comm=comm)               # TP layers swapped in, checked on a probe
        loss = gpt_loss(model(ids[:, :-1]), ids[:, 1:])       # fused AG/RS/AR under the GEMMs
        loss.backward()
        x, w = torch.randn(4, 8), torch.randn(8, 6)           # a fused op on its own
        y = all_gather_matmul(x.chunk(2)[dims.tp_rank], w, comm=comm)   # [4/2, 8] -> [4, 6]
    return abs(loss.item() - want.item()), (y - x @ w).abs().max().item()


if __name__ == "__main__":
    errors = launch(main, 2)
    print(errors)                             # [(~1e-7, ~1e-7), ...]: the unsharded numbers
    assert all(e < 1e-4 for rank in errors for e in rank), errors   # fp32 sums reordered
