"""Pipeline parallelism: stages, schedules as validated data, and an executor with overlapped P2P.

    from overlap.pp import build_schedule, pipeline_stages, Pipeline
    stages = pipeline_stages(model, pp_group=g, num_virtual=1)        # this rank's chunks
    sched = build_schedule("1f1b", pp_size=p, num_microbatches=m)     # validated
    pipe = Pipeline(stages, sched, loss_fn=loss_fn, pp_group=g)
    out = pipe.step(inputs, targets)     # out.loss on the last stage's rank; grads in .grad
"""

from overlap.pp.build import build_schedule
from overlap.pp.check import (ScheduleError, SimResult, check_schedule, diagram, render_table,
                              simulate)
from overlap.pp.executor import Pipeline, StepResult, Timeline, bubble_fractions
from overlap.pp.p2p import P2P, P2PError
from overlap.pp.schedules import SCHEDULES, Action, PipelineSchedule
from overlap.pp.stage import PipelineStage, model_pieces, pipeline_stages, split_pieces

__all__ = ["Action", "PipelineSchedule", "build_schedule", "SCHEDULES", "ScheduleError",
           "check_schedule", "simulate", "SimResult", "render_table", "diagram", "PipelineStage",
           "pipeline_stages",
           "split_pieces", "model_pieces", "Pipeline", "StepResult", "Timeline",
           "bubble_fractions", "P2P", "P2PError"]
