"""Pipeline x tensor parallelism: tp=2 x pp=2 on 4 processes, a TP-parallelized GPT (fused
sequence-parallel TP ops, vocab-parallel head and loss) split into pipeline stages.

ZB-H1's split backward replays the boundary nodes of the autograd graph in its W pass, and the
fused TP ops' backward issues TP collectives, so both TP ranks of a stage must replay them in
the same order (they once did not: the order came from a set of graph nodes, i.e. from memory
addresses, and the TP ranks fell out of step). Every owned gradient, unsharded, must equal the
plain GPT on one process over the same micro-batches (fp32, rtol 1e-4, atol 1e-6: the fused
ops sum in a different order), for two steps.
"""

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from overlap.models import GPT, GPTConfig
from overlap.pp import Pipeline, build_schedule, pipeline_stages
from test_pp_executor import VOCAB, _batch, _owned, _reference

RTOL, ATOL = 1e-4, 1e-6
SEQ = 8


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=16, n_layer=2, n_head=2))


def _pp_tp(name: str, m: int, backend: str):
    from overlap.dist.dims import ParallelDims
    from overlap.tp import close_default_comms
    from overlap.nn.embedding import vocab_parallel_cross_entropy
    from overlap.nn.parallelize import gather_grads, parallelize
    from overlap.models.tp_plans import gpt_plan

    dims = ParallelDims.build(tp=2, pp=2, dp=1)
    ref, model = _gpt(), _gpt()
    comm = dims.tp_comm(backend=backend)
    parallelize(model, comm=comm, plan=gpt_plan(loss_parallel=True), sequence_parallel=True)
    stages = pipeline_stages(model, pp_group=dims.pp_group)

    def loss_fn(logits_shard, targets):
        return vocab_parallel_cross_entropy(logits_shard, targets, comm=comm)

    pipe = Pipeline(stages, build_schedule(name, pp_size=2, num_microbatches=m),
                    loss_fn=loss_fn, pp_group=dims.pp_group, timeout=30)
    owned = _owned(ref, stages)
    err = 0.0
    try:
        for step in range(2):
            idx, tgt = _batch(m, SEQ, seed=10 * m + step)
            _, want = _reference(ref, idx, tgt, m)
            model.zero_grad(set_to_none=True)
            pipe.step(idx, tgt)
            got = gather_grads(model)
            for n in owned:
                torch.testing.assert_close(got[n], want[n], rtol=RTOL, atol=ATOL)
                err = max(err, float((got[n] - want[n]).abs().max()))
    finally:
        close_default_comms()
    return err


@pytest.mark.parametrize("name, m, backend", [("zb_h1", 3, "chunked"),
                                              ("zb_h1", 2, "symmetric"),
                                              ("1f1b", 2, "symmetric")])
def test_tp2_pp2_matches_single_process(name, m, backend):
    errs = run_ranks(_pp_tp, 4, name, m, backend, timeout=60)
    assert all(e <= 1e-4 for e in errs), errs
