"""Data parallelism: bucketed asynchronous gradient reduction (GradReducer) and a ZeRO-1/2
style sharded optimizer (ShardedOptimizer)."""

from overlap.dp.grad_reducer import GradReducer, IterationStats, ReducerConfig, ReducerFailed
from overlap.dp.sharded_optimizer import ShardedOptimizer

__all__ = ["GradReducer", "ReducerConfig", "ReducerFailed", "IterationStats", "ShardedOptimizer"]
