import copy
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from overlap.dist import ParallelDims
from overlap.dist.launch import launch
from overlap.nn import TPPlan, dtensor_state_dict, load_dtensor_state_dict, parallelize
from overlap.tp import close_default_comms


def mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))


def main(path):
    plan = TPPlan(name="mlp", layers={"0": "column", "2": "row"})
    dims = ParallelDims.build(tp=2)
    model = parallelize(mlp(0), comm=dims.tp_comm(), plan=plan)
    dcp.save(dtensor_state_dict(model), checkpoint_id=path)        # saved at tp=2
    unsharded = mlp(1)                                              # other weights
    sd = unsharded.state_dict()
    dcp.load(sd, checkpoint_id=path)                                # read back unsharded
    unsharded.load_state_dict(sd)
    other = parallelize(mlp(2), comm=dims.tp_comm(), plan=plan)               # tp=2 again, other weights
    sd = dtensor_state_dict(other)
    dcp.load(sd, checkpoint_id=path)
    load_dtensor_state_dict(other, sd)
    x = torch.randn(4, 16)
    same = torch.equal(unsharded(x), mlp(0)(x)), torch.equal(other(x), model(x))
    close_default_comms()
    return same


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as path:
        out = launch(main, 2, args=(path,))
    print(out)                                # [(True, True), (True, True)]: bit for bit
    assert all(a and b for a, b in out), out
