"""Process groups and launching: ParallelDims (the tp/cp/pp/dp/ep mesh) and local launch."""

from overlap.dist.dims import AXES, ParallelDims

__all__ = ["AXES", "ParallelDims"]
