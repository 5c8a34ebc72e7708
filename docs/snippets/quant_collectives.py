import torch
import torch.distributed as dist

from overlap.comm import quant
from overlap.dist.launch import launch


def main():
    g, n = dist.group.WORLD, dist.get_world_size()
    torch.manual_seed(dist.get_rank())
    bucket = torch.randn(4096)
    exact = bucket.clone()
    dist.all_reduce(exact, group=g)                                     # the fp32 reference
    got = bucket.clone()
    quant.all_reduce(got, group=g, comm_dtype="int8")                   # in place, a sum
    shard = quant.reduce_scatter(bucket, group=g, comm_dtype="bf16")    # [n*m] -> [m]
    full = quant.all_gather(shard, group=g, comm_dtype="int8")          # [m] -> [n*m]
    work = quant.all_reduce(bucket.clone(), group=g, comm_dtype="bf16", async_op=True)
    work.wait()
    s = bucket.abs().max().reshape(1)
    dist.all_reduce(s, group=g)          # S = sum of the ranks' absmax: the error scale
    m, r = exact.numel() // n, dist.get_rank()
    return [((got - exact).abs().max() <= s / 125).item(),                    # INT8: ~S/127
            ((shard - exact[r * m:][:m]).abs().max() <= s / 256).item(),      # BF16: 2^-8 S
            ((full[r * m:][:m] - shard).abs().max() <= shard.abs().max() / 250).item()]


if __name__ == "__main__":
    out = launch(main, 4)
    print(out)
    assert all(all(rank) for rank in out), out     # [[True, True, True], ...]
