import torch

from overlap.dist import ParallelDims
from overlap.dist.launch import launch
from overlap.models import GPT, GPTConfig
from overlap.nn import parallelize
from overlap.tp import close_default_comms


def main():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=2, n_head=4))
    dims = ParallelDims.build(tp=2)
    parallelize(model, comm=dims.tp_comm(), sequence_parallel=True)   # the shipped plan for overlap's GPT
    block = model.blocks[0]
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")  # or the whole model
    x = torch.randn(2, 8, 32).chunk(2, dim=1)[dims.tp_rank]  # batch-first, a sequence shard
    eager_out, compiled_out = block(x), compiled(x)
    close_default_comms()
    return ((compiled_out - eager_out).abs().max() / eager_out.abs().max()).item()


if __name__ == "__main__":
    out = launch(main, 2)
    print(out)                                # [~1e-7, ~1e-7]: one graph, eager's numbers
    assert all(e < 1e-5 for e in out), out    # a compiled LayerNorm may sum in another order
