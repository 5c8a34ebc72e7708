import copy

import torch
import torch.nn as nn

from overlap.dist import ParallelDims
from overlap.dist.launch import launch
from overlap.tp import close_default_comms
from overlap.nn import TPPlan, gather_grads, gather_state_dict, parallelize


class MyMLP(nn.Module):                       # a model you already have: nothing to change
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def main():
    torch.manual_seed(0)                      # the same weights on every rank
    model = MyMLP()
    reference = copy.deepcopy(model)
    dims = ParallelDims.build(tp=2)
    plan = TPPlan(name="my-mlp", layers={"up": "column", "down": "row"})
    parallelize(model, comm=dims.tp_comm(), plan=plan)  # up: 128 of 256 rows per rank, down: 128 columns
    x = torch.randn(8, 64)
    model(x).square().sum().backward()        # forward all-reduce overlapped with the GEMM
    reference(x).square().sum().backward()
    grads, state = gather_grads(model), gather_state_dict(model)  # unsharded, same keys
    close_default_comms()                      # the fused ops' cached workspaces
    return max((grads[n] - p.grad).abs().max().item() for n, p in reference.named_parameters())


if __name__ == "__main__":
    print(launch(main, 2))                    # [~1e-6, ~1e-6]: unsharded grads, up to fp32 rounding
