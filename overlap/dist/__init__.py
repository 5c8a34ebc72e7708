"""Process groups and launching: ParallelDims (the tp/cp/pp/dp/ep mesh) and local launch."""
