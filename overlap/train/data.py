"""The bundled corpus and a byte-level tokenizer, identical on every rank given the seed.

The corpus is the Book of Genesis, King James Version (1611; public domain), about 200 KB,
shipped in ``overlap/data/``. Bytes are tokens (vocabulary 256), so there is no tokenizer file.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["load_tokens", "Batches", "DEFAULT_CORPUS"]

DEFAULT_CORPUS = Path(__file__).resolve().parent.parent / "data" / "genesis_kjv.txt"


def load_tokens(path: str | Path | None = None) -> torch.Tensor:
    """The text file as a 1-D int64 tensor of byte values."""
    p = Path(path) if path is not None else DEFAULT_CORPUS
    data = p.read_bytes()
    if len(data) < 2:
        raise ValueError(f"overlap.train: corpus {p} has {len(data)} bytes; need at least 2")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


class Batches:
    """Random windows of the token stream: step s, dp rank d and micro-batch j always get the
    same sequences for a seed, whatever the parallel layout, so a 1-process run sees exactly the
    data of the 8-process run (the dp ranks' micro-batches concatenated)."""

    def __init__(self, tokens: torch.Tensor, *, seq_len: int, micro_batch_size: int,
                 micro_batches: int, dp: int, seed: int):
        if tokens.numel() <= seq_len + 1:
            raise ValueError(f"overlap.train: the corpus has {tokens.numel()} tokens, fewer "
                             f"than seq_len + 2 = {seq_len + 2}")
        self.tokens, self.seq_len = tokens, seq_len
        self.mbs, self.num_mb, self.dp, self.seed = micro_batch_size, micro_batches, dp, seed

    def step(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All sequences of a step: (inputs, targets), each (dp, micro_batches, mbs, seq_len)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        n = self.dp * self.num_mb * self.mbs
        starts = torch.randint(0, self.tokens.numel() - self.seq_len - 1, (n,), generator=g)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        win = self.tokens[idx].view(self.dp, self.num_mb, self.mbs, self.seq_len + 1)
        return win[..., :-1].contiguous(), win[..., 1:].contiguous()
