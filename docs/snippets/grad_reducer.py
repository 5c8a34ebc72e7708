import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from overlap.dist.launch import launch
from overlap.dp.grad_reducer import GradReducer
from overlap.dp.sharded_optimizer import ShardedOptimizer


def model_and_batches(k):
    torch.manual_seed(0)                                        # the same model on every rank
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 4))
    g = torch.Generator().manual_seed(dist.get_rank())          # this DP rank's data
    return model, [(torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g))
                   for _ in range(k)]


def main():
    k, group = 3, dist.group.WORLD
    model, batches = model_and_batches(k)
    reference = copy.deepcopy(model)
    reducer = GradReducer(model, dp_group=group)                # comm_dtype="fp32"|"bf16"|"int8"
    with reducer.no_sync():                                     # gradient accumulation
        for x, y in batches[:-1]:
            (nn.functional.mse_loss(model(x), y) / k).backward()
    x, y = batches[-1]
    (nn.functional.mse_loss(model(x), y) / k).backward()        # reduced under this backward
    for x, y in batches:                                        # reference: sum, then average
        (nn.functional.mse_loss(reference(x), y) / k).backward()
    for p in reference.parameters():
        dist.all_reduce(p.grad, group=group)
        p.grad /= dist.get_world_size()
    grad_err = max((a.grad - b.grad).abs().max().item()
                   for a, b in zip(model.parameters(), reference.parameters()))
    # ZeRO-1/2: reduce-scatter the gradients, each rank updates its 1/dp shard, all-gather.
    sharded, _ = model_and_batches(0)
    opt = ShardedOptimizer(GradReducer(sharded, dp_group=group, shard=True), torch.optim.AdamW,
                           lr=1e-2, eps=1e-3)  # eps >> a gradient's rounding
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-3)
    nn.functional.mse_loss(sharded(x), y).backward()
    reference.zero_grad()
    nn.functional.mse_loss(reference(x), y).backward()
    for p in reference.parameters():
        dist.all_reduce(p.grad, group=group)
        p.grad /= dist.get_world_size()
    opt.step()
    plain.step()
    sharded(x)                                                  # waits for its parameters
    step_err = max((a - b).abs().max().item()
                   for a, b in zip(sharded.parameters(), reference.parameters()))
    return grad_err, step_err


if __name__ == "__main__":
    out = launch(main, 2)
    print(out)                                # [(~1e-8, ~1e-8), ...]: fp32 summation order
    assert all(g < 1e-6 and s < 1e-6 for g, s in out), out
