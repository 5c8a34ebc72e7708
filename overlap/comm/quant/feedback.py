"""Error feedback: the quantization residual of a lossy collective, carried to the next call."""

from __future__ import annotations

import torch

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """Error feedback for a gradient sent with a lossy ``comm_dtype`` ("int8" or "bf16").

    Each call sends p = g + e (e: this rank's residual) and keeps e' = p - deq(q(p)); the owner
    of an all-reduce shard likewise adds f to the reduced shard y before requantizing and keeps
    f' = (y + f) - deq(q(y + f)). Summed over steps the errors telescope:
    sum_t result_t = sum_t exact_t - (sum_r e_r + f)  (last residuals), so the accumulated sum
    stays within one quantization step of the exact accumulated sum instead of drifting.
    One instance per tensor (bucket) and per rank; ``numel`` is the tensor's element count.
    """

    def __init__(self, numel: int, *, device: torch.device | str = "cpu"):
        if numel < 0:
            raise ValueError(f"ErrorFeedback: numel must be >= 0, got {numel}")
        self.numel = numel
        self.residual = torch.zeros(numel, dtype=torch.float32, device=device)
        self.shard_residual: torch.Tensor | None = None

    def shard_residual_for(self, length: int) -> torch.Tensor:
        if self.shard_residual is None:
            self.shard_residual = torch.zeros(length, dtype=torch.float32,
                                              device=self.residual.device)
        elif self.shard_residual.numel() != length:
            raise ValueError(f"ErrorFeedback: this instance carries a shard residual of "
                             f"{self.shard_residual.numel()} elements, the call needs {length} "
                             "(same tensor with another group size or block size?)")
        return self.shard_residual

    def reset(self) -> None:
        self.residual.zero_()
        self.shard_residual = None
