import torch
import torch.distributed as dist

from overlap.dist import ParallelDims
from overlap.dist.launch import launch
from overlap.tp import TPComm, all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter


def main(backend):
    dims = ParallelDims.build(tp=dist.get_world_size())
    tp, r = dims.tp, dims.tp_rank
    torch.manual_seed(0)                                   # the same full tensors everywhere
    x, w1, w2 = torch.randn(8, 2, 16), torch.randn(16, 32), torch.randn(32, 16)
    x_shard = x.chunk(tp, dim=0)[r]                        # [S/tp, B, H]: a sequence shard
    w1_shard, w2_shard = w1.chunk(tp, dim=1)[r], w2.chunk(tp, dim=0)[r]
    with TPComm(dims.tp_group, backend=backend, timeout=60) as comm:   # collective
        h = all_gather_matmul(x_shard, w1_shard, comm=comm)           # [S, B, F/tp]
        y_shard = matmul_reduce_scatter(h.relu(), w2_shard, comm=comm)  # [S/tp, B, H]
        y = matmul_all_reduce(h.relu(), w2_shard, comm=comm)          # [S, B, H]
    want = (x.double() @ w1.double()).relu() @ w2.double()     # exact enough: float64
    bound = 48 * 2.0**-24 * (x.abs() @ w1.abs()) @ w2.abs()     # fp32 sums of 16 + 32 terms
    return bool(((y - want).abs() <= bound).all()
                and ((y_shard - want.chunk(tp, dim=0)[r]).abs() <= bound.chunk(tp)[r]).all())


if __name__ == "__main__":
    for backend in ("chunked", "symmetric", "unfused"):
        within = launch(main, 2, args=(backend,))
        print(backend, within)                # [True, True]: equal up to fp32 rounding
        assert all(within), (backend, within)
