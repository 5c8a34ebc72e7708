import torch
import torch.distributed as dist

from overlap.dist import ParallelDims
from overlap.dist.launch import launch


def work(scale):                              # module-level, so it can be sent to the ranks
    dims = ParallelDims.build(tp=2)           # collective; dp = 4 / 2 = 2 inferred
    t = torch.full((2,), float(dist.get_rank()) * scale)
    dist.all_reduce(t, group=dims.tp_group)   # TP is innermost: ranks {0, 1} and {2, 3}
    return dims.ranks("tp"), t.tolist()


if __name__ == "__main__":
    print(ParallelDims.resolve(world_size=8, tp=2, pp=2))   # a pure check: dp=2 inferred
    out = launch(work, 4, args=(1.0,))
    print(out)       # [([0, 1], [1.0, 1.0]), ([0, 1], [1.0, 1.0]), ([2, 3], [5.0, 5.0]), ...]
    assert out == [([0, 1], [1.0, 1.0])] * 2 + [([2, 3], [5.0, 5.0])] * 2, out
