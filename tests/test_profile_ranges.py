"""The runtime's own profiler ranges (NVTX on CUDA, record_function everywhere), as the analyzer
reads them: every pipeline action with stage and micro-batch, every DP bucket launch and wait,
every quantize/dequantize and the training step, all parsed by overlap.profile.names into the
kind the analyzer counts them as. pp=2 x dp=2 on 4 processes, one profiled step."""

import torch
import torch.distributed as dist
from torch._C._profiler import _ExperimentalConfig

from harness import run_ranks
from overlap.comm import quant
from overlap.dp.grad_reducer import GradReducer
from overlap.models import gpt_loss
from overlap.pp import Pipeline, build_schedule, pipeline_stages
from overlap.profile import names, nvtx
from test_pp_executor import SEQ, _batch, _model


def _profiled_step():
    rank = dist.get_rank()
    pp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pp, dp = pp_groups[rank // 2], dp_groups[rank % 2]
    model = _model(2)
    stages = pipeline_stages(model, pp_group=pp)
    reducers = []
    for stage in stages:
        red = GradReducer(stage.module, dp_group=dp, bucket_cap_mb=0.001,
                          first_bucket_cap_mb=0.001)
        red.sync_if(lambda s=stage: s.last_backward)
        reducers.append(red)
    pipe = Pipeline(stages, build_schedule("zb_h1", pp_size=2, num_microbatches=2),
                    loss_fn=gpt_loss, pp_group=pp, timeout=60)
    idx, tgt = _batch(2, SEQ, seed=1)
    pipe.step(idx, tgt)  # warm-up: shapes, bucket rebuild
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                experimental_config=_ExperimentalConfig(
                                    profile_all_threads=True)) as prof:
        with nvtx.step(7):
            pipe.step(idx, tgt)
            quant.all_reduce(torch.randn(300), group=dp, comm_dtype="int8")
    seen = sorted({e.name for e in prof.events()})
    pipe.close()
    for red in reducers:
        red.close()
    return pp.rank() if hasattr(pp, "rank") else dist.get_rank(pp), len(reducers[0].buckets), seen


def test_runtime_ranges_follow_the_naming_scheme():
    results = run_ranks(_profiled_step, 4, timeout=120)
    for rank, (pp_rank, num_buckets, seen) in enumerate(results):
        stage = pp_rank
        want = {"step:7",
                names.pp_action("F", stage=stage, micro_batch=0),
                names.pp_action("F", stage=stage, micro_batch=1),
                names.pp_action("I", stage=stage, micro_batch=1),
                names.pp_action("W", stage=stage, micro_batch=0),
                names.quant("quantize", "blocks"), names.quant("dequantize", "blocks")}
        want |= {names.dp_bucket("grads", b) for b in range(num_buckets)}
        want |= {names.dp_bucket("grads", b, wait=True) for b in range(num_buckets)}
        assert want <= set(seen), (rank, sorted(want - set(seen)))
        # What the analyzer makes of them.
        assert names.classify_range("step:7").kind == names.STEP
        assert names.classify_range(names.pp_action("W", stage=stage, micro_batch=0)).kind \
            == names.COMPUTE
        launch = names.classify_range(names.dp_bucket("grads", 0))
        wait = names.classify_range(names.dp_bucket("grads", 0, wait=True))
        assert launch.kind == names.COMM and not launch.wait
        assert wait.kind == names.COMM and wait.wait
        assert names.classify_range(names.quant("quantize", "blocks")).kind == names.COMPUTE
